"""Host overhead of the public forward at small N: the API call vs its kernels alone.

python scripts/diag/overhead.py [N,H,V]   (default 512,3584,152064)
"""
import sys

import torch
import triton.testing

import rl_kernels
from rl_kernels import api, ops

n, h, v = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "512,3584,152064").split(","))
g = torch.Generator(device="cuda").manual_seed(0)
hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
lab = torch.randint(0, v, (n,), device="cuda", generator=g)
cfg = ops.default_config(hid.device)
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=1000, return_mode="median")  # noqa: E731
t_mm = bench(lambda: hid @ w.T)
rows = {
    "API linear_log_probs, no grad": lambda: rl_kernels.linear_log_probs(hid, w, lab),
    "kernels only (stats + combine)": lambda: ops.split_combine(
        *ops.linear_split_stats(hid, w, lab, 1.0, True, cfg), lab, -100, True),
    "label check only": lambda: api.check_label_values(lab, v, -100),
}
with torch.no_grad():
    for name, f in rows.items():
        t = bench(f)
        print(f"{name:34s} {t * 1e3:8.1f} us = {t / t_mm:.3f}x mm")
    real = api.check_label_values
    api.check_label_values = lambda *a: None
    t = bench(rows["API linear_log_probs, no grad"])
    api.check_label_values = real
    print(f"{'API without the label check':34s} {t * 1e3:8.1f} us = {t / t_mm:.3f}x mm")
