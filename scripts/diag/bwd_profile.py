"""Where does the backward's time go? (speed issue diagnosis; H100/H200, bf16)

Times, as multiples of one cuBLAS ``h @ W.T`` of the same shape in the same run:
  * forward, the full backward at chunk budgets 5% / 10% / 25%,
  * one dlogits window (all rows x C columns, and R rows x all columns) vs a matmul of that shape,
  * dlogits tile configs (BLOCK_M x BLOCK_N, warps, stages),
  * a single-recompute backward (vocab chunks; dW from the window, dh accumulated in float32 with
    ``torch.addmm(..., out_dtype=float32)`` when torch has it), with its dh / dW error vs float64
    at a small N.
"""
import dataclasses
import time

import torch
import triton

from rl_kernels.reference import make_inputs, reference_linear_grads, rel_err  # noqa: E402

import rl_kernels.autograd.backward_schedule as ag  # noqa: E402
from rl_kernels import linear_log_probs, ops  # noqa: E402


def bench(fn, reps=10):
    return triton.testing.do_bench(fn, warmup=3, rep=reps * 20, return_mode="median")


def single_recompute(hidden, weight, labels, lse, ent, g_lp, g_ent, cfg, budget, addmm_ok):
    n, h = hidden.shape
    v = weight.shape[0]
    step = max(1, budget // n)
    buf = torch.empty(n * step, dtype=hidden.dtype, device=hidden.device)
    dw = torch.empty_like(weight)
    acc = torch.zeros(n, h, dtype=torch.float32, device=hidden.device)
    for c0 in range(0, v, step):
        c1 = min(v, c0 + step)
        dz = buf[: n * (c1 - c0)].view(n, c1 - c0)
        ops.linear_dlogits(hidden, weight, labels, lse, ent, g_lp, g_ent, slice(0, n), slice(c0, c1),
                           1.0, -100, dz, cfg, cfg.bwd_cols)
        torch.mm(dz.T, hidden, out=dw[c0:c1])
        if addmm_ok:
            torch.addmm(acc, dz, weight[c0:c1], out_dtype=torch.float32, out=acc)
        else:
            acc += torch.mm(dz, weight[c0:c1]).float()
    return acc.to(hidden.dtype), dw


def main():
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    dev = "cuda"
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, time.strftime("%Y-%m-%d"))
    acc = torch.zeros(4, 3, device=dev)
    try:
        torch.addmm(acc, torch.randn(4, 8, device=dev, dtype=torch.bfloat16),
                    torch.randn(8, 3, device=dev, dtype=torch.bfloat16), out_dtype=torch.float32, out=acc)
        addmm_ok = True
    except Exception as exc:  # noqa: BLE001
        print("addmm out_dtype unavailable:", str(exc)[:100])
        addmm_ok = False
    print("addmm(out_dtype=float32, out=acc):", addmm_ok)

    n, h, v = 16384, 3584, 152064
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, seed=0, device=dev, w_scale=0.02)
    g = torch.Generator(device=dev).manual_seed(3)
    g_lp = torch.randn(n, device=dev, generator=g)
    g_ent = torch.randn(n, device=dev, generator=g)
    mm = bench(lambda: hidden @ weight.T)
    print(f"\n{n}x{h}x{v}: cuBLAS mm {mm:.2f} ms ({2 * n * h * v / mm / 1e9:.0f} TFLOP/s)")
    cfg = ops.default_config(hidden.device)
    parts = ops.linear_split_stats(hidden, weight, labels, 1.0, True, cfg)
    lp, ent, lse = ops.split_combine(*parts, labels, -100, True)
    fwd = bench(lambda: ops.split_combine(*ops.linear_split_stats(hidden, weight, labels, 1.0, True, cfg),
                                          labels, -100, True))
    print(f"forward {fwd / mm:.2f}x")

    hd, wd = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    for frac in (0.05, 0.08, 0.25):
        ag.CHUNK_FRACTION = frac

        def fb():
            out = linear_log_probs(hd, wd, labels, backend="triton")
            torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])
        t = bench(fb, reps=3)
        print(f"fwd+bwd, chunk budget {frac:.0%}: {t / mm:.2f}x  (bwd alone ~{(t - fwd) / mm:.2f}x)")
    ag.CHUNK_FRACTION = 0.08

    budget = int(0.08 * (n + v) * h)
    cw = budget // n // 64 * 64
    rw = budget // v
    out_c = torch.empty(n, cw, dtype=torch.bfloat16, device=dev)
    out_r = torch.empty(rw, v, dtype=torch.bfloat16, device=dev)
    print(f"\nwindows at 8% (aligned): {n} x {cw} (dW pass), {rw} x {v} (dh pass)")
    for bm, bn, warps, stages in [(128, 128, 8, 3), (128, 256, 8, 3), (128, 256, 8, 4), (256, 128, 8, 3),
                                  (128, 128, 4, 4), (64, 256, 4, 3)]:
        c = dataclasses.replace(cfg, bwd_cols=ops.BwdTile(bm, bn, warps, stages),
                                bwd_rows=ops.BwdTile(bm, bn, warps, stages))
        try:
            tc = bench(lambda: ops.linear_dlogits(hidden, weight, labels, lse, ent, g_lp, g_ent, slice(0, n),
                                                  slice(0, cw), 1.0, -100, out_c, c, c.bwd_cols))
            tr = bench(lambda: ops.linear_dlogits(hidden, weight, labels, lse, ent, g_lp, g_ent, slice(0, rw),
                                                  slice(0, v), 1.0, -100, out_r, c, c.bwd_rows))
            mc = bench(lambda: hidden @ weight[:cw].T)
            mr = bench(lambda: hidden[:rw] @ weight.T)
            print(f"dlogits {bm}x{bn} w{warps} s{stages}: col window {tc / mc:.2f}x its mm, "
                  f"row window {tr / mr:.2f}x its mm; whole-V equivalent {tc * v / cw / mm:.2f}x / "
                  f"{tr * n / rw / mm:.2f}x")
        except Exception as exc:  # noqa: BLE001
            print(f"dlogits {bm}x{bn} w{warps} s{stages}: {type(exc).__name__} {str(exc)[:80]}")
    mw = bench(lambda: torch.mm(out_c.T, hidden))
    mh = bench(lambda: torch.mm(out_r, weight))
    print(f"dW mm per window {mw:.3f} ms -> {mw * v / cw / mm:.2f}x; dh mm per window {mh:.3f} ms -> "
          f"{mh * n / rw / mm:.2f}x")

    for frac in (0.05, 0.10):
        b = int(frac * (n + v) * h)
        t = bench(lambda: single_recompute(hidden, weight, labels, lse, ent, g_lp, g_ent, cfg, b, addmm_ok),
                  reps=3)
        print(f"single-recompute backward, budget {frac:.0%}: {t / mm:.2f}x (+ forward {fwd / mm:.2f}x = "
              f"{(t + fwd) / mm:.2f}x); fp32 dh accumulator {n * h * 4 / 2**20:.0f} MiB")

    # accuracy of the single-recompute variant at a small N
    n2 = 2048
    h2, w2, y2 = make_inputs(n2, h, 151937, torch.bfloat16, seed=1, device=dev, w_scale=0.02)
    gl, ge = g_lp[:n2].clone(), g_ent[:n2].clone()
    dh_ref, dw_ref = reference_linear_grads(h2, w2, y2, gl, ge, 1.0)
    p2 = ops.linear_split_stats(h2, w2, y2, 1.0, True, cfg)
    _, ent2, lse2 = ops.split_combine(*p2, y2, -100, True)
    dh, dw = single_recompute(h2, w2, y2, lse2, ent2, gl, ge, cfg, int(0.05 * (n2 + 151937) * h), addmm_ok)
    print(f"single-recompute accuracy (2048x3584x151937): dh rel {rel_err(dh, dh_ref):.2e}, "
          f"dW rel {rel_err(dw, dw_ref):.2e}")
    h3, w3 = h2.clone().requires_grad_(), w2.clone().requires_grad_()
    out = linear_log_probs(h3, w3, y2, backend="triton")
    torch.autograd.backward([out.log_probs, out.entropy], [gl, ge])
    print(f"current backward accuracy: dh rel {rel_err(h3.grad, dh_ref):.2e}, dW rel {rel_err(w3.grad, dw_ref):.2e}")


if __name__ == "__main__":
    main()
