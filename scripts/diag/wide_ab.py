"""A/B of the window-width cap of the one-recompute backward (rl_kernels.autograd.WIDE_FACTOR),
interleaved (ABCD ABCD) in one process to see past clock drift. python scripts/diag/wide_ab.py"""
import sys

import torch
import triton.testing

import rl_kernels.autograd.backward_schedule as ag
from rl_kernels import linear_log_probs

FACTORS = [1, 2, 4, 0]  # 1: fixed buffer only; 0: as wide as fits
for shape in sys.argv[1:] or ["16384,3584,152064", "32768,4096,128256"]:
    n, h, v = (int(x) for x in shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16().requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    gl, ge = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    t_mm = triton.testing.do_bench(lambda: hid @ w.T, return_mode="median")

    def step():
        out = linear_log_probs(hid, w, y)
        torch.autograd.backward([out.log_probs, out.entropy], [gl, ge])
        hid.grad = w.grad = None

    times = {f: [] for f in FACTORS}
    for _ in range(2):
        for f in FACTORS:
            ag.WIDE_FACTOR = f
            times[f].append(triton.testing.do_bench(step, warmup=3, rep=1500, return_mode="median") / t_mm)
    print(shape, " ".join(f"cap{f or 'none'}: {min(t):.2f}x/{max(t):.2f}x" for f, t in times.items()), flush=True)
    del hid, w
    torch.cuda.empty_cache()
