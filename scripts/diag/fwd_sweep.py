"""Forward mainloop config sweep: time vs cuBLAS (same run), max |Δ| vs the first config.

python scripts/diag/fwd_sweep.py [N,H,V ...]   (default: the three benchmark shapes)
"""
import dataclasses
import sys

import torch
import triton.testing

from rl_kernels import ops

SHAPES = sys.argv[1:] or ["512,3584,152064", "16384,3584,152064", "32768,4096,128256"]
# (BM, BN, BK, warps, stages, GROUP_M, split_v); the first is the shipped CUDA config
CONFIGS = [(128, 256, 64, 8, 3, 8, 2048), (128, 256, 64, 8, 3, 8, 1024), (128, 256, 64, 8, 3, 8, 512),
           (128, 256, 64, 8, 3, 4, 1024), (128, 128, 64, 8, 3, 8, 1024), (64, 256, 64, 4, 3, 8, 1024)]
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")  # noqa: E731

for shape in SHAPES:
    n, h, v = (int(x) for x in shape.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    t_mm = bench(lambda: hid @ w.T)
    ref = None
    print(f"{n}x{h}x{v}: cuBLAS {t_mm:.2f} ms", flush=True)
    for bm, bn, bk, warps, stages, gm, split in CONFIGS:
        cfg = dataclasses.replace(ops.CUDA_CONFIG, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                                  num_stages=stages, group_m=gm, split_v=split)
        try:
            f = lambda: ops.split_combine(*ops.linear_split_stats(hid, w, lab, 1.0, True, cfg),  # noqa: E731
                                          lab, -100, True)
            lp = f()[0]
            t = bench(f)
        except Exception as e:  # noqa: BLE001
            print(f"  {cfg}: {type(e).__name__} {str(e)[:100]}")
            continue
        ref = lp if ref is None else ref
        print(f"  BM{bm} BN{bn} BK{bk} w{warps} s{stages} G{gm} split{split}: {t:.3f} ms = {t / t_mm:.2f}x mm, "
              f"max|Δ| vs first {(lp - ref).abs().max().item():.1e}", flush=True)
    del hid, w, lab
    torch.cuda.empty_cache()
