"""Autograd of the fused linear head (``linear_log_probs``; the distillation losses reuse it).

Forward: the split-vocab Triton kernels (``ops.linear_forward`` + ``ops.split_combine``) or the
torch twin (``torch_ops.linear``) give per-row log-prob, entropy, lse (and sum p^2); saved state
is O(N). Backward: ``head_backward`` recomputes d loss / d logits windows (``ops.linear_backward``
or the torch twin) and hands them to the shared schedule (``autograd.backward_schedule``), which
turns them into dh and dW without an N x V buffer.
"""
from __future__ import annotations

import dataclasses

import torch

from ..torch_ops.linear import torch_dlogits, torch_forward, torch_gathered_logits
from ..validation import raise_label_errors
from .backward_schedule import chunked_backward, full_precision_reduction
from .common import first_order_only, hidden_for_weight_grad


@dataclasses.dataclass(frozen=True)
class HeadParams:
    backend: str  # "triton" or "torch" (already resolved)
    inv_temperature: float
    ignore_index: int
    return_entropy: bool
    return_lse: bool = False  # internal (distillation losses): lse as a differentiable output
    name: str = "linear_log_probs"  # the public function, for error messages
    # False when the caller knows no label equals ignore_index (read in the label check's host
    # sync): the backward then skips the non-finite ignored-row check and its host sync
    may_have_ignored: bool = True
    return_sum_pi_squared: bool = False  # sum_j p_j^2 as a differentiable output
    # logits soft-capped at this value before the temperature, z = c tanh(h.w / c) / T (Gemma-2);
    # None: plain z = h.w / T
    softcap: float | None = None


def head_forward(hidden_states, weight, labels, params: HeadParams, label_check=None):
    """(log_probs, entropy or None, lse, sum_sq or None), (N,) float32 each, no autograd.
    ``label_check``: (flag, check_id) of ``validation.deferred_label_check`` for the Triton
    kernels, which then make a bad label's row NaN and report it; None when checked already."""
    sq = params.return_sum_pi_squared
    if params.backend == "triton":
        from .. import ops

        n = hidden_states.shape[0]
        if n == 0:
            empty = hidden_states.new_empty(0, dtype=torch.float32)
            return (empty, (empty.clone() if params.return_entropy else None), empty.clone(),
                    empty.clone() if sq else None)
        cfg = ops.default_config(hidden_states.device, hidden_states.dtype)
        check = None if label_check is None else (*label_check, params.ignore_index)
        m, s, b, z_y, q = ops.linear_split_stats(hidden_states, weight, labels, params.inv_temperature,
                                                 params.return_entropy, cfg, return_sum_pi_squared=sq,
                                                 label_check=check, softcap=params.softcap)
        return ops.split_combine(m, s, b, z_y, labels, params.ignore_index, params.return_entropy,
                                 part_q=q, mark_bad=check is not None)
    return torch_forward(hidden_states, weight, labels, params.inv_temperature,
                         params.ignore_index, params.return_entropy, return_sum_pi_squared=sq,
                         softcap=params.softcap)


def head_backward(hidden_states, weight, labels, lse, entropy, grad_log_probs, grad_entropy,
                  params: HeadParams, need_dh: bool, need_dw: bool, grad_lse=None, gathered=None,
                  dh_float32: bool = False, sum_sq=None, grad_sum_sq=None):
    """(dh or None, dW or None) in the input dtypes; see the module docstring. ``gathered``:
    optional (ids (N, K), grad (N, K)): upstream gradients of the logits z[i, ids[i, k]], added to
    each recomputed dlogits window as sparse entries (no dense (N, K, H) work). ``dh_float32``:
    return dh unrounded in float32 (a vocab shard's partial sum, rounded after the all-reduce).
    ``sum_sq``, ``grad_sum_sq``: the forward's sum_j p_j^2 and its upstream gradient, (N,) float32
    contiguous, or None."""
    if params.backend == "triton":
        from .. import ops

        cfg = ops.default_config(hidden_states.device, hidden_states.dtype)
        dz_dtype, width = hidden_states.dtype, cfg.bwd_cols.block_n

        def dlogits(rows, cols, out):
            tile = cfg.bwd_rows if cols.stop - cols.start == weight.shape[0] else cfg.bwd_cols
            return ops.linear_dlogits(hidden_states, weight, labels, lse, entropy, grad_log_probs,
                                      grad_entropy, rows, cols, params.inv_temperature,
                                      params.ignore_index, out, cfg, tile, grad_lse, sum_sq, grad_sum_sq,
                                      params.softcap)
    else:
        dz_dtype, width = torch.float32, 1

        def dlogits(rows, cols, out):
            return torch_dlogits(hidden_states, weight, labels, lse, entropy, grad_log_probs,
                                 grad_entropy, rows, cols, params.inv_temperature,
                                 params.ignore_index, out, grad_lse, sum_sq, grad_sum_sq, params.softcap)

    if gathered is not None:
        if params.softcap is not None:  # the sparse entries below carry no 1 - tanh^2 factor
            raise NotImplementedError("gathered-logit gradients with a softcap")
        dlogits = _with_gathered(dlogits, *gathered, labels != params.ignore_index,
                                 params.inv_temperature)
    h_dw = hidden_states
    if need_dw and params.may_have_ignored:
        h_dw = hidden_for_weight_grad(hidden_states, labels == params.ignore_index, lse)
    with full_precision_reduction():
        return chunked_backward(dlogits, hidden_states, weight, dz_dtype, need_dh, need_dw, dh_float32,
                                h_dw, width_multiple=width)


def _with_gathered(dlogits, ids, grad, valid, inv_temperature):
    """Wrap a dlogits window function: add grad[i, k] * inv_temperature at (i, ids[i, k]) for the
    ids inside the window's columns (rows whose label is ignored get nothing)."""
    g = torch.where(valid[:, None], grad.float() * inv_temperature, torch.zeros((), device=grad.device))

    def wrapped(rows, cols, out):
        dz = dlogits(rows, cols, out)
        ids_r = ids[rows]
        r, k = ((ids_r >= cols.start) & (ids_r < cols.stop)).nonzero(as_tuple=True)
        dz.index_put_((r, ids_r[r, k] - cols.start), g[rows][r, k].to(dz.dtype), accumulate=True)
        return dz
    return wrapped


class LinearLogProbsFunction(torch.autograd.Function):
    """Inputs: hidden_states (N, H), weight (V, H), labels (N,), HeadParams.
    Outputs, in this order: log_probs (N,) float32, entropy (N,) when params.return_entropy, lse
    (N,) when params.return_lse, sum_j p_j^2 (N,) when params.return_sum_pi_squared, and the (N, K)
    logits at ``gather_ids`` when given."""

    @staticmethod
    def forward(ctx, hidden_states, weight, labels, params: HeadParams, gather_ids=None, label_check=None):
        log_probs, entropy, lse, sum_sq = head_forward(hidden_states, weight, labels, params, label_check)
        ctx.save_for_backward(hidden_states, weight, labels, lse, entropy, sum_sq, gather_ids)
        ctx.params, ctx.fn_name = params, params.name
        ctx.set_materialize_grads(False)
        outs = (log_probs,) + ((entropy,) if params.return_entropy else ()) + \
            ((lse.clone(),) if params.return_lse else ()) + \
            ((sum_sq,) if params.return_sum_pi_squared else ())
        if gather_ids is not None:  # (N, K) logits z[i, ids[i, k]] (internal: distillation)
            outs += (gathered_logits(hidden_states, weight, gather_ids, params),)
        return outs if len(outs) > 1 else log_probs

    @staticmethod
    @first_order_only
    def backward(ctx, grad_log_probs, *more):
        raise_label_errors()  # a bad label reported by this call's (or an earlier) forward kernel
        hidden_states, weight, labels, lse, entropy, sum_sq, gather_ids = ctx.saved_tensors
        params: HeadParams = ctx.params
        more = list(more)
        grad_entropy = more.pop(0) if params.return_entropy else None
        grad_lse = more.pop(0) if params.return_lse else None
        grad_sum_sq = more.pop(0) if params.return_sum_pi_squared else None
        grad_gathered = more.pop(0) if gather_ids is not None else None
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if all(g is None for g in (grad_log_probs, grad_entropy, grad_lse, grad_sum_sq, grad_gathered)) \
                or not (need_dh or need_dw):
            return None, None, None, None, None, None
        if grad_lse is not None:
            grad_lse = grad_lse.float().contiguous()
        if grad_sum_sq is not None:
            grad_sum_sq = grad_sum_sq.float().contiguous()
        dh, dw = head_backward(hidden_states, weight, labels, lse, entropy,
                               grad_log_probs, grad_entropy, params, need_dh, need_dw, grad_lse,
                               None if grad_gathered is None else (gather_ids, grad_gathered),
                               sum_sq=sum_sq, grad_sum_sq=grad_sum_sq)
        return dh, dw, None, None, None, None


def gathered_logits(hidden_states, weight, ids, params: HeadParams) -> torch.Tensor:
    """(N, K) float32 z[i, k] = hidden_states[i] . weight[ids[i, k]] * inv_temperature (soft-capped
    first with ``params.softcap``)."""
    if params.backend == "triton":
        from ..ops.linear_forward import label_logits

        return label_logits(hidden_states, weight, ids, params.inv_temperature, softcap=params.softcap)
    return torch_gathered_logits(hidden_states, weight, ids, params.inv_temperature, softcap=params.softcap)
