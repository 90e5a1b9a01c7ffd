"""linear_jsd on the GPU, bf16: accuracy vs float64, time vs cuBLAS and our linear_log_probs
fwd+bwd (same run), peak memory vs torch eager and Liger's fused linear JSD (when importable),
and a sweep of the JSD kernels' tiles.

python scripts/diag/jsd_bench.py [N,H,V] [--sweep] [--no-final]   (default 4096,3584,152064: a Qwen2.5-7B head)
"""
import dataclasses

import torch
import triton.testing

import rl_kernels
from rl_kernels.tools import diag

ap = diag.parser(__doc__, shapes=["4096,3584,152064"], one_shape=True, json_out=True)
ap.add_argument("--sweep", action="store_true", help="also sweep the JSD kernels' tiles")
ap.add_argument("--no-final", action="store_true", help="leave out the per-beta accuracy, time and memory rows")
args = diag.start(ap)
ops, peak_extra = diag.ops, diag.peak_extra_gib
n, h, v = args.shape
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
hs = torch.randn(n, h, device=dev, generator=g).bfloat16()
ws = (0.02 * torch.randn(v, h, device=dev, generator=g)).bfloat16()
ht = torch.randn(n, h, device=dev, generator=g).bfloat16()
wt = (ws.float() + 0.01 * torch.randn(v, h, device=dev, generator=g)).bfloat16()  # a related teacher
labels = torch.randint(0, v, (n,), device=dev, generator=g)
labels[torch.rand(n, device=dev, generator=g) < 0.1] = -100
g_lp, g_ent = torch.randn(2, n, device=dev, generator=g)
T = 0.9


def bench(f):
    return triton.testing.do_bench(f, warmup=3, rep=600, return_mode="median")


hsx, wsx = hs.clone().requires_grad_(), ws.clone().requires_grad_()


def ours(beta):
    def step():
        hsx.grad = wsx.grad = None
        rl_kernels.linear_jsd(hsx, wsx, ht, wt, beta=beta, temperature=T, labels=labels).backward()
    return step


def eager(beta):
    def step():
        hsx.grad = wsx.grad = None
        lq = torch.log_softmax((hsx @ wsx.T).float() / T, -1)
        lp = torch.log_softmax((ht @ wt.T).float() / T, -1)
        if beta == 0:
            per = (lp.exp() * (lp - lq)).sum(-1)
        elif beta == 1:
            per = (lq.exp() * (lq - lp)).sum(-1)
        else:
            lm = torch.logaddexp(lp + torch.log(torch.tensor(beta)), lq + torch.log(torch.tensor(1 - beta)))
            per = beta * (lp.exp() * (lp - lm)).sum(-1) + (1 - beta) * (lq.exp() * (lq - lm)).sum(-1)
        valid = labels != -100
        (torch.where(valid, per * T * T, 0.0).sum() / valid.sum()).backward()
    return step


def head():
    hsx.grad = wsx.grad = None
    out = rl_kernels.linear_log_probs(hsx, wsx, labels)
    torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])


def reference(beta, chunk=512):
    """float64 loss and student grads, in row chunks (dense logits of one chunk at a time)."""
    w64 = ws.double().requires_grad_()
    dh = torch.empty(n, h, dtype=torch.float64, device=dev)
    valid = labels != -100
    count = valid.sum()
    total = 0.0
    wt64 = wt.double()
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        h64 = hs[r0:r1].double().requires_grad_()
        lq = torch.log_softmax(h64 @ w64.T / T, -1)
        lp = torch.log_softmax(ht[r0:r1].double() @ wt64.T / T, -1)
        if beta == 0:
            per = (lp.exp() * (lp - lq)).sum(-1)
        elif beta == 1:
            per = (lq.exp() * (lq - lp)).sum(-1)
        else:
            m = (beta * lp.exp() + (1 - beta) * lq.exp()).log()
            per = beta * (lp.exp() * (lp - m)).sum(-1) + (1 - beta) * (lq.exp() * (lq - m)).sum(-1)
        part = torch.where(valid[r0:r1], per * T * T, 0.0).sum() / count
        part.backward()
        total += part.item()
        dh[r0:r1] = h64.grad
        del lq, lp, per, part
    return total, dh, w64.grad


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


t_mm = bench(lambda: hs @ ws.T)
t_head = bench(head)
print(f"{n}x{h}x{v} bf16 T={T}: cuBLAS mm {t_mm:.2f} ms; "
      f"linear_log_probs fwd+bwd {t_head:.2f} ms ({t_head / t_mm:.2f}x mm)")

liger = None
try:
    from liger_kernel.transformers import LigerFusedLinearJSD
    liger = LigerFusedLinearJSD
except Exception as e:  # noqa: BLE001
    print(f"Liger not importable: {type(e).__name__}: {e}")

if args.sweep:
    base = ops.default_config(torch.device(dev))

    def run_with(cfg):
        with ops.forced_config(cfg):
            with torch.no_grad():
                tf = bench(lambda: rl_kernels.linear_jsd(hs, ws, ht, wt, beta=0.5, temperature=T, labels=labels))
            return tf, bench(ours(0.5))

    for fused in (False, True):  # forward kernel tiles (backward fixed at the default)
        for fwd in (ops.BwdTile(128, 128, 8, 3), ops.BwdTile(128, 256, 16, 2), ops.BwdTile(256, 128, 16, 2),
                    ops.BwdTile(128, 128, 8, 2), ops.BwdTile(128, 128, 4, 3)):
            try:
                tf, t = run_with(dataclasses.replace(base, jsd_fwd=fwd, jsd_fused_k=fused))
                print(f"  sweep fused={fused} fwd {fwd}: fwd {tf / t_mm:.2f}x mm, fwd+bwd {t / t_mm:.2f}x mm")
            except Exception as e:  # noqa: BLE001
                print(f"  sweep fused={fused} fwd {fwd}: failed {type(e).__name__}: {str(e)[:150]}")
        for bwd in (ops.BwdTile(128, 256, 16, 2), ops.BwdTile(256, 128, 16, 2), ops.BwdTile(128, 128, 8, 2)):
            try:
                tf, t = run_with(dataclasses.replace(base, jsd_bwd=bwd, jsd_fused_k=fused))
                print(f"  sweep fused={fused} bwd {bwd}: fwd {tf / t_mm:.2f}x mm, fwd+bwd {t / t_mm:.2f}x mm, "
                      f"bwd {(t - tf) / t_mm:.2f}x mm")
            except Exception as e:  # noqa: BLE001
                print(f"  sweep fused={fused} bwd {bwd}: failed {type(e).__name__}: {str(e)[:150]}")

rows = []
for beta in (() if args.no_final else (0.0, 0.5, 1.0)):
    row = {"beta": beta, "shape": [n, h, v], "temperature": T, "mm_ms": t_mm, "linear_log_probs_fwd_bwd_ms": t_head}
    rows.append(row)
    f = ours(beta)
    mem = peak_extra(f)
    got = rl_kernels.linear_jsd(hsx, wsx, ht, wt, beta=beta, temperature=T, labels=labels)
    hsx.grad = wsx.grad = None
    got.backward()
    ref, dh, dw = reference(beta)
    print(f"beta={beta}: loss {got.item():.6f} vs float64 {ref:.6f} (rel {abs(got.item() - ref) / abs(ref):.1e}); "
          f"dh rel {rel(hsx.grad, dh):.2e}, dW rel {rel(wsx.grad, dw):.2e}")
    row.update(loss=got.item(), loss_float64=ref, dh_rel=rel(hsx.grad, dh), dw_rel=rel(wsx.grad, dw))
    del dh, dw
    torch.cuda.empty_cache()
    t = bench(f)
    row.update(ours_ms=t, ours_peak_extra_gib=mem)
    print(f"  ours fwd+bwd {t:.2f} ms = {t / t_head:.3f}x linear_log_probs fwd+bwd ({t / t_mm:.2f}x mm); "
          f"peak extra {mem:.2f} GiB (grads {2 * (n + v) * h / 2**30:.2f} GiB)")
    try:
        me = peak_extra(eager(beta))
        te = bench(eager(beta))
        row.update(eager_ms=te, eager_peak_extra_gib=me)
        print(f"  torch eager fwd+bwd {te:.2f} ms ({te / t:.2f}x ours), peak extra {me:.2f} GiB")
    except torch.OutOfMemoryError:
        print("  torch eager: out of memory")
    torch.cuda.empty_cache()
    if liger is not None:
        mod = liger(jsd_beta=beta, ignore_index=-100, temperature=T)

        def lig():
            hsx.grad = wsx.grad = None
            mod(hsx, wsx, ht, wt, labels).backward()
        try:
            val = mod(hsx, wsx, ht, wt, labels).item()
            ml = peak_extra(lig)
            tl_ = bench(lig)
            row.update(liger_ms=tl_, liger_peak_extra_gib=ml, liger_loss=val)
            print(f"  Liger fused linear JSD fwd+bwd {tl_:.2f} ms ({tl_ / t:.2f}x ours), peak extra {ml:.2f} GiB; "
                  f"value {val:.6f} (x T^2 = {val * T * T:.6f})")
        except Exception as e:  # noqa: BLE001
            print(f"  Liger failed: {type(e).__name__}: {str(e)[:300]}")
        torch.cuda.empty_cache()
if args.json:
    from importlib.metadata import PackageNotFoundError, version

    try:
        liger_version = version("liger-kernel") if liger is not None else None
    except PackageNotFoundError:  # importable without its metadata (unzipped onto PYTHONPATH)
        liger_version = "unknown version"
    diag.write_json(args.json, rows, liger=liger_version)
