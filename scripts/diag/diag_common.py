"""Pieces the diagnostic scripts in this folder share (they run as ``python scripts/diag/X.py``,
so this folder is on ``sys.path``)."""
import time

import torch


def head_inputs(n: int, h: int, v: int, seed: int = 0):
    """Benchmark inputs of the fused head on CUDA, generated there (as ``scripts/bench.py``): bf16
    hidden ~ N(0, 1) (N, H) and weight ~ N(0, 0.02^2) (V, H), labels uniform in [0, V), and float32
    upstream gradients ~ N(0, 1) for log-probs and entropy; returns (hidden, weight, labels,
    g_lp, g_ent)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)
    return hidden, weight, labels, g_lp, g_ent


def per_call_us(f, reps: int = 400, warmup: int = 20) -> float:
    """Host throughput of ``f``: microseconds per call over ``reps`` back-to-back calls (after
    ``warmup`` calls), synchronized before and after, so it is the larger of host and GPU time."""
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6
