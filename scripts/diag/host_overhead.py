"""Host overhead of the public calls: where a call's time goes when the GPU work is small (the
small-batch and launch-cost questions). Two measurements (formerly overhead.py and launch_cost.py):

python scripts/diag/host_overhead.py [N,H,V] [--cprofile]   (default 512,3584,152064)
    Each public call at small N against its kernels alone and against the label check it
    contains (the check's host sync), for the fused head and the from-logits path. Times are
    do_bench medians (us) and x one cuBLAS ``hidden @ W.T``. With --cprofile: the from-logits
    forward+backward run 300 times under cProfile (host functions by own time, per call), after
    the table.

python scripts/diag/host_overhead.py --tiny [--profile]
    Host cost per call of the public functions and of their parts, at a tiny shape (8 x 4096, head
    H = 256) where the GPU finishes each kernel in a few microseconds, so that the loop's wall time
    is the host's time (``rl_kernels.tools.diag.per_call_us``); with the autograd engine's own floor (an
    identity Function). With --profile: a cProfile of the public calls (where the host time goes,
    by Python function).
"""
import cProfile
import pstats

import torch
import triton.testing

import rl_kernels
from rl_kernels.tools import diag
from rl_kernels.tools.diag import LogitsStatsFunction, check_label_values, per_call_us


def small_n(n, h, v, cprofile=False):
    ops = diag.ops
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    logits = (3 * torch.randn(n, v, device="cuda", generator=g)).bfloat16()
    cfg = ops.default_config(hid.device)
    lcfg = ops.logits_config(hid.device)
    bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=1000, return_mode="median")  # noqa: E731
    t_mm = bench(lambda: hid @ w.T)
    xg = logits.detach().requires_grad_()
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")

    def logits_fwd_bwd():
        xg.grad = None
        out = rl_kernels.logits_stats(xg, lab)
        torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])

    hp, lp = diag.head_params(logits.device), diag.logits_params(logits.device)
    stats = ops.logits_forward(logits, lab, lp, lcfg)
    grad = torch.empty_like(logits)
    rows = {
        "head API linear_log_probs (no grad)": lambda: rl_kernels.linear_log_probs(hid, w, lab),
        "head kernels only (stats + combine)": lambda: ops.split_combine(
            ops.linear_split_stats(hid, w, lab, hp, cfg), lab, hp),
        "label check only (host sync)": lambda: check_label_values(lab, v, -100),
        "logits API logits_stats (no grad)": lambda: rl_kernels.logits_stats(logits, lab),
        "logits forward kernel only": lambda: ops.logits_forward(logits, lab, lp, lcfg),
        "logits API fwd+bwd": logits_fwd_bwd,
        "logits backward kernel only": lambda: ops.logits_backward(
            logits, grad, lab, stats, {"log_probs": g_lp, "entropy": g_ent}, lp, lcfg),
    }
    print(f"{n}x{h}x{v} bf16: cuBLAS mm {t_mm * 1e3:.1f} us")
    for name, f in rows.items():
        with torch.no_grad() if "fwd+bwd" not in name else torch.enable_grad():
            t = bench(f)
        print(f"{name:38s} {t * 1e3:8.1f} us = {t / t_mm:.3f}x mm")

    if cprofile:
        reps = 300
        print(f"\nlogits API fwd+bwd, {reps} back-to-back calls: {per_call_us(logits_fwd_bwd, reps):.1f} us per call")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(reps):
            logits_fwd_bwd()
        torch.cuda.synchronize()
        prof.disable()
        stats = pstats.Stats(prof)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:25]
        print(f"{'own us/call':>11s} {'cum us/call':>11s} {'calls/step':>10s}  function")
        for (file, line, fn), (cc, nc, tt, ct, _) in rows:
            print(f"{tt / reps * 1e6:11.1f} {ct / reps * 1e6:11.1f} {nc / reps:10.1f}  "
                  f"{file.split('/')[-1]}:{line} {fn}")


class _Identity(torch.autograd.Function):  # the autograd engine's own floor: one Function, no kernels
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def tiny(profile=False):
    ops = diag.ops
    n, v, h = diag.TINY
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(n, v, device=dev, generator=g).bfloat16()
    lab = torch.randint(0, v, (n,), device=dev, generator=g)
    hid = torch.randn(n, h, device=dev, generator=g).bfloat16()
    w = (0.05 * torch.randn(v, h, device=dev, generator=g)).bfloat16()
    lcfg = ops.logits_config(dev)
    cfg = ops.default_config(dev)
    g_lp, g_ent = torch.randn(n, device=dev), torch.randn(n, device=dev)
    hp, lp = diag.head_params(dev), diag.logits_params(dev, name="logits_stats")
    stats = ops.logits_forward(logits, lab, lp, lcfg)
    grad = torch.empty_like(logits)
    steps = diag.tiny_steps(rl_kernels)  # the public calls' forward+backward (shared with ab_versions --host)

    def nograd(f):
        def run():
            with torch.no_grad():
                f()
        return run

    rows = {
        "torch.empty(8)": lambda: torch.empty(n, device=dev),
        "torch add (one tiny kernel)": lambda: g_lp.add(g_ent),
        "label check (any + item)": lambda: check_label_values(lab, v, -100),
        "ops.logits_forward (1 level)": lambda: ops.logits_forward(logits, lab, lp, lcfg, two_level=False),
        "ops.logits_forward (2 levels)": lambda: ops.logits_forward(logits, lab, lp, lcfg, two_level=True),
        "ops.logits_backward": lambda: ops.logits_backward(logits, grad, lab, stats,
                                                           {"log_probs": g_lp, "entropy": g_ent}, lp, lcfg),
        "LogitsStatsFunction.apply no grad": nograd(
            lambda: LogitsStatsFunction.apply(logits, lab, None, lp, None, None)),
        "logits_stats no grad, labels": nograd(lambda: rl_kernels.logits_stats(logits, lab)),
        "logits_stats no grad, no labels": nograd(lambda: rl_kernels.logits_stats(logits)),
        "logits_stats fwd+bwd": steps["logits_stats"],
        "topk_log_probs_from_logits fwd+bwd (K=4)": steps["topk_log_probs_from_logits"],
        "topk_kl_from_logits fwd+bwd (K=4, labels)": steps["topk_kl_from_logits"],
        "ops.linear_split_stats": lambda: ops.linear_split_stats(hid, w, lab, hp, cfg),
        "linear_log_probs no grad": nograd(lambda: rl_kernels.linear_log_probs(hid, w, lab)),
        "linear_log_probs fwd+bwd": steps["linear_log_probs"],
    }

    x_small = torch.randn(n, device=dev, requires_grad=True)

    def identity_step():
        x_small.grad = None
        torch.autograd.backward([_Identity.apply(x_small)], [g_lp])

    rows["autograd floor (identity Function fwd+bwd)"] = identity_step
    print(f"host us per call, {n}x{v} (head H={h})")
    for name, f in rows.items():
        print(f"{name:44s} {per_call_us(f):8.1f}")

    if profile:
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


def main():
    ap = diag.parser(__doc__, shapes=["512,3584,152064"], one_shape=True)
    ap.add_argument("--cprofile", action="store_true", help="default mode: also a cProfile of the from-logits fwd+bwd")
    ap.add_argument("--tiny", action="store_true", help="host us per call at a tiny shape instead")
    ap.add_argument("--profile", action="store_true", help="with --tiny: also a cProfile of the public calls")
    args = diag.start(ap)
    tiny(args.profile) if args.tiny else small_n(*args.shape, cprofile=args.cprofile)


if __name__ == "__main__":
    main()
