"""Host cost of one Triton launch by number of pointer arguments (the C launcher resolves each
pointer), through Triton's path (``kernel[grid](...)``) and through the compiled kernel's runner
with prebuilt arguments (the floor a launch cache could reach). Tiny grid: the loop's wall time
is host time. (A per-specialization launch cache in Python, keyed like Triton's binder, measured
slower than Triton's own path on the H100 host, 2026-11-24, and was not kept: BENCHMARKS.md.)

python scripts/diag/launch_floor.py
"""
import torch
import triton
import triton.language as tl

from rl_kernels.tools import diag

diag.start(diag.parser(__doc__))


@triton.jit
def _one(p0, n, B: tl.constexpr):
    tl.store(p0 + tl.arange(0, B), tl.zeros((B,), tl.float32), mask=tl.arange(0, B) < n)


@triton.jit
def _many(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, n, B: tl.constexpr):
    tl.store(p0 + tl.arange(0, B), tl.zeros((B,), tl.float32), mask=tl.arange(0, B) < n)


@triton.jit
def _many_ints(p0, n, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, B: tl.constexpr):
    tl.store(p0 + tl.arange(0, B), tl.zeros((B,), tl.float32), mask=tl.arange(0, B) < n)


def per_call_us(f):
    return diag.per_call_us(f, reps=2000, warmup=50)


x = [torch.empty(64, device="cuda") for _ in range(14)]
cases = {"1 pointer": (_one, (x[0], 8)), "14 pointers": (_many, (*x, 8)),
         "1 pointer + 13 ints": (_many_ints, (x[0], 8, *range(3, 16)))}
print("host us per launch")
print(f"{'kernel':24s} {'kernel[grid]':>12s} {'runner':>8s}")
for name, (kern, args) in cases.items():
    plain = per_call_us(lambda: kern[(1,)](*args, B=64))
    compiled = kern[(1,)](*args, B=64)
    stream = torch.cuda.current_stream().cuda_stream
    run = compiled[(1, 1, 1)]
    raw = per_call_us(lambda: run(*args, 64, stream=stream))
    print(f"{name:24s} {plain:12.1f} {raw:8.1f}")
print(f"{'torch.cuda.current_device()':40s} {per_call_us(torch.cuda.current_device):8.2f}")
print(f"{'torch.empty(8, device=cuda)':40s} {per_call_us(lambda: torch.empty(8, device='cuda')):8.2f}")
print(f"{'tensor.data_ptr()':40s} {per_call_us(x[0].data_ptr):8.2f}")
