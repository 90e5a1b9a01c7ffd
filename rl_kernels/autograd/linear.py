"""Autograd of the fused linear head (``linear_log_probs``; the distillation losses reuse it).

The head family "linear": its parameter record (``HeadParams``), its output record
(``HeadOutputs``), its two backend implementations (``TritonHead``: the split-vocab kernels of
``ops.linear``, forward split statistics, their combine and the dlogits windows; ``TorchHead``: the
twin ``torch_ops.linear``) and its one autograd Function, eager and compiled, sharded over a
vocab-parallel group or not (``vp_forward``). Forward: per-row log-prob, entropy, lse (and
sum_pi_squared; and the logits at given ids, and the tail lse outside them); saved state is O(N).
Backward: ``head_backward`` recomputes d loss / d logits windows on the backend and hands them to
the shared schedule (``autograd.backward_schedule``), which turns them into dh and dW without an
N x V buffer.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends import Backend, implements
from ..label_check import checked_labels, raise_if_interpreted, raise_label_errors
from ..validation import check_label_values, warn_fp16_temperature
from ..torch_ops.linear import per_row, torch_dlogits, torch_forward, torch_gathered_logits
from .backward_schedule import chunked_backward, full_precision_reduction
from .common import (OpArgs, as_float_grad, custom_op_pair, fake_grads, first_order_only, grads_or_empty,
                     hidden_for_weight_grad, or_empty, rl_op, sorted_tail_ids)
from .vocab_parallel import (all_gather_rows, finish_hidden_grad, group_from_op, local_labels, merge_lse,
                             merge_shards)


class HeadParams(NamedTuple):
    """The fused head's parameters, one immutable record from the public function to the launcher
    (a NamedTuple: built once per call, cheaply)."""

    backend: Backend  # resolved (backends.get_backend)
    inv_temperature: float
    ignore_index: int
    return_entropy: bool
    name: str = "linear_log_probs"  # the public function, for error messages
    # False when the caller knows no label equals ignore_index (read in the label check's host
    # sync): the backward then skips the non-finite ignored-row check and its host sync
    may_have_ignored: bool = True
    return_sum_pi_squared: bool = False  # sum_j p_j^2 as a differentiable output
    # logits soft-capped at this value before the temperature, z = c tanh(h.w / c) / T (Gemma-2);
    # None: plain z = h.w / T
    softcap: float | None = None
    # True when the caller checked the labels' values (and set may_have_ignored): the forward's
    # backend call then does not check them again
    labels_checked: bool = False
    # True: also tail_lse, the logsumexp of the logits outside the row's gather ids (the tail bucket
    # of the tail-aware top-K KL, ``distill``), differentiable; needs gather ids
    return_tail: bool = False


class HeadOutputs(NamedTuple):
    """The fused head's outputs, the same fields on every path (vocab-parallel included) and for
    the gradients of the backward; ``None`` for what was not asked. (N,) float32 each, except
    ``gathered_logits`` (N, K) float32: the logits z[i, ids[i, k]] at given ids (distillation).
    ``tail_lse``: logsumexp of z over the columns that are not among the row's ids (-inf when K = V)."""

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    gathered_logits: torch.Tensor | None = None
    tail_lse: torch.Tensor | None = None


@implements("linear", "triton")
class TritonHead:
    """The fused head on the Triton kernels (``ops.linear``: split statistics, combine, dlogits)."""

    @staticmethod
    def forward(hidden_states, weight, labels, params: HeadParams, label_check, tail_ids=None) -> HeadOutputs:
        from .. import ops

        n = hidden_states.shape[0]
        if n == 0:
            empty = hidden_states.new_empty(0, dtype=torch.float32)
            return HeadOutputs(empty, empty.clone() if params.return_entropy else None, empty.clone(),
                               empty.clone() if params.return_sum_pi_squared else None,
                               tail_lse=empty.clone() if tail_ids is not None else None)
        cfg = ops.default_config(hidden_states.device, hidden_states.dtype)
        sorted_ids = sorted_tail_ids(tail_ids, 0, weight.shape[0]) if tail_ids is not None else None
        partials = ops.linear_split_stats(hidden_states, weight, labels, params, cfg, label_check, sorted_ids)
        log_probs, entropy, lse, sum_pi_squared, *tail = ops.split_combine(partials, labels, params,
                                                                           mark_bad=label_check is not None)
        return HeadOutputs(log_probs, entropy, lse, sum_pi_squared, tail_lse=tail[0] if tail else None)

    @staticmethod
    def dlogits(hidden_states, weight, labels, saved: HeadOutputs, grads: HeadOutputs, params: HeadParams,
                tail_ids=None):
        """(window function, dlogits dtype, column-width multiple) for ``chunked_backward``."""
        from .. import ops

        cfg = ops.default_config(hidden_states.device, hidden_states.dtype)
        sorted_ids = sorted_tail_ids(tail_ids, 0, weight.shape[0]) if tail_ids is not None else None

        def window(rows, cols, out):
            tile = cfg.dlogits_tile(cols.stop - cols.start, weight.shape[0])
            return ops.linear_dlogits(hidden_states, weight, labels, saved, grads, rows, cols, out, params, cfg, tile,
                                      sorted_ids)
        return window, hidden_states.dtype, cfg.bwd_cols.block_n

    @staticmethod
    def gathered_logits(hidden_states, weight, ids, params: HeadParams) -> torch.Tensor:
        from ..ops.linear import label_logits

        return label_logits(hidden_states, weight, ids, params)


@implements("linear", "torch")
class TorchHead:
    """The fused head's torch twin (``torch_ops.linear``): float32 row chunks, any device."""

    @staticmethod
    def forward(hidden_states, weight, labels, params: HeadParams, label_check, tail_ids=None) -> HeadOutputs:
        log_probs, entropy, lse, sum_pi_squared, *tail = torch_forward(hidden_states, weight, labels, params,
                                                                       tail_ids=tail_ids)
        return HeadOutputs(log_probs, entropy, lse, sum_pi_squared, tail_lse=tail[0] if tail else None)

    @staticmethod
    def dlogits(hidden_states, weight, labels, saved: HeadOutputs, grads: HeadOutputs, params: HeadParams,
                tail_ids=None):
        def window(rows, cols, out):
            return torch_dlogits(hidden_states, weight, labels, saved, grads, rows, cols, out, params, tail_ids)
        return window, torch.float32, 1

    @staticmethod
    def gathered_logits(hidden_states, weight, ids, params: HeadParams) -> torch.Tensor:
        return torch_gathered_logits(hidden_states, weight, ids, params)


def head_forward(hidden_states, weight, labels, params: HeadParams, label_check=None, tail_ids=None) -> HeadOutputs:
    """The head's statistics, no autograd: ``HeadOutputs`` with log_probs, lse, entropy (when
    asked) and sum_pi_squared (when asked), (N,) float32 each. ``label_check``: (flag, check_id)
    of ``label_check.deferred_label_check`` for the Triton kernels, which then make a bad label's
    row NaN and report it; None when checked already. ``tail_ids``: (N, K) int columns of
    ``weight`` (others never match): tail_lse too, the logsumexp outside them."""
    if tail_ids is None:  # (the call as before the tail: other families' backends need no new argument)
        return params.backend.family("linear").forward(hidden_states, weight, labels, params, label_check)
    return params.backend.family("linear").forward(hidden_states, weight, labels, params, label_check, tail_ids)


def head_backward(hidden_states, weight, labels, saved: HeadOutputs, grads: HeadOutputs, params: HeadParams,
                  need_dh: bool, need_dw: bool, gathered_ids=None, dh_float32: bool = False, tail_ids=None):
    """(dh or None, dW or None) in the input dtypes; see the module docstring. ``saved``: the
    forward's lse, entropy and sum_pi_squared (N,) float32 contiguous (entropy / sum_pi_squared
    None when not needed); ``grads``: their upstream gradients (float32 contiguous, or None) and,
    with ``gathered_ids`` (N, K), the gradient (N, K) of the logits at those ids, added to each
    recomputed dlogits window as sparse entries (no dense (N, K, H) work). ``dh_float32``: return
    dh unrounded in float32 (a vocab shard's partial sum, rounded after the all-reduce). ``tail_ids``
    (N, K) int columns of ``weight``, with ``saved.tail_lse`` and ``grads.tail_lse``: the tail_lse
    gradient, [j not among the ids] exp(z_j - tail_lse), in the same windows."""
    family = params.backend.family("linear")
    if tail_ids is not None and grads.tail_lse is not None:
        dlogits, dz_dtype, width = family.dlogits(hidden_states, weight, labels, saved, grads, params, tail_ids)
    else:
        dlogits, dz_dtype, width = family.dlogits(hidden_states, weight, labels, saved, grads, params)
    if grads.gathered_logits is not None:
        if params.softcap is not None:  # the sparse entries below carry no 1 - tanh^2 factor
            raise NotImplementedError("gathered-logit gradients with a softcap")
        dlogits = _with_gathered(dlogits, gathered_ids, grads.gathered_logits, labels != params.ignore_index,
                                 params.inv_temperature)
    h_dw = hidden_states
    if need_dw and params.may_have_ignored:
        h_dw = hidden_for_weight_grad(hidden_states, labels == params.ignore_index, saved.lse)
    with full_precision_reduction():
        return chunked_backward(dlogits, hidden_states, weight, dz_dtype, need_dh, need_dw, dh_float32,
                                h_dw, width_multiple=width)


def _with_gathered(dlogits, ids, grad, valid, inv_temperature):
    """Wrap a dlogits window function: add grad[i, k] * inv_temperature at (i, ids[i, k]) for the
    ids inside the window's columns (rows whose label is ignored get nothing)."""
    g = torch.where(valid[:, None], grad.float() * per_row(inv_temperature), torch.zeros((), device=grad.device))

    def wrapped(rows, cols, out):
        dz = dlogits(rows, cols, out)
        ids_r = ids[rows]
        r, k = ((ids_r >= cols.start) & (ids_r < cols.stop)).nonzero(as_tuple=True)
        dz.index_put_((r, ids_r[r, k] - cols.start), g[rows][r, k].to(dz.dtype), accumulate=True)
        return dz
    return wrapped


def forward_body(hidden_states, weight, labels, params: HeadParams, gather_ids=None, tp=None) -> tuple:
    """The family's forward as one backend call runs it -> (HeadOutputs, the params the backward
    uses, the labels and ids the backward reads): a bad label reported by an earlier call raised,
    the fp16 temperature warning, this call's label values checked unless ``params.labels_checked``
    (in the Triton kernels without a host sync, else on the host, which also tells whether any
    label is ignore_index: ``may_have_ignored``), the statistics (:func:`head_forward`) and, with
    ``gather_ids`` (N, K), the logits at those ids. With ``tp`` (a vocab shard) the shard's
    statistics merged over the group (:func:`vp_forward`), labels and ids then global. Eagerly
    :class:`LinearLogProbsFunction` calls it directly; under torch.compile the
    ``rl_kernels::linear_forward`` custom op's body does."""
    raise_label_errors()  # a bad label that an earlier call's kernel reported
    warn_fp16_temperature(hidden_states.dtype, 1.0 / params.inv_temperature)
    if params.return_tail and gather_ids is None:
        raise ValueError(f"{params.name}: the tail (return_tail) is the vocabulary outside given ids: pass them")
    if tp is not None:
        return vp_forward(hidden_states, weight, labels, params, gather_ids, tp)
    label_check = None
    if not params.labels_checked:
        label_check, has_ignored = checked_labels(labels, weight.shape[0], params.ignore_index, params.name,
                                                  params.backend.checks_labels_in_kernel)
        params = params._replace(may_have_ignored=has_ignored is not False)
    out = head_forward(hidden_states, weight, labels, params, label_check,
                       gather_ids if params.return_tail else None)
    if gather_ids is not None:
        out = out._replace(gathered_logits=gathered_logits(hidden_states, weight, gather_ids, params))
    raise_if_interpreted(label_check, hidden_states.device)
    return out, params, labels, gather_ids


def backward_body(hidden_states, weight, labels, gather_ids, saved: HeadOutputs, grads: HeadOutputs,
                  params: HeadParams, tp, need_dh: bool, need_dw: bool) -> tuple:
    """(dh or None, dW or None) in the input dtypes from the forward's ``saved`` statistics and the
    float32 upstream ``grads``; ``labels`` / ``gather_ids``: what :func:`forward_body` returned for
    the backward (a shard's own with ``tp``, whose partial dh is then summed over the group when
    ``tp.reduce_hidden_grad``, in float32 and rounded once: as accurate as the unsharded head).
    Eagerly :class:`LinearLogProbsFunction` calls it directly; under torch.compile the
    ``rl_kernels::linear_backward`` custom op's body does."""
    raise_label_errors()  # a bad label reported by this call's (or an earlier) forward kernel
    tail_ids = None
    if params.return_tail and grads.tail_lse is not None:  # the ids (a shard's: after its label's column)
        tail_ids = gather_ids if tp is None else gather_ids[:, 1:]
    if tp is not None and gather_ids is not None:
        grads, gather_ids = vp_gather_grads(labels, gather_ids, grads, params.ignore_index)
    reduce_dh = tp is not None and tp.reduce_hidden_grad
    dh, dw = head_backward(hidden_states, weight, labels, saved, grads, params, need_dh, need_dw, gather_ids,
                           dh_float32=reduce_dh, tail_ids=tail_ids)
    return (finish_hidden_grad(dh, tp, hidden_states.dtype) if reduce_dh else dh), dw


def asked_outputs(params: HeadParams, gather: bool) -> tuple:
    """The ``HeadOutputs`` fields a call computes, in order: what :class:`LinearLogProbsFunction`
    returns (tensors only: torch.compile's tracing of a Function handles no None outputs)."""
    asked = (True, params.return_entropy, True, params.return_sum_pi_squared, gather, params.return_tail)
    return tuple([k for k, a in zip(HeadOutputs._fields, asked) if a])


class LinearLogProbsFunction(torch.autograd.Function):
    """Inputs: hidden_states (N, H), weight (V, H) (a vocab shard (V_r, H) with ``tp``), labels
    (N,), HeadParams, optional ids (N, K) (the logits at those ids are returned too:
    distillation), runtime temperature (None, or the 0-d tensor of a compiled graph), the
    vocab-parallel layout (``autograd.vocab_parallel.ParallelParams``) or None. Outputs: the asked
    fields of ``HeadOutputs`` (:func:`asked_outputs`), identical on every rank of a group. The one
    route of the family, eager and under ``torch.compile(fullgraph=True)``, sharded or not: its
    backend calls are the ``rl_kernels::linear_forward`` / ``linear_backward`` custom ops while the
    compiler traces (a group travels by name), their bodies (:func:`forward_body`,
    :func:`backward_body`) called directly otherwise (the same code, the same bits)."""

    @staticmethod
    def forward(ctx, hidden_states, weight, labels, params: HeadParams, gather_ids=None, temperature=None, tp=None):
        if torch.compiler.is_compiling():
            *out, shard_labels, shard_ids = rl_op("linear_forward", temperature)(
                hidden_states, weight, labels, gather_ids, *OP_ARGS.pack(params, temperature, tp))
            out = HeadOutputs(*out)
            if tp is None:  # (the op returns a shard's own labels and ids only)
                shard_labels, shard_ids = labels, gather_ids
        else:
            out, params, shard_labels, shard_ids = forward_body(hidden_states, weight, labels, params, gather_ids, tp)
        ctx.save_for_backward(hidden_states, weight, shard_labels, out.lse,
                              out.entropy if params.return_entropy else None,
                              out.sum_pi_squared if params.return_sum_pi_squared else None,
                              shard_ids if gather_ids is not None else None, temperature,
                              out.tail_lse if params.return_tail else None)
        ctx.params, ctx.tp, ctx.fn_name = params, tp, params.name
        ctx.outputs = asked_outputs(params, gather_ids is not None)
        ctx.set_materialize_grads(False)
        return tuple([getattr(out, k) for k in ctx.outputs])

    @staticmethod
    @first_order_only
    def backward(ctx, *output_grads):
        hidden_states, weight, labels, lse, entropy, sum_pi_squared, gather_ids, temperature, tail_lse = \
            ctx.saved_tensors
        got = {k: g for k, g in zip(ctx.outputs, output_grads) if g is not None}
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        none = (None,) * 5
        if not got or not (need_dh or need_dw):
            return (None, None) + none
        grads = HeadOutputs(*(as_float_grad(got[k]) if k in got else None for k in HeadOutputs._fields))
        if torch.compiler.is_compiling():
            dh, dw = rl_op("linear_backward", temperature)(
                hidden_states, weight, labels, gather_ids, lse, entropy, sum_pi_squared, tail_lse, *grads, need_dh,
                need_dw,
                *OP_ARGS.pack(ctx.params, temperature, ctx.tp))
            return (dh if need_dh else None, dw if need_dw else None) + none
        saved = HeadOutputs(None, entropy, lse, sum_pi_squared, tail_lse=tail_lse)
        return backward_body(hidden_states, weight, labels, gather_ids, saved, grads, ctx.params, ctx.tp, need_dh,
                             need_dw) + none


def linear_head(hidden_states, weight, labels, params: HeadParams, gather_ids=None, temperature=None,
                tp=None) -> HeadOutputs:
    """:class:`LinearLogProbsFunction`'s outputs as a ``HeadOutputs`` record (None where not asked)."""
    outs = dict(zip(asked_outputs(params, gather_ids is not None),
                    LinearLogProbsFunction.apply(hidden_states, weight, labels, params, gather_ids, temperature, tp)))
    return HeadOutputs(*(outs.get(k) for k in HeadOutputs._fields))


def gathered_logits(hidden_states, weight, ids, params: HeadParams) -> torch.Tensor:
    """(N, K) float32 z[i, k] = hidden_states[i] . weight[ids[i, k]] * inv_temperature (soft-capped
    first with ``params.softcap``)."""
    return params.backend.family("linear").gathered_logits(hidden_states, weight, ids, params)


# ------------------------------------------------------------------ a vocab shard (tensor parallelism)
# The head over a shard of the vocabulary (``autograd.vocab_parallel``: layout, collectives, the
# merge of the shards' statistics and its formulas).

def vp_forward(hidden_states, weight, labels, params: HeadParams, gather_ids, tp) -> tuple:
    """:func:`forward_body` on a vocab shard: global ``labels`` (their values checked on the host
    against the whole vocabulary when it is known, unless ``params.labels_checked``) -> (HeadOutputs
    merged over the group, params, the labels and ids of this shard that the backward reads)."""
    if not params.labels_checked and tp.vocab_size is not None:
        has_ignored = check_label_values(labels, tp.vocab_size, params.ignore_index, report_ignored=True)
        params = params._replace(may_have_ignored=has_ignored is not False)
    if gather_ids is not None:
        out, shard_labels, shard_ids = vp_gather_forward(hidden_states, weight, labels, gather_ids, params, tp)
        return out, params, shard_labels, shard_ids
    v_r = weight.shape[0]
    local, owned = local_labels(labels, tp.start, v_r, params.ignore_index)
    shard = head_forward(hidden_states, weight, local, params)
    z_y = gathered_logits(hidden_states, weight, torch.where(owned, local, 0)[:, None], params)[:, 0]
    log_probs, entropy, lse, sum_pi_squared = merge_shards(
        tp.process_group, shard.lse, shard.entropy, z_y, owned, labels, params.ignore_index, tp.vocab_size,
        shard.sum_pi_squared)
    # the merged entropy of ignored rows is 0 here; the backward masks those rows anyway
    return HeadOutputs(log_probs, entropy, lse, sum_pi_squared), params, local, None


def vp_gather_forward(hidden_states, weight, labels, ids, params: HeadParams, tp) -> tuple:
    """The shard forward with the logits at global ``ids`` (N, K) (distillation) -> (HeadOutputs
    with log_probs, lse and gathered_logits merged over the group, this shard's row labels (no
    label column on any shard: the label's logit is gathered as the ids' are), this shard's ids
    (N, 1 + K): the label's, then ``ids``, -1 where another shard holds the id). One all_gather of
    (N, 2 + 2 (K + 1)) float32: each shard's lse, its logits at the ids it holds, and which it
    holds; with ``params.return_tail`` also its tail lse, the logsumexp of its columns outside the ids,
    merged as the lse is). Raises ValueError for an id (or a label) held by no shard or by several."""
    if params.return_entropy or params.return_sum_pi_squared:
        raise NotImplementedError("entropy / sum_pi_squared with gathered logits on a vocab shard")
    v_r = weight.shape[0]
    valid = labels != params.ignore_index
    shard_labels = torch.where(valid, v_r, params.ignore_index)  # matches no column of the shard
    every = torch.cat([torch.where(valid, labels, 0)[:, None].to(ids.dtype), ids], 1)  # (N, 1 + K)
    owned = (every >= tp.start) & (every < tp.start + v_r)
    shard_ids = torch.where(owned, every - tp.start, -1)
    shard = head_forward(hidden_states, weight, shard_labels, params, None,
                         shard_ids[:, 1:] if params.return_tail else None)
    z_r = gathered_logits(hidden_states, weight, shard_ids.clamp_min(0), params)
    zero = torch.zeros((), device=z_r.device)
    part = [shard.lse.float()[:, None], torch.where(owned, z_r, zero), owned.float()]
    if params.return_tail:
        part.append(shard.tail_lse.float()[:, None])
    k = every.shape[1]
    gathered = all_gather_rows(tp.process_group, torch.cat(part, 1))  # (W, N, 1 + 2 (1 + K) [+ 1])
    lse, _ = merge_lse(gathered[:, :, 0])
    tail_lse = merge_lse(gathered[:, :, -1])[0] if params.return_tail else None
    count = gathered[:, :, 1 + k:1 + 2 * k].sum(0)
    for cols, name in ((slice(1, k), "teacher_token_ids"), (slice(0, 1), "labels")):
        bad = count[:, cols] != 1
        if bool(bad.any()):
            i, j = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"{name}: id {int(every[i, cols][j])} at (token {i}, k {j}) is held by "
                             f"{int(count[i, cols][j])} shards, expected one (check vocab_start_index)")
    z = gathered[:, :, 1:1 + k].sum(0)
    log_probs = torch.where(valid, (z[:, 0] - lse).clamp_max(0.0), zero)
    return HeadOutputs(log_probs, None, lse, None, z[:, 1:], tail_lse), shard_labels, shard_ids


def vp_gather_grads(shard_labels, shard_ids, grads: HeadOutputs, ignore_index: int) -> tuple:
    """(grads, ids) for :func:`head_backward` on a shard of :func:`vp_gather_forward`: the ids'
    columns only, or, with a log-prob gradient g, the label's column too, whose logit gets g as a
    sparse entry (d log p_y / dz = onehot(y) - p: the -p g part comes from the kernels as for any
    row, whose label matches no column of the shard)."""
    if grads.log_probs is None:
        return grads, shard_ids[:, 1:]
    g = torch.where(shard_labels != ignore_index, grads.log_probs, torch.zeros((), device=grads.log_probs.device))
    rest = grads.gathered_logits
    if rest is None:
        rest = g.new_zeros(shard_ids.shape[0], shard_ids.shape[1] - 1)
    return grads._replace(gathered_logits=torch.cat([g[:, None], rest], 1)), shard_ids


# ------------------------------------------------------------------ the backend calls as custom ops
# What torch.compile sees of the family: its forward and backward backend calls as torch.library
# custom ops (opaque, so no graph break; fake implementations give the output shapes, symbolic sizes
# included). Autograd is the Function's on both routes; the ops themselves are not differentiable
# (called directly on inputs that require grad, their backward raises). Their trailing arguments are
# the parameter record, the vocab-parallel layout and the runtime temperature (``OP_ARGS``,
# ``autograd.common.OpArgs``: a temperature that Dynamo holds as a symbolic float travels as a 0-d
# tensor, a runtime value, so a temperature schedule runs one graph).

OP_ARGS = OpArgs(HeadParams)


@custom_op_pair(
    "rl_kernels::linear_forward",
    schema="(Tensor hidden_states, Tensor weight, Tensor labels, Tensor? gather_ids, " + OP_ARGS.schema
           + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
def _linear_forward_op(hidden_states, weight, labels, gather_ids, *args):
    """:func:`forward_body` -> (log_probs, entropy, lse, sum_pi_squared, gathered_logits, tail_lse, the
    shard's labels, the shard's ids), empty where not asked (the last two: with a group only)."""
    params, group = OP_ARGS.unpack(args)
    tp = group_from_op(*group, params.ignore_index, weight.shape[0], hidden_states.device)
    out, _, shard_labels, shard_ids = forward_body(hidden_states, weight, labels, params, gather_ids, tp)
    shard = (shard_labels, shard_ids) if tp is not None else (None, None)
    return or_empty(tuple(out) + shard, hidden_states)


@_linear_forward_op.register_fake
def _(hidden_states, weight, labels, gather_ids, *args):
    params, (group_name, _, _) = OP_ARGS.unpack(args, read_temperature=False)
    n = hidden_states.shape[0]

    def rows(asked):
        return hidden_states.new_empty(n if asked else 0, dtype=torch.float32)
    gathered = hidden_states.new_empty((n, gather_ids.shape[1]) if gather_ids is not None else (0,),
                                       dtype=torch.float32)
    sharded = group_name is not None
    shard_labels = torch.empty_like(labels) if sharded else hidden_states.new_empty(0, dtype=torch.float32)
    shard_ids = (gather_ids.new_empty(n, 1 + gather_ids.shape[1]) if sharded and gather_ids is not None
                 else hidden_states.new_empty(0, dtype=torch.float32))
    return (rows(True), rows(params.return_entropy), rows(True), rows(params.return_sum_pi_squared), gathered,
            rows(params.return_tail), shard_labels, shard_ids)


@custom_op_pair(
    "rl_kernels::linear_backward",
    schema="(Tensor hidden_states, Tensor weight, Tensor labels, Tensor? gather_ids, Tensor lse, Tensor? entropy, "
           "Tensor? sum_pi_squared, Tensor? tail_lse, Tensor? grad_log_probs, Tensor? grad_entropy, Tensor? grad_lse, "
           "Tensor? grad_sum_pi_squared, Tensor? grad_gathered_logits, Tensor? grad_tail_lse, bool need_dh, "
           "bool need_dw, " + OP_ARGS.schema + ") -> (Tensor, Tensor)")
def _linear_backward_op(hidden_states, weight, labels, gather_ids, lse, entropy, sum_pi_squared, tail_lse,
                        grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared, grad_gathered_logits,
                        grad_tail_lse, need_dh, need_dw, *args):
    """:func:`backward_body` -> (dh, dW) in the input dtypes, empty where not needed."""
    params, group = OP_ARGS.unpack(args)
    grads = HeadOutputs(grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared, grad_gathered_logits,
                        grad_tail_lse)
    saved = HeadOutputs(None, entropy, lse, sum_pi_squared, tail_lse=tail_lse)
    dh, dw = backward_body(hidden_states, weight, labels, gather_ids, saved, grads, params, group_from_op(*group),
                           need_dh, need_dw)
    return grads_or_empty(dh, dw, hidden_states, weight)


@_linear_backward_op.register_fake
def _(hidden_states, weight, labels, gather_ids, lse, entropy, sum_pi_squared, tail_lse, grad_log_probs, grad_entropy,
      grad_lse, grad_sum_pi_squared, grad_gathered_logits, grad_tail_lse, need_dh, need_dw, *args):
    return fake_grads(hidden_states, weight, need_dh, need_dw)
