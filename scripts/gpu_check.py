"""First GPU timing of linear_log_probs vs cuBLAS matmul and torch eager (same run).

Usage: python scripts/gpu_check.py [--shapes N,H,V ...] [--json OUT.json]
Prints one table: forward (no grad, log-probs + entropy) and forward+backward ms, each as a ratio
to cuBLAS `hidden @ W.T` of the same shape timed in the same run, peak extra memory, and the
max |error| of log-probs vs float64 on the first 256 rows. bf16, h ~ N(0,1), W ~ N(0, 0.02^2).
"""
import argparse
import datetime
import json

import torch
import triton.testing
from tabulate import tabulate

from rl_kernels import linear_log_probs
from rl_kernels.reference import reference_linear_log_probs
from rl_kernels.repro import torch_eager

DEFAULT_SHAPES = ["16384,3584,152064", "32768,4096,128256", "512,3584,152064"]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def peak_extra(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def run_shape(n, hdim, v):
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(n, hdim, device="cuda", generator=g).bfloat16()
    w = (0.02 * torch.randn(v, hdim, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp, g_ent = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    t_mm = bench(lambda: h @ w.T)
    rows = []
    impls = {"rl_kernels": lambda a, b, c: linear_log_probs(a, b, c), "torch eager": torch_eager}
    for name, fn in impls.items():
        try:
            with torch.no_grad():
                t_f = bench(lambda: fn(h, w, labels))
                m_f = peak_extra(lambda: fn(h, w, labels))
                lp = fn(h[:256], w, labels[:256])[0]
            ref = reference_linear_log_probs(h[:256], w, labels[:256])
            err = (lp.double() - ref.log_probs).abs().max().item()
            hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()

            def fb():
                out = fn(hx, wx, labels)
                torch.autograd.backward([out[0], out[1]], [g_lp, g_ent])
                hx.grad = wx.grad = None
            t_fb = bench(fb)
            m_fb = peak_extra(fb)
            hx = wx = None  # free the gradient copies before the next implementation
        except torch.OutOfMemoryError:
            rows.append([f"{n}x{hdim}x{v}", name, "OOM"] + [""] * 6)
            torch.cuda.empty_cache()
            continue
        rows.append([f"{n}x{hdim}x{v}", name, f"{t_f:.2f}", f"{t_f / t_mm:.2f}", f"{t_fb:.2f}",
                     f"{t_fb / t_mm:.2f}", f"{m_f:.3f}", f"{m_fb:.2f}", f"{err:.1e}"])
        torch.cuda.empty_cache()
    tflops = 2 * n * hdim * v / t_mm / 1e9
    return rows, t_mm, tflops


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", nargs="*", default=DEFAULT_SHAPES)
    p.add_argument("--json")
    args = p.parse_args()
    table, meta = [], []
    for s in args.shapes:
        n, hdim, v = map(int, s.split(","))
        rows, t_mm, tflops = run_shape(n, hdim, v)
        table += rows
        meta.append({"shape": s, "cublas_ms": t_mm, "cublas_tflops": tflops, "rows": rows})
        print(f"{s}: cuBLAS {t_mm:.2f} ms = {tflops:.0f} TFLOP/s", flush=True)
    head = ["shape", "impl", "fwd ms", "fwd ×mm", "fwd+bwd ms", "fwd+bwd ×mm",
            "fwd extra GB", "fwd+bwd extra GB", "max|Δlogp|"]
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}, {datetime.date.today()}")
    print(tabulate(table, headers=head, tablefmt="github"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
                       "shapes": meta}, f, indent=1)


if __name__ == "__main__":
    main()
