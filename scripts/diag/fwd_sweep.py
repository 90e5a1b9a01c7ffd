"""Forward mainloop variant sweep: time vs cuBLAS (same run), max |Δ| vs the first variant.

python scripts/diag/fwd_sweep.py [--bwd] [N,H,V ...]   (default: the three benchmark shapes)

Each variant is a set of ``KernelConfig`` fields replaced in the shipped CUDA config. With
``--bwd`` the forward+backward of ``linear_log_probs`` is timed too (random upstream gradients on
both outputs), with the variant installed as the CUDA config.
"""
import dataclasses

import torch
import triton.testing

from rl_kernels.tools import diag

ap = diag.parser(__doc__, shapes=["512,3584,152064", "16384,3584,152064", "32768,4096,128256"])
ap.add_argument("--bwd", action="store_true", help="also time the forward+backward with each variant installed")
args = diag.start(ap)
ops = diag.ops
BASE = dict(tma=False, flatten=False, warp_specialize=False)
VARIANTS = [
    ("pointer loads", BASE),
    ("TMA", dict(BASE, tma=True)),
    ("TMA + flatten", dict(BASE, tma=True, flatten=True)),
    ("TMA + WS", dict(BASE, tma=True, warp_specialize=True)),
    ("TMA + flatten + WS", dict(BASE, tma=True, flatten=True, warp_specialize=True)),
    ("TMA + flatten, 4 stages", dict(BASE, tma=True, flatten=True, num_stages=4)),
    ("TMA + flatten, split 1024", dict(BASE, tma=True, flatten=True, split_v=1024)),
]
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=500, return_mode="median")  # noqa: E731

shipped = ops.CUDA_CONFIG
for n, h, v in args.shapes:
    hid, w, lab, g_lp, g_ent = diag.head_inputs(n, h, v)
    hp = diag.head_params(hid.device)
    t_mm = bench(lambda: hid @ w.T)
    ref = None
    print(f"{n}x{h}x{v}: cuBLAS {t_mm:.2f} ms ({2 * n * h * v / t_mm / 1e9:.0f} TFLOP/s)", flush=True)
    for name, fields in VARIANTS:
        cfg = dataclasses.replace(shipped, **fields)
        try:
            f = lambda: ops.split_combine(ops.linear_split_stats(hid, w, lab, hp, cfg), lab, hp)  # noqa: E731
            lp = f()[0]
            t = bench(f)
        except Exception as e:  # noqa: BLE001
            print(f"  {name}: {type(e).__name__} {str(e)[:120]}", flush=True)
            continue
        ref = lp if ref is None else ref
        line = (f"  {name:42s} fwd {t:7.3f} ms = {t / t_mm:.3f}x mm, "
                f"max|Δ| vs first {(lp - ref).abs().max().item():.1e}")
        if args.bwd:
            step, hg, wg = diag.head_step(hid, w, lab, g_lp, g_ent)
            try:
                with ops.forced_config(cfg):
                    step()
                    tb = bench(step)
                line += f", fwd+bwd {tb:.2f} ms = {tb / t_mm:.3f}x mm"
            except Exception as e:  # noqa: BLE001
                line += f", fwd+bwd {type(e).__name__} {str(e)[:200]}"
            del step, hg, wg
        print(line, flush=True)
    del hid, w, lab
    torch.cuda.empty_cache()
