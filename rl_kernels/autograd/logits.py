"""Autograd of the from-logits statistics: one Function for every public from-logits function.

The head family "logits": its parameter record (``LogitsParams``), output record
(``LogitsOutputs``), its bodies on the backend's ``forward`` / ``backward`` (``ops.logits`` or
``torch_ops.logits``) and its one
Function, ``LogitsStatsFunction`` (the bodies called directly eagerly, and as the
``rl_kernels::logits_forward`` / ``logits_backward`` stage ops while torch.compile traces).
Forward: one read of the logits (Triton ``ops.logits_forward`` or its torch twin
``torch_ops.logits``) gives per-row float32 statistics; only O(N) of them are saved.
Backward: one more read of the logits writes d loss / d logits once, in the logits' dtype (into
the logits' own storage with ``inplace_backward``, reported to autograd by a version bump).

The top-K log-probs of ``rl_kernels.topk_log_probs_from_logits`` / ``topk_kl_from_logits`` are
the same Function with token ids: the forward's lse with K gathered logits (and, with
``return_tail``, the log-probability outside the K ids), and a backward that writes one N x V
gradient (the family's backward with the lse's share, then the K columns of each row: see "top-K
log-probs" below); on a vocab shard too ("top-K on a vocab shard")."""
from __future__ import annotations

import collections
import functools
import logging
from typing import NamedTuple

import torch

from ..core._logging import log_once
from ..core.backends import Backend
from ..core.label_check import deferred_label_check, raise_if_interpreted, raise_label_errors
from ..core.validation import check_label_values, check_token_id_values
from .head_family import (OpArgs, as_float_grad, first_order_only, kernels, or_empty, plain_op, rl_op, sorted_tail_ids,
                          stage_op, sum_over_equal_ids, temperature_samples)
from .positions import check_tail_teacher
from .vocab_parallel import all_gather_rows, group_from_op, local_labels, merge_lse, merge_shards


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
    # across calls (ops.logits.row_counters); off in the custom ops' bodies (torch.compile),
    # where inductor's CUDA-graph trees warm up in a private memory pool that no tensor may outlive
    combine_in_one_launch: bool = True
    # with token ids: also the log-probability outside each row's K ids (``tail_log_probs``); the
    # ids must then be distinct in every row that counts (ValueError naming ``ids_name``)
    return_tail: bool = False
    ids_name: str = "token_ids"  # the public argument that holds the token ids (error messages)


class LogitsOutputs(NamedTuple):
    """Per-row float32 outputs of the from-logits Function, (N,) each but ``topk_log_probs``
    (N, K), the same fields for its gradients; None where not asked (lse always)."""

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    lse: torch.Tensor | None
    mean_log_p: torch.Tensor | None = None
    sum_pi_squared: torch.Tensor | None = None
    topk_log_probs: torch.Tensor | None = None  # at the K token ids per row given to the Function
    tail_log_probs: torch.Tensor | None = None  # (N,): log of the probability outside those K ids


def forward_body(logits, labels, token_ids, params: LogitsParams, tp=None) -> tuple:
    """The family's forward as one backend call runs it: a bad label reported
    by an earlier call raised, this call's label values checked (in the Triton kernel without a host
    sync, else on the host), the statistics (the backend's ``forward``). With ``tp`` (a vocab
    shard, global labels checked on the host against the whole vocabulary when it is known) the
    shard's statistics merged over the group (:func:`vp_forward`). With ``token_ids`` (N, K) int64
    (checked by the caller without ``tp``; global ids with ``tp``, checked in
    :func:`vp_topk_forward`) also ``topk_log_probs``, z[ids] - lse, and with ``params.return_tail``
    ``tail_log_probs`` = tail_lse - lse (at most 0; the backend's, formed without rounding at the
    lse's magnitude; the Function's backward is written by hand, so that clamp zeroes no gradient)
    and ``tail_lse`` (the ids distinct in every row that counts: :func:`check_distinct_ids`);
    ``labels`` then only mark the rows to ignore (not checked here: the callers pass checked ids or
    ``ignore_index``). -> one tensor or None per slot of ``_STAT_KEYS``, in order."""
    raise_label_errors()  # a bad label that an earlier call's kernel reported
    if token_ids is not None and params.inplace_backward:
        raise NotImplementedError(f"rl_kernels.{params.name}: token ids with inplace_backward")
    if params.return_tail:
        if token_ids is None or params.return_entropy or params.return_mean_log_p or params.return_sum_pi_squared:
            raise NotImplementedError(f"rl_kernels.{params.name}: the tail without token ids, or with other "
                                      f"statistics (entropy, mean log p, sum of squared probabilities)")
        check_distinct_ids(token_ids, labels, params)
    if tp is not None and token_ids is not None:
        stats = vp_topk_forward(logits, labels, params, tp, token_ids)
    elif tp is not None:
        if labels is not None and tp.vocab_size is not None:
            check_label_values(labels, tp.vocab_size, params.ignore_index)
        stats = vp_forward(logits, labels, params, tp)
    else:
        label_check = None
        if labels is not None and token_ids is None:
            label_check = deferred_label_check(labels, logits.shape[-1], params.ignore_index, params.name,
                                               in_kernel=params.backend.checks_labels_in_kernel)
        tail_ids = sorted_tail_ids(token_ids) if params.return_tail else None
        stats = kernels(params.backend, "logits").forward(logits, labels, params, label_check, tail_ids)
        raise_if_interpreted(label_check, logits.device)
        if token_ids is not None:  # (the labels only mark rows: their log-probs are not an output)
            stats.pop("log_probs", None)
            stats["topk_log_probs"] = gather_logits(logits, token_ids, params.inv_temperature) - stats["lse"][:, None]
    return tuple(map(stats.get, _STAT_KEYS))


def check_distinct_ids(token_ids, labels, params: LogitsParams) -> None:
    """ValueError naming ``params.ids_name`` when a row that counts (``labels`` None, or not
    ``ignore_index``) holds an id twice: the tail is the probability outside K distinct ids
    (``positions.check_tail_teacher``: one sort of the (N, K) ids and one host read)."""
    if token_ids.shape[1] < 2 or not token_ids.numel():
        return
    valid = torch.ones(token_ids.shape[0], dtype=torch.bool, device=token_ids.device) if labels is None \
        else labels != params.ignore_index
    check_tail_teacher(token_ids, None, valid, params.ids_name)


def backward_body(logits, labels, token_ids, entropy, lse, sum_pi_squared, row_max, log_sum, shard_labels, tail_lse,
                  shard_ids, grad_log_probs, grad_entropy, grad_lse, grad_mean_log_p, grad_sum_pi_squared,
                  grad_topk_log_probs, grad_tail_log_probs, params: LogitsParams, tp):
    """The family's backward (the saved inputs and slots, one upstream gradient or
    None per output, float32 here) -> d loss / d logits (:func:`dlogits`); a shard's own labels or
    ids where the forward made them."""
    grads = {k: as_float_grad(g) for k, g in zip(LogitsOutputs._fields, (
        grad_log_probs, grad_entropy, grad_lse, grad_mean_log_p, grad_sum_pi_squared, grad_topk_log_probs,
        grad_tail_log_probs)) if g is not None}
    stats = {"row_max": row_max, "log_sum": log_sum, "lse": lse, "entropy": entropy, "sum_pi_squared": sum_pi_squared,
             "tail_lse": tail_lse}
    return dlogits(logits, labels if shard_labels is None else shard_labels, stats, grads, params, tp,
                   token_ids if shard_ids is None else shard_ids)


def dlogits(logits, labels, stats: dict, grads: dict, params: LogitsParams, tp=None, token_ids=None):
    """d loss / d logits from the forward's ``stats`` and the float32 upstream ``grads`` (both
    dicts keyed as ``LogitsOutputs``' fields; ``stats["lse"]`` with ``token_ids``, and
    ``stats["tail_lse"]`` with the tail; ``labels``: a shard's own with ``tp``; ``token_ids``: a
    shard's own, -1 where another shard owns the id, with ``tp``): into the logits' own storage
    with ``inplace_backward`` (reported to autograd by a version bump), else a new tensor in the
    logits' dtype; a vocab shard's by :func:`vp_backward` (with token ids: this same path on the
    merged statistics, the shard's own ids); with a gradient of ``topk_log_probs`` or
    ``tail_log_probs`` the K columns of each row by :func:`topk_columns`."""
    raise_label_errors()  # a bad label reported by this call's (or an earlier) forward kernel
    if tp is not None and token_ids is None:
        return vp_backward(logits, labels, stats, LogitsOutputs(*(grads.get(k) for k in LogitsOutputs._fields)),
                           params)
    grads = dict(grads)
    grad_topk = grads.pop("topk_log_probs", None)
    grad_tail = grads.pop("tail_log_probs", None)
    if grad_topk is not None:  # d lse / dz = p: the K log-probs' share of the softmax term
        grad_lse = -grad_topk.sum(1)
        grads["lse"] = grad_lse if grads.get("lse") is None else grads["lse"] + grad_lse
    if grad_tail is not None:  # log q_tail = tail_lse - lse
        grads["lse"] = -grad_tail if grads.get("lse") is None else grads["lse"] - grad_tail
        grads["tail_lse"] = grad_tail
    # documented: with inplace_backward the logits' storage receives their gradient
    grad = logits if params.inplace_backward else torch.empty_like(logits, memory_format=torch.contiguous_format)
    kernels(params.backend, "logits").backward(logits, grad, labels, stats, grads, params)
    if grad_topk is not None or grad_tail is not None:
        topk_columns(grad, logits, token_ids, labels, stats["lse"], grad_topk, grads, params, shard=tp is not None)
    if params.inplace_backward:
        # the kernel wrote through a raw pointer: tell autograd the logits changed, so that any
        # other saved use of them (a second consumer, retain_graph and a second backward)
        # raises torch's "modified by an inplace operation" error instead of reading gradients
        torch.autograd.graph.increment_version(logits)
    return grad


# ------------------------------------------------------------------ a vocab shard (tensor parallelism)
# The statistics of logits sharded over the vocabulary (``autograd.vocab_parallel``: layout,
# collectives, the merge of the shards' statistics and its formulas). The forward's stats hold the
# merged lse as ``row_max`` with a zero ``log_sum`` (lse = row_max + log_sum, as the kernels read
# them), so that the backward's softmax is the global one on every shard.

def vp_forward(logits, labels, params: LogitsParams, tp) -> dict:
    """The vocab-parallel forward without autograd: the stats dict of :func:`forward_body` merged
    over the group (log_probs with labels, entropy and sum_pi_squared when asked, lse, row_max,
    log_sum) and, with labels, ``shard_labels``: the labels shifted into this shard
    (``local_labels``), which the backward reads. ``return_mean_log_p`` is not served here."""
    if params.return_mean_log_p:
        raise NotImplementedError("mean_log_p over a vocab shard")
    v_r = logits.shape[1]
    stats = kernels(params.backend, "logits").forward(logits, None, params)
    if labels is not None:
        local, owned = local_labels(labels, tp.start, v_r, params.ignore_index)
        z_y = logits.gather(1, torch.where(owned, local, 0).long()[:, None])[:, 0].float() * params.inv_temperature
        # (a per-row inv_temperature (N,) multiplies row by row)
    else:
        owned = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        z_y = torch.zeros(logits.shape[0], device=logits.device)
    log_probs, entropy, lse, sum_pi_squared = merge_shards(
        tp.process_group, stats["lse"], stats.get("entropy"), z_y, owned, labels, params.ignore_index,
        tp.vocab_size, stats.get("sum_pi_squared"))
    out = {"log_probs": log_probs, "entropy": entropy, "lse": lse, "sum_pi_squared": sum_pi_squared,
           "row_max": lse, "log_sum": torch.zeros_like(lse)}
    if labels is not None:
        out["shard_labels"] = local
    return {k: t for k, t in out.items() if t is not None}


def vp_backward(logits, local, stats: dict, g: LogitsOutputs, params: LogitsParams) -> torch.Tensor:
    """d loss / d logits of the shard (a new tensor in the logits' dtype) from the merged
    statistics (:func:`vp_forward`'s) and the upstream gradients ``g``; ``local``: the forward's
    shard labels or None."""
    zero = torch.zeros((), device=logits.device)
    valid = (local != params.ignore_index) if local is not None else None
    lse = stats["row_max"]
    # onehot(y) - p on the shard: the -p part folds into the lse coefficient on every rank, the
    # onehot part is added below on the owner's column only
    coef = g.lse.float() if g.lse is not None else torch.zeros(lse.shape, device=lse.device)
    grad_log_probs = None
    if g.log_probs is not None:
        grad_log_probs = torch.where(valid, g.log_probs.float(), zero)
        coef = coef - grad_log_probs
    grads = {"lse": coef.contiguous()}
    if g.entropy is not None:
        grads["entropy"] = (torch.where(valid, g.entropy.float(), zero) if valid is not None
                            else g.entropy.float()).contiguous()
    shard_stats = {"row_max": lse, "log_sum": stats["log_sum"]}
    if stats.get("entropy") is not None:
        shard_stats["entropy"] = stats["entropy"]
    if g.sum_pi_squared is not None:  # global p = exp(z - lse) and global S on every shard
        shard_stats["sum_pi_squared"] = stats["sum_pi_squared"]
        grads["sum_pi_squared"] = g.sum_pi_squared.float().contiguous()
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    # labels for the shard kernel: only the ignored / kept mask (id -1 ... matches no column,
    # and no log-prob gradient is passed: the onehot part is added below)
    row_labels = None if local is None else torch.where(valid, -1 if params.ignore_index != -1 else -2,
                                                        params.ignore_index)
    kernels(params.backend, "logits").backward(logits, grad, row_labels, shard_stats, grads, params)
    if grad_log_probs is not None:
        owned = valid & (local >= 0) & (local < logits.shape[1])  # (ignore_index is negative here)
        rows = owned.nonzero()[:, 0]
        cols = local[rows].long()
        inv_temperature = params.inv_temperature
        if isinstance(inv_temperature, torch.Tensor):  # per row
            inv_temperature = inv_temperature[rows]
        grad[rows, cols] += (grad_log_probs[rows] * inv_temperature).to(grad.dtype)
    return grad


# ------------------------------------------------------------------ top-K on a vocab shard
# Each rank runs the family's forward on its shard (lse_r and, with the tail, the shard's row max
# m_r, log-sum ls_r and tail log-probability t_r over its columns outside the row's ids) and
# gathers its owned logits at the K global ids; ONE all_gather of (N, 1 + 2K) float32 (lse_r, z at
# the owned ids (0 elsewhere), owned as 0 / 1; with the tail (N, 4 + 2K): m_r, ls_r, t_r too)
# gives every rank the same tensor, merged in rank order by the same code, so every rank returns
# the same bits: lse = logsumexp_r lse_r (``merge_lse``), z_k = the owner's value (a sum of one
# value and zeros: exact), log q_k = z_k - lse and, with a_r = (m_r - max_r m_r) + ls_r (the
# shard's log-mass up to a common shift, no term of the lse's magnitude),
# log q_tail = logsumexp_r (a_r + t_r) - logsumexp_r a_r, tail_lse = lse + log q_tail. The
# backward is the single-process one on the shard with the merged lse (as the saved row max,
# log-sum 0) and tail_lse, the shard's own ids (-1 where another shard owns one): every rank gets
# its shard's gradient of the same loss (the Megatron convention).

def vp_topk_forward(logits, labels, params: LogitsParams, tp, token_ids) -> dict:
    """:func:`forward_body` with ``token_ids`` (N, K) int64 global ids on a vocab shard ``logits``
    (N, V_r): the stats dict (lse, topk_log_probs, with the tail tail_log_probs and tail_lse,
    row_max = lse, log_sum = 0) and ``shard_ids`` (N, K) int64, the ids local to this shard or -1.
    ``labels`` only mark ignored rows. Ids are checked against the whole vocabulary when it is known
    (no ``vocab_start_index``), and every id must be owned by exactly one shard (ValueError naming
    ``params.ids_name``)."""
    if tp.vocab_size is not None:
        check_token_id_values(token_ids, tp.vocab_size, params.ids_name)
    n, v_r = logits.shape
    local = token_ids - tp.start
    owned = (local >= 0) & (local < v_r)
    shard_ids = torch.where(owned, local, -1)
    tail_ids = sorted_tail_ids(token_ids, tp.start, v_r) if params.return_tail else None
    stats = kernels(params.backend, "logits").forward(logits, None, params, None, tail_ids)
    z = gather_logits(logits, shard_ids.clamp_min(0), params.inv_temperature) if v_r else \
        torch.zeros(token_ids.shape, device=logits.device)
    zero = torch.zeros((), device=logits.device)
    rows = [stats["lse"]] + ([stats["row_max"], stats["log_sum"], stats["tail_log_probs"]] if tail_ids is not None
                             else [])
    part = torch.cat([torch.stack(rows, 1), torch.where(owned, z, zero), owned.float()], 1)
    gathered = all_gather_rows(tp.process_group, part)  # (W, N, len(rows) + 2K)
    k, c = token_ids.shape[1], len(rows)
    count = gathered[:, :, c + k:].sum(0)
    bad = count != 1
    if bool(bad.any()):
        i = int(bad.reshape(-1).nonzero()[0, 0])
        raise ValueError(f"{params.ids_name}: {int(bad.sum())} ids are held by no shard or by several; first at "
                         f"flat position {i}: id {int(token_ids.reshape(-1)[i])} is in {int(count.reshape(-1)[i])} "
                         f"shards" + (f" (vocab_size {tp.vocab_size})" if tp.vocab_size is not None else
                                      " (check vocab_start_index)"))
    lse = merge_lse(gathered[:, :, 0])[0]
    out = {"lse": lse, "topk_log_probs": gathered[:, :, c:c + k].sum(0) - lse[:, None], "row_max": lse,
           "log_sum": torch.zeros_like(lse), "shard_ids": shard_ids}
    if tail_ids is not None:  # (section comment: no term of the lse's magnitude is rounded)
        m_w, ls_w, t_w = gathered[:, :, 1], gathered[:, :, 2], gathered[:, :, 3]
        top = m_w.amax(0)
        top = torch.where(torch.isfinite(top), top, zero)
        a_w = (m_w - top) + ls_w  # -inf for a shard without mass (its t_r, NaN there, is not read)
        t_w = torch.where(a_w > float("-inf"), t_w, zero)
        out["tail_log_probs"] = (torch.logsumexp(a_w + t_w, 0) - torch.logsumexp(a_w, 0)).clamp_max(0.0)
        out["tail_lse"] = lse + out["tail_log_probs"]
    return out


# ------------------------------------------------------------------ the Function and its stage ops
# The forward body's slots, in order: ``LogitsOutputs``' fields (the outputs), then the state the
# backward reads: the row max and log-sum, a shard's own labels, the tail's lse, a shard's own ids.
_STAT_KEYS = ("log_probs", "entropy", "lse", "mean_log_p", "sum_pi_squared", "topk_log_probs", "row_max", "log_sum",
              "shard_labels", "tail_log_probs", "tail_lse", "shard_ids")
_SAVED = ("entropy", "lse", "sum_pi_squared", "row_max", "log_sum", "shard_labels", "tail_lse", "shard_ids")


def made_slots(params: LogitsParams, has_labels: bool, has_token_ids: bool, sharded: bool) -> tuple:
    """One bool per slot of ``_STAT_KEYS``: whether a call makes it (lse, row max and log-sum always;
    with token ids their log-probs and, with ``return_tail``, the tail's, and no log-probs at the
    labels, which then only mark ignored rows; a shard's own labels or ids with a layout)."""
    tail = has_token_ids and params.return_tail
    return (has_labels and not has_token_ids, params.return_entropy, True, params.return_mean_log_p,
            params.return_sum_pi_squared, has_token_ids, True, True, sharded and has_labels and not has_token_ids,
            tail, tail, sharded and has_token_ids)


def asked_outputs(params: LogitsParams, has_labels: bool, has_token_ids: bool = False) -> tuple:
    """The ``LogitsOutputs`` fields a call computes, in order: what :class:`LogitsStatsFunction`
    returns, no None among them (torch.compile's tracing of a Function handles tensors only)."""
    made = dict(zip(_STAT_KEYS, made_slots(params, has_labels, has_token_ids, False)))
    return tuple([k for k in LogitsOutputs._fields if made[k]])


def logits_forward_call(logits, labels, token_ids, params: LogitsParams, temperature=None, tp=None) -> tuple:
    """The forward alone (no autograd node): one tensor or None per slot of ``_STAT_KEYS``; the body
    directly eagerly, the ``rl_kernels::logits_forward`` op while torch.compile traces
    (``temperature``: None or the runtime temperature of a compiled graph)."""
    if not torch.compiler.is_compiling():
        return forward_body(logits, labels, token_ids, params, tp)
    slots = rl_op("logits_forward", temperature)(logits, labels, token_ids, *OP_ARGS.pack(params, temperature, tp))
    made = made_slots(params, labels is not None, token_ids is not None, tp is not None)
    return tuple([t if m else None for t, m in zip(slots, made)])


class LogitsStatsFunction(torch.autograd.Function):
    """``apply(logits (N, V), labels (N,) or None, token_ids (N, K) int64 or None, params, temperature,
    tp)`` -> the outputs :func:`asked_outputs` names, in that order, float32, (N,) each and (N, K) at
    the token ids, identical on every rank of a group (``tp``: the vocab-parallel layout, the logits
    a shard (N, V_r); or None); the gradient to the logits only. ``temperature``: None or the runtime
    temperature of a compiled graph (``head_family.split_temperature``; per row only without token
    ids). Only O(N) statistics are saved."""

    @staticmethod
    def forward(ctx, logits, labels, token_ids, params: LogitsParams, temperature, tp):
        if torch.compiler.is_compiling():
            slots = logits_forward_call(logits, labels, token_ids, params, temperature, tp)
        else:
            slots = forward_body(logits, labels, token_ids, params, tp)
        stats = dict(zip(_STAT_KEYS, slots))
        ctx.save_for_backward(logits, labels, token_ids, *[stats[k] for k in _SAVED], temperature)
        ctx.params, ctx.tp, ctx.fn_name = params, tp, params.name
        ctx.asked = asked_outputs(params, labels is not None, token_ids is not None)
        ctx.set_materialize_grads(False)
        return tuple([stats[k] for k in ctx.asked])

    @staticmethod
    @first_order_only
    def backward(ctx, *output_grads):
        if not ctx.needs_input_grad[0] or all(g is None for g in output_grads):
            return None, None, None, None, None, None
        *saved, temperature = ctx.saved_tensors
        given = dict(zip(ctx.asked, output_grads))
        grads = [given.get(k) for k in LogitsOutputs._fields]
        if torch.compiler.is_compiling():
            grad = rl_op("logits_backward", temperature)(*saved, *grads, *OP_ARGS.pack(ctx.params, temperature, ctx.tp))
        else:
            grad = backward_body(*saved, *grads, ctx.params, ctx.tp)
        return grad, None, None, None, None, None


# The stage ops (torch.compile's route; autograd is the Function's on both routes): their bodies
# call the same bodies, with the record as :func:`_in_op` makes it. ``inplace_backward`` is not
# honoured by the ops (a custom op cannot return its input's storage as a new gradient; the forward
# op says so once). Trailing arguments: the record's fields, the vocab-parallel group
# (``GROUP_SCHEMA``), the runtime temperature (``head_family.OpArgs``).
OP_ARGS = OpArgs(LogitsParams)


def _in_op(params: LogitsParams, forward: bool) -> LogitsParams:
    """The record as the ops' bodies use it: ``inplace_backward`` off (asked, it is reported once by
    the forward op and not honoured: this route's gradient is a new tensor) and the two-level
    forward combining in a second launch (no state kept across calls: see ``combine_in_one_launch``)."""
    if forward and params.inplace_backward:
        log_once(logging.WARNING, f"rl_kernels.{params.name}: inplace_backward=True is not honoured under "
                 f"torch.compile; the gradient is written to a new tensor (the same values)")
    return params._replace(inplace_backward=False, combine_in_one_launch=False)


@functools.cache
def _op_samples() -> dict:
    """opcheck's samples: CPU, the torch backend; the statistics at labels (one row ignored; the
    temperature per row too), and the top-K log-probs with the tail (the labels marking an ignored
    row); each stage with the float and the runtime temperature."""
    from ..core.backends import get_backend

    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(5, 11, generator=g), torch.tensor([3, -100, 0, 10, 7])
    ids = torch.tensor([[0, 10, 3], [5, 4, 1], [2, 9, 8], [6, 7, 0], [1, 2, 3]])
    backend = get_backend("torch", logits.device)
    stats = LogitsParams(backend, 1 / 0.7, -100, True, "logits_stats", return_mean_log_p=True,
                         return_sum_pi_squared=True)
    topk = LogitsParams(backend, 1 / 0.7, -100, False, "topk_kl_from_logits", return_tail=True)
    samples = collections.defaultdict(list)
    for inputs, params, rows in (((logits, labels, None), stats, 5), ((logits, labels, ids), topk, None)):
        slots = dict(zip(_STAT_KEYS, forward_body(*inputs, params)))
        grads = [None if slots[k] is None else torch.randn(slots[k].shape, generator=g) for k in LogitsOutputs._fields]
        for op, tensors in (("logits_forward", inputs), ("logits_backward", (*inputs, *[slots[k] for k in _SAVED], *grads))):
            for name, sample in temperature_samples(op, tensors, OP_ARGS, params, rows=rows).items():
                samples[name] += sample
    return dict(samples)


@stage_op("logits_forward", f"(Tensor logits, Tensor? labels, Tensor? token_ids, {OP_ARGS.schema}) -> "
                            f"({', '.join(['Tensor'] * len(_STAT_KEYS))})", _op_samples)
def _forward_op(logits, labels, token_ids, *args):
    params, group = OP_ARGS.unpack(args)
    params = _in_op(params, True)
    tp = group_from_op(*group, params.ignore_index, logits.shape[1], logits.device, False)
    return or_empty(forward_body(logits, labels, token_ids, params, tp), logits, (logits, labels, token_ids))


@_forward_op.register_fake
def _(logits, labels, token_ids, *args):
    params, group = OP_ARGS.unpack(args, read_temperature=False)
    made = made_slots(params, labels is not None, token_ids is not None, group[0] is not None)
    rows = (logits.shape[0],)
    like = {"topk_log_probs": (token_ids, torch.float32), "shard_labels": (labels, None),
            "shard_ids": (token_ids, torch.int64)}
    return tuple([logits.new_empty(0, dtype=torch.float32) if not m
                  else logits.new_empty(like[k][0].shape, dtype=like[k][1] or like[k][0].dtype) if k in like
                  else logits.new_empty(rows, dtype=torch.float32) for k, m in zip(_STAT_KEYS, made)])


@stage_op("logits_backward", "(Tensor logits, Tensor? labels, Tensor? token_ids, "
                             + ", ".join(f"Tensor{'' if k in ('lse', 'row_max', 'log_sum') else '?'} {k}" for k in _SAVED)
                             + ", " + ", ".join(f"Tensor? grad_{k}" for k in LogitsOutputs._fields)
                             + f", {OP_ARGS.schema}) -> Tensor", _op_samples)
def _backward_op(*args):
    n = 3 + len(_SAVED) + len(LogitsOutputs._fields)
    params, group = OP_ARGS.unpack(args[n:])
    # (_in_op turns inplace_backward off: the gradient is a new tensor, never the logits' storage)
    return backward_body(*args[:n], _in_op(params, False), group_from_op(*group)).contiguous()


@_backward_op.register_fake
def _(logits, *args):
    return logits.new_empty(logits.shape)


# ------------------------------------------------------------------ top-K log-probs of the logits
# log softmax(z)[ids] with z = logits * inv_temperature, for K given ids per row (the Function's
# ``token_ids``): the lse comes from the family's forward (one read of the logits, O(N) saved); the
# K values are z[ids] - lse. Backward, from the softmax derivative (d lse / dz = p): with g the
# (N, K) upstream gradient,
#     d/dz_j = p_j g_lse + sum_{k: ids_k = j} g_k,    g_lse = -sum_k g_k,
# so the family's backward writes p_j g_lse (times inv_temperature) into the one N x V gradient,
# with the other statistics' terms when their gradients come too, and then the K columns of each
# row get the sparse term (:func:`topk_columns`). Duplicate ids are summed first (in float64, over
# the row's K slots), so every slot of an id writes the same value (no atomic add into the
# gradient; float64 sums of a few float32 values round to the same float32 whatever their order,
# but for a double-rounding tie).
# The tail (``return_tail``; verl RFC #7856): log q_tail = tail_lse - lse, tail_lse the logsumexp of
# z over the columns NOT among the row's ids, computed by the kernels with those columns at -inf (no
# 1 - sum_k q_k cancellation: q_tail ~ 1e-30 keeps its digits). With g_t its gradient,
#     d/dz_j = p_j g_lse + sum_{k: ids_k = j} g_k + g_t [j outside the ids] exp(z_j - tail_lse),
#     g_lse = -sum_k g_k - g_t,
# the family's backward adds g_t exp(z_j - tail_lse) at every column (no mask), and the K columns,
# whose tail term is 0, are then overwritten by :func:`topk_columns` with (p g_lse + sums) / T,
# which holds no tail term. The ids must be distinct per row (:func:`check_distinct_ids`).


def gather_logits(logits, token_ids, inv_temperature: float) -> torch.Tensor:
    """z[i, token_ids[i, k]] in float32: ``logits`` (N, V) at (N, K) int64 ids, scaled as the
    kernels scale them (converted to float32, then times ``inv_temperature``)."""
    return logits.gather(1, token_ids).float() * inv_temperature


def topk_columns(grad, logits, token_ids, labels, lse, grad_topk, grads: dict, params: LogitsParams,
                 shard: bool = False) -> None:
    """The K columns of each row of ``grad`` (N x V, the logits' dtype), after the family's
    backward wrote it with ``grads`` (the lse's gradient holding g_lse = -sum_k g_k, minus g_t with
    a tail gradient ``grads["tail_lse"]`` = g_t): when the lse (and the tail's lse) was the only
    gradient there, those columns are overwritten with their whole value, (p g_lse + the sum of g
    over the slots with that id) / T, computed in float32 and rounded once (no tail term: the K
    columns are not in the tail); when other statistics' gradients came too (never with the tail),
    the sparse term is added to what the family wrote (rounded twice there). ``grad_topk``: (N, K)
    or None (the tail's gradient alone). ``labels``: None, or (N,) whose ``ignore_index`` rows keep
    exactly what the family wrote (0 for the lse alone) unless g_lse or g_t != 0 there. ``shard``:
    ``token_ids`` are a vocab shard's own, -1 where another shard owns the id (not written)."""
    grad_lse = grads["lse"]
    # (before the shard's -1 ids become 0 below: they must not join a real id 0's slots)
    sums = sum_over_equal_ids(token_ids, grad_topk) if grad_topk is not None else None
    if shard:  # a slot of another shard writes column 0 with the value column 0 ends with (below)
        if grad.shape[1] == 0:
            return
        owned = token_ids >= 0
        token_ids = token_ids.clamp_min(0)
    if grads.keys() <= {"lse", "tail_lse"}:
        p = (gather_logits(logits, token_ids, params.inv_temperature) - lse[:, None]).exp()
        values = p * grad_lse[:, None]
        values, kept = (values if sums is None else values + sums) * params.inv_temperature, 0.0
    else:
        kept = grad.gather(1, token_ids).float()
        values = kept + sums * params.inv_temperature
    if labels is not None:
        active = (labels != params.ignore_index) | (grad_lse != 0)
        if "tail_lse" in grads:
            active |= grads["tail_lse"] != 0
        values = torch.where(active[:, None], values, kept)
    values = values.to(grad.dtype)
    if shard:  # column 0's final value: that of an owned slot with id 0, else what the family wrote
        at_zero = owned & (token_ids == 0)
        first = at_zero.to(torch.int8).argmax(1, keepdim=True)
        zero_value = torch.where(at_zero.any(1, keepdim=True), values.gather(1, first), grad[:, :1])
        values = torch.where(owned, values, zero_value)
    grad.scatter_(1, token_ids, values)


def topk_log_probs(logits, token_ids, labels, params: LogitsParams, temperature=None, tp=None) -> tuple:
    """(log-probs (N, K) float32, tail log-probs (N,) float32 or None) of 2-D ``logits`` at int64
    ``token_ids`` (N, K) (checked; global ids with ``tp``, a vocab shard's layout, checked there)
    (``labels``: None, or (N,) marking the rows to ignore); the tail with ``params.return_tail``:
    the family's Function with the ids when a gradient is wanted, its forward alone otherwise
    (:func:`logits_forward_call`; eager: no autograd node). ``temperature``: the runtime temperature of
    a compiled graph (``autograd.head_family.split_temperature``) or None."""
    if torch.is_grad_enabled() and logits.requires_grad:
        outs = LogitsStatsFunction.apply(logits, labels, token_ids, params, temperature, tp)
        return (outs[-2], outs[-1]) if params.return_tail else (outs[-1], None)
    slots = logits_forward_call(logits, labels, token_ids, params, temperature, tp)
    return slots[_TOPK], slots[_TAIL]


_TOPK, _TAIL = _STAT_KEYS.index("topk_log_probs"), _STAT_KEYS.index("tail_log_probs")


@plain_op("rl_kernels::checked_token_ids",
          schema="(Tensor token_ids, SymInt vocab_size, str name, Tensor? tail_valid=None) -> Tensor",
          examples=lambda: [(torch.tensor([[0, 10, 3], [5, 5, 1]]), 11, "token_ids"),
                            (torch.tensor([[0, 10, 3], [5, 5, 1]]), 11, "token_ids", torch.tensor([True, False]))])
def _checked_token_ids_op(token_ids, vocab_size, name, tail_valid=None):
    """torch.compile's route of the id checks: ValueError as in eager (the host reads the ids inside
    this opaque op) -> the ids as a new int64 tensor, which the traced function then gathers with
    (so the op is not dropped as unused)."""
    _check_ids(token_ids, vocab_size, name, tail_valid)
    return token_ids.to(torch.int64, copy=True)


@_checked_token_ids_op.register_fake
def _(token_ids, vocab_size, name, tail_valid=None):
    return token_ids.new_empty(token_ids.shape, dtype=torch.int64)


def _check_ids(token_ids, vocab_size, name, tail_valid) -> None:
    check_token_id_values(token_ids, vocab_size, name)
    if tail_valid is not None:
        check_tail_teacher(token_ids, None, tail_valid, name)


def checked_token_ids(token_ids, vocab_size: int, name: str, tail_valid=None) -> torch.Tensor:
    """``token_ids`` as int64 after the value check against ``vocab_size`` and, with ``tail_valid``
    ((N,) bool: the counted positions), the tail's distinct-ids check (``positions.check_tail_teacher``);
    eager: on the host here; compiled: in the ``rl_kernels::checked_token_ids`` op's body."""
    if torch.compiler.is_compiling():
        return torch.ops.rl_kernels.checked_token_ids(token_ids, vocab_size, name, tail_valid)
    _check_ids(token_ids, vocab_size, name, tail_valid)
    return token_ids.long()
