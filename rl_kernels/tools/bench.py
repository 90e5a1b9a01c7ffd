"""The benchmark behind ``rl-kernels bench`` (also ``python -m rl_kernels bench`` and, in a clone,
``python scripts/bench.py [options]``): the fused head against cuBLAS and its peers, on one GPU.
A module of the package, so an installed wheel has it; it does not import the command line
(``rl_kernels.tools.cli`` calls :func:`run`, :func:`parse_shapes`, :func:`load_results` and
:func:`plot`; what both use is in ``rl_kernels.tools.usage``).

Per shape (N tokens x H hidden x V vocab, bf16, h ~ N(0, 1), W ~ N(0, 0.02^2), labels uniform)
and implementation: forward without grad (log-probs + entropy) and forward+backward (random
upstream gradients on both outputs) in ms, each also as a ratio to cuBLAS ``hidden @ W.T`` of the
same shape timed in the same run; peak extra memory (GB) of each; and the max |error| of the
log-probs against float64 on the first 256 rows. Medians of ``triton.testing.do_bench``.

Implementations: ours (``linear_log_probs``), torch eager (materialized bf16 logits, verl's
default path) and, when importable, verl's ``linear_cross_entropy`` (Triton) and
``FusedLinearForPPO`` (torch), Liger's per-token log-prob + entropy function
``LigerFusedLinearScaledCrossEntropyFunction`` called as verl 0.9.1's ``impl_backend=liger`` calls
it (its row is named after the route Liger takes here: its CuTe-DSL kernel on sm90 with
``nvidia-cutlass-dsl`` installed, else torch chunks), Liger's fused linear cross-entropy and
Apple's CCE. Those last two return only the cross-entropy (no entropy); their rows time log-probs
alone, which favours them. Accuracy: max |error| of the log-probs and, where an implementation
returns it, of the entropy, against float64. An implementation that fails (out of memory, an
error) gets its error in the table instead.

``--varying-n`` adds the case of verl's dynamic micro-batches (:func:`bench_varying_n`, run
first, before anything else has compiled): 8 fused-head forward+backward calls whose token
counts change from call to call (3000 to 20000), wall time of each call including any
compilation, then the same 8 calls again (warm).

``--logits`` benchmarks the from-logits path instead (:func:`run_logits`): bf16 logits N x V
(~ N(0, 2^2), labels uniform), ours ``logits_stats`` (log-probs + entropy + lse in one call)
against torch eager (verl's ``logprobs_from_logits`` + ``entropy_from_logits`` on float32 logits,
``rl_kernels.tools.reference.torch_eager_logits``) and, when importable, flash-attn's Triton cross-entropy
and Liger's cross-entropy (CE only: log-probs without entropy). These are memory-bound, so besides
ms each row gives the achieved bandwidth: forward N V 2 bytes read / forward time, and backward
(N V 2 bytes read + N V 2 written) / (fwd+bwd time - forward time), also as a fraction of two
ceilings measured in the same run on a ~4 GiB bf16 tensor: the read ceiling (best of
``x.sum(dtype=float32)`` and ``torch.amax(x)``) and the copy ceiling (``y.copy_(x)``, read +
write bytes). The bytes are the minimum any implementation must move, so for torch eager (several
float32 N x V passes) the figure is an effective bandwidth, not what its kernels move.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Callable

import torch

from rl_kernels.tools.usage import DEFAULT_LOGITS_SHAPES, DEFAULT_SHAPES, UsageError, report_written
from rl_kernels.core._logging import log_once

ERROR_ROWS = 256
CEILING_BYTES = 4 * 2**30  # bf16 tensor of the bandwidth ceilings


Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def implementations(stub_verl: bool = False) -> tuple[dict[str, Impl], dict[str, str]]:
    """(name -> fn(hidden, weight, labels) -> (log_probs, entropy or None)), (name -> why absent)."""
    from rl_kernels import linear_log_probs
    from rl_kernels.tools.reference import torch_eager

    impls: dict[str, Impl] = {
        "rl_kernels": lambda h, w, y: tuple(linear_log_probs(h, w, y)),
        "torch eager": lambda h, w, y: torch_eager(h, w, y, 1.0, -100),
    }
    absent: dict[str, str] = {}
    try:
        from rl_kernels.tools.verl_kernels import verl_linear_kernels

        for name, fn in verl_linear_kernels(stub_verl).items():
            impls[name] = lambda h, w, y, fn=fn: fn(h, w, y, 1.0)
    except Exception as exc:  # noqa: BLE001
        absent["verl"] = _why(exc)
    try:
        from liger_kernel.ops import LigerFusedLinearScaledCrossEntropyFunction

        impls[f"liger ppo ({liger_ppo_route()})"] = \
            lambda h, w, y, f=LigerFusedLinearScaledCrossEntropyFunction: _liger_ppo(f, h, w, y)
    except Exception as exc:  # noqa: BLE001
        absent["liger ppo"] = _why(exc)
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        impls["liger (CE only)"] = lambda h, w, y: (-liger_fused_linear_cross_entropy(h, w, y, reduction="none"),
                                                    None)
    except Exception as exc:  # noqa: BLE001
        absent["liger"] = _why(exc)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        impls["cce (CE only)"] = lambda h, w, y: (-cce(h, w, y, reduction="none"), None)
    except Exception as exc:  # noqa: BLE001
        absent["cce"] = _why(exc)
    for name, why in absent.items():
        log_once(logging.INFO, f"rl-kernels bench: {name} not benchmarked ({why})")
    return impls, absent


def liger_ppo_route() -> str:
    """Which of its two routes Liger's ``LigerFusedLinearScaledCrossEntropyFunction`` takes on the
    current CUDA device: its CuTe-DSL kernel on sm90 where ``nvidia-cutlass-dsl`` is importable,
    else its torch chunks."""
    import importlib.util

    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) \
            and importlib.util.find_spec("cutlass") is not None:
        return "CuTe sm90"
    return "torch chunks"


def _liger_ppo(function, hidden, weight, labels) -> tuple:
    """Liger's per-token NLL + entropy, called as verl 0.9.1's fused forward does with
    ``impl_backend=liger`` (temperature 1.0, ignore_index -100, one M tile per cluster, entropy
    on, int64 labels): (log_probs = -nll, entropy)."""
    nll, entropy = function.apply(hidden, weight, labels.long(), 1.0, -100, 1, True)
    return -nll, entropy


def _why(exc: BaseException) -> str:
    """Why a peer is absent, for the table's "not importable here" line."""
    return f"{type(exc).__name__}: {str(exc)[:80]}"


def peak_extra_gib(fn) -> float:
    """GiB allocated on the current CUDA device beyond what was allocated before ``fn()``, at its peak."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def head_inputs(n: int, h: int, v: int, seed: int = 0) -> tuple:
    """The fused head's benchmark inputs on CUDA, generated there (module docstring; also the
    diagnostic scripts'): bf16 hidden ~ N(0, 1) (n, h) and weight ~ N(0, 0.02^2) (v, h), labels
    uniform in [0, v) (n,), float32 upstream gradients ~ N(0, 1) of log-probs and entropy (n,):
    (hidden, weight, labels, g_lp, g_ent)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)
    return hidden, weight, labels, g_lp, g_ent


def _backward(outputs: tuple, g_lp: torch.Tensor, g_ent: torch.Tensor) -> None:
    """Backward of an implementation's (log_probs, entropy or None, ...) with the upstream
    gradients ``g_lp`` / ``g_ent``, each cast to its output's dtype."""
    lp, ent = outputs[:2]
    outs, grads = [lp], [g_lp.to(lp.dtype)]
    if ent is not None:
        outs.append(ent)
        grads.append(g_ent.to(ent.dtype))
    torch.autograd.backward(outs, grads)


def _failure(exc: BaseException) -> dict:
    """The record of an implementation that failed: its failure is a result, not the run's end."""
    if isinstance(exc, torch.OutOfMemoryError):
        return {"error": "out of memory"}
    return {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}


def _each_impl(impls: dict, measure, progress=None, first=lambda name: {}) -> dict:
    """{name: record} of ``measure(fn, record)`` for every implementation, each starting from
    ``first(name)`` (a fresh dict, empty by default): an implementation that raises gets its failure record
    (``_failure``, after ``first(name)``'s keys) and the run goes on; the CUDA cache is emptied
    after each (its tensors, local to ``measure``, are gone by then) and ``progress`` advanced."""
    results = {}
    for name, fn in impls.items():
        rec = first(name)
        try:
            measure(fn, rec)
        except Exception as exc:  # noqa: BLE001 - a peer's failure is a result
            rec = {**first(name), **_failure(exc)}
        torch.cuda.empty_cache()
        results[name] = rec
        if progress is not None:
            progress.update(1)
    return results


def bench_shape(n: int, h: int, v: int, impls: dict[str, Impl], progress=None) -> dict:
    """Time every implementation on one shape; returns a JSON-ready dict."""
    from rl_kernels.tools.reference import reference_linear_log_probs

    bench = _do_bench
    hidden, weight, labels, g_lp, g_ent = head_inputs(n, h, v, seed=0)
    rows = min(ERROR_ROWS, n)
    ref_out = reference_linear_log_probs(hidden[:rows], weight, labels[:rows])
    ref, ref_ent = ref_out.log_probs, ref_out.entropy
    t_mm = bench(lambda: hidden @ weight.T)

    def measure(fn, rec):
        with torch.no_grad():
            rec["fwd_ms"] = bench(lambda: fn(hidden, weight, labels))
            rec["fwd_extra_gb"] = peak_extra_gib(lambda: fn(hidden, weight, labels))
            lp, ent = fn(hidden[:rows], weight, labels[:rows])[:2]
            rec["max_err"] = (lp.double() - ref).abs().max().item()
            rec["max_ent_err"] = None if ent is None else (ent.double() - ref_ent).abs().max().item()
            rec["entropy_dtype"] = None if ent is None else str(ent.dtype).replace("torch.", "")
        hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

        def fwd_bwd():
            _backward(fn(hx, wx, labels), g_lp, g_ent)
            hx.grad = wx.grad = None

        rec["fwd_bwd_ms"] = bench(fwd_bwd)
        rec["fwd_bwd_extra_gb"] = peak_extra_gib(fwd_bwd)
        rec["fwd_x_mm"] = rec["fwd_ms"] / t_mm
        rec["fwd_bwd_x_mm"] = rec["fwd_bwd_ms"] / t_mm

    return {"shape": [n, h, v], "cublas_ms": t_mm, "cublas_tflops": 2 * n * h * v / t_mm / 1e9,
            "impls": _each_impl(impls, measure, progress)}


VARYING_N_COUNTS = (12288, 3000, 17001, 7919, 20000, 5000, 14321, 9876)
"""Token counts of the varying-N case: packed micro-batches of 3000 to 20000 tokens, in the
unordered way verl's dynamic batching hands them over."""


def bench_varying_n(h: int, v: int, impls: dict[str, Impl], counts=VARYING_N_COUNTS, progress=None) -> dict:
    """Forward+backward of each implementation on ``len(counts)`` calls whose token count changes
    from call to call (hidden size ``h``, vocabulary ``v``, bf16), twice: a first pass in which any
    compilation for a new token count is part of the call's wall time, then the same calls again.
    Wall time per call in seconds (the call and a device synchronization). Run it before anything
    else in the process has compiled, so the first pass is what a fresh training job sees."""
    import time

    hidden, weight, labels, g_lp, g_ent = head_inputs(max(counts), h, v, seed=1)

    def measure(fn, rec):
        rec.update(first_s=[], second_s=[])
        wx = weight.clone().requires_grad_()
        for key in ("first_s", "second_s"):
            for n in counts:
                hx = hidden[:n].clone().requires_grad_()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                _backward(fn(hx, wx, labels[:n]), g_lp[:n], g_ent[:n])
                torch.cuda.synchronize()
                rec[key].append(time.perf_counter() - t0)
                wx.grad = None
                del hx

    return {"hidden": h, "vocab": v, "counts": list(counts), "impls": _each_impl(impls, measure, progress)}


def format_varying_n(case: dict) -> str:
    from tabulate import tabulate

    counts = case["counts"]
    lines = [f"\nvarying N (verl's dynamic micro-batches): {len(counts)} forward+backward calls of "
             f"N x {case['hidden']} x {case['vocab']} bf16, N = {', '.join(map(str, counts))}; wall "
             f"seconds, first pass (compilation included) and the same calls again"]
    rows = []
    for name, r in case["impls"].items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", r["error"]])
            continue
        first, second = sum(r["first_s"]), sum(r["second_s"])
        rows.append([name, f"{first:.2f}", f"{second:.3f}", f"{first - second:.2f}",
                     " ".join(f"{t:.2f}" for t in r["first_s"]), ""])
    lines.append(tabulate(rows, headers=["impl", "first pass s", "second pass s", "first - second s",
                                         "first pass per call s", "error"], tablefmt="github"))
    return "\n".join(lines)


def format_tables(results: dict) -> str:
    from tabulate import tabulate

    if results.get("kind") == "logits":
        return format_logits_tables(results)
    lines = [f"device: {results['device']}, torch {results['torch']}, triton {results['triton']}, "
             f"{results['date']}"]
    for shape in results["shapes"]:
        n, h, v = shape["shape"]
        lines.append(f"\n{n} x {h} x {v}: cuBLAS hidden @ W.T {shape['cublas_ms']:.2f} ms "
                     f"= {shape['cublas_tflops']:.0f} TFLOP/s")
        rows = []
        for name, r in shape["impls"].items():
            if "error" in r:
                rows.append([name] + ["-"] * 8 + [r["error"]])
                continue
            ent_err = r.get("max_ent_err")
            ent_col = "no entropy" if ent_err is None else f"{ent_err:.1e} ({r.get('entropy_dtype', '?')})"
            rows.append([name, f"{r['fwd_ms']:.2f}", f"{r['fwd_x_mm']:.2f}", f"{r['fwd_bwd_ms']:.2f}",
                         f"{r['fwd_bwd_x_mm']:.2f}", f"{r['fwd_extra_gb']:.3f}", f"{r['fwd_bwd_extra_gb']:.2f}",
                         f"{r['max_err']:.1e}", ent_col, ""])
        lines.append(tabulate(rows, headers=["impl", "fwd ms", "fwd x mm", "fwd+bwd ms", "fwd+bwd x mm",
                                             "fwd extra GB", "fwd+bwd extra GB", "max |logp err|",
                                             "max |entropy err|", "error"], tablefmt="github"))
    if results.get("varying_n"):
        lines.append(format_varying_n(results["varying_n"]))
    if results.get("absent"):
        lines.append("\nnot importable here: " + "; ".join(f"{k} ({v})" for k, v in results["absent"].items()))
    return "\n".join(lines)


def load_results(path: str) -> tuple[dict, str]:
    """A saved ``--json`` result and its tables (``rl-kernels bench --plot``). ValueError naming
    ``path`` when it is missing, unreadable, not JSON or not a bench result."""
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file")
    if os.path.isdir(path):
        raise ValueError(f"{path}: is a directory, not a bench result (.json)")
    try:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column "
                         f"{exc.colno})") from exc
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON (not UTF-8 text)") from exc
    except RecursionError as exc:
        raise ValueError(f"{path}: not an rl-kernels bench result (JSON nested too deeply)") from exc
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    if not isinstance(results, dict) or not isinstance(results.get("shapes"), list):
        raise ValueError(f"{path}: not an rl-kernels bench result (expected a JSON object with a "
                         f"'shapes' list, as written by rl-kernels bench --json)")
    try:
        text = format_tables(results)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        raise ValueError(f"{path}: not a complete rl-kernels bench result ({what})") from exc
    return results, text


def plot(results: dict, path: str) -> None:
    """Bar chart of fwd and fwd+bwd time / cuBLAS matmul per shape and implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if results.get("kind") == "logits":
        return plot_logits(results, path, plt)
    _bar_panels(results, path, plt, ("fwd_x_mm", "forward"), ("fwd_bwd_x_mm", "forward+backward"), "",
                "time / cuBLAS matmul", f"{results['device']}, {results['date']}")


def _bar_panels(results: dict, path: str, plt, left: tuple, right: tuple, title_suffix: str, ylabel: str,
                suptitle: str) -> None:
    """One panel per shape, two bars per implementation: ``left`` / ``right`` = (result key, legend
    label); a missing value draws 0. Saved to ``path``."""
    shapes = results["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        names = [k for k, r in shape["impls"].items() if "error" not in r]
        x = range(len(names))
        for offset, (key, label) in ((-0.2, left), (0.2, right)):
            ax.bar([i + offset for i in x], [shape["impls"][k][key] or 0.0 for k in names], width=0.4, label=label)
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_title("x".join(map(str, shape["shape"])) + title_suffix, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.axhline(1.0, color="gray", lw=0.5)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _select(impls: dict, only) -> dict:
    if not only:
        return impls
    unknown = sorted(set(only) - set(impls))
    if unknown:
        raise UsageError(f"argument --impls: unknown {unknown}; available here: {sorted(impls)}")
    return {k: v for k, v in impls.items() if k in only}


def parse_shapes(shapes, logits: bool = False) -> list[tuple[int, ...]]:
    """'N,H,V' strings (with ``logits``: 'N,V') -> int tuples; a UsageError (SystemExit with
    status 2) naming --shapes."""
    want, form = (2, "N,V (two integers, with --logits)") if logits else (3, "N,H,V (three integers)")
    parsed = []
    for s in shapes:
        try:
            dims = tuple(int(x) for x in s.split(","))
        except ValueError:
            dims = ()
        if len(dims) != want or min(dims) < 1:
            raise UsageError(f"argument --shapes: expected {form}, got {s!r}")
        parsed.append(dims)
    return parsed


def parse_hidden_vocab(text: str) -> tuple[int, int]:
    """'H,V' of ``--varying-n`` -> (H, V); a UsageError naming --varying-n."""
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 2 or min(dims) < 1:
        raise UsageError(f"argument --varying-n: expected H,V (two positive integers), got {text!r}")
    return dims


def _header() -> dict:
    import triton

    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "date": str(datetime.date.today())}


def _save(results: dict, json_path, png_path) -> None:
    print(format_tables(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
        print(report_written(json_path))
    if png_path:
        plot(results, png_path)
        print(report_written(png_path))


def run(shapes=None, *, json_path=None, png_path=None, stub_verl=False, only=None,
        logits=False, varying_n=None) -> int:
    """The ``rl-kernels bench`` command (``logits``: ``--logits``, :func:`run_logits`). ``shapes``
    None: the defaults. ``varying_n``: "H,V" of the varying-N case (:func:`bench_varying_n`, run
    first), None for none. Returns the exit status."""
    if not torch.cuda.is_available():
        print("rl-kernels bench: no CUDA device here; nothing to benchmark (the timings need a GPU)")
        return 0
    if logits:
        return run_logits(shapes, json_path=json_path, png_path=png_path, only=only)
    from tqdm import tqdm

    parsed = parse_shapes(shapes if shapes is not None else DEFAULT_SHAPES)
    impls, absent = implementations(stub_verl)
    impls = _select(impls, only)
    results = {**_header(), "absent": absent, "shapes": []}
    varying = parse_hidden_vocab(varying_n) if varying_n else None
    total = (len(parsed) + (varying is not None)) * len(impls)
    with tqdm(total=total, desc="rl-kernels bench", unit="impl") as progress:
        if varying is not None:
            results["varying_n"] = bench_varying_n(*varying, impls, progress=progress)
        for n, h, v in parsed:
            results["shapes"].append(bench_shape(n, h, v, impls, progress))
    _save(results, json_path, png_path)
    return 0


# ----------------------------------------------------------------------------- --logits

LogitsImpl = Callable[[torch.Tensor, torch.Tensor], tuple]


def logits_implementations() -> tuple[dict[str, LogitsImpl], dict[str, str]]:
    """(name -> fn(logits, labels) -> (log_probs, entropy or None)), (name -> why absent).
    Peers named "(CE only)" compute the cross-entropy alone; their log-probs are -loss."""
    from rl_kernels import logits_stats
    from rl_kernels.tools.reference import torch_eager_logits

    impls: dict[str, LogitsImpl] = {
        "rl_kernels": lambda x, y: tuple(logits_stats(x, y))[:2],
        "torch eager": lambda x, y: torch_eager_logits(x, y, 1.0, -100),
    }
    absent: dict[str, str] = {}
    try:
        from flash_attn.ops.triton.cross_entropy import cross_entropy_loss

        # as verl's logprobs_from_logits calls it (inplace_backward=False: ours allocates too)
        impls["flash-attn (CE only)"] = lambda x, y: (-cross_entropy_loss(x, y, inplace_backward=False)[0],
                                                      None)
    except Exception as exc:  # noqa: BLE001
        absent["flash-attn"] = _why(exc)
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy

        impls["liger (CE only)"] = lambda x, y: (-liger_cross_entropy(x, y, reduction="none"), None)
    except Exception as exc:  # noqa: BLE001
        absent["liger"] = _why(exc)
    for name, why in absent.items():
        log_once(logging.INFO, f"rl-kernels bench --logits: {name} not benchmarked ({why})")
    return impls, absent


def _do_bench(fn) -> float:
    """Median ms of ``fn``. rep is a time budget (ms): 1 s gives ~6 samples even of a 150 ms step
    (200 ms gave 1-2, and a 10% spread between runs of the same code)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=1000, return_mode="median")


def measure_ceilings(nbytes: int = CEILING_BYTES, bench=_do_bench) -> dict:
    """Bandwidth ceilings (GB/s, 1e9 bytes) of this GPU, from a bf16 tensor of ``nbytes``: read =
    best of ``x.sum(dtype=float32)`` and ``torch.amax(x)`` (nbytes read); copy = ``y.copy_(x)``
    (nbytes read + nbytes written)."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_(-1.0, 1.0)
    sum_ms = bench(lambda: x.sum(dtype=torch.float32))
    amax_ms = bench(lambda: torch.amax(x))
    y = torch.empty_like(x)
    copy_ms = bench(lambda: y.copy_(x))
    del x, y
    torch.cuda.empty_cache()
    out = {"bytes": nbytes, "read_sum_gbps": nbytes / sum_ms / 1e6,
           "read_amax_gbps": nbytes / amax_ms / 1e6, "copy_gbps": 2 * nbytes / copy_ms / 1e6}
    out["read_gbps"] = max(out["read_sum_gbps"], out["read_amax_gbps"])
    return out


def _bandwidths(rec: dict, n: int, v: int, ceilings: dict) -> None:
    """Add fwd/bwd GB/s and fractions of the ceilings to a record with fwd_ms and fwd_bwd_ms."""
    nbytes = n * v * 2
    rec["fwd_gbps"] = nbytes / rec["fwd_ms"] / 1e6
    rec["fwd_frac_read"] = rec["fwd_gbps"] / ceilings["read_gbps"]
    rec["bwd_ms"] = rec["fwd_bwd_ms"] - rec["fwd_ms"]
    if rec["bwd_ms"] > 0:
        rec["bwd_gbps"] = 2 * nbytes / rec["bwd_ms"] / 1e6
        rec["bwd_frac_copy"] = rec["bwd_gbps"] / ceilings["copy_gbps"]
    else:  # timing noise on a tiny shape: no meaningful backward bandwidth
        rec["bwd_gbps"] = rec["bwd_frac_copy"] = None


def bench_logits_shape(n: int, v: int, impls: dict[str, LogitsImpl], ceilings: dict,
                       progress=None) -> dict:
    """Time every from-logits implementation on bf16 logits (n, v); returns a JSON-ready dict."""
    from rl_kernels.tools.reference import reference_logits_stats

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.empty(n, v, dtype=torch.bfloat16, device="cuda")
    step = max(1, (1 << 28) // v)  # fill in chunks: no N x V float32 temporary
    for r0 in range(0, n, step):
        chunk = logits[r0:r0 + step]
        chunk.copy_(2.0 * torch.randn(chunk.shape, device="cuda", generator=g))
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)
    rows = min(ERROR_ROWS, n)
    ref = reference_logits_stats(logits[:rows], labels[:rows]).log_probs

    def measure(fn, rec):
        with torch.no_grad():
            rec["fwd_ms"] = _do_bench(lambda: fn(logits, labels))
            rec["fwd_extra_gb"] = peak_extra_gib(lambda: fn(logits, labels))
            lp = fn(logits[:rows], labels[:rows])[0]
            rec["max_err"] = (lp.double() - ref).abs().max().item()
        x = logits.clone().requires_grad_()

        def fwd_bwd():
            _backward(fn(x, labels), g_lp, g_ent)
            x.grad = None

        rec["fwd_bwd_ms"] = _do_bench(fwd_bwd)
        rec["fwd_bwd_extra_gb"] = peak_extra_gib(fwd_bwd)
        _bandwidths(rec, n, v, ceilings)

    return {"shape": [n, v],
            "impls": _each_impl(impls, measure, progress, first=lambda name: {"ce_only": "CE only" in name})}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_logits_tables(results: dict) -> str:
    from tabulate import tabulate

    c = results["ceilings"]
    lines = [f"device: {results['device']}, torch {results['torch']}, triton {results['triton']}, "
             f"{results['date']}",
             f"ceilings ({c['bytes'] / 2**30:.0f} GiB bf16, same run): read {c['read_gbps']:.0f} GB/s "
             f"(sum {c['read_sum_gbps']:.0f}, amax {c['read_amax_gbps']:.0f}); copy "
             f"{c['copy_gbps']:.0f} GB/s (read + write)"]
    for shape in results["shapes"]:
        n, v = shape["shape"]
        nbytes = n * v * 2
        lines.append(f"\n{n} x {v} bf16 logits ({nbytes / 2**30:.2f} GiB): at the ceilings forward "
                     f"{nbytes / c['read_gbps'] / 1e6:.3f} ms, backward "
                     f"{2 * nbytes / c['copy_gbps'] / 1e6:.3f} ms")
        rows = []
        for name, r in shape["impls"].items():
            note = "CE only" if r.get("ce_only") else ""
            if "error" in r:
                rows.append([name] + ["-"] * 10 + ["; ".join(x for x in (note, r["error"]) if x)])
                continue
            rows.append([name, f"{r['fwd_ms']:.3f}", f"{r['fwd_gbps']:.0f}", f"{r['fwd_frac_read']:.0%}",
                         f"{r['fwd_bwd_ms']:.3f}", f"{r['bwd_ms']:.3f}", _fmt(r["bwd_gbps"], ".0f"),
                         _fmt(r["bwd_frac_copy"], ".0%"), f"{r['fwd_extra_gb']:.3f}",
                         f"{r['fwd_bwd_extra_gb']:.2f}", f"{r['max_err']:.1e}", note])
        lines.append(tabulate(rows, headers=["impl", "fwd ms", "fwd GB/s", "fwd / read ceil",
                                             "fwd+bwd ms", "bwd ms", "bwd GB/s", "bwd / copy ceil",
                                             "fwd extra GiB", "fwd+bwd extra GiB", "max |logp err|",
                                             "note"], tablefmt="github"))
    if results.get("absent"):
        lines.append("\nnot importable here: " + "; ".join(f"{k} ({v})" for k, v in results["absent"].items()))
    return "\n".join(lines)


def plot_logits(results: dict, path: str, plt) -> None:
    """Bar chart of forward (of the read ceiling) and backward (of the copy ceiling) bandwidth."""
    c = results["ceilings"]
    _bar_panels(results, path, plt, ("fwd_frac_read", "forward / read ceiling"),
                ("bwd_frac_copy", "backward / copy ceiling"), " bf16 logits", "fraction of the measured bandwidth",
                f"{results['device']}, {results['date']}: read {c['read_gbps']:.0f} GB/s, "
                f"copy {c['copy_gbps']:.0f} GB/s")


def run_logits(shapes=None, *, json_path=None, png_path=None, only=None) -> int:
    """``rl-kernels bench --logits`` (needs CUDA; :func:`run` checks). Returns the exit status."""
    from tqdm import tqdm

    parsed = parse_shapes(shapes if shapes is not None else DEFAULT_LOGITS_SHAPES, logits=True)
    impls, absent = logits_implementations()
    impls = _select(impls, only)
    results = {**_header(), "kind": "logits", "absent": absent, "shapes": []}
    with tqdm(total=1 + len(parsed) * len(impls), desc="rl-kernels bench --logits",
              unit="step") as progress:
        results["ceilings"] = measure_ceilings()
        progress.update(1)
        for n, v in parsed:
            results["shapes"].append(bench_logits_shape(n, v, impls, results["ceilings"], progress))
    _save(results, json_path, png_path)
    return 0

