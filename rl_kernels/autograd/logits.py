"""Autograd of the from-logits statistics: one Function for every public from-logits function.

Forward: one read of the logits (Triton ``ops.logits_forward`` or its torch twin
``torch_ops.logits_stats``) gives per-row float32 statistics; only O(N) of them are saved.
Backward: one more read of the logits writes d loss / d logits once, in the logits' dtype (into
the logits' own storage with ``inplace_backward``, reported to autograd by a version bump)."""
from __future__ import annotations

import torch

from ..torch_ops.logits_stats import torch_logits_backward, torch_logits_forward
from ..validation import raise_label_errors
from .common import first_order_only

OUTPUTS = ("log_probs", "entropy", "lse", "mean_log_p", "sum_pi_squared")


def logits_stats_forward(logits, labels, inv_temperature, ignore_index, return_entropy, return_mean_log_p,
                         backend, return_sum_pi_squared=False, label_check=None) -> dict:
    """The forward's per-row statistics (a dict of (N,) float32 tensors, as ``ops.logits_forward``),
    without autograd: ``LogitsStatsFunction`` runs it, and so do calls that need no gradient
    (sparing the autograd node's host cost)."""
    if backend == "triton":
        from .. import ops

        flag, check_id = label_check if label_check is not None else (None, 0)
        return ops.logits_forward(logits, labels, inv_temperature, ignore_index, return_entropy,
                                  return_mean_log_p, ops.logits_config(logits.device),
                                  return_sum_pi_squared=return_sum_pi_squared, label_flag=flag,
                                  check_id=check_id)
    return torch_logits_forward(logits, labels, inv_temperature, ignore_index, return_entropy, return_mean_log_p,
                                return_sum_pi_squared)


class LogitsStatsFunction(torch.autograd.Function):
    """2-D logits (N, V) -> (log_probs, entropy, lse, mean_log_p, sum_pi_squared), float32 (N,)
    or None."""

    @staticmethod
    def forward(ctx, logits, labels, inv_temperature, ignore_index, return_entropy, return_mean_log_p,
                inplace_backward, backend, fn_name, return_sum_pi_squared=False, label_check=None):
        stats = logits_stats_forward(logits, labels, inv_temperature, ignore_index, return_entropy,
                                     return_mean_log_p, backend, return_sum_pi_squared, label_check)
        ctx.save_for_backward(logits, labels, stats["row_max"], stats["log_sum"],
                              stats.get("entropy"), stats.get("sum_pi_squared"))
        ctx.inv_temperature, ctx.ignore_index = inv_temperature, ignore_index
        ctx.inplace_backward, ctx.backend, ctx.fn_name = inplace_backward, backend, fn_name
        ctx.set_materialize_grads(False)
        return tuple(stats.get(k) for k in OUTPUTS)

    @staticmethod
    @first_order_only
    def backward(ctx, *out_grads):
        raise_label_errors()  # a bad label reported by this call's (or an earlier) forward kernel
        logits, labels, row_max, log_sum, entropy, sum_sq = ctx.saved_tensors
        grads = {("smooth" if k == "mean_log_p" else k): g.float().contiguous()
                 for k, g in zip(OUTPUTS, out_grads) if g is not None}
        if not ctx.needs_input_grad[0] or not grads:
            return (None,) * 11
        stats = {"row_max": row_max, "log_sum": log_sum, "entropy": entropy, "sum_pi_squared": sum_sq}
        # documented: with inplace_backward the logits' storage receives their gradient
        grad = logits if ctx.inplace_backward else torch.empty_like(
            logits, memory_format=torch.contiguous_format)
        if ctx.backend == "triton":
            from .. import ops

            ops.logits_backward(logits, grad, labels, stats, grads, ctx.inv_temperature, ctx.ignore_index,
                                ops.logits_config(logits.device))
        else:
            torch_logits_backward(logits, grad, labels, stats, grads, ctx.inv_temperature, ctx.ignore_index)
        if ctx.inplace_backward:
            # the kernel wrote through a raw pointer: tell autograd the logits changed, so that any
            # other saved use of them (a second consumer, retain_graph and a second backward)
            # raises torch's "modified by an inplace operation" error instead of reading gradients
            torch.autograd.graph.increment_version(logits)
        return grad, None, None, None, None, None, None, None, None, None, None
