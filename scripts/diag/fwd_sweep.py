"""Forward mainloop tile sweep at one shape: time vs cuBLAS (same run), max |Δ| vs the default."""
import dataclasses
import sys

import torch
import triton.testing

from rl_kernels import ops

n, h, v = (int(x) for x in (sys.argv[1:4] if len(sys.argv) > 3 else (16384, 3584, 152064)))
g = torch.Generator(device="cuda").manual_seed(0)
hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
lab = torch.randint(0, v, (n,), device="cuda", generator=g)
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")
t_mm = bench(lambda: hid @ w.T)
base = ops.CUDA_CONFIG
ref = None
print(f"{n}x{h}x{v}: cuBLAS {t_mm:.2f} ms")
for bm, bn, bk, warps, stages, gm, split in [
        (128, 128, 64, 8, 3, 8, 2048), (128, 128, 64, 8, 3, 1, 2048), (128, 256, 64, 8, 3, 8, 2048),
        (128, 128, 64, 4, 4, 8, 2048), (128, 128, 64, 8, 4, 16, 2048), (256, 128, 64, 8, 3, 8, 2048),
        (128, 256, 64, 8, 4, 8, 4096), (64, 256, 64, 4, 4, 8, 2048)]:
    cfg = dataclasses.replace(base, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                              num_stages=stages, group_m=gm, split_v=split)
    try:
        f = lambda: ops.split_combine(*ops.linear_split_stats(hid, w, lab, 1.0, True, cfg), lab, -100, True)
        lp = f()[0]
        t = bench(f)
    except Exception as e:  # noqa: BLE001
        print(f"{cfg}: {type(e).__name__} {str(e)[:100]}")
        continue
    ref = lp if ref is None else ref
    print(f"BM{bm} BN{bn} BK{bk} w{warps} s{stages} G{gm} split{split}: {t:.2f} ms = {t / t_mm:.2f}x mm, "
          f"max|Δ| vs first {(lp - ref).abs().max().item():.1e}", flush=True)
