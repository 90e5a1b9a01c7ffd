"""Autograd of the from-logits statistics: one Function for every public from-logits function.

The head family "logits": its parameter record (``LogitsParams``), output record
(``LogitsOutputs``), two backend implementations (``TritonLogits``, ``TorchLogits``) and Function.
Forward: one read of the logits (Triton ``ops.logits_forward`` or its torch twin
``torch_ops.logits_stats``) gives per-row float32 statistics; only O(N) of them are saved.
Backward: one more read of the logits writes d loss / d logits once, in the logits' dtype (into
the logits' own storage with ``inplace_backward``, reported to autograd by a version bump)."""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from .._logging import log_once
from ..backends import Backend, backend_by_name, implements
from ..label_check import deferred_label_check, raise_if_interpreted, raise_label_errors
from ..torch_ops.logits_stats import torch_logits_backward, torch_logits_forward
from .common import as_float_grad, first_order_only, float_grads, if_asked, or_empty, refuse_double_backward


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
    # two-level forward: the row's last split merges it in the same launch, with row counters kept
    # across calls (ops.logits_stats.row_counters); off in the custom ops' bodies (torch.compile),
    # where inductor's CUDA-graph trees warm up in a private memory pool that no tensor may outlive
    combine_in_one_launch: bool = True


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

        return ops.logits_forward(logits, labels, params, ops.logits_config(logits.device), label_check=label_check,
                                  last_combines=None if params.combine_in_one_launch else False)

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
        grads = {k: as_float_grad(g) for k, g in zip(LogitsOutputs._fields, output_grads) if g is not None}
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


# ------------------------------------------------------------------ torch.compile: custom ops
# LogitsStatsFunction's forward and backward as torch.library custom ops (see the same section of
# ``autograd/linear.py``). The forward op also returns the two saved statistics (row max, log-sum)
# that its backward reads. ``inplace_backward`` is not offered on this route: a custom op cannot
# return its input's storage as a new gradient (the public function says so once).

LOGITS_OP_SCHEMA = ("str backend, float inv_temperature, int ignore_index, bool return_entropy, "
                    "bool return_mean_log_p, bool return_sum_pi_squared, bool inplace_backward, str name")
_STAT_KEYS = ("log_probs", "entropy", "lse", "mean_log_p", "sum_pi_squared", "row_max", "log_sum")


def logits_op_params(params: LogitsParams) -> tuple:
    """A LogitsParams as the custom ops' trailing plain arguments (``LOGITS_OP_SCHEMA``)."""
    return (params.backend.name, params.inv_temperature, params.ignore_index, params.return_entropy,
            params.return_mean_log_p, params.return_sum_pi_squared, params.inplace_backward, params.name)


def logits_params_from_op(backend, inv_temperature, ignore_index, return_entropy, return_mean_log_p,
                          return_sum_pi_squared, inplace_backward, name) -> LogitsParams:
    """The record back from the plain values; ``inplace_backward`` (asked by the caller) is
    reported, not honoured: this route's gradient is a new tensor. The two-level forward combines
    in a second launch here (no state kept across calls: see ``combine_in_one_launch``)."""
    return LogitsParams(backend=backend_by_name(backend), inv_temperature=inv_temperature, ignore_index=ignore_index,
                        return_entropy=return_entropy, name=name, return_mean_log_p=return_mean_log_p,
                        return_sum_pi_squared=return_sum_pi_squared, inplace_backward=False,
                        combine_in_one_launch=False)


@torch.library.custom_op(
    "rl_kernels::logits_forward", mutates_args=(),
    schema="(Tensor logits, Tensor? labels, " + LOGITS_OP_SCHEMA
           + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def _logits_forward_op(logits, labels, *params):
    """-> (log_probs, entropy, lse, mean_log_p, sum_pi_squared, row_max, log_sum), empty where not
    asked."""
    raise_label_errors()  # a bad label that an earlier call's kernel reported
    p = logits_params_from_op(*params)
    if params[6]:  # inplace_backward asked: say once that this route does not honour it
        log_once(logging.WARNING, f"rl_kernels.{p.name}: inplace_backward=True is not honoured under "
                 f"torch.compile; the gradient is written to a new tensor (the same values)")
    label_check = None
    if labels is not None:  # in the kernel (no host sync), else on the host here
        label_check = deferred_label_check(labels, logits.shape[-1], p.ignore_index, p.name,
                                           in_kernel=p.backend.checks_labels_in_kernel)
    stats = logits_stats_forward(logits, labels, p, label_check)
    raise_if_interpreted(label_check, logits.device)
    return or_empty((stats.get(k) for k in _STAT_KEYS), logits)


@_logits_forward_op.register_fake
def _(logits, labels, backend, inv_temperature, ignore_index, return_entropy, return_mean_log_p,
      return_sum_pi_squared, inplace_backward, name):
    n = logits.shape[0]
    asked = (labels is not None, return_entropy, True, return_mean_log_p, return_sum_pi_squared, True, True)
    return tuple(logits.new_empty(n if a else 0, dtype=torch.float32) for a in asked)


@torch.library.custom_op(
    "rl_kernels::logits_backward", mutates_args=(),
    schema="(Tensor logits, Tensor? labels, Tensor row_max, Tensor log_sum, Tensor? entropy, Tensor? sum_pi_squared, "
           "Tensor? grad_log_probs, Tensor? grad_entropy, Tensor? grad_lse, Tensor? grad_mean_log_p, "
           "Tensor? grad_sum_pi_squared, " + LOGITS_OP_SCHEMA + ") -> Tensor")
def _logits_backward_op(logits, labels, row_max, log_sum, entropy, sum_pi_squared, grad_log_probs, grad_entropy,
                        grad_lse, grad_mean_log_p, grad_sum_pi_squared, *params):
    """-> d loss / d logits, a new contiguous tensor in the logits' dtype."""
    raise_label_errors()  # a bad label reported by this call's (or an earlier) forward kernel
    p = logits_params_from_op(*params)
    grads = {k: g for k, g in zip(LogitsOutputs._fields, (grad_log_probs, grad_entropy, grad_lse, grad_mean_log_p,
                                                           grad_sum_pi_squared)) if g is not None}
    stats = {"row_max": row_max, "log_sum": log_sum, "entropy": entropy, "sum_pi_squared": sum_pi_squared}
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    p.backend.family("logits").backward(logits, grad, labels, stats, grads, p)
    return grad


@_logits_backward_op.register_fake
def _(logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _logits_setup_context(ctx, inputs, output):
    logits, labels, *params = inputs
    _, entropy, _, _, sum_pi_squared, row_max, log_sum = output
    ctx.params = params
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, labels, row_max, log_sum, if_asked(entropy, params[3]),
                          if_asked(sum_pi_squared, params[5]))


def _logits_backward(ctx, *output_grads):
    logits, labels, row_max, log_sum, entropy, sum_pi_squared = ctx.saved_tensors
    none = (None,) * (2 + len(ctx.params))
    asked = (labels is not None, ctx.params[3], True, ctx.params[4], ctx.params[5])
    grads = float_grads(output_grads, asked)
    if not ctx.needs_input_grad[0] or all(g is None for g in grads):
        return none
    grad = torch.ops.rl_kernels.logits_backward(logits, labels, row_max, log_sum, entropy, sum_pi_squared, *grads,
                                                *ctx.params)
    return (grad,) + none[1:]


_logits_forward_op.register_autograd(_logits_backward, setup_context=_logits_setup_context)
refuse_double_backward(_logits_backward_op)


def compiled_logits_stats(logits, labels, params: LogitsParams) -> LogitsOutputs:
    """``LogitsStatsFunction``'s outputs through the custom ops (``torch.compile``'s route; see
    ``autograd.common.compiling``). Label values are checked in the op's body."""
    out = torch.ops.rl_kernels.logits_forward(logits, labels, *logits_op_params(params))
    return LogitsOutputs(if_asked(out[0], labels is not None), if_asked(out[1], params.return_entropy), out[2],
                         if_asked(out[3], params.return_mean_log_p), if_asked(out[4], params.return_sum_pi_squared))
