"""Autograd of the from-logits statistics: one Function for every public from-logits function.

The head family "logits": its parameter record (``LogitsParams``), output record
(``LogitsOutputs``), two backend implementations (``TritonLogits``, ``TorchLogits``) and Function.
Forward: one read of the logits (Triton ``ops.logits_forward`` or its torch twin
``torch_ops.logits_stats``) gives per-row float32 statistics; only O(N) of them are saved.
Backward: one more read of the logits writes d loss / d logits once, in the logits' dtype (into
the logits' own storage with ``inplace_backward``, reported to autograd by a version bump).

Also the top-K log-probs of ``rl_kernels.topk_log_probs_from_logits`` / ``topk_kl_from_logits``
(``TopKLogProbsFunction`` and its custom ops): the same forward's lse with K gathered logits, and a
backward that writes one N x V gradient (the family's backward for the lse, then the K columns per
row)."""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from .._logging import log_once
from ..backends import Backend, backend_by_name, implements
from ..label_check import deferred_label_check, raise_if_interpreted, raise_label_errors
from ..torch_ops.logits_stats import torch_logits_backward, torch_logits_forward
from .common import (RUNTIME_TEMPERATURE_SCHEMA, as_float_grad, compiling, custom_op_pair, first_order_only,
                     float_grads, if_asked, op_inv_temperature, op_temperature, or_empty, refuse_double_backward, rl_op)


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
# return its input's storage as a new gradient (the public function says so once). The ops' last
# argument is the runtime temperature (``autograd.common.op_temperature``).

LOGITS_OP_SCHEMA = ("str backend, float inv_temperature, int ignore_index, bool return_entropy, "
                    "bool return_mean_log_p, bool return_sum_pi_squared, bool inplace_backward, str name")
_STAT_KEYS = ("log_probs", "entropy", "lse", "mean_log_p", "sum_pi_squared", "row_max", "log_sum")


def logits_op_params(params: LogitsParams, temperature=None) -> tuple:
    """A LogitsParams as the custom ops' trailing plain arguments (``LOGITS_OP_SCHEMA``, then the
    runtime temperature or None). ``temperature``: the public function's checked temperature (see
    ``autograd.common.op_temperature``)."""
    inv_temperature, runtime_temperature = op_temperature(params.inv_temperature, temperature)
    return (params.backend.name, inv_temperature, params.ignore_index, params.return_entropy,
            params.return_mean_log_p, params.return_sum_pi_squared, params.inplace_backward, params.name,
            runtime_temperature)


def logits_params_from_op(backend, inv_temperature, ignore_index, return_entropy, return_mean_log_p,
                          return_sum_pi_squared, inplace_backward, name, temperature=None) -> LogitsParams:
    """The record back from the plain values; ``inplace_backward`` (asked by the caller) is
    reported, not honoured: this route's gradient is a new tensor. The two-level forward combines
    in a second launch here (no state kept across calls: see ``combine_in_one_launch``). 1 / T
    from ``temperature`` when given."""
    return LogitsParams(backend=backend_by_name(backend), ignore_index=ignore_index,
                        inv_temperature=op_inv_temperature(inv_temperature, temperature),
                        return_entropy=return_entropy, name=name, return_mean_log_p=return_mean_log_p,
                        return_sum_pi_squared=return_sum_pi_squared, inplace_backward=False,
                        combine_in_one_launch=False)


@custom_op_pair(
    "rl_kernels::logits_forward",
    schema="(Tensor logits, Tensor? labels, " + LOGITS_OP_SCHEMA + ", " + RUNTIME_TEMPERATURE_SCHEMA
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
      return_sum_pi_squared, inplace_backward, name, temperature=None):
    n = logits.shape[0]
    asked = (labels is not None, return_entropy, True, return_mean_log_p, return_sum_pi_squared, True, True)
    return tuple(logits.new_empty(n if a else 0, dtype=torch.float32) for a in asked)


@custom_op_pair(
    "rl_kernels::logits_backward",
    schema="(Tensor logits, Tensor? labels, Tensor row_max, Tensor log_sum, Tensor? entropy, Tensor? sum_pi_squared, "
           "Tensor? grad_log_probs, Tensor? grad_entropy, Tensor? grad_lse, Tensor? grad_mean_log_p, "
           "Tensor? grad_sum_pi_squared, " + LOGITS_OP_SCHEMA + ", " + RUNTIME_TEMPERATURE_SCHEMA + ") -> Tensor")
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
    grad = rl_op("logits_backward", ctx.params[-1])(logits, labels, row_max, log_sum, entropy, sum_pi_squared,
                                                    *grads, *ctx.params)
    return (grad,) + none[1:]


_logits_forward_op.register_autograd(_logits_backward, setup_context=_logits_setup_context)
refuse_double_backward(_logits_backward_op)


def compiled_logits_stats(logits, labels, params: LogitsParams, temperature=None) -> LogitsOutputs:
    """``LogitsStatsFunction``'s outputs through the custom ops (``torch.compile``'s route; see
    ``autograd.common.compiling``). Label values are checked in the op's body. ``temperature``: the
    public function's checked temperature (``autograd.common.op_temperature``)."""
    op_params = logits_op_params(params, temperature)
    out = rl_op("logits_forward", op_params[-1])(logits, labels, *op_params)
    return LogitsOutputs(if_asked(out[0], labels is not None), if_asked(out[1], params.return_entropy), out[2],
                         if_asked(out[3], params.return_mean_log_p), if_asked(out[4], params.return_sum_pi_squared))


# ------------------------------------------------------------------ top-K log-probs of the logits
# log softmax(z)[ids] with z = logits * inv_temperature, for K given ids per row: the lse comes from
# the family's forward (one read of the logits, O(N) saved); the K values are z[ids] - lse.
# Backward, from the softmax derivative (d lse / dz = p): with g the (N, K) upstream gradient,
#     d/dz_j = p_j g_lse + sum_{k: ids_k = j} g_k,    g_lse = -sum_k g_k,
# so the family's backward writes p_j g_lse (times inv_temperature) into the one N x V gradient, and
# the K columns of each row are then overwritten with their full value, computed in float32 and
# rounded once: duplicate ids are summed first (in float64, over the row's K slots), so every slot
# of an id writes the same value (no atomic add into the gradient; float64 sums of a few float32
# values round to the same float32 whatever their order, but for a double-rounding tie).


def gather_logits(logits, token_ids, inv_temperature: float) -> torch.Tensor:
    """z[i, token_ids[i, k]] in float32: ``logits`` (N, V) at (N, K) int64 ids, scaled as the
    kernels scale them (converted to float32, then times ``inv_temperature``)."""
    return logits.gather(1, token_ids).float() * inv_temperature


def sum_over_equal_ids(token_ids, grad_log_probs) -> torch.Tensor:
    """(N, K) float32: for each slot, the sum of ``grad_log_probs`` over the slots of its row that
    hold the same id (itself alone when its id is unique in the row). The runs of equal ids of
    each sorted row are summed in float64 (``scatter_add_`` over at most K slots: a slot alone is
    its own value exactly) and rounded to float32 once."""
    if token_ids.shape[1] == 1:
        return grad_log_probs
    sorted_ids, order = token_ids.sort(dim=1, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    run = starts.cumsum(1) - 1  # the run (of equal ids) each sorted slot belongs to
    sums = torch.zeros(sorted_ids.shape, dtype=torch.float64, device=token_ids.device)
    sums.scatter_add_(1, run, grad_log_probs.gather(1, order).double())
    return torch.empty_like(grad_log_probs).scatter_(1, order, sums.gather(1, run).float())


def topk_log_probs_backward(logits, grad, token_ids, labels, row_max, log_sum, lse, grad_log_probs,
                            params: LogitsParams) -> torch.Tensor:
    """Write d loss / d logits into ``grad`` (N x V, the logits' dtype) for the upstream gradient
    ``grad_log_probs`` (N, K) float32 of the top-K log-probs: the family's backward with
    g_lse = -sum_k g_k, then the K columns of each row overwritten (see the section comment).
    ``labels``: None, or (N,) whose ``ignore_index`` rows get exactly 0 unless g_lse != 0 there
    (as the family's backward selects them)."""
    grad_lse = -grad_log_probs.sum(1)
    stats = {"row_max": row_max, "log_sum": log_sum}
    params.backend.family("logits").backward(logits, grad, labels, stats, {"lse": grad_lse}, params)
    p = (gather_logits(logits, token_ids, params.inv_temperature) - lse[:, None]).exp()
    values = (p * grad_lse[:, None] + sum_over_equal_ids(token_ids, grad_log_probs)) * params.inv_temperature
    if labels is not None:
        active = (labels != params.ignore_index) | (grad_lse != 0)
        values = torch.where(active[:, None], values, torch.zeros((), device=values.device))
    grad.scatter_(1, token_ids, values.to(grad.dtype))
    return grad


class TopKLogProbsFunction(torch.autograd.Function):
    """2-D logits (N, V), token ids (N, K) int64 in [0, V), labels (N,) or None (rows whose label
    is ``params.ignore_index`` get exactly zero gradient when no gradient reaches them, even if
    non-finite), LogitsParams -> float32 (N, K) log softmax(logits * inv_temperature) at the ids.
    Saves O(N) statistics (and the inputs); its backward allocates one N x V tensor, the gradient."""

    @staticmethod
    def forward(ctx, logits, token_ids, labels, params: LogitsParams):
        stats = logits_stats_forward(logits, labels, params)
        lse = stats["lse"]
        ctx.save_for_backward(logits, token_ids, labels, stats["row_max"], stats["log_sum"], lse)
        ctx.params, ctx.fn_name = params, params.name
        ctx.set_materialize_grads(False)
        return gather_logits(logits, token_ids, params.inv_temperature) - lse[:, None]

    @staticmethod
    @first_order_only
    def backward(ctx, grad_log_probs):
        if grad_log_probs is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        logits, token_ids, labels, row_max, log_sum, lse = ctx.saved_tensors
        grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        topk_log_probs_backward(logits, grad, token_ids, labels, row_max, log_sum, lse,
                                as_float_grad(grad_log_probs), ctx.params)
        return grad, None, None, None


# torch.compile's route: TopKLogProbsFunction's forward and backward bodies as custom ops (the
# forward op also returns the three (N,) statistics its backward reads), so that compiled and eager
# run the same code and give the same bits, with the same one N x V tensor in backward.

@custom_op_pair(
    "rl_kernels::topk_log_probs_forward",
    schema="(Tensor logits, Tensor token_ids, Tensor? labels, " + LOGITS_OP_SCHEMA + ", " + RUNTIME_TEMPERATURE_SCHEMA
           + ") -> (Tensor, Tensor, Tensor, Tensor)")
def _topk_forward_op(logits, token_ids, labels, *params):
    """-> (log_probs (N, K), row_max, log_sum, lse), float32."""
    p = logits_params_from_op(*params)
    stats = logits_stats_forward(logits, labels, p)
    log_probs = gather_logits(logits, token_ids, p.inv_temperature) - stats["lse"][:, None]
    return (log_probs, *or_empty((stats["row_max"], stats["log_sum"], stats["lse"]), logits))


@_topk_forward_op.register_fake
def _(logits, token_ids, labels, *params):
    n = logits.shape[0]
    return (logits.new_empty(token_ids.shape, dtype=torch.float32),
            *(logits.new_empty(n, dtype=torch.float32) for _ in range(3)))


@custom_op_pair(
    "rl_kernels::topk_log_probs_backward",
    schema="(Tensor logits, Tensor token_ids, Tensor? labels, Tensor row_max, Tensor log_sum, Tensor lse, "
           "Tensor grad_log_probs, " + LOGITS_OP_SCHEMA + ", " + RUNTIME_TEMPERATURE_SCHEMA + ") -> Tensor")
def _topk_backward_op(logits, token_ids, labels, row_max, log_sum, lse, grad_log_probs, *params):
    """-> d loss / d logits, a new contiguous tensor in the logits' dtype."""
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    return topk_log_probs_backward(logits, grad, token_ids, labels, row_max, log_sum, lse, grad_log_probs,
                                   logits_params_from_op(*params))


@_topk_backward_op.register_fake
def _(logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _topk_setup_context(ctx, inputs, output):
    logits, token_ids, labels, *params = inputs
    _, row_max, log_sum, lse = output
    ctx.params = params
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, token_ids, labels, row_max, log_sum, lse)


def _topk_backward(ctx, grad_log_probs, *unused):
    logits, token_ids, labels, row_max, log_sum, lse = ctx.saved_tensors
    none = (None,) * (3 + len(ctx.params))
    if grad_log_probs is None or not ctx.needs_input_grad[0]:
        return none
    grad = rl_op("topk_log_probs_backward", ctx.params[-1])(logits, token_ids, labels, row_max, log_sum, lse,
                                                            as_float_grad(grad_log_probs), *ctx.params)
    return (grad,) + none[1:]


_topk_forward_op.register_autograd(_topk_backward, setup_context=_topk_setup_context)
refuse_double_backward(_topk_backward_op)


def topk_log_probs(logits, token_ids, labels, params: LogitsParams, temperature=None) -> torch.Tensor:
    """(N, K) float32 log-probs of 2-D ``logits`` at checked int64 ``token_ids`` (N, K): through
    :class:`TopKLogProbsFunction` when a gradient is wanted, its forward alone otherwise, and under
    ``torch.compile`` through the ``rl_kernels::topk_log_probs_forward`` / ``_backward`` custom ops
    (the same bodies: the same bits; ``temperature``: the public function's checked temperature,
    ``autograd.common.op_temperature``)."""
    if compiling():
        op_params = logits_op_params(params, temperature)
        return rl_op("topk_log_probs_forward", op_params[-1])(logits, token_ids, labels, *op_params)[0]
    if torch.is_grad_enabled() and logits.requires_grad:
        return TopKLogProbsFunction.apply(logits, token_ids, labels, params)
    lse = logits_stats_forward(logits, labels, params)["lse"]
    return gather_logits(logits, token_ids, params.inv_temperature) - lse[:, None]


def check_token_id_values(token_ids, vocab_size: int, name: str) -> None:
    """ValueError naming ``name`` when an id lies outside [0, vocab_size) (one host read)."""
    if token_ids.numel() and bool(((token_ids < 0) | (token_ids >= vocab_size)).any()):
        bad = (token_ids < 0) | (token_ids >= vocab_size)
        first = bad.reshape(-1).nonzero()[0, 0].item()
        raise ValueError(f"{name}: values must lie in [0, vocab_size={vocab_size}); {int(bad.sum())} do not, "
                         f"first at flat position {first}: {token_ids.reshape(-1)[first].item()} (min "
                         f"{int(token_ids.min())}, max {int(token_ids.max())})")


@torch.library.custom_op("rl_kernels::checked_token_ids", mutates_args=(),
                         schema="(Tensor token_ids, SymInt vocab_size, str name) -> Tensor")
def _checked_token_ids_op(token_ids, vocab_size, name):
    """torch.compile's route of the id check: ValueError as in eager (the host reads the ids inside
    this opaque op) -> the ids as a new int64 tensor, which the traced function then gathers with
    (so the op is not dropped as unused)."""
    check_token_id_values(token_ids, vocab_size, name)
    return token_ids.to(torch.int64, copy=True)


@_checked_token_ids_op.register_fake
def _(token_ids, vocab_size, name):
    return token_ids.new_empty(token_ids.shape, dtype=torch.int64)


def checked_token_ids(token_ids, vocab_size: int, name: str) -> torch.Tensor:
    """``token_ids`` as int64 after the value check (eager: on the host here; compiled: in the
    ``rl_kernels::checked_token_ids`` op's body)."""
    if compiling():
        return torch.ops.rl_kernels.checked_token_ids(token_ids, vocab_size, name)
    check_token_id_values(token_ids, vocab_size, name)
    return token_ids.long()
