"""``rl-kernels bench``: the fused head against cuBLAS and its peers, on one GPU.

Per shape (N tokens x H hidden x V vocab, bf16, h ~ N(0, 1), W ~ N(0, 0.02^2), labels uniform)
and implementation: forward without grad (log-probs + entropy) and forward+backward (random
upstream gradients on both outputs) in ms, each also as a ratio to cuBLAS ``hidden @ W.T`` of the
same shape timed in the same run; peak extra memory (GB) of each; and the max |error| of the
log-probs against float64 on the first 256 rows. Medians of ``triton.testing.do_bench``.

Implementations: ours (``linear_log_probs``), torch eager (materialized bf16 logits, verl's
default path) and, when importable, verl's ``linear_cross_entropy`` (Triton) and
``FusedLinearForPPO`` (torch), Liger's fused linear cross-entropy and Apple's CCE. Liger and CCE
return only the cross-entropy (no entropy); their rows time log-probs alone, which favours them.
An implementation that fails (out of memory, an error) gets its error in the table instead.
"""
from __future__ import annotations

import datetime
import importlib
import importlib.util
import json
import logging
import os
import sys
import types
from collections.abc import Callable

import torch

from ._logging import log_once

DEFAULT_SHAPES = ("16384,3584,152064", "32768,4096,128256", "512,3584,152064")
ERROR_ROWS = 256


def import_verl_modules(stub: bool) -> str:
    """Import the verl modules the peers need. With ``stub``, when the full import fails (no Ray /
    tensordict / omegaconf stack, as on a GPU machine without a package index), verl's package
    ``__init__`` files are bypassed and tensordict is stubbed. Returns how verl was imported."""
    try:
        import verl.models.transformers.monkey_patch  # noqa: F401
        return "verl"
    except Exception as exc:  # noqa: BLE001 - any failure of the full import
        if not stub:
            raise
        for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
            del sys.modules[name]
        reason = f"{type(exc).__name__}: {exc}"

    class _Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {"__init__": lambda self, *a, **k: None})

    if importlib.util.find_spec("tensordict") is None:
        for name in ("tensordict", "tensordict.tensorclass"):
            mod = _Stub(name)
            mod.__path__ = []
            sys.modules[name] = mod
    spec = importlib.util.find_spec("verl")
    if spec is None:
        raise ImportError("verl is not installed")
    root = list(spec.submodule_search_locations)[0]
    for sub in ("", "utils", "models", "models.transformers", "utils.experimental", "utils.kernel"):
        name = "verl" + ("." + sub if sub else "")
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(root, *sub.split("."))] if sub else [root]
        sys.modules[name] = mod
    importlib.import_module("verl.models.transformers.monkey_patch")
    return f"verl with stubbed package inits ({reason[:100]})"


Impl = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple]


def implementations(stub_verl: bool = False) -> tuple[dict[str, Impl], dict[str, str]]:
    """(name -> fn(hidden, weight, labels) -> (log_probs, entropy or None)), (name -> why absent)."""
    from . import linear_log_probs
    from .repro import torch_eager

    impls: dict[str, Impl] = {
        "rl_kernels": lambda h, w, y: tuple(linear_log_probs(h, w, y)),
        "torch eager": lambda h, w, y: torch_eager(h, w, y, 1.0, -100),
    }
    absent: dict[str, str] = {}
    try:
        import_verl_modules(stub_verl)
        from verl.utils.experimental.torch_functional import FusedLinearForPPO
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        impls["verl triton"] = lambda h, w, y: linear_cross_entropy(h, w, y, 1.0, "none")
        impls["verl torch"] = lambda h, w, y: FusedLinearForPPO(impl_backend="torch")(h, w, y, 1.0)
    except Exception as exc:  # noqa: BLE001
        absent["verl"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        impls["liger (CE only)"] = lambda h, w, y: (-liger_fused_linear_cross_entropy(h, w, y, reduction="none"),
                                                    None)
    except Exception as exc:  # noqa: BLE001
        absent["liger"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        impls["cce (CE only)"] = lambda h, w, y: (-cce(h, w, y, reduction="none"), None)
    except Exception as exc:  # noqa: BLE001
        absent["cce"] = f"{type(exc).__name__}: {str(exc)[:80]}"
    for name, why in absent.items():
        log_once(logging.INFO, f"rl-kernels bench: {name} not benchmarked ({why})")
    return impls, absent


def _peak_extra_gb(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def bench_shape(n: int, h: int, v: int, impls: dict[str, Impl], progress=None) -> dict:
    """Time every implementation on one shape; returns a JSON-ready dict."""
    import triton.testing

    from .reference import reference_linear_log_probs

    def bench(fn):
        # rep is a time budget (ms): 1 s gives ~6 samples even of a 150 ms step (200 ms gave 1-2,
        # and a 10% spread between runs of the same code)
        return triton.testing.do_bench(fn, warmup=25, rep=1000, return_mode="median")

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    g_lp = torch.randn(n, device="cuda", generator=g)
    g_ent = torch.randn(n, device="cuda", generator=g)
    rows = min(ERROR_ROWS, n)
    ref = reference_linear_log_probs(hidden[:rows], weight, labels[:rows]).log_probs
    t_mm = bench(lambda: hidden @ weight.T)
    out = {"shape": [n, h, v], "cublas_ms": t_mm, "cublas_tflops": 2 * n * h * v / t_mm / 1e9, "impls": {}}
    for name, fn in impls.items():
        rec: dict = {}
        try:
            with torch.no_grad():
                rec["fwd_ms"] = bench(lambda: fn(hidden, weight, labels))
                rec["fwd_extra_gb"] = _peak_extra_gb(lambda: fn(hidden, weight, labels))
                lp = fn(hidden[:rows], weight, labels[:rows])[0]
                rec["max_err"] = (lp.double() - ref).abs().max().item()
            hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

            def fwd_bwd():
                lp, ent = fn(hx, wx, labels)[:2]
                outs, grads = [lp], [g_lp.to(lp.dtype)]
                if ent is not None:
                    outs.append(ent)
                    grads.append(g_ent.to(ent.dtype))
                torch.autograd.backward(outs, grads)
                hx.grad = wx.grad = None

            rec["fwd_bwd_ms"] = bench(fwd_bwd)
            rec["fwd_bwd_extra_gb"] = _peak_extra_gb(fwd_bwd)
            hx = wx = None  # free the gradient copies before the next implementation
            rec["fwd_x_mm"] = rec["fwd_ms"] / t_mm
            rec["fwd_bwd_x_mm"] = rec["fwd_bwd_ms"] / t_mm
        except torch.OutOfMemoryError:
            rec = {"error": "out of memory"}
        except Exception as exc:  # noqa: BLE001 - a peer's failure is a result
            rec = {"error": f"{type(exc).__name__}: {str(exc)[:100]}"}
        torch.cuda.empty_cache()
        out["impls"][name] = rec
        if progress is not None:
            progress.update(1)
    return out


def format_tables(results: dict) -> str:
    from tabulate import tabulate

    lines = [f"device: {results['device']}, torch {results['torch']}, triton {results['triton']}, "
             f"{results['date']}"]
    for shape in results["shapes"]:
        n, h, v = shape["shape"]
        lines.append(f"\n{n} x {h} x {v}: cuBLAS hidden @ W.T {shape['cublas_ms']:.2f} ms "
                     f"= {shape['cublas_tflops']:.0f} TFLOP/s")
        rows = []
        for name, r in shape["impls"].items():
            if "error" in r:
                rows.append([name] + ["-"] * 7 + [r["error"]])
                continue
            rows.append([name, f"{r['fwd_ms']:.2f}", f"{r['fwd_x_mm']:.2f}", f"{r['fwd_bwd_ms']:.2f}",
                         f"{r['fwd_bwd_x_mm']:.2f}", f"{r['fwd_extra_gb']:.3f}", f"{r['fwd_bwd_extra_gb']:.2f}",
                         f"{r['max_err']:.1e}", ""])
        lines.append(tabulate(rows, headers=["impl", "fwd ms", "fwd x mm", "fwd+bwd ms", "fwd+bwd x mm",
                                             "fwd extra GB", "fwd+bwd extra GB", "max |logp err|", "error"],
                              tablefmt="github"))
    if results.get("absent"):
        lines.append("\nnot importable here: " + "; ".join(f"{k} ({v})" for k, v in results["absent"].items()))
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Bar chart of fwd and fwd+bwd time / cuBLAS matmul per shape and implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = results["shapes"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        names = [k for k, r in shape["impls"].items() if "error" not in r]
        x = range(len(names))
        fwd = [shape["impls"][k]["fwd_x_mm"] for k in names]
        fb = [shape["impls"][k]["fwd_bwd_x_mm"] for k in names]
        ax.bar([i - 0.2 for i in x], fwd, width=0.4, label="forward")
        ax.bar([i + 0.2 for i in x], fb, width=0.4, label="forward+backward")
        ax.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
        ax.set_title("x".join(map(str, shape["shape"])), fontsize=9)
        ax.set_ylabel("time / cuBLAS matmul")
        ax.axhline(1.0, color="gray", lw=0.5)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{results['device']}, {results['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(shapes, *, json_path=None, png_path=None, stub_verl=False, only=None) -> int:
    """The ``rl-kernels bench`` command. Returns the exit status."""
    if not torch.cuda.is_available():
        print("rl-kernels bench: no CUDA device here; nothing to benchmark (the timings need a GPU)")
        return 0
    import triton
    from tqdm import tqdm

    impls, absent = implementations(stub_verl)
    if only:
        unknown = sorted(set(only) - set(impls))
        if unknown:
            raise SystemExit(f"--impls: unknown {unknown}; available here: {sorted(impls)}")
        impls = {k: v for k, v in impls.items() if k in only}
    parsed = []
    for s in shapes:
        try:
            n, h, v = (int(x) for x in s.split(","))
        except ValueError:
            raise SystemExit(f"--shapes: expected N,H,V (three integers), got {s!r}") from None
        parsed.append((n, h, v))
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "date": str(datetime.date.today()), "absent": absent,
               "shapes": []}
    with tqdm(total=len(parsed) * len(impls), desc="rl-kernels bench", unit="impl") as progress:
        for n, h, v in parsed:
            results["shapes"].append(bench_shape(n, h, v, impls, progress))
    print(format_tables(results))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {json_path}")
    if png_path:
        plot(results, png_path)
        print(f"wrote {png_path}")
    return 0
