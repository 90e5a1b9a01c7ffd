"""Backward schedule A/B: the one-recompute schedule with the float32 dh accumulator's second half
in dW's tail storage (those N vocab rows recomputed after dh is final) against the same half in
storage of its own (``backward_schedule.SPARE_ACCUMULATOR_FRACTION``), on the fused head's
forward+backward.

python scripts/diag/schedule_ab.py [--rounds R] [N,H,V ...]   (default: the three benchmark shapes)

Per shape: rounds alternate the two variants (median of the rounds' ``do_bench`` medians, 1 s
budget each), as multiples of one cuBLAS ``hidden @ W.T`` of the same shape timed in the same run;
peak extra memory of a step beyond inputs; whether the forward outputs are bitwise equal and the
largest relative difference of dh / dW between the variants (their float32 dh sums are grouped
differently, so bits may differ) and each variant's dh / dW error against float64 on 64 rows.
"""
import statistics

import torch
import triton.testing

from rl_kernels.tools import diag
from rl_kernels.tools.diag import backward_schedule as schedule

VARIANTS = (("tail (re-recompute)", 0.0), ("spare accumulator", 0.25))


def main():
    args = diag.start(diag.parser(__doc__, shapes=diag.BENCH_SHAPES, rounds=3), full_precision_bf16=True)
    for n, h, v in args.shapes:
        hid, w, lab, g_lp, g_ent = diag.head_inputs(n, h, v)
        t_mm = triton.testing.do_bench(lambda: hid @ w.T, rep=500, return_mode="median")
        step, hg, wg = diag.head_step(hid, w, lab, g_lp, g_ent)

        results, times = {}, {name: [] for name, _ in VARIANTS}
        for name, frac in VARIANTS:
            schedule.SPARE_ACCUMULATOR_FRACTION = frac
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = step()
            torch.cuda.synchronize()
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            results[name] = (out.log_probs.clone(), out.entropy.clone(), hg.grad.clone(), wg.grad.clone(), peak)
        for _ in range(args.rounds):
            for name, frac in VARIANTS:
                schedule.SPARE_ACCUMULATOR_FRACTION = frac
                times[name].append(triton.testing.do_bench(step, warmup=5, rep=1000, return_mode="median"))
        # float64 gradients of the first 64 rows' loss (dh rows) and of their contribution to dW
        rows = slice(0, 64)
        h64, w64 = hid[rows].double().requires_grad_(), w.double().requires_grad_()
        z = h64 @ w64.T
        logp = z.log_softmax(-1)
        lp64 = logp.gather(1, lab[rows, None])[:, 0]
        ent64 = -(logp.exp() * logp).sum(-1)
        torch.autograd.backward([lp64, ent64], [g_lp[rows].double(), g_ent[rows].double()])
        dh_ref = h64.grad
        print(f"\n{n}x{h}x{v}: cuBLAS {t_mm:.2f} ms ({2 * n * h * v / t_mm / 1e9:.0f} TFLOP/s)")
        (a_name, a), (b_name, b) = results.items()
        same_fwd = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        rel = lambda x, y: ((x.float() - y.float()).norm() / y.float().norm()).item()  # noqa: E731
        print(f"  forward bitwise equal: {same_fwd}; dh rel diff {rel(a[2], b[2]):.1e}, dW rel diff "
              f"{rel(a[3], b[3]):.1e}")
        for name, (_, _, dh, dw, peak) in results.items():
            t = statistics.median(times[name])
            print(f"  {name:22s} fwd+bwd {t:8.2f} ms = {t / t_mm:5.3f}x mm (rounds "
                  f"{' '.join(f'{x / t_mm:.3f}' for x in times[name])}); peak extra {peak:.2f} GiB; "
                  f"dh[:64] err vs float64 {rel(dh[rows], dh_ref):.1e}", flush=True)
        del hid, w, step, hg, wg, results
        torch.cuda.empty_cache()
    schedule.SPARE_ACCUMULATOR_FRACTION = 0.25


if __name__ == "__main__":
    main()
