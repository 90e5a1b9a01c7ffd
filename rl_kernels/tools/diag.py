"""The measuring scripts' harness (``scripts/*.py``, ``scripts/diag/*.py``; scripts/README.md indexes
them) and their one door into the library's internals. Not the library's API: the public API is
``rl_kernels``; the names below follow the kernels and may change with them. Nothing of the
library or of the other tools imports this module. It imports without Triton: the names that need
it (``ops``, ``topk_ops``, :func:`jit_kernel`, :func:`bench`) import it on first use.

Command line, device line, output (every script):
  * :func:`parser`: an ``argparse`` parser with the script's docstring as its help and the shared
    arguments a script asks for: shapes (``N,H,V`` or ``N,V``, checked), ``--rounds``, ``--json PATH``
    and sizes (``--n``, ``--hidden``, ``--vocab``, ``--topk``, ``--check-rows``);
  * :func:`start`: parse, then :func:`require_cuda` (without a GPU: one line, exit status 0; so
    ``--help`` works anywhere), then print :func:`device_line`;
  * :func:`header` / :func:`device_line`: device, torch and Triton versions, date, command line;
  * :func:`write_json`: the one JSON format, ``{device, torch, triton, date, command, ..., rows}``.

Inputs and timing:
  * ``BENCH_SHAPES``; ``head_inputs`` and ``peak_extra_gib`` (from ``rl_kernels.tools.bench``: the
    benchmark's inputs and peak memory); :func:`head_step` (a ``linear_log_probs`` forward+backward);
    :func:`topk_teacher` (the distillation scripts' noisy top-K teacher); ``TINY`` / :func:`tiny_steps`
    (the public calls at a shape where host time dominates);
  * :func:`bench` (do_bench median and peak memory; :func:`print_bench_rows` / :func:`bench_records`
    print / record its rows), :func:`per_call_us` (host throughput);
  * over ranks: :func:`slowest_rank_ms` / :func:`local_ms` (never ``do_bench`` around collectives:
    its repeat count is each rank's own, so ranks call different numbers of collectives and hang).

Internals (for sweeps, A/Bs and instruction counts):
  * ``ops``: the kernel package ``rl_kernels.ops``: launchers (``linear_split_stats``,
    ``split_combine``, ``linear_dlogits``, ``logits_forward``, ``logits_backward``), configurations
    (``CUDA_CONFIG``, ``ops.config.LOGITS_CUDA_CONFIG``, ``CLASSES``, ``CONFIG_CLASS_ENV``,
    ``forced_config``, ``default_config``, ``logits_config``, ``BwdTile``, ``use_two_level``);
  * ``topk_ops``: ``rl_kernels.ops.linear_topk``, whose ``topk_tiles`` / ``topk_splits`` a sweep
    replaces; ``backward_schedule``: ``rl_kernels.autograd.backward_schedule``, whose
    ``SPARE_ACCUMULATOR_FRACTION`` an A/B switches;
  * :func:`jit_kernel`: a Triton kernel function by role, to compile it alone;
  * :func:`head_params`, :func:`logits_params`, :func:`saved_and_grads`: the records a launcher takes;
    ``LogitsStatsFunction`` (the from-logits autograd Function), ``check_label_values`` (the label check);
  * the float64 oracles ``reference_linear_log_probs``, ``reference_linear_grads``, ``rel_err``
    (``rl_kernels.tools.reference``) and ``linear_log_probs_at_ids`` (what the verl integration's fused
    distillation calls).

verl, as the GPU machine has it (no Ray / tensordict stack: a full import fails there):
:func:`verl_losses` (its FSDP distillation losses), :func:`verl_functional` (its from-logits
functions), :func:`verl_loss_config` (what its top-K loss reads of its config).
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import shlex
import statistics
import sys
import time

import torch

from rl_kernels.autograd import backward_schedule
from rl_kernels.autograd.logits import LogitsStatsFunction
from rl_kernels.distill import linear_log_probs_at_ids
from rl_kernels.tools.reference import reference_linear_grads, reference_linear_log_probs, rel_err
from rl_kernels.tools.usage import report_written
from rl_kernels.tools.bench import head_inputs, peak_extra_gib
from rl_kernels.core.validation import check_label_values

__all__ = [  # this surface (the module docstring), and ops and topk_ops (imported on first use: they need Triton)
    "parser", "positive_int", "shape_type", "start", "require_cuda", "header", "device_line", "write_json",
    "BENCH_SHAPES", "head_inputs", "peak_extra_gib", "head_step", "topk_teacher", "TINY", "tiny_steps", "bench",
    "print_bench_rows", "bench_records", "per_call_us", "iters_for", "median_ms", "local_ms", "slowest_rank_ms",
    "backward_schedule", "jit_kernel", "head_params", "logits_params", "saved_and_grads",
    "LogitsStatsFunction", "check_label_values", "reference_linear_log_probs", "reference_linear_grads", "rel_err",
    "linear_log_probs_at_ids", "verl_losses", "verl_functional", "verl_loss_config"]

BENCH_SHAPES = ("4096,3584,152064", "16384,3584,152064", "32768,4096,128256")  # N,H,V of the bench runs

_LAZY = {"ops": "rl_kernels.ops", "topk_ops": "rl_kernels.ops.linear_topk"}  # they import Triton


def __getattr__(name: str):
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        globals()[name] = module
        return module
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------- command line

_SIZES = {"n": "tokens (rows)", "hidden": "hidden size H", "vocab": "vocabulary size V",
          "topk": "teacher ids per token K", "check_rows": "rows of the checks against float64, run first"}


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def shape_type(form: str = "N,H,V"):
    """An argparse type: ``form`` (``N,H,V`` or ``N,V``) -> a tuple of positive integers."""
    want = form.count(",") + 1

    def parse(text: str) -> tuple[int, ...]:
        try:
            dims = tuple(int(x) for x in text.split(","))
        except ValueError:
            dims = ()
        if len(dims) != want or min(dims) < 1:
            raise argparse.ArgumentTypeError(f"expected {form} ({want} positive integers), got {text!r}")
        return dims
    parse.__name__ = form  # argparse names the type in its messages
    return parse


def parser(doc: str, *, shapes=None, form: str = "N,H,V", one_shape: bool = False, rounds: int | None = None,
           json_out: bool = False, **sizes: int) -> argparse.ArgumentParser:
    """The script's parser: ``doc`` (its docstring) is the help. ``shapes``: default shape strings
    of a positional ``shapes`` argument (``form`` each; ``one_shape``: a single optional ``shape``),
    parsed into int tuples. ``rounds``: ``--rounds R`` with that default. ``json_out``: ``--json
    PATH`` (:func:`write_json`). ``sizes``: ``--n``, ``--hidden``, ``--vocab``, ``--topk``,
    ``--check-rows`` with the given defaults."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if shapes is not None:
        parse = shape_type(form)
        if one_shape:
            ap.add_argument("shape", nargs="?", type=parse, default=parse(shapes[0]),
                            help=f"{form} (default {shapes[0]})")
        else:
            ap.add_argument("shapes", nargs="*", type=parse, default=[parse(s) for s in shapes],
                            help=f"{form} ... (default {' '.join(shapes)})")
    if rounds is not None:
        ap.add_argument("--rounds", type=positive_int, default=rounds, help=f"timing rounds (default {rounds})")
    for name, default in sizes.items():
        if name not in _SIZES:
            raise TypeError(f"parser(): unknown size {name!r}; known: {sorted(_SIZES)}")
        ap.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=default,
                        help=f"{_SIZES[name]} (default {default})")
    if json_out:
        ap.add_argument("--json", metavar="PATH", default=None,
                        help="also write the results here: device, versions, date, command line, rows")
    return ap


def require_cuda(name: str, hint: str = "") -> None:
    """Without a CUDA device: print ``NAME: no CUDA device (HINT); nothing to measure`` (NAME the
    script's, e.g. ``sys.argv[0]``, without folder and ``.py``; HINT e.g. a CPU option) and exit
    with status 0. Called after the argument parsing, before the first CUDA call."""
    if not torch.cuda.is_available():
        name = os.path.splitext(os.path.basename(name))[0]
        print(f"{name}: no CUDA device{f' ({hint})' if hint else ''}; nothing to measure", flush=True)
        raise SystemExit(0)


def start(ap: argparse.ArgumentParser, argv=None, *, full_precision_bf16: bool = False) -> argparse.Namespace:
    """Parse ``argv``, :func:`require_cuda`, print :func:`device_line`; with
    ``full_precision_bf16``, cuBLAS's reduced-precision bf16 reduction is turned off first (the
    fused backward's own setting, so that the matmul baselines run as it does). Returns the args."""
    args = ap.parse_args(argv)
    require_cuda(ap.prog)
    if full_precision_bf16:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    print(device_line(), flush=True)
    return args


def header(device=None) -> dict:
    """Device (``device``'s name, default the current CUDA device, "CPU" without one), torch and
    Triton versions, date and the command line."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type == "cuda":
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "CPU"
    else:
        name = device.type.upper()
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"device": name, "torch": torch.__version__, "triton": triton_version,
            "date": str(datetime.date.today()), "command": shlex.join(["python", *sys.argv])}


def device_line(device=None) -> str:
    """``DEVICE | torch X | Triton Y | DATE``."""
    h = header(device)
    return f"{h['device']} | torch {h['torch']} | Triton {h['triton']} | {h['date']}"


def write_json(path: str, rows, *, device=None, **fields) -> None:
    """Write ``{**header(device), **fields, "rows": rows}`` to ``path`` (indent 1) and print
    ``wrote PATH (SIZE MB)``. ``rows``: the script's records (a list, or row name -> record)."""
    with open(path, "w") as f:
        json.dump({**header(device), **fields, "rows": rows}, f, indent=1)
    print(report_written(path), flush=True)


# ----------------------------------------------------------------------------- inputs and timing

def head_step(hidden, weight, labels, g_lp, g_ent, **kwargs):
    """(step, hidden leaf, weight leaf): ``step()`` resets the leaves' gradients and runs
    ``linear_log_probs(hidden, weight, labels, **kwargs)`` forward and backward with upstream
    gradients ``g_lp`` / ``g_ent``; it returns the output."""
    import rl_kernels

    hg, wg = hidden.detach().requires_grad_(), weight.detach().requires_grad_()

    def step():
        hg.grad = wg.grad = None
        out = rl_kernels.linear_log_probs(hg, wg, labels, **kwargs)
        torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])
        return out
    return step, hg, wg


def bench(fn, rep=1000):
    """(median ms of ``fn`` by triton.testing.do_bench with ``rep`` ms, peak extra GiB of one call), after
    one warm-up call."""
    import triton.testing

    fn()
    peak = peak_extra_gib(fn)
    return triton.testing.do_bench(fn, rep=rep, return_mode="median"), peak


def print_bench_rows(rows: dict) -> None:
    """Print ``rows`` (name -> :func:`bench`'s (ms, peak extra GiB); one named ``mm``, the matmul)
    as a table: ms, ms / the matmul's, peak extra GiB."""
    mm, width = rows["mm"][0], max(map(len, rows)) + 2
    print(f"{'row':<{width}}{'ms':>10}{'x mm':>8}{'peak GiB':>10}")
    for name, (ms, peak) in rows.items():
        print(f"{name:<{width}}{ms:>10.3f}{ms / mm:>8.2f}{peak:>10.2f}")


def bench_records(rows: dict) -> dict:
    """``rows`` (name -> :func:`bench`'s (ms, peak extra GiB)) as JSON records."""
    return {name: {"ms": ms, "peak_extra_gib": peak} for name, (ms, peak) in rows.items()}


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


# Timing over ranks: a function holding collectives must be called the same number of times on
# every rank: a fixed warm-up, a barrier, then a count every rank agrees on.

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
        for start_event, end_event in events:
            start_event.record()
            fn()
            end_event.record()
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in events]
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


# ----------------------------------------------------------------------------- internals

_JIT_KERNELS = {"logits_fwd": ("rl_kernels.ops.logits", "_logits_fwd_kernel"),
                "logits_bwd": ("rl_kernels.ops.logits", "_logits_bwd_kernel"),
                "linear_dlogits": ("rl_kernels.ops.linear", "_linear_dlogits_kernel"),
                "linear_split_stats": ("rl_kernels.ops.linear", "_linear_split_stats_kernel")}


def jit_kernel(role: str):
    """The Triton JIT function of a kernel, by role: ``logits_fwd`` / ``logits_bwd`` (from logits),
    ``linear_split_stats`` (fused forward), ``linear_dlogits`` (fused backward's recompute)."""
    if role not in _JIT_KERNELS:
        raise ValueError(f"jit_kernel: unknown role {role!r}; known: {sorted(_JIT_KERNELS)}")
    module, name = _JIT_KERNELS[role]
    return getattr(importlib.import_module(module), name)


def head_params(device, return_entropy: bool = True):
    """The fused head's parameter record for a direct launcher call: T = 1, ignore_index -100,
    the Triton backend (the launchers read the record's values, not its backend)."""
    from rl_kernels.autograd.linear import HeadParams
    from rl_kernels.core.backends import get_backend

    return HeadParams(backend=get_backend("triton", device), inv_temperature=1.0, ignore_index=-100,
                      return_entropy=return_entropy)


def logits_params(device, return_entropy: bool = True, name: str = "diag"):
    """The from-logits parameter record for a direct launcher call (T = 1, ignore_index -100)."""
    from rl_kernels.autograd.logits import LogitsParams
    from rl_kernels.core.backends import get_backend

    return LogitsParams(backend=get_backend("triton", device), inv_temperature=1.0, ignore_index=-100,
                        return_entropy=return_entropy, name=name)


def saved_and_grads(lse, entropy, grad_log_probs, grad_entropy):
    """(saved, grads) records of ``ops.linear_dlogits`` from the forward's lse / entropy and the
    upstream gradients of log_probs / entropy."""
    from rl_kernels.autograd.linear import HeadOutputs

    return HeadOutputs(None, entropy, lse), HeadOutputs(grad_log_probs, grad_entropy)


# ----------------------------------------------------------------------------- verl

FSDP_LOSSES = "verl.trainer.distillation.fsdp.losses"


def verl_losses():
    """(verl's FSDP distillation loss module, how it was imported): in full, or where that fails
    (a GPU machine without verl's Ray / tensordict / omegaconf stack), the loss file alone with
    verl's Ulysses helpers stubbed at world size 1."""
    import importlib.util
    import types

    try:
        return importlib.import_module(FSDP_LOSSES), "verl"
    except Exception as exc:  # noqa: BLE001 - any failure of the full import: load the file alone
        reason = f"{type(exc).__name__}: {str(exc)[:100]}"
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        del sys.modules[name]
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("verl is not importable (put verl on PYTHONPATH)")
    root = list(spec.submodule_search_locations)[0]
    for name in ("verl", "verl.utils", "verl.workers", "verl.trainer", "verl.trainer.distillation",
                 "verl.trainer.distillation.fsdp"):
        mod = types.ModuleType(name)
        mod.__path__ = [root + "/" + "/".join(name.split(".")[1:])]
        sys.modules[name] = mod
    ulysses = types.ModuleType("verl.utils.ulysses")
    ulysses.get_ulysses_sequence_parallel_world_size = lambda *a, **k: 1
    ulysses.slice_input_tensor = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no Ulysses in the bench"))
    config = types.ModuleType("verl.workers.config")
    config.DistillationConfig = config.DistillationLossConfig = object
    sys.modules.update({"verl.utils.ulysses": ulysses, "verl.workers.config": config})
    spec = importlib.util.spec_from_file_location(FSDP_LOSSES, f"{root}/trainer/distillation/fsdp/losses.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[FSDP_LOSSES] = module
    spec.loader.exec_module(module)
    return module, f"verl's loss file alone, Ulysses stubbed at world size 1 (full import failed: {reason})"


def verl_loss_config(chunked: bool, clamp):
    """What verl's top-K distillation loss reads of its DistillationConfig."""
    from types import SimpleNamespace

    return SimpleNamespace(distillation_loss=SimpleNamespace(
        log_prob_min_clamp=clamp, use_chunked_topk=chunked, chunked_topk_chunk_size=4096))


def verl_functional():
    """verl's ``verl.utils.torch_functional`` (the logits path's functions), and how it was imported:
    in full, or, where verl's full import fails (a GPU machine without Ray), its file alone with
    ``verl.utils.device`` stubbed (the only verl module it imports; CUDA)."""
    import importlib.util
    import types

    try:
        return importlib.import_module("verl.utils.torch_functional"), "verl"
    except Exception as exc:  # noqa: BLE001 - any failure of the full import: load the file alone
        reason = f"{type(exc).__name__}: {str(exc)[:80]}"
    root = list(importlib.util.find_spec("verl").submodule_search_locations)[0]
    device = types.ModuleType("verl.utils.device")
    device.get_device_name = lambda: "cuda"
    device.get_torch_device = lambda: torch.cuda
    for name in ("verl", "verl.utils"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["verl.utils.device"] = device
    spec = importlib.util.spec_from_file_location("verl.utils.torch_functional", f"{root}/utils/torch_functional.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, f"torch_functional.py alone (full import failed: {reason})"
