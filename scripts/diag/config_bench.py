"""Speed of every configuration class on this GPU, per dtype: forward (no grad) and
forward+backward of ``linear_log_probs`` as multiples of one cuBLAS ``hidden @ W.T`` of the same
shape and dtype (torch's default precision: full fp32 products for float32), one run.

    python scripts/diag/config_bench.py [N,H,V]   (default 4096,3584,152064)
"""
import os

import torch
import triton.testing

import rl_kernels
from rl_kernels.tools import diag

args = diag.start(diag.parser(__doc__, shapes=["4096,3584,152064"], one_shape=True))
config_mod = diag.ops  # the configuration classes (CLASSES) and their environment variable
n, h, v = args.shape
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=300, return_mode="median")  # noqa: E731
print(f"{n}x{h}x{v}; x = multiple of cuBLAS in the same dtype")
print(f"{'class':8s} {'dtype':9s} {'mm ms':>8s} {'fwd x':>7s} {'fwd+bwd x':>10s}")
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).to(dtype)
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    up = torch.randn(2, n, device="cuda", generator=g)
    t_mm = bench(lambda: hid @ w.T)
    hx, wx = hid.clone().requires_grad_(), w.clone().requires_grad_()
    for name in sorted(config_mod.CLASSES):
        os.environ[config_mod.CONFIG_CLASS_ENV] = name
        with torch.no_grad():
            t_f = bench(lambda: rl_kernels.linear_log_probs(hid, w, lab))

        def step():
            hx.grad = wx.grad = None
            out = rl_kernels.linear_log_probs(hx, wx, lab)
            torch.autograd.backward([out.log_probs, out.entropy], [up[0], up[1]])
        t_fb = bench(step)
        print(f"{name:8s} {str(dtype)[6:]:9s} {t_mm:8.2f} {t_f / t_mm:7.3f} {t_fb / t_mm:10.3f}", flush=True)
    os.environ.pop(config_mod.CONFIG_CLASS_ENV, None)
    del hid, w, hx, wx
    torch.cuda.empty_cache()
