"""Pieces the diagnostic scripts in this folder share (they run as ``python scripts/diag/X.py``,
so this folder is on ``sys.path``)."""
from __future__ import annotations

import math
import os
import statistics
import time

import torch

from rl_kernels.tools.bench import head_inputs  # noqa: F401 - the bench's inputs, these scripts' too


def require_cuda(script: str, hint: str = "") -> None:
    """Every script here measures on a CUDA GPU: without one, print one line, ``NAME: no CUDA
    device; nothing to measure`` (NAME: the script's, from ``__file__``; ``hint`` after it, e.g. a
    CPU option), and exit with status 0, as the top-level scripts (``scripts/gpu_parity.py`` ...)
    do. Called before a script's first CUDA call, after its argument parsing (``--help`` works
    anywhere)."""
    if not torch.cuda.is_available():
        name = os.path.splitext(os.path.basename(script))[0]
        print(f"{name}: no CUDA device{f' ({hint})' if hint else ''}; nothing to measure", flush=True)
        raise SystemExit(0)


BENCH_SHAPES = ["4096,3584,152064", "16384,3584,152064", "32768,4096,128256"]  # N,H,V of the bench runs


def head_shapes_cli(script: str, description: str | None = None):
    """The command line of the A/B scripts that time the fused head: ``[N,H,V ...]`` (default
    ``BENCH_SHAPES``) ``[--rounds R]`` (default 3). After parsing, :func:`require_cuda`; then
    cuBLAS's reduced-precision bf16 reduction is turned off (the backward's own setting, for the
    matmul baseline too) and the device, torch / Triton versions and date are printed. Returns the
    parsed arguments."""
    import argparse

    import triton

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("shapes", nargs="*", default=BENCH_SHAPES)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    require_cuda(script)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, time.strftime("%Y-%m-%d"))
    return args


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


# ----------------------------------------------------------------------------- timing over ranks
# Never time collectives with triton.testing.do_bench: it picks its repeat count from each rank's
# own timing, so ranks can call different numbers of collectives and hang (tp_bench.py did, on two
# GPUs with a cold Triton cache). These helpers call the function the same number of times on every
# rank: a fixed warm-up, a barrier, then a count every rank agrees on.

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def iters_for(estimate_ms: float, rep_ms: float, lo: int = 5, hi: int = 1000) -> int:
    """How many timed calls fill ``rep_ms`` (do_bench's ``rep``) at ``estimate_ms`` per call, within
    [lo, hi]."""
    return int(min(hi, max(lo, math.ceil(rep_ms / max(estimate_ms, 1e-3)))))


def median_ms(fn, device: torch.device, iters: int) -> float:
    """Median ms of ``iters`` calls of ``fn`` (CUDA events around each call on CUDA, the host clock
    with a sync on CPU); no warm-up, no collectives of its own."""
    times = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _estimate_ms(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3


def local_ms(fn, device: torch.device, warmup: int = 5, iters: int | None = None,
             rep_ms: float = 500.0) -> float:
    """One process, no collectives in ``fn``: ``warmup`` calls, then the median of ``iters`` calls
    (default: as many as fill ``rep_ms``, from one more call's time). The same method as
    :func:`slowest_rank_ms`, for a one-GPU baseline to compare with."""
    for _ in range(warmup):
        fn()
    if iters is None:
        iters = iters_for(_estimate_ms(fn, device), rep_ms)
    _sync(device)
    return median_ms(fn, device, iters)


def slowest_rank_ms(fn, device: torch.device, warmup: int = 5, iters: int | None = None,
                    rep_ms: float = 500.0, group=None) -> float:
    """``fn`` holds collectives over ``group``: every rank calls it ``warmup`` times (Triton compiles
    here, on every rank), meets the others at a barrier, and then calls it the same number of
    times: ``iters``, or (None) the count that fills ``rep_ms`` at the slowest rank's time of one
    more call (all-reduced MAX, so every rank computes the same count). Returns the slowest rank's
    median ms (all-reduced MAX), the same on every rank."""
    import torch.distributed as dist

    on = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
        torch.device("cpu")
    for _ in range(warmup):
        fn()
    _sync(device)
    dist.barrier(group=group)
    if iters is None:
        estimate = torch.tensor([_estimate_ms(fn, device)], dtype=torch.float64, device=on)
        dist.all_reduce(estimate, op=dist.ReduceOp.MAX, group=group)
        iters = iters_for(estimate.item(), rep_ms)
        dist.barrier(group=group)
    ms = torch.tensor([median_ms(fn, device, iters)], dtype=torch.float64, device=on)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    return ms.item()


def head_params(device, return_entropy: bool = True):
    """The fused head's parameter record for a direct launcher call: T = 1, ignore_index -100,
    the Triton backend (the launchers read the record's values, not its backend)."""
    from rl_kernels.autograd.linear import HeadParams
    from rl_kernels.backends import get_backend

    return HeadParams(backend=get_backend("triton", device), inv_temperature=1.0, ignore_index=-100,
                      return_entropy=return_entropy)


def logits_params(device, return_entropy: bool = True, name: str = "diag"):
    """The from-logits parameter record for a direct launcher call (T = 1, ignore_index -100)."""
    from rl_kernels.autograd.logits import LogitsParams
    from rl_kernels.backends import get_backend

    return LogitsParams(backend=get_backend("triton", device), inv_temperature=1.0, ignore_index=-100,
                        return_entropy=return_entropy, name=name)


def saved_and_grads(lse, entropy, grad_log_probs, grad_entropy):
    """(saved, grads) records of ``ops.linear_dlogits`` from the forward's lse / entropy and the
    upstream gradients of log_probs / entropy."""
    from rl_kernels.autograd.linear import HeadOutputs

    return HeadOutputs(None, entropy, lse), HeadOutputs(grad_log_probs, grad_entropy)


TINY = (8, 4096, 256)  # rows, vocabulary, head H: the GPU finishes each kernel in microseconds


def tiny_steps(mod, seed: int = 0) -> dict:
    """{name: a forward+backward step} of the public calls of ``mod`` (an rl_kernels package: the
    working tree's or an older copy) at the tiny shape ``TINY``, bf16, for host-time measurements
    (``per_call_us``): ``logits_stats`` (log-probs and entropy), ``topk_log_probs_from_logits``
    (K = 4), ``topk_kl_from_logits`` (K = 4, labels) and ``linear_log_probs``. The inputs are made
    once per call of this function; each step resets the gradients it reads."""
    n, v, h = TINY
    dev = torch.device("cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, v, device=dev, generator=g).bfloat16().requires_grad_()
    hid = torch.randn(n, h, device=dev, generator=g).bfloat16().requires_grad_()
    w = (0.05 * torch.randn(v, h, device=dev, generator=g)).bfloat16().requires_grad_()
    lab = torch.randint(0, v, (n,), device=dev, generator=g)
    ids = torch.randint(0, v, (n, 4), device=dev, generator=g)
    teacher = torch.log_softmax(torch.randn(n, 4, device=dev, generator=g), -1)
    g_n, g_k = torch.randn(n, device=dev), torch.randn(n, 4, device=dev)

    def stats():
        x.grad = None
        out = mod.logits_stats(x, lab)
        torch.autograd.backward([out.log_probs, out.entropy], [g_n, g_n])

    def topk():
        x.grad = None
        torch.autograd.backward([mod.topk_log_probs_from_logits(x, ids)], [g_k])

    def topk_kl():
        x.grad = None
        mod.topk_kl_from_logits(x, ids, teacher, labels=lab).backward()

    def head():
        hid.grad = w.grad = None
        out = mod.linear_log_probs(hid, w, lab)
        torch.autograd.backward([out.log_probs, out.entropy], [g_n, g_n])
    return {"logits_stats": stats, "topk_log_probs_from_logits": topk, "topk_kl_from_logits": topk_kl,
            "linear_log_probs": head}


def bench(fn, rep=1000):
    """(median ms of ``fn`` by triton.testing.do_bench with ``rep`` ms, peak extra GiB of one call), after
    one warm-up call."""
    import triton.testing

    from rl_kernels.tools.bench import peak_extra_gib

    fn()
    peak = peak_extra_gib(fn)
    return triton.testing.do_bench(fn, rep=rep, return_mode="median"), peak


def topk_teacher(hidden, weight, k, seed=3):
    """(ids (N, K) int64, float32 log-probs (N, K)): the top K of the student's float32 logits plus
    N(0, 1) noise, log-softmaxed over the vocabulary (row chunks)."""
    n, v = hidden.shape[0], weight.shape[0]
    ids = torch.empty(n, k, dtype=torch.int64, device="cuda")
    log_probs = torch.empty(n, k, device="cuda")
    g = torch.Generator("cuda").manual_seed(seed)
    with torch.no_grad():
        for r0 in range(0, n, 2048):
            r1 = min(n, r0 + 2048)
            z = (hidden[r0:r1] @ weight.T).float() + torch.randn(r1 - r0, v, device="cuda", generator=g)
            top, ids[r0:r1] = z.topk(k, -1)
            log_probs[r0:r1] = top - torch.logsumexp(z, -1, keepdim=True)
            del z, top
    return ids, log_probs
