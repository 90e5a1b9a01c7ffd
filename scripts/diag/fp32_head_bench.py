"""The float32 head on this GPU (issue 54 item 1): ``linear_log_probs`` on float32 hidden states
and weight, per product form (the forward's ``tl.dot`` and the backward's cuBLAS matmuls), against one torch float32 matmul of
the same shape (full fp32 products: torch's default "highest" precision), the bf16 head, and
torch's float32 path (the logits materialized: ``hidden @ W.T`` in float32, then log-softmax and
entropy in float32, what verl's torch backend computes on float32 inputs); then the accuracy of
each against float64 on a smaller shape (log-probs, entropy and both gradients; logits std 2,
temperature 1 and 0.3). One run; ratios are to the matmul of the same run.

    python scripts/diag/fp32_head_bench.py [N,H,V] [--check N,H,V] [--only NAME ...] [--json PATH]
"""
import dataclasses
import os

import torch

import rl_kernels
from rl_kernels.tools import diag

ap = diag.parser(__doc__, shapes=["4096,3584,152064"], one_shape=True, json_out=True)
ap.add_argument("--check", type=diag.shape_type("N,H,V"), default=(2048, 3584, 32768),
                help="N,H,V of the accuracy check against float64 (default 2048,3584,32768)")
ap.add_argument("--only", nargs="*", default=None, help="the variants to run (default: all)")
args = diag.start(ap)
ops = diag.ops
shipped = ops.default_config(torch.device("cuda"), torch.float32)
base_class = ops.config_class(torch.device("cuda"))
VARIANTS = {  # name -> the float32 tiles
    "shipped": shipped,
    "SGEMM backward": dataclasses.replace(shipped, fp32_backward="ieee"),
    "tf32x3 backward (split once, promoted)": dataclasses.replace(shipped, fp32_backward="tf32x3"),
    "tf32 (1 pass)": dataclasses.replace(shipped, fp32_precision="tf32", fp32_backward="tf32"),
}


def use(variant):
    """Every launch (forward and the backward, which autograd may run on another thread) takes
    the variant's float32 tiles: a configuration class of its own, forced by name."""
    cfg = variant
    ops.CLASSES["fp32-sweep"] = dataclasses.replace(base_class, name="fp32-sweep", fp32=cfg)
    os.environ[ops.CONFIG_CLASS_ENV] = "fp32-sweep"


def head_step(hid, w, lab, up):
    return diag.head_step(hid, w, lab, up[0], up[1])[0]


def torch_path(hid, w, lab, up, temperature=1.0):
    """torch's float32 path: float32 logits, log-softmax, the label's log-prob and the entropy."""
    logits = (hid @ w.T) / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, lab[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


n, h, v = args.shape
g = torch.Generator(device="cuda").manual_seed(0)
hid = torch.randn(n, h, device="cuda", generator=g)
w = torch.randn(v, h, device="cuda", generator=g) * (2.0 / h ** 0.5)
lab = torch.randint(0, v, (n,), device="cuda", generator=g)
up = torch.randn(2, n, device="cuda", generator=g)
bench = lambda fn: diag.bench(fn)[0]  # noqa: E731 - median ms
t_mm = bench(lambda: hid @ w.T)
hb, wb = hid.bfloat16(), w.bfloat16()
t_mm_bf16 = bench(lambda: hb @ wb.T)
t_bf16 = bench(head_step(hb, wb, lab, up))
rows = [{"what": "torch fp32 matmul (highest)", "ms": t_mm}, {"what": "torch bf16 matmul", "ms": t_mm_bf16},
        {"what": "bf16 head fwd+bwd", "ms": t_bf16}]


def torch_step_of(hid, w, lab, up):
    hx, wx = hid.clone().requires_grad_(), w.clone().requires_grad_()

    def step():
        hx.grad = wx.grad = None
        lp, ent = torch_path(hx, wx, lab, up)
        torch.autograd.backward([lp, ent], [up[0], up[1]])
    return step


with torch.no_grad():
    rows.append({"what": "torch fp32 path fwd", "ms": bench(lambda: torch_path(hid, w, lab, up))})
t_torch, peak_torch = diag.bench(torch_step_of(hid, w, lab, up))
rows.append({"what": "torch fp32 path fwd+bwd", "ms": t_torch, "peak_extra_gib": peak_torch})
print(f"{n}x{h}x{v} float32; fp32 matmul {t_mm:.2f} ms, bf16 matmul {t_mm_bf16:.2f} ms, bf16 head fwd+bwd "
      f"{t_bf16:.2f} ms; torch fp32 path fwd {rows[3]['ms']:.2f} ms, fwd+bwd {rows[4]['ms']:.2f} ms", flush=True)
for name, variant in VARIANTS.items():
    if args.only is not None and name not in args.only:
        continue
    use(variant)
    try:
        with torch.no_grad():
            t_f = bench(lambda: rl_kernels.linear_log_probs(hid, w, lab))
        t_fb, peak = diag.bench(head_step(hid, w, lab, up))
    except Exception as e:  # noqa: BLE001 - a variant that does not fit this GPU
        print(f"  {name:34s} {type(e).__name__}: {str(e)[:160]}", flush=True)
        continue
    rows.append({"what": f"fp32 head {name}", "fwd_ms": t_f, "fwd_bwd_ms": t_fb, "fwd_bwd_peak_extra_gib": peak})
    print(f"  {name:34s} fwd {t_f:8.2f} ms = {t_f / t_mm:5.2f}x fp32 mm; fwd+bwd {t_fb:8.2f} ms = "
          f"{t_fb / t_bf16:5.2f}x the bf16 head, {t_fb / t_mm:5.2f}x fp32 mm, peak +{peak:.2f} GiB", flush=True)
hid = w = hb = wb = None
torch.cuda.empty_cache()

# accuracy against float64
n, h, v = args.check
hid = torch.randn(n, h, device="cuda", generator=g)
w = torch.randn(v, h, device="cuda", generator=g) * (2.0 / h ** 0.5)
lab = torch.randint(0, v, (n,), device="cuda", generator=g)
up = torch.randn(2, n, device="cuda", generator=g)


def grads(fn, hid, w, temperature):
    hx, wx = hid.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent = fn(hx, wx, temperature)
    torch.autograd.backward([lp, ent], [up[0].to(lp.dtype), up[1].to(lp.dtype)])
    return lp.detach().double(), ent.detach().double(), hx.grad.double(), wx.grad.double()


def ours(hx, wx, temperature):
    out = rl_kernels.linear_log_probs(hx, wx, lab, temperature=temperature)
    return out.log_probs, out.entropy


print(f"accuracy vs float64, {n}x{h}x{v}, logits std 2: mean / max |error| (gradients: relative to the "
      f"largest |float64 gradient|)", flush=True)
for temperature in (1.0, 0.3):
    ref = grads(lambda hx, wx, t: torch_path(hx, wx, lab, up, t), hid.double(), w.double(), temperature)
    cands = {"torch fp32 path": lambda: grads(lambda hx, wx, t: torch_path(hx, wx, lab, up, t), hid, w, temperature)}
    for name in [name for name in VARIANTS if args.only is None or name in args.only]:
        cands[f"fp32 head {name}"] = (lambda cfg: lambda: (use(cfg), grads(ours, hid, w, temperature))[1])(VARIANTS[name])
    for name, run in cands.items():
        got = run()
        errs = []
        for label, a, b in zip(("log_probs", "entropy", "d_hidden", "d_weight"), got, ref):
            e = (a - b).abs()
            scale = b.abs().max() if label.startswith("d_") else 1.0
            errs.append((label, float(e.mean() / scale), float(e.max() / scale)))
        rows.append({"what": f"error T={temperature} {name}", **{f"{k}_mean": m for k, m, _ in errs},
                     **{f"{k}_max": x for k, _, x in errs}})
        print(f"  T={temperature} {name:28s} " + "  ".join(f"{k} {m:.1e}/{x:.1e}" for k, m, x in errs), flush=True)
os.environ.pop(ops.CONFIG_CLASS_ENV, None)
if args.json:
    diag.write_json(args.json, {"shape": list(args.shape), "check": list(args.check), "rows": rows})
