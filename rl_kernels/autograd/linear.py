"""Autograd of the fused linear head (``linear_log_probs``; the distillation losses reuse it).

The head family "linear": its parameter record (``HeadParams``), its output record
(``HeadOutputs``), its two bodies on the backend's kernels (``ops.linear``: the split-vocab kernels,
forward split statistics, their combine and the dlogits windows; or its twin ``torch_ops.linear``;
both give ``forward``, ``dlogits`` and ``gathered_logits``), and its one autograd Function
(``LinearHeadFunction``, eager and compiled, sharded over a vocab-parallel group or not
(``vp_forward``), calling the ``rl_kernels::linear_forward`` / ``linear_backward`` stage ops while
torch.compile traces; ``linear_head`` applies it). Forward: per-row log-prob, entropy, lse (and
sum_pi_squared; and the logits at given ids, and the tail lse outside them); saved state is O(N).
Backward: ``head_backward`` recomputes d loss / d logits windows on the backend and hands them to
the shared schedule (``autograd.backward_schedule``), which turns them into dh and dW without an
N x V buffer.
"""
from __future__ import annotations

import collections
import functools
from typing import NamedTuple

import torch

from ..core.backends import Backend
from ..core.label_check import checked_labels, raise_if_interpreted, raise_label_errors
from ..core.validation import check_label_values, warn_fp16_temperature
from ..torch_ops.linear import per_row
from .backward_schedule import chunked_backward, full_precision_reduction
from .head_family import (OpArgs, as_float_grad, first_order_only, hidden_for_weight_grad, kernels, or_empty, rl_op,
                          sorted_tail_ids, stage_op, sum_over_equal_ids, temperature_samples)
from .linear_topk import TopkParams
from .vocab_parallel import (all_gather_rows, finish_hidden_grad, gather_topk, group_from_op, local_labels, merge_lse,
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
    # > 0: also the row's top_k largest logits (ids, and their log-probs), selected in the forward's
    # own pass over the logit tiles (verl's distillation overlap metrics); no gradient
    top_k: int = 0


class HeadOutputs(NamedTuple):
    """The fused head's outputs, the same fields on every path (vocab-parallel included) and for
    the gradients of the backward; ``None`` for what was not asked. (N,) float32 each, except
    ``gathered_logits`` (N, K) float32: the logits z[i, ids[i, k]] at given ids (distillation).
    ``tail_lse``: logsumexp of z over the columns that are not among the row's ids (-inf when K = V).
    ``top_logits`` / ``top_ids`` (N, top_k) float32 / int64: the row's top_k largest logits z and their
    global ids, by (value descending, id ascending), as ``linear_topk`` selects them (an empty slot,
    where fewer than top_k logits are neither NaN nor -inf: -inf and id -1); no gradient."""

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    gathered_logits: torch.Tensor | None = None
    tail_lse: torch.Tensor | None = None
    top_logits: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None


def head_forward(hidden_states, weight, labels, params: HeadParams, label_check=None, tail_ids=None) -> HeadOutputs:
    """The head's statistics, no autograd: ``HeadOutputs`` with log_probs, lse, entropy (when
    asked) and sum_pi_squared (when asked), (N,) float32 each. ``label_check``: (flag, check_id)
    of ``label_check.deferred_label_check`` for the Triton kernels, which then make a bad label's
    row NaN and report it; None when checked already. ``tail_ids``: (N, K) int columns of
    ``weight`` (others never match): tail_lse too, the logsumexp outside them. With ``params.top_k``
    the row's top K too (``top_logits``, ``top_ids``). On the backend's ``forward``
    (``ops.linear`` or ``torch_ops.linear``)."""
    sorted_ids = sorted_tail_ids(tail_ids, 0, weight.shape[0]) if tail_ids is not None else None
    log_probs, entropy, lse, sum_pi_squared, tail_lse, top_logits, top_ids = kernels(params.backend, "linear").forward(
        hidden_states, weight, labels, params, label_check, sorted_ids)
    if params.top_k and top_ids is None:  # (the torch twin selects none in its forward: a pass of its own)
        top_logits, top_ids, _ = kernels(params.backend, "linear_topk").select(
            hidden_states, weight, TopkParams(params.backend, params.inv_temperature, params.top_k, params.softcap))
    return HeadOutputs(log_probs, entropy, lse, sum_pi_squared, None, tail_lse, top_logits, top_ids)


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
    family = kernels(params.backend, "linear")
    sorted_ids = sorted_tail_ids(tail_ids, 0, weight.shape[0]) if tail_ids is not None and grads.tail_lse is not None \
        else None
    dlogits, dz_dtype, width, fp32_products = family.dlogits(hidden_states, weight, labels, saved, grads, params,
                                                             sorted_ids)
    if grads.gathered_logits is not None:
        if params.softcap is not None:  # the sparse entries below carry no 1 - tanh^2 factor
            raise NotImplementedError("gathered-logit gradients with a softcap")
        whole = None
        if grads.entropy is None and grads.sum_pi_squared is None:
            # the dense part at the ids' columns in float32, from the forward's logits there (a vocab
            # shard's own ids: recomputed on its weight): d(lse, log p_y)/dz_j = p_j, [j = y] - p_j (the
            # tail's term is 0 at the ids); a missing gradient as zeros, so that an eager call (None)
            # and a compiled one (zeros) give the same bits
            z = saved.gathered_logits if saved.gathered_logits is not None else \
                family.gathered_logits(hidden_states, weight, gathered_ids.clamp_min(0), params)
            zeros = torch.zeros_like(saved.lse)
            g_lse = grads.lse if grads.lse is not None else zeros
            g_lp = grads.log_probs if grads.log_probs is not None else zeros
            whole = ((z - saved.lse[:, None]).exp() * (g_lse - g_lp)[:, None]
                     + torch.where(gathered_ids == labels[:, None], g_lp[:, None], 0.0)) * per_row(params.inv_temperature)
        dlogits = _with_gathered(dlogits, gathered_ids, grads.gathered_logits, labels != params.ignore_index,
                                 params.inv_temperature, whole)
    h_dw = hidden_states
    if need_dw and params.may_have_ignored:
        h_dw = hidden_for_weight_grad(hidden_states, labels == params.ignore_index, saved.lse)
    with full_precision_reduction():
        return chunked_backward(dlogits, hidden_states, weight, dz_dtype, need_dh, need_dw, dh_float32,
                                h_dw, width_multiple=width, fp32_products=fp32_products)


def _with_gathered(dlogits, ids, grad, valid, inv_temperature, whole=None):
    """Wrap a dlogits window function: add grad[i, k] * inv_temperature at (i, ids[i, k]) for the
    ids inside the window's columns (rows whose label is ignored get nothing), summed over a row's
    slots with the same id first (:func:`~.head_family.sum_over_equal_ids`; a repeated id's slots all
    write the same value). ``whole``: None, or (N, K) float32, the dense part the kernels wrote at
    those columns recomputed in float32 (where the lse's gradient is the only dense one: p g_lse / T)
    - then the columns get ``whole`` + the sparse term, rounded once to the window's dtype (issue 54:
    a bf16 window holding the dense part rounded, plus the sparse part, rounds twice: up to 1% of the
    largest gradient where the two nearly cancel, as reverse top-K KL's do); without it the sparse
    term is added to the window's value in float32 and the sum rounded."""
    g = torch.where(valid[:, None], grad.float() * per_row(inv_temperature), torch.zeros((), device=grad.device))
    sums = sum_over_equal_ids(ids, g)

    def wrapped(rows, cols, out):
        dz = dlogits(rows, cols, out)
        ids_r = ids[rows]
        r, k = ((ids_r >= cols.start) & (ids_r < cols.stop) & valid[rows, None]).nonzero(as_tuple=True)
        at = (r, ids_r[r, k] - cols.start)
        dense = dz[at].float() if whole is None else whole[rows][r, k]
        dz.index_put_(at, (dense + sums[rows][r, k]).to(dz.dtype))
        return dz
    return wrapped


def forward_body(hidden_states, weight, labels, gather_ids, params: HeadParams, tp) -> tuple:
    """The family's forward as one backend call runs it -> (slots, the params the backward uses):
    the slots of ``_SLOTS`` (``HeadOutputs``' fields, then the shard's own labels and ids that
    the backward reads: None without ``tp``, where it reads the inputs). A bad label reported by an
    earlier call raised, the fp16 temperature warning, this call's label values checked unless
    ``params.labels_checked`` (in the Triton kernels without a host sync, else on the host, which
    also tells whether any label is ignore_index: ``may_have_ignored``), the statistics
    (:func:`head_forward`) and, with ``gather_ids`` (N, K), the logits at those ids. With ``tp`` (a
    vocab shard) the shard's statistics merged over the group (:func:`vp_forward`), labels and ids
    then global."""
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
    return (*out, None, None), params


def backward_body(hidden_states, weight, labels, gather_ids, entropy, lse, sum_pi_squared, gathered_logits, tail_lse,
                  shard_labels, shard_ids, grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared, grad_gathered_logits,
                  grad_tail_lse, params: HeadParams, tp, need_dh: bool, need_dw: bool) -> tuple:
    """(dh or None, dW or None) in the input dtypes from the forward's saved statistics (None where
    not made) and the upstream gradients (None where none came; made float32 contiguous here);
    ``shard_labels`` / ``shard_ids``: what :func:`forward_body` made for the backward (a shard's
    own, with ``tp``: the partial dh is then summed over the group when ``tp.reduce_hidden_grad``,
    in float32 and rounded once, as accurate as the unsharded head), else None (the inputs'). The top-K
    outputs have no gradient (the public functions hand them out detached)."""
    raise_label_errors()  # a bad label reported by this call's (or an earlier) forward kernel
    grads = HeadOutputs(*[g if g is None else as_float_grad(g) for g in (
        grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared, grad_gathered_logits, grad_tail_lse)])
    saved = HeadOutputs(None, entropy, lse, sum_pi_squared, gathered_logits if tp is None else None, tail_lse)
    if shard_labels is not None:
        labels, gather_ids = shard_labels, shard_ids
    tail_ids = None
    if params.return_tail and grads.tail_lse is not None:  # the ids (a shard's: after its label's column)
        tail_ids = gather_ids if tp is None else gather_ids[:, 1:]
    if tp is not None and gather_ids is not None:
        grads, gather_ids = vp_gather_grads(labels, gather_ids, grads, params.ignore_index)
    reduce_dh = tp is not None and tp.reduce_hidden_grad
    dh, dw = head_backward(hidden_states, weight, labels, saved, grads, params, need_dh, need_dw, gather_ids,
                           dh_float32=reduce_dh, tail_ids=tail_ids)
    return (finish_hidden_grad(dh, tp, hidden_states.dtype) if reduce_dh else dh), dw


def made_slots(params: HeadParams, has_gather_ids: bool, sharded: bool) -> tuple:
    """One bool per slot of ``_SLOTS`` (``HeadOutputs``' fields, then a shard's own labels and ids):
    whether a call makes it."""
    top = params.top_k > 0
    return (True, params.return_entropy, True, params.return_sum_pi_squared, has_gather_ids, params.return_tail,
            top, top, sharded, sharded and has_gather_ids)


def linear_head(hidden_states, weight, labels, params: HeadParams, gather_ids=None, temperature=None,
                tp=None) -> HeadOutputs:
    """The family's one route, eager and compiled, sharded or not (:class:`LinearHeadFunction`):
    ``hidden_states`` (N, H), ``weight`` (V, H) (a vocab shard (V_r, H) with ``tp``), ``labels``
    (N,), optional ``gather_ids`` (N, K) (the logits at those ids too: distillation), the runtime
    temperature (None, or the 0-d tensor of a compiled graph), the vocab-parallel layout or None
    -> a ``HeadOutputs`` record (None where not asked), identical on every rank of a group."""
    made = made_slots(params, gather_ids is not None, tp is not None)
    outs = iter(LinearHeadFunction.apply(hidden_states, weight, labels, gather_ids, params, temperature, tp, made))
    return HeadOutputs(*[next(outs) if m else None for m in made[:_N_OUTPUTS]])


def gathered_logits(hidden_states, weight, ids, params: HeadParams) -> torch.Tensor:
    """(N, K) float32 z[i, k] = hidden_states[i] . weight[ids[i, k]] * inv_temperature (soft-capped
    first with ``params.softcap``)."""
    return kernels(params.backend, "linear").gathered_logits(hidden_states, weight, ids, params)


# ------------------------------------------------------------------ a vocab shard (tensor parallelism)
# The head over a shard of the vocabulary (``autograd.vocab_parallel``: layout, collectives, the
# merge of the shards' statistics and its formulas).

def vp_forward(hidden_states, weight, labels, params: HeadParams, gather_ids, tp) -> tuple:
    """:func:`forward_body` on a vocab shard: global ``labels`` (their values checked on the host
    against the whole vocabulary when it is known, unless ``params.labels_checked``) -> (slots:
    HeadOutputs' fields merged over the group, then the labels and ids of this shard that the
    backward reads; params)."""
    if not params.labels_checked and tp.vocab_size is not None:
        has_ignored = check_label_values(labels, tp.vocab_size, params.ignore_index, report_ignored=True)
        params = params._replace(may_have_ignored=has_ignored is not False)
    if gather_ids is not None:
        out, shard_labels, shard_ids = vp_gather_forward(hidden_states, weight, labels, gather_ids, params, tp)
        return (*out, shard_labels, shard_ids), params
    v_r = weight.shape[0]
    local, owned = local_labels(labels, tp.start, v_r, params.ignore_index)
    shard = head_forward(hidden_states, weight, local, params)
    z_y = gathered_logits(hidden_states, weight, torch.where(owned, local, 0)[:, None], params)[:, 0]
    log_probs, entropy, lse, sum_pi_squared = merge_shards(
        tp.process_group, shard.lse, shard.entropy, z_y, owned, labels, params.ignore_index, tp.vocab_size,
        shard.sum_pi_squared)
    # the merged entropy of ignored rows is 0 here; the backward masks those rows anyway
    return (log_probs, entropy, lse, sum_pi_squared, None, None, *vp_top(shard, tp, params.top_k), local,
            None), params


def vp_top(shard: HeadOutputs, tp, k: int) -> tuple:
    """(top_logits, top_ids) over the group from a shard's own (local ids), or (None, None) without ``k``."""
    if not k:
        return None, None
    ids = torch.where(shard.top_ids >= 0, shard.top_ids + tp.start, -1)
    values, ids, _ = gather_topk(tp.process_group, shard.top_logits, ids, shard.top_logits[:, :0], k)
    return values, ids


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
    return (HeadOutputs(log_probs, None, lse, None, z[:, 1:], tail_lse, *vp_top(shard, tp, params.top_k)),
            shard_labels, shard_ids)


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


# ------------------------------------------------------------------ the Function and its stage ops
# The forward body's slots: HeadOutputs' fields, then a shard's own labels (N,) and ids (N, 1 + K)
# for the backward (made with a layout only: the backward reads the inputs otherwise).
_SLOTS = HeadOutputs._fields + ("shard_labels", "shard_ids")
_N_OUTPUTS = len(HeadOutputs._fields)
_SAVED_NAMES = ("entropy", "lse", "sum_pi_squared", "gathered_logits", "tail_lse", "shard_labels", "shard_ids")
_SAVED = tuple(_SLOTS.index(k) for k in _SAVED_NAMES)
# the outputs with a gradient (the top K are selections: none)
_GRADS = tuple(k for k in HeadOutputs._fields if k not in ("top_logits", "top_ids"))


class LinearHeadFunction(torch.autograd.Function):
    """``apply(hidden_states, weight, labels, gather_ids, params, temperature, tp, made)`` (see
    :func:`linear_head`, which applies it; ``made``: :func:`made_slots` of the call) -> the made
    outputs, in ``HeadOutputs``' order; gradients to ``hidden_states`` and ``weight``. Eagerly the
    bodies run directly (:func:`forward_body`, whose refined record the backward then reads), while
    torch.compile traces as the ``rl_kernels::linear_forward`` / ``linear_backward`` stage ops
    (``rl_op``: the twin with a runtime temperature)."""

    @staticmethod
    def forward(ctx, hidden_states, weight, labels, gather_ids, params: HeadParams, temperature, tp, made):
        if torch.compiler.is_compiling():
            slots = rl_op("linear_forward", temperature)(hidden_states, weight, labels, gather_ids,
                                                          *OP_ARGS.pack(params, temperature, tp))
            slots = [t if m else None for t, m in zip(slots, made)]
        else:
            slots, params = forward_body(hidden_states, weight, labels, gather_ids, params, tp)
        ctx.save_for_backward(hidden_states, weight, labels, gather_ids, *[slots[j] for j in _SAVED], temperature)
        ctx.params, ctx.tp, ctx.made, ctx.fn_name = params, tp, made, params.name
        ctx.set_materialize_grads(False)
        return tuple([t for t, m in zip(slots[:_N_OUTPUTS], made) if m])

    @staticmethod
    @first_order_only
    def backward(ctx, *output_grads):
        need_dh, need_dw = ctx.needs_input_grad[:2]
        if not (need_dh or need_dw) or all(g is None for g in output_grads):
            return (None,) * 8
        *saved, temperature = ctx.saved_tensors
        given = iter(output_grads)
        grads = [next(given) if m else None for m in ctx.made[:_N_OUTPUTS]][:len(_GRADS)]
        if torch.compiler.is_compiling():
            dh, dw = rl_op("linear_backward", temperature)(*saved, *grads, need_dh, need_dw,
                                                           *BACKWARD_OP_ARGS.pack(ctx.params, temperature, ctx.tp))
            dh, dw = dh if need_dh else None, dw if need_dw else None
        else:
            dh, dw = backward_body(*saved, *grads, ctx.params, ctx.tp, need_dh, need_dw)
        return dh, dw, None, None, None, None, None, None


# The stage ops' trailing arguments: the record's fields (the backward's without those only the
# forward reads), the vocab-parallel group (``GROUP_SCHEMA``), the runtime temperature
# (``head_family.OpArgs``).
OP_ARGS = OpArgs(HeadParams)
BACKWARD_OP_ARGS = OpArgs(HeadParams, skip=("name", "labels_checked", "top_k"))


@functools.cache
def _op_samples() -> dict:
    """opcheck's samples: CPU, the torch backend; the statistics with entropy and sum_pi_squared (an
    ignored row), and the logits at given ids with the tail and the top K; each stage with the float
    and the runtime temperature (0-d and per row)."""
    from ..core.backends import get_backend

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g)
    labels = torch.tensor([3, -100, 0, 10, 7])
    ids = torch.stack([torch.randperm(11, generator=g)[:3] for _ in range(5)])
    backend = get_backend("torch", h.device)
    samples = collections.defaultdict(list)
    for inputs, params in (((h, w, labels, None), HeadParams(backend, 1 / 0.7, -100, True, return_sum_pi_squared=True)),
                           ((h, w, labels, ids), HeadParams(backend, 1 / 0.7, -100, False, "linear_topk_kl",
                                                            return_tail=True, top_k=4))):
        slots = forward_body(*inputs, params, None)[0]
        grads = [None if t is None else torch.randn(t.shape, generator=g) for t in slots[:len(_GRADS)]]
        for op, tensors, op_args, tail in (
                ("linear_forward", inputs, OP_ARGS, ()),
                ("linear_backward", (*inputs, *[slots[j] for j in _SAVED], *grads), BACKWARD_OP_ARGS, (True, True))):
            for name, sample in temperature_samples(op, tensors, op_args, params, tail, rows=5).items():
                samples[name] += sample
    return dict(samples)


_INPUTS = "Tensor hidden_states, Tensor weight, Tensor labels, Tensor? gather_ids"


@stage_op("linear_forward", f"({_INPUTS}, {OP_ARGS.schema}) -> ({', '.join(['Tensor'] * len(_SLOTS))})",
          _op_samples)
def _forward_op(hidden_states, weight, labels, gather_ids, *args):
    params, group = OP_ARGS.unpack(args)
    tp = group_from_op(*group, params.ignore_index, weight.shape[0], hidden_states.device)
    slots = forward_body(hidden_states, weight, labels, gather_ids, params, tp)[0]
    made = made_slots(params, gather_ids is not None, tp is not None)
    return or_empty([t if m else None for t, m in zip(slots, made)], hidden_states,
                    (hidden_states, weight, labels, gather_ids))


@_forward_op.register_fake
def _(hidden_states, weight, labels, gather_ids, *args):
    params, group = OP_ARGS.unpack(args, read_temperature=False)
    n, k = hidden_states.shape[0], (gather_ids.shape[1] if gather_ids is not None else 0)
    shapes = {"gathered_logits": ((n, k), torch.float32), "top_logits": ((n, params.top_k), torch.float32),
              "top_ids": ((n, params.top_k), torch.int64),
              "shard_labels": (labels.shape, labels.dtype if gather_ids is None else torch.int64),
              "shard_ids": ((n, 1 + k), gather_ids.dtype if gather_ids is not None else torch.int64)}
    made = made_slots(params, gather_ids is not None, group[0] is not None)
    out = []
    for name, m in zip(_SLOTS, made):
        shape, dtype = shapes.get(name, ((n,), torch.float32)) if m else ((0,), torch.float32)
        out.append(hidden_states.new_empty(shape, dtype=dtype))
    return tuple(out)


@stage_op("linear_backward", f"({_INPUTS}, "
                             + ", ".join(f"Tensor{'' if k == 'lse' else '?'} {k}" for k in _SAVED_NAMES) + ", "
                             + ", ".join(f"Tensor? grad_{k}" for k in _GRADS)
                             + f", bool need_dh, bool need_dw, {BACKWARD_OP_ARGS.schema}) -> (Tensor, Tensor)",
          _op_samples)
def _backward_op(*args):
    n = 4 + len(_SAVED) + len(_GRADS)
    need_dh, need_dw = args[n:n + 2]
    params, group = BACKWARD_OP_ARGS.unpack(args[n + 2:])
    dh, dw = backward_body(*args[:n], params, group_from_op(*group), need_dh, need_dw)
    hidden_states, weight = args[:2]  # (dh and dW are new tensors: never an input's storage)
    return dh.contiguous() if need_dh else hidden_states.new_empty(0), dw.contiguous() if need_dw else weight.new_empty(0)


@_backward_op.register_fake
def _(hidden_states, weight, *args):
    need_dh, need_dw = args[2 + len(_SAVED) + len(_GRADS):][:2]
    return hidden_states.new_empty(hidden_states.shape if need_dh else (0,)), \
        weight.new_empty(weight.shape if need_dw else (0,))
