"""Autograd of the from-logits statistics: one Function for every public from-logits function.

The head family "logits": its parameter record (``LogitsParams``), output record
(``LogitsOutputs``), two backend implementations (``TritonLogits``, ``TorchLogits``) and Function.
Forward: one read of the logits (Triton ``ops.logits_forward`` or its torch twin
``torch_ops.logits_stats``) gives per-row float32 statistics; only O(N) of them are saved.
Backward: one more read of the logits writes d loss / d logits once, in the logits' dtype (into
the logits' own storage with ``inplace_backward``, reported to autograd by a version bump)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends import Backend, implements
from ..torch_ops.logits_stats import torch_logits_backward, torch_logits_forward
from ..label_check import raise_label_errors
from .common import first_order_only


class LogitsParams(NamedTuple):
    """The from-logits functions' parameters, one immutable record from the public function to the
    launcher (a NamedTuple: built once per call, cheaply)."""

    backend: Backend  # resolved (backends.get_backend)
    inv_temperature: float
    ignore_index: int
    return_entropy: bool
    name: str  # the public function, for error messages
    return_mean_log_p: bool = False  # the row's mean log p over the vocabulary (label smoothing)
    return_sum_pi_squared: bool = False
    inplace_backward: bool = False  # the gradient is written into the logits' own storage


class LogitsOutputs(NamedTuple):
    """Per-row float32 (N,) outputs of the from-logits Function, the same fields for its
    gradients; None where not asked (lse always)."""

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    lse: torch.Tensor | None
    mean_log_p: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None


@implements("logits", "triton")
class TritonLogits:
    """The from-logits statistics on the Triton kernels (``ops.logits_stats``)."""

    @staticmethod
    def forward(logits, labels, params: LogitsParams, label_check=None) -> dict:
        from .. import ops

        return ops.logits_forward(logits, labels, params, ops.logits_config(logits.device), label_check=label_check)

    @staticmethod
    def backward(logits, grad, labels, stats: dict, grads: dict, params: LogitsParams) -> None:
        from .. import ops

        ops.logits_backward(logits, grad, labels, stats, grads, params, ops.logits_config(logits.device))


@implements("logits", "torch")
class TorchLogits:
    """The from-logits statistics' torch twin (``torch_ops.logits_stats``): float32 row chunks."""

    @staticmethod
    def forward(logits, labels, params: LogitsParams, label_check=None) -> dict:
        return torch_logits_forward(logits, labels, params)

    @staticmethod
    def backward(logits, grad, labels, stats: dict, grads: dict, params: LogitsParams) -> None:
        torch_logits_backward(logits, grad, labels, stats, grads, params)


def logits_stats_forward(logits, labels, params: LogitsParams, label_check=None) -> dict:
    """The forward's per-row statistics (a dict of (N,) float32 tensors, as ``ops.logits_forward``:
    ``row_max``, ``log_sum``, ``lse`` and the outputs asked), without autograd:
    ``LogitsStatsFunction`` runs it, and so do calls that need no gradient (sparing the autograd
    node's host cost)."""
    return params.backend.family("logits").forward(logits, labels, params, label_check)


class LogitsStatsFunction(torch.autograd.Function):
    """2-D logits (N, V), labels (N,) or None, LogitsParams, optional label check -> the five
    fields of ``LogitsOutputs``, float32 (N,) or None."""

    @staticmethod
    def forward(ctx, logits, labels, params: LogitsParams, label_check=None):
        stats = logits_stats_forward(logits, labels, params, label_check)
        ctx.save_for_backward(logits, labels, stats["row_max"], stats["log_sum"],
                              stats.get("entropy"), stats.get("sum_pi_squared"))
        ctx.params, ctx.fn_name = params, params.name
        ctx.set_materialize_grads(False)
        return tuple(stats.get(k) for k in LogitsOutputs._fields)

    @staticmethod
    @first_order_only
    def backward(ctx, *output_grads):
        raise_label_errors()  # a bad label reported by this call's (or an earlier) forward kernel
        logits, labels, row_max, log_sum, entropy, sum_pi_squared = ctx.saved_tensors
        params: LogitsParams = ctx.params
        grads = {k: g.float().contiguous() for k, g in zip(LogitsOutputs._fields, output_grads) if g is not None}
        if not ctx.needs_input_grad[0] or not grads:
            return None, None, None, None
        stats = {"row_max": row_max, "log_sum": log_sum, "entropy": entropy, "sum_pi_squared": sum_pi_squared}
        # documented: with inplace_backward the logits' storage receives their gradient
        grad = logits if params.inplace_backward else torch.empty_like(
            logits, memory_format=torch.contiguous_format)
        params.backend.family("logits").backward(logits, grad, labels, stats, grads, params)
        if params.inplace_backward:
            # the kernel wrote through a raw pointer: tell autograd the logits changed, so that any
            # other saved use of them (a second consumer, retain_graph and a second backward)
            # raises torch's "modified by an inplace operation" error instead of reading gradients
            torch.autograd.graph.increment_version(logits)
        return grad, None, None, None
