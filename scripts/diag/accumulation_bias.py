"""The bf16 head's accumulation bias (issue 54 item 4): the errors of the log-probs of
``linear_log_probs`` on bf16 hidden states and weight against float64 on the same bf16 values,
beside torch's float32 path (the bf16 inputs upcast, one SGEMM, float32 log-softmax), at
temperature 1 and 0.3 and logits std 2; then the head's forward+backward time against one cuBLAS
bf16 matmul of the same shape at each timing shape. One run.

    python scripts/diag/accumulation_bias.py [N,H,V ...] [--check N,H,V] [--json PATH]
"""
import torch

from rl_kernels.tools import diag

ap = diag.parser(__doc__, shapes=["4096,3584,152064", "16384,3584,152064", "32768,3584,152064"], json_out=True)
ap.add_argument("--check", type=diag.shape_type("N,H,V"), default=(2048, 3584, 152064),
                help="N,H,V of the accuracy check against float64 (default 2048,3584,152064)")
args = diag.start(ap)
import rl_kernels  # noqa: E402

rows = []
n, h, v = args.check
g = torch.Generator(device="cuda").manual_seed(0)
hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
w = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h ** 0.5)).bfloat16()
lab = torch.randint(0, v, (n,), device="cuda", generator=g)
print(f"accuracy vs float64, {n}x{h}x{v} bf16, logits std 2: log-prob mean / max |error|, "
      f"mean signed error (the bias)", flush=True)
for temperature in (1.0, 0.3):
    z64 = (hid.double() @ w.double().T) / temperature
    lse64 = torch.logsumexp(z64, -1)
    lp64 = z64.gather(1, lab[:, None])[:, 0] - lse64
    z64 = None
    z32 = (hid.float() @ w.float().T) / temperature
    lp32 = z32.gather(1, lab[:, None])[:, 0] - torch.logsumexp(z32, -1)
    z32 = None
    with torch.no_grad():
        out = rl_kernels.linear_log_probs(hid, w, lab, temperature=temperature, return_entropy=False)
    for name, lp in (("torch fp32 path", lp32), ("rl_kernels", out.log_probs)):
        d = lp.double() - lp64
        e, bias = d.abs(), float(d.mean())
        rows.append({"what": f"T={temperature} {name}", "log_probs_mean": float(e.mean()),
                     "log_probs_max": float(e.max()), "log_probs_bias": bias})
        print(f"  T={temperature} {name:16s} log-probs {float(e.mean()):.2e} / {float(e.max()):.2e}, "
              f"bias {bias:+.2e}", flush=True)
hid = w = None
torch.cuda.empty_cache()
for n, h, v in args.shapes:
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h ** 0.5)).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    up = torch.randn(2, n, device="cuda", generator=g)
    t_mm = diag.bench(lambda: hid @ w.T)[0]
    t_head = diag.bench(diag.head_step(hid, w, lab, up[0], up[1])[0])[0]
    rows.append({"what": f"{n}x{h}x{v} fwd+bwd", "mm_ms": t_mm, "head_ms": t_head})
    print(f"  {n}x{h}x{v}: matmul {t_mm:.2f} ms, head fwd+bwd {t_head:.2f} ms = {t_head / t_mm:.2f}x", flush=True)
    hid = w = None
    torch.cuda.empty_cache()
if args.json:
    diag.write_json(args.json, {"check": list(args.check), "rows": rows})
