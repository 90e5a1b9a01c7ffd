"""linear_topk on the GPU (issue 45, item 4): time of the fused top-K selection (Triton) against one
cuBLAS matmul of the same shape (torch.mm, bf16), its peak extra memory, and a check of its ids
and log-probs against the torch backend (float32 logits) on the first rows.

python scripts/diag/linear_topk_bench.py [N,H,V ...] [--k 64 ...] [--rounds 3]
    [--splits S] [--block-m BM] [--block-n BN] [--warps W] [--stages ST] [--[no-]flatten] [--trend X]

Goal (issue 45): at 16384,3584,152064 and k = 64, ms <= 1.3 x the matmul's. The tile options
override the kernel's launch (``ops.linear_topk.topk_tiles`` / ``topk_splits``) for a sweep; every
override gives the same ids and log-probs (only the launch changes). ``--trend X`` adds X * (1 - 2 v
/ V) to every row's logit v (through one hidden feature), so that the logits rise (X < 0: the
selection's worst case, every tile brings new candidates) or fall (X > 0) along the vocabulary;
0 (default): the random inputs' order.
Output: one line per (shape, k): ms of linear_topk, of torch.mm, their ratio, the peak extra GiB of
linear_topk (and of the matmul's logits), the splits, and the check.
"""
import argparse
import dataclasses

import torch

from rl_kernels.tools import diag


def main():
    parser = diag.parser(__doc__, shapes=["16384,3584,152064", diag.BENCH_SHAPES[0]], rounds=3)
    parser.add_argument("--k", type=diag.positive_int, nargs="+", default=[64], help="top-K sizes (default 64)")
    parser.add_argument("--splits", type=int, default=None, help="vocab splits per row block (default: auto)")
    parser.add_argument("--block-m", type=int, default=None)
    parser.add_argument("--block-n", type=int, default=None)
    parser.add_argument("--warps", type=int, default=None)
    parser.add_argument("--stages", type=int, default=None)
    parser.add_argument("--flatten", action=argparse.BooleanOptionalAction, default=None,
                        help="flatten the tile loop's pipeline or not (default: the head configuration's)")
    parser.add_argument("--trend", type=float, default=0.0, help="logit trend along the vocabulary (see above)")
    parser.add_argument("--check-rows", type=int, default=512, help="rows checked against the torch backend")
    args = diag.start(parser, full_precision_bf16=True)

    import triton.testing

    import rl_kernels

    topk_ops, head_inputs, peak_extra_gib = diag.topk_ops, diag.head_inputs, diag.peak_extra_gib
    tiles, splits = topk_ops.topk_tiles, topk_ops.topk_splits
    chosen = {}

    def tiles_override(cfg, kp):
        t = tiles(cfg, kp)
        over = {"block_m": args.block_m, "block_n": args.block_n, "num_warps": args.warps,
                "num_stages": args.stages}
        over["flatten"] = args.flatten
        t = dataclasses.replace(t, **{f: x for f, x in over.items() if x is not None})
        chosen["tiles"] = t
        return t

    def splits_override(row_blocks, n_chunks, device):
        chosen["splits"] = min(n_chunks, args.splits) if args.splits else splits(row_blocks, n_chunks, device)
        return chosen["splits"]

    topk_ops.topk_tiles, topk_ops.topk_splits = tiles_override, splits_override

    def bench(f):
        return sorted(triton.testing.do_bench(f, warmup=5, rep=500, return_mode="median")
                      for _ in range(args.rounds))[args.rounds // 2]

    print(f"{'shape':>20} {'k':>4} {'topk ms':>8} {'mm ms':>7} {'ratio':>6} {'peak GiB':>9} {'mm GiB':>7} "
          f"{'splits':>6}  check (ids differing from torch's float32, where: max |logit gap|)")
    for n, h, v in args.shapes:
        shape = f"{n},{h},{v}"
        hidden, weight = head_inputs(n, h, v)[:2]
        if args.trend:
            hidden[:, 0] = 1.0
            weight[:, 0] = (args.trend * (1 - 2 * torch.arange(v, device="cuda") / v)).bfloat16()
        mm_ms = bench(lambda: torch.mm(hidden, weight.T))
        mm_gib = peak_extra_gib(lambda: torch.mm(hidden, weight.T))
        for k in args.k:
            def call():
                return rl_kernels.linear_topk(hidden, weight, k=k, backend="triton")
            call()  # compile
            ms = bench(call)
            gib = peak_extra_gib(call)
            lp, ids = call()
            rows = min(n, args.check_rows)
            ref_lp, ref_ids = rl_kernels.linear_topk(hidden[:rows], weight, k=k, backend="torch")
            differ = ids[:rows] != ref_ids
            z = hidden[:rows].float() @ weight.float().T
            gap = (z.gather(1, ids[:rows]) - z.gather(1, ref_ids)).abs().max().item()
            lp_err = (lp[:rows] - ref_lp).abs().max().item()
            check = f"{int(differ.sum())} of {differ.numel()} ids (max |logit gap| {gap:.1e}), log-prob {lp_err:.1e}"
            print(f"{shape:>20} {k:>4} {ms:8.3f} {mm_ms:7.3f} {ms / mm_ms:6.2f} {gib:9.3f} {mm_gib:7.2f} "
                  f"{chosen.get('splits', '?'):>6}  {check}  {chosen.get('tiles')}", flush=True)


if __name__ == "__main__":
    main()
