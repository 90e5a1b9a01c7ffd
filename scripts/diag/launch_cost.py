"""Host cost per call of the public functions and of their parts, at a tiny shape where the GPU
finishes each kernel in a few microseconds, so that the loop's wall time is the host's time.
Then a cProfile of the public calls (where the host time goes, by Python function).

python scripts/diag/launch_cost.py [--profile]
"""
import cProfile
import pstats
import sys

import torch

import rl_kernels
from rl_kernels import ops
from rl_kernels.autograd.logits import LogitsStatsFunction
from rl_kernels.validation import check_label_values

from diag_common import per_call_us


n, v, h = 8, 4096, 256
dev = torch.device("cuda")
g = torch.Generator(device="cuda").manual_seed(0)
logits = torch.randn(n, v, device=dev, generator=g).bfloat16()
lab = torch.randint(0, v, (n,), device=dev, generator=g)
hid = torch.randn(n, h, device=dev, generator=g).bfloat16()
w = (0.05 * torch.randn(v, h, device=dev, generator=g)).bfloat16()
lcfg = ops.logits_config(dev)
cfg = ops.default_config(dev)
g_lp, g_ent = torch.randn(n, device=dev), torch.randn(n, device=dev)
stats = ops.logits_forward(logits, lab, 1.0, -100, True, False, lcfg)
grad = torch.empty_like(logits)
xg = logits.clone().requires_grad_()
hg = hid.clone().requires_grad_()
wg = w.clone().requires_grad_()


def logits_step():
    xg.grad = None
    out = rl_kernels.logits_stats(xg, lab)
    torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])


def head_step():
    hg.grad = wg.grad = None
    out = rl_kernels.linear_log_probs(hg, wg, lab)
    torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])


def nograd(f):
    def run():
        with torch.no_grad():
            f()
    return run


rows = {
    "torch.empty(8)": lambda: torch.empty(n, device=dev),
    "torch add (one tiny kernel)": lambda: g_lp.add(g_ent),
    "label check (any + item)": lambda: check_label_values(lab, v, -100),
    "ops.logits_forward (1 level)": lambda: ops.logits_forward(logits, lab, 1.0, -100, True, False, lcfg,
                                                               two_level=False),
    "ops.logits_forward (2 levels)": lambda: ops.logits_forward(logits, lab, 1.0, -100, True, False, lcfg,
                                                                two_level=True),
    "ops.logits_backward": lambda: ops.logits_backward(logits, grad, lab, stats,
                                                       {"log_probs": g_lp, "entropy": g_ent}, 1.0, -100, lcfg),
    "LogitsStatsFunction.apply no grad": nograd(lambda: LogitsStatsFunction.apply(
        logits, lab, 1.0, -100, True, False, False, "triton", "logits_stats")),
    "logits_stats no grad, labels": nograd(lambda: rl_kernels.logits_stats(logits, lab)),
    "logits_stats no grad, no labels": nograd(lambda: rl_kernels.logits_stats(logits)),
    "logits_stats fwd+bwd": logits_step,
    "ops.linear_split_stats": lambda: ops.linear_split_stats(hid, w, lab, 1.0, True, cfg),
    "linear_log_probs no grad": nograd(lambda: rl_kernels.linear_log_probs(hid, w, lab)),
    "linear_log_probs fwd+bwd": head_step,
}


class _Identity(torch.autograd.Function):  # the autograd engine's own floor: one Function, no kernels
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


x_small = torch.randn(n, device=dev, requires_grad=True)


def identity_step():
    x_small.grad = None
    torch.autograd.backward([_Identity.apply(x_small)], [g_lp])


rows["autograd floor (identity Function fwd+bwd)"] = identity_step
print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; host us per call, {n}x{v} (head H={h})")
for name, f in rows.items():
    print(f"{name:44s} {per_call_us(f):8.1f}")

if "--profile" in sys.argv:
    for name in ("logits_stats fwd+bwd", "linear_log_probs fwd+bwd"):
        f = rows[name]
        per_call_us(f, 50)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            f()
        prof.disable()
        torch.cuda.synchronize()
        print(f"\n== cProfile: {name}, 200 calls (tottime, s)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(22)
