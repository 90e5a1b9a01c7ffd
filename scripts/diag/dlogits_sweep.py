"""dlogits launch variants (persistent tile loop, stages): the recompute kernel alone and the whole
forward+backward of ``linear_log_probs``, as multiples of cuBLAS ``hidden @ W.T`` of the same
shape in the same run, and whether dh / dW are bitwise equal to the first variant's.

python scripts/diag/dlogits_sweep.py [--rounds R] [N,H,V ...]   (default: the three benchmark shapes)

Each variant replaces ``KernelConfig`` fields of the shipped CUDA config. The kernel alone is one
column window (all N rows x ``WINDOW`` vocab columns, the one-recompute schedule's fixed window)
against a cuBLAS matmul of that window's shape. Forward+backward rounds alternate the variants
(median of the rounds' do_bench medians), upstream gradients random on both outputs.
"""
import dataclasses
import statistics

import torch
import triton.testing

from rl_kernels.tools import diag

WINDOW = 4096
VARIANTS = [  # every field set explicitly: the shipped config may have either
    ("one tile per program", dict(bwd_programs_per_sm=0, bwd_tma_store=False)),
    ("persistent 1/SM, flatten", dict(bwd_programs_per_sm=1, bwd_tma_store=False)),
    ("persistent 1/SM, flatten, 4 stages", dict(bwd_programs_per_sm=1, bwd_tma_store=False, bwd_tile_stages=4)),
    ("persistent 1/SM, flatten, TMA store", dict(bwd_programs_per_sm=1, bwd_tma_store=True)),
    ("one tile per program, TMA store", dict(bwd_programs_per_sm=0, bwd_tma_store=True)),
]


def bench(fn, rep=500):
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def variant_config(fields):
    fields = dict(fields)
    stages = fields.pop("bwd_tile_stages", None)
    cfg = dataclasses.replace(diag.ops.CUDA_CONFIG, **fields)
    if stages:
        cfg = dataclasses.replace(cfg, bwd_cols=dataclasses.replace(cfg.bwd_cols, num_stages=stages),
                                  bwd_rows=dataclasses.replace(cfg.bwd_rows, num_stages=stages))
    return cfg


def main():
    args = diag.start(diag.parser(__doc__, shapes=diag.BENCH_SHAPES, rounds=3), full_precision_bf16=True)
    ops = diag.ops
    for n, h, v in args.shapes:
        hid, w, lab, g_lp, g_ent = diag.head_inputs(n, h, v)
        t_mm = bench(lambda: hid @ w.T)
        t_win_mm = bench(lambda: hid @ w[:WINDOW].T)
        base = ops.CUDA_CONFIG
        hp = diag.head_params(hid.device)
        _, ent, lse, _ = ops.split_combine(ops.linear_split_stats(hid, w, lab, hp, base), lab, hp)
        saved, upstream = diag.saved_and_grads(lse, ent, g_lp, g_ent)
        win = torch.empty(n, WINDOW, dtype=hid.dtype, device="cuda")
        step, hg, wg = diag.head_step(hid, w, lab, g_lp, g_ent)

        print(f"\n{n}x{h}x{v}: cuBLAS {t_mm:.2f} ms ({2 * n * h * v / t_mm / 1e9:.0f} TFLOP/s); "
              f"window {n}x{WINDOW} cuBLAS {t_win_mm:.3f} ms", flush=True)
        rows, ref, times = {}, None, {name: [] for name, _ in VARIANTS}
        for name, fields in VARIANTS:
            cfg = variant_config(fields)
            try:
                def kernel():
                    ops.linear_dlogits(hid, w, lab, saved, upstream, slice(0, n), slice(0, WINDOW), win, hp, cfg,
                                       cfg.bwd_cols)
                win.fill_(float("nan"))
                kernel()
                dz = win.clone()
                t_k = bench(kernel)
                with ops.forced_config(cfg):
                    step()
                grads = (hg.grad.clone(), wg.grad.clone())
            except Exception as e:  # noqa: BLE001
                print(f"  {name}: {type(e).__name__} {str(e)[:200]}", flush=True)
                continue
            if ref is None:
                ref = (dz, *grads)
            same = all(torch.equal(a, b) for a, b in zip(ref, (dz, *grads)))
            rows[name] = (cfg, t_k, same)
        for _ in range(args.rounds):
            for name, (cfg, _, _) in rows.items():
                with ops.forced_config(cfg):
                    times[name].append(bench(step, rep=1000))
        print(f"  {'variant':38s} {'window ×mm':>10s} {'fwd+bwd ms':>11s} {'×mm':>6s}  bitwise = first")
        for name, (cfg, t_k, same) in rows.items():
            t = statistics.median(times[name])
            print(f"  {name:38s} {t_k / t_win_mm:10.3f} {t:11.2f} {t / t_mm:6.3f}  {same}", flush=True)
        del hid, w, step, hg, wg, win
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
