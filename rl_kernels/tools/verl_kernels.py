"""verl's own kernels as comparison points (``rl-kernels repro`` rows, the benchmark's peers).

Everything that knows verl's module layout for that purpose lives here: where its fused Triton
``linear_cross_entropy`` and its ``FusedLinearForPPO`` torch path are, and how to import them on
a machine without verl's Ray / tensordict stack (``import_verl_modules(stub=True)``). It is
tooling, not the integration: it imports verl's kernels unpatched and patches nothing.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Callable

import torch

LinearFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple]


def import_verl_modules(stub: bool) -> str:
    """Import the verl modules that hold its kernels. With ``stub``, when the full import fails
    (no Ray / tensordict / omegaconf stack, as on a GPU machine without a package index), verl's
    package ``__init__`` files are bypassed and tensordict is stubbed. Returns how verl was
    imported; raises ImportError when verl is not installed (or the import fails without
    ``stub``)."""
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


def verl_linear_kernels(stub: bool = False) -> dict[str, LinearFn]:
    """verl's fused linear heads as ``fn(hidden_states, weight, labels, temperature) ->
    (log_probs, entropy)`` (float32, shaped like labels): "verl triton" (its
    ``linear_cross_entropy``, CUDA only) and "verl torch" (``FusedLinearForPPO`` with the torch
    backend; verl 0.9+ where it takes ``impl_backend``). Raises ImportError (or what verl's import
    raises) when verl is not importable."""
    import_verl_modules(stub)
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    def triton_head(h, w, y, temperature):
        lp, ent = linear_cross_entropy(h, w, y, float(temperature), "none")
        return lp.float().view(y.shape), ent.float().view(y.shape)

    found = {"verl triton": triton_head}
    try:
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        torch_head = FusedLinearForPPO(impl_backend="torch")
        found["verl torch"] = lambda h, w, y, temperature: torch_head(h, w, y, float(temperature))
    except (ImportError, TypeError):  # older verl: no impl_backend argument
        pass
    return found
