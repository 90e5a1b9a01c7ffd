"""A/B timing of two versions of rl_kernels in one process: the working tree's ``rl_kernels``
against an older copy of the package directory (e.g. from ``git archive``), imported under another
name. Each case alternates A and B for several rounds (median of ``do_bench`` medians), with the
cuBLAS ``hidden @ W.T`` of the same shape as the unit.

    mkdir -p .ab && git archive <rev> rl_kernels | tar -x -C .ab && mv .ab/rl_kernels .ab/rl_kernels_old
    python scripts/diag/ab_versions.py --old .ab/rl_kernels_old [--rounds 5]

Cases: linear head forward (no grad) and forward+backward at 16384 x 3584 x 152064, 32768 x 4096 x
128256, 4096 x 3584 x 152064 and 512 x 3584 x 152064; logits_stats forward and forward+backward at 16384 x 152064 and
512 x 152064 (bf16), and its forward on stride-0 rows (one row in L2 for all N: the compute
bound, no HBM traffic); the top-K from-logits functions' forward+backward at 4096 x 152064, K = 64
and 512 x 152064, K = 1. Prints a table: ms of A and B, B / A, and x matmul; with ``--check``, whether
A and B give bitwise equal outputs and gradients (a refactoring must), and by how much they differ
where not. With ``--host``: host time per eager call instead (``rl_kernels.tools.diag.tiny_steps``).
"""
import importlib.util
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

import rl_kernels as new
from rl_kernels.tools import diag


def load_old(path: Path):
    spec = importlib.util.spec_from_file_location("rl_kernels_old", path / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["rl_kernels_old"] = mod
    spec.loader.exec_module(mod)
    return mod


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median")


def head_cases(n, h, v):
    g = torch.Generator(device="cuda").manual_seed(n)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    hx, wx = hid.clone().requires_grad_(), w.clone().requires_grad_()

    def fwd(mod):
        def run():
            with torch.no_grad():
                mod.linear_log_probs(hid, w, lab)
        return run

    def fwd_bwd(mod):
        def run():
            hx.grad = wx.grad = None
            out = mod.linear_log_probs(hx, wx, lab)
            (out.log_probs.sum() + out.entropy.sum()).backward()
        return run
    def values(mod):  # what --check compares bitwise: outputs and both gradients
        fwd_bwd(mod)()
        out = mod.linear_log_probs(hid, w, lab)
        return [out.log_probs, out.entropy, hx.grad.clone(), wx.grad.clone()]
    mm = bench(lambda: hid @ w.T)
    return [(f"head fwd {n}x{h}x{v}", fwd, mm, None), (f"head fwd+bwd {n}x{h}x{v}", fwd_bwd, mm, values)]


def logits_cases(n, v):
    g = torch.Generator(device="cuda").manual_seed(n + 1)
    x = torch.randn(n, v, device="cuda", generator=g).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    xg = x.clone().requires_grad_()

    def fwd(mod):
        def run():
            with torch.no_grad():
                mod.logits_stats(x, lab)
        return run

    def fwd_bwd(mod):
        def run():
            xg.grad = None
            s = mod.logits_stats(xg, lab)
            (s.log_probs.sum() + s.entropy.sum()).backward()
        return run
    def values(mod):
        fwd_bwd(mod)()
        s = mod.logits_stats(x, lab)
        return [s.log_probs, s.entropy, s.lse, xg.grad.clone()]
    def fwd_l2(mod):  # every row the same 300 KB (stride 0): no HBM traffic, the kernel's compute bound
        row = x[:1].expand(n, v)

        def run():
            with torch.no_grad():
                mod.logits_stats(row, lab)
        return run
    return [(f"logits fwd {n}x{v}", fwd, None, None), (f"logits fwd+bwd {n}x{v}", fwd_bwd, None, values),
            (f"logits fwd {n}x{v} stride-0 rows", fwd_l2, None, None)]


def topk_cases(n, v, k):
    """The top-K from-logits functions: ``topk_log_probs_from_logits`` and ``topk_kl_from_logits``
    (a mask, so that ignored rows are marked) forward+backward, bf16 logits, K teacher ids per row
    with duplicates. (No compiled route here: A's custom ops of the same names would replace B's;
    tests/gpu/test_gpu_compile.py compares compiled and eager.)"""
    g = torch.Generator(device="cuda").manual_seed(n + 2)
    x = (2 * torch.randn(n, v, device="cuda", generator=g)).bfloat16()
    ids = torch.randint(0, v, (n, k), device="cuda", generator=g)
    if k > 1:
        ids[::7, 1] = ids[::7, 0]  # duplicate ids in some rows
    teacher = torch.log_softmax(torch.randn(n, k, device="cuda", generator=g), -1)
    mask = torch.rand(n, device="cuda", generator=g) > 0.1
    up = torch.randn(n, k, device="cuda", generator=g)
    xg = x.clone().requires_grad_()

    def fwd_bwd(mod):
        def run():
            xg.grad = None
            lp = mod.topk_log_probs_from_logits(xg, ids, temperature=0.9)
            kl = mod.topk_kl_from_logits(xg, ids, teacher, temperature=0.9, mask=mask)
            ((lp * up).sum() + kl).backward()
        return run

    def values(mod):
        outs = []
        for f in ((lambda t: mod.topk_log_probs_from_logits(t, ids, temperature=0.9)),
                  (lambda t: mod.topk_kl_from_logits(t, ids, teacher, temperature=0.9, mask=mask, reduction="none"))):
            xg.grad = None
            out = f(xg)
            (out * (up if out.dim() == 2 else up[:, 0])).sum().backward()
            outs += [out.detach(), xg.grad.clone()]
        return outs
    return [(f"topk fwd+bwd {n}x{v} K={k}", fwd_bwd, None, values)]


def host_main(old, rounds: int, cases: str = "") -> None:
    a_steps, b_steps = diag.tiny_steps(old), diag.tiny_steps(new)
    print(f"host us per eager fwd+bwd call, rows x vocabulary x head H = {diag.TINY}; A and B alternated, "
          f"{rounds} rounds of 400 calls each; median (min-max)")
    for name in a_steps:
        if cases not in name:
            continue
        ta, tb = [], []
        for r in range(rounds):  # A B, then B A: neither always goes first
            order = ((a_steps, ta), (b_steps, tb)) if r % 2 == 0 else ((b_steps, tb), (a_steps, ta))
            for fns, out in order:
                out.append(diag.per_call_us(fns[name]))
        a, b = statistics.median(ta), statistics.median(tb)
        print(f"{name:28s} A {a:7.1f} ({min(ta):.0f}-{max(ta):.0f})  B {b:7.1f} ({min(tb):.0f}-{max(tb):.0f})  "
              f"B/A {b / a:.3f}", flush=True)


def main():
    ap = diag.parser(__doc__, rounds=5)
    ap.add_argument("--old", type=Path, required=True, help="directory of the older rl_kernels package")
    ap.add_argument("--cases", default="", help="run only the cases whose name contains this text")
    ap.add_argument("--check", action="store_true",
                    help="also compare A's and B's outputs and gradients bitwise (fwd+bwd cases)")
    ap.add_argument("--host", action="store_true",
                    help="instead: host time per eager call at a tiny shape, A and B alternated (diag.tiny_steps)")
    args = diag.start(ap)
    old = load_old(args.old)
    if args.host:
        return host_main(old, args.rounds, args.cases)
    cases = []
    for shape in ((16384, 3584, 152064), (32768, 4096, 128256), (4096, 3584, 152064), (512, 3584, 152064)):
        cases += head_cases(*shape)
    for shape in ((16384, 152064), (512, 152064)):
        cases += logits_cases(*shape)
    for shape in ((4096, 152064, 64), (512, 152064, 1)):
        cases += topk_cases(*shape)
    print(f"A = {args.old}, B = working tree")
    print(f"{'case':36s} {'A ms':>9s} {'B ms':>9s} {'B/A':>7s} {'per-round B/A':>15s} {'A xmm':>7s} {'B xmm':>7s}")
    for name, make, mm, values in cases:
        if args.cases not in name:
            continue
        if args.check and values is not None:
            pairs = list(zip(values(old), values(new)))
            same = [torch.equal(x, y) for x, y in pairs]
            diff = ", ".join(f"{(y.float() - x.float()).abs().max().item() / x.float().abs().max().item():.1e}"
                             for x, y in pairs)
            print(f"{name:36s} A and B bitwise equal (outputs, gradients): {same}; "
                  f"max |B - A| / max |A|: {diff}", flush=True)
        a_fn, b_fn = make(old), make(new)
        a_fn(), b_fn()  # compile both
        ta, tb = [], []
        for _ in range(args.rounds):
            ta.append(bench(a_fn))
            tb.append(bench(b_fn))
        a, b = statistics.median(ta), statistics.median(tb)
        ratios = [y / x for x, y in zip(ta, tb)]
        spread = f"{min(ratios):.3f}-{max(ratios):.3f}"
        xmm = (f"{a / mm:7.3f} {b / mm:7.3f}" if mm else f"{'':7s} {'':7s}")
        print(f"{name:36s} {a:9.3f} {b:9.3f} {b / a:7.3f} {spread:>15s} {xmm}", flush=True)


if __name__ == "__main__":
    main()
