"""HBM ceilings for the memory-bound paths: device-to-device copy (read + write) and a read-only
reduction, 4 GiB bf16, median of triton.testing.do_bench. python scripts/diag/bandwidth.py"""
import time

import torch
import triton
import triton.testing

n = 2 << 30  # elements: 4 GiB of bf16
x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
t_copy = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=200, return_mode="median")
t_read = triton.testing.do_bench(lambda: x.view(-1, 8192).amax(dim=1), warmup=5, rep=200, return_mode="median")
gb = x.numel() * x.element_size() / 1e9
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
print(f"copy (read+write) {2 * gb / t_copy * 1e3:.0f} GB/s; read-only reduction {gb / t_read * 1e3:.0f} GB/s")
