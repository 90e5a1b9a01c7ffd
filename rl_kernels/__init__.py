"""rl-kernels: fused linear + log-prob / entropy for RL training of LLMs.

Public API: every name in the ``__all__`` of the public modules ``linear``, ``logits`` and
``distill``; each function's signature is listed at the end of this docstring (generated at import
from the functions themselves, checked by tests/api/test_public_api.py).

Conventions, the same in every function:
  * tensors are positional; every other argument is keyword-only, in this order: temperature
    (and softcap, the rest of the logits' definition, where a function has it);
    which positions count (labels, ignore_index, mask); the function's own options; reduction;
    backend; the vocab-parallel trio (process_group, vocab_start_index, reduce_hidden_grad); one
    passed by position raises a TypeError that spells the call with keywords (``temperature=0.7``);
  * a position counts unless its label equals ``ignore_index`` (-100); the distillation losses
    (``linear_topk_kl``, ``topk_kl_from_logits``, ``linear_jsd``), which need no labels, also take
    a ``mask`` (1 = counts), and with both given a position counts when both say so;
  * losses default to ``reduction='mean'`` over the positions that count;
  * ``weight`` is always an lm_head weight (V, H); outputs are float32 in nats (``cross_entropy``'s
    loss: the logits' dtype, as torch's);
  * every function traces under ``torch.compile(fullgraph=True)`` without a graph break (it then
    calls the ``torch.ops.rl_kernels`` custom ops, which run the same kernels: the same bits as
    eager), with the temperature a runtime value of the graph (no graph per temperature), and
    can be captured in a CUDA graph (docs/compile.md).

Each function's docstring is its contract (shapes, dtypes, units, errors, the formula's source);
why the kernels compute it as they do is in docs/design.md.
"""
import inspect as _inspect

from . import distill as _distill, linear as _linear, logits as _logits
from .distill import *  # noqa: F401,F403 - each public module's __all__
from .linear import *  # noqa: F401,F403
from .logits import *  # noqa: F401,F403

__version__ = "0.1.0"
__all__ = [*_linear.__all__, *_logits.__all__, *_distill.__all__, "__version__"]


def _signature(fn) -> str:
    """``name(positional, *, keyword=default, ...)``: the form the summary below lists."""
    parts, star = [], False
    for p in _inspect.signature(fn).parameters.values():
        if p.kind == p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return f"{fn.__name__}({', '.join(parts)})"


if __doc__ is not None:  # (python -OO strips docstrings)
    __doc__ += "\nSignatures:\n\n" + "\n".join(
        f"    {_signature(globals()[name])}" for name in __all__ if callable(globals()[name])
        and not isinstance(globals()[name], type))
