"""Log-probs, entropy, logsumexp and cross-entropy from already-materialized logits.

Two backends compute the same per-row statistics from one read of the logits and save only O(N)
state for backward, which reads the logits once more and writes the gradient once, in the logits
dtype (optionally into the logits' own storage):

* ``triton`` (CUDA, or Triton's CPU interpreter): ``rl_kernels.ops.logits``, a one-level
  online-softmax kernel for many rows and a two-level split (per-split partials, then a combine)
  for few rows, chosen automatically and bitwise identical to each other;
* ``torch`` (any device): ``rl_kernels.torch_ops.logits``, float32 row chunks.

Torch eager (verl's ``logprobs_from_logits`` + ``entropy_from_logits``) instead keeps several
N x V copies (softmax, ``softmax * logits``, per-row log-softmax outputs) alive until backward.

Formulas (z = logits / temperature, p = softmax(z), lse = logsumexp(z)):
    log p_y = z_y - lse
    H = -sum_j p_j log p_j                       (computed as log s - b / s: no cancellation)
    d log p_y / dz = onehot(y) - p,   d lse / dz = p,   dH/dz_j = -p_j (log p_j + H)
    cross-entropy with label smoothing eps: (1 - eps) (-log p_y) + eps (-(1/V) sum_j log p_j)
Top-K log-probs at K given ids per row (distillation from a top-K teacher): log p_{id_k} =
z_{id_k} - lse, with gradient d/dz_j = p_j g_lse + sum_{k: id_k = j} g_k, g_lse = -sum_k g_k (the
lse from the same kernels; no N x V tensor in forward, the gradient alone in backward:
``rl_kernels.autograd.logits``, section "top-K log-probs"), and the log-probability outside the K
ids, log q_tail = tail_lse - lse with tail_lse the logsumexp of z over the other columns (the
tail-aware top-K KL of verl RFC #7856).
And d/dlogits = (d/dz) / temperature. Sources: the softmax derivative d p_j / dz_k = p_j ([j == k]
- p_k), from which the three gradients follow (dH/dz_k = -sum_j (1 + log p_j) dp_j/dz_k); label
smoothing as in Szegedy et al. 2016 ("Rethinking the Inception Architecture", sec. 7) and
``torch.nn.functional.cross_entropy``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .autograd.common import split_temperature
from .autograd.logits import (LogitsOutputs, LogitsParams, LogitsStatsFunction, asked_outputs, checked_token_ids,
                              forward_call, topk_log_probs)
from .autograd.vocab_parallel import parallel_params
from .backends import get_backend
from .autograd.positions import checked_positions
from .distill import KINDS, REDUCTIONS as LOSS_REDUCTIONS, _check_teacher, topk_kl_loss
from .validation import (check_bool_arg, check_choice, check_labels, check_logits, check_temperature,
                         check_token_ids, describe, public_signature, raise_extra_positional)

__all__ = ["LogitsStats", "logits_stats", "log_probs_from_logits", "entropy_from_logits", "logsumexp",
           "sum_pi_squared_from_logits", "cross_entropy", "topk_log_probs_from_logits",
           "topk_kl_from_logits"]  # the public names (rl_kernels/__init__.py exports them)

REDUCTIONS = ("none", "sum", "mean")


class LogitsStats(NamedTuple):
    """Per-row float32 statistics shaped like ``logits.shape[:-1]`` (None where not asked)."""

    log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    lse: torch.Tensor
    sum_pi_squared: torch.Tensor | None = None


def _run(logits, labels, temperature, ignore_index, return_entropy, return_mean_log_p,
         inplace_backward, backend, process_group=None, vocab_start_index=None, *, fn_name,
         return_sum_pi_squared=False) -> LogitsOutputs:
    """Validate, flatten to 2-D, run; returns ``LogitsOutputs`` shaped like logits.shape[:-1].
    ``fn_name``: the public function (error messages)."""
    check_logits(logits)
    temperature = check_temperature(temperature, logits[..., 0], "logits.shape[:-1]")
    if labels is not None:  # label values: in the kernel, or on the host in the backend call
        check_labels(labels, logits, "logits", logits.shape[-1], ignore_index, check_values=False)
    check_bool_arg("inplace_backward", inplace_backward)
    if inplace_backward and process_group is not None:
        raise ValueError("inplace_backward: not supported with process_group (the gradient of a "
                         "shard is written to a new tensor); pass inplace_backward=False")
    tp = parallel_params(process_group, vocab_start_index, False, ignore_index, logits.shape[-1], logits.device,
                         allow_reduce_hidden_grad=False)
    shape = logits.shape[:-1]
    logits2d = logits if logits.dim() == 2 else logits.reshape(-1, logits.shape[-1])
    labels1d = labels.reshape(-1) if labels is not None and labels.dim() != 1 else labels
    inv_temperature, runtime_temperature = split_temperature(temperature)
    params = LogitsParams(backend=get_backend(backend, logits.device), inv_temperature=inv_temperature,
                          ignore_index=int(ignore_index), return_entropy=return_entropy, name=fn_name,
                          return_mean_log_p=return_mean_log_p, return_sum_pi_squared=return_sum_pi_squared,
                          inplace_backward=inplace_backward)  # (False with a group: refused above)
    if inplace_backward:
        _check_inplace_target(logits, logits2d)
    # the family's one route (eager and compiled, vocab-sharded logits with ``tp``)
    if torch.is_grad_enabled() and logits.requires_grad:
        stats = dict(zip(asked_outputs(params, labels is not None),
                         LogitsStatsFunction.apply(logits2d, labels1d, params, runtime_temperature, tp)))
    else:  # no gradient wanted: the same forward without an autograd node (host cost at small N)
        stats = forward_call(logits2d, labels1d, params, runtime_temperature, tp)
    outs = (stats.get("log_probs"), stats.get("entropy"), stats["lse"], stats.get("mean_log_p"),
            stats.get("sum_pi_squared"))  # (LogitsOutputs' fields)
    if logits2d is logits:  # 2-D logits: the (N,) outputs as they are (host time at small N)
        return LogitsOutputs(*outs)
    return LogitsOutputs(*(o if o is None else o.view(shape) for o in outs))


def _overlaps(x: torch.Tensor) -> bool:
    """Whether two elements of 2-D ``x`` share memory: dims of size > 1 sorted by stride must
    each step over everything the smaller ones span (a zero stride always overlaps)."""
    dims = sorted((st, sz) for st, sz in zip(x.stride(), x.shape) if sz > 1)
    span = 0  # largest offset reachable with the dims so far
    for stride, size in dims:
        if stride <= span:
            return True
        span += stride * (size - 1)
    return False


def _check_inplace_target(logits, logits2d) -> None:
    """Refuse ``inplace_backward=True`` (before anything is written) when the logits' storage
    cannot receive their gradient element for element: a reshape that copies, or elements that
    share memory (expanded / zero-stride or otherwise overlapping logits)."""
    if logits2d.data_ptr() != logits.data_ptr():
        raise ValueError(f"inplace_backward=True: logits ({describe(logits)}, strides "
                         f"{logits.stride()}) cannot be viewed as (N, vocab_size) without a copy, so "
                         f"their storage cannot receive the gradient; pass inplace_backward=False")
    if _overlaps(logits2d):
        raise ValueError(f"inplace_backward=True: logits ({describe(logits)}, strides "
                         f"{logits.stride()}) have elements that share memory (expanded or "
                         f"overlapping), so their gradient cannot be written over them; pass "
                         f"inplace_backward=False")


# ----------------------------------------------------------------------------- public functions

_ARGS_DOC = """
        logits: (..., vocab_size) bfloat16, float16 or float32, any leading shape and strides (a
            layout that cannot be viewed as 2-D is copied once by ``reshape``).
        temperature: positive Python number; logits are divided by it. The per-row functions (all
            but the top-K ones) also take a float tensor shaped like ``logits.shape[:-1]`` on the
            logits' device: each row divided by its own temperature (verl's per-sample temperature),
            forward and backward; its values are checked (positive, finite, in the range) with one
            host read, and it gets no gradient."""
_BACKEND_DOC = """
        backend: 'auto' (Triton on CUDA, the torch backend elsewhere; logged once), 'triton'
            (CUDA or TRITON_INTERPRET=1) or 'torch'."""
_TP_DOC = """
        process_group: a ``torch.distributed`` group over which the vocabulary is sharded:
            ``logits`` is then this rank's contiguous vocab shard (shards may differ in size,
            ordered by group rank), labels are global ids and ``ignore_index`` must be negative;
            one all_gather of four (N,) float32 rows merges the shards and every rank returns the
            same bits (``rl_kernels.autograd.vocab_parallel``). Backward gives the gradient of the local shard.
        vocab_start_index: global id of the shard's first column; None derives it from the group
            (one small all_gather)."""
_RAISES_DOC = """
    Non-finite logits (NaN, +inf) in a row give non-finite outputs and gradient for that row
    only; -inf logits are zero-probability columns.

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype, shape, device,
        temperature (outside ``rl_kernels.validation.TEMPERATURE_RANGE`` included), a label outside
        [0, vocab_size) that is not ``ignore_index`` (on CUDA with the Triton backend the kernel
        finds it without a host sync: that row's log-prob and gradient are NaN and the ValueError
        comes from the next rl_kernels call or backward; ``RL_KERNELS_SYNC_LABEL_CHECK=1`` raises
        in the call itself), or an ``ignore_index`` that does not fit the labels' dtype; RuntimeError when the requested backend cannot run on the logits'
        device, and when a gradient is differentiated again (double backward is not
        supported: ``create_graph=True`` gives correct first derivatives only)."""


@public_signature
def logits_stats(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *extra_positional,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = True,
    return_sum_pi_squared: bool = False,
    inplace_backward: bool = False,
    backend: str = "auto",
    process_group=None,
    vocab_start_index: int | None = None,
) -> LogitsStats:
    """Log-probs of ``labels``, entropy and logsumexp of ``softmax(logits / temperature)`` from a
    single read of the logits (one kernel launch per level, O(N) extra memory).

    Args:{args}
        labels: (...) int64 or int32 token ids in [0, vocab_size), or ``ignore_index``; None
            skips the log-probs.
        ignore_index: label value whose row gets log-prob 0 and entropy 0 (and no gradient
            through them; lse is still computed).
        return_entropy: when False the entropy is not computed (returned as None).
        return_sum_pi_squared: also return sum_j p_j^2 (the collision probability; verl's
            optimal-token-baseline estimators use it), from one more accumulator of the same
            read, differentiable (d/dz_j = 2 p_j (p_j - sum_k p_k^2)).
        inplace_backward: when True, backward writes d loss / d logits into the logits' own
            storage instead of allocating an N x V tensor (saves one logits-sized buffer). The
            write is reported to autograd (the logits' version counter), so a later backward that
            still needs the logits (another consumer, ``retain_graph`` and a second backward)
            raises torch's "modified by an inplace operation" error rather than reading the
            gradient; expanded or overlapping logits are refused (ValueError) before anything is
            written. Off by default because other consumers of the logits usually need them.{backend}{tp}

    Returns:
        ``LogitsStats(log_probs, entropy, lse, sum_pi_squared)``: float32, shape
        ``logits.shape[:-1]`` (nats, except sum_pi_squared: a probability, None unless asked), all
        differentiable w.r.t. ``logits``; the gradient is written in the logits dtype.
{raises}
    Formula: log p_y = z_y - lse, H = -sum p log p, lse = log sum exp z with z = logits / T
    (module docstring).
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(logits_stats, extra_positional)
    check_bool_arg("return_entropy", return_entropy)
    check_bool_arg("return_sum_pi_squared", return_sum_pi_squared)
    out = _run(logits, labels, temperature, ignore_index, return_entropy, False, inplace_backward, backend,
               process_group, vocab_start_index, fn_name="logits_stats", return_sum_pi_squared=return_sum_pi_squared)
    return LogitsStats(out.log_probs, out.entropy, out.lse, out.sum_pi_squared)


@public_signature
def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *extra_positional,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    backend: str = "auto",
    process_group=None,
    vocab_start_index: int | None = None,
) -> torch.Tensor:
    """Log-probabilities ``log softmax(logits / temperature)[labels]`` from materialized logits.

    Args:{args}
        labels: (...) int64 or int32 token ids in [0, vocab_size), or ``ignore_index``.
        ignore_index: label value whose position gets log-prob 0 and gradient 0.
        inplace_backward: when True, backward writes d loss / d logits into the logits' own
            storage (as verl's flash-attn path does) instead of allocating a new N x V tensor;
            autograd is told of the write, as for :func:`logits_stats`.{backend}{tp}

    Returns:
        float32 log-probs (nats), shape ``labels.shape``; differentiable w.r.t. ``logits``.
{raises}
    Memory: O(N) saved for backward. Formula: log p_y = z_y - logsumexp(z), gradient
    onehot(y) - softmax(z) (module docstring).
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(log_probs_from_logits, extra_positional)
    if labels is None:
        raise TypeError("labels: expected a torch.Tensor of token ids, got None")
    return _run(logits, labels, temperature, ignore_index, False, False, inplace_backward, backend,
                process_group, vocab_start_index, fn_name="log_probs_from_logits").log_probs


@public_signature
def entropy_from_logits(logits: torch.Tensor, *extra_positional, temperature: float | torch.Tensor = 1.0,
                        backend: str = "auto",
                        process_group=None, vocab_start_index: int | None = None) -> torch.Tensor:
    """Shannon entropy ``-sum p log p`` of ``softmax(logits / temperature)`` over the last dim.

    Args:{args}{backend}{tp}

    Returns:
        float32 entropy (nats), shape ``logits.shape[:-1]``; differentiable w.r.t. ``logits``.
{raises}
    Formula: H = -sum_j p_j log p_j, dH/dz_j = -p_j (log p_j + H) (module docstring).
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(entropy_from_logits, extra_positional)
    return _run(logits, None, temperature, -100, True, False, False, backend, process_group,
                vocab_start_index, fn_name="entropy_from_logits").entropy


@public_signature
def logsumexp(logits: torch.Tensor, *extra_positional, temperature: float | torch.Tensor = 1.0, backend: str = "auto",
              process_group=None, vocab_start_index: int | None = None) -> torch.Tensor:
    """``log sum_j exp(logits_j / temperature)`` over the last dim, in float32.

    Args:{args}{backend}{tp}

    Returns:
        float32 (nats), shape ``logits.shape[:-1]``; differentiable (d lse / d logits =
        softmax / temperature). Unlike ``torch.logsumexp`` on bf16 input, the result is not
        rounded to the input dtype.
{raises}
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(logsumexp, extra_positional)
    return _run(logits, None, temperature, -100, False, False, False, backend, process_group,
                vocab_start_index, fn_name="logsumexp").lse


@public_signature
def sum_pi_squared_from_logits(logits: torch.Tensor, *extra_positional, temperature: float | torch.Tensor = 1.0,
                               backend: str = "auto", process_group=None,
                               vocab_start_index: int | None = None) -> torch.Tensor:
    """Sum of squared probabilities ``sum_j softmax(logits / temperature)_j^2`` over the last dim
    (the collision probability; verl's optimal-token-baseline advantage estimators use it).

    Args:{args}{backend}{tp}

    Returns:
        float32 in (0, 1], shape ``logits.shape[:-1]``; differentiable w.r.t. ``logits``.
{raises}
    Formula: with m = max z, s = sum exp(z - m) and q = sum exp(2 (z - m)), sum_j p_j^2 = q / s^2
    (one read, same split tree as the lse); d/dz_j = 2 p_j (p_j - sum_k p_k^2) (from the softmax
    derivative d p_k / dz_j = p_k ([k == j] - p_j)). Vocab shards merge as sum_r w_r^2 S_r with
    w_r the shard's probability mass (``rl_kernels.autograd.vocab_parallel``).
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(sum_pi_squared_from_logits, extra_positional)
    return _run(logits, None, temperature, -100, False, False, False, backend, process_group,
                vocab_start_index, fn_name="sum_pi_squared_from_logits", return_sum_pi_squared=True).sum_pi_squared


@public_signature
def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *extra_positional,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    inplace_backward: bool = False,
    reduction: str = "mean",
    backend: str = "auto",
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.cross_entropy(logits, labels, ignore_index=...,
    reduction=..., label_smoothing=...)`` on (N, C) logits and (N,) class-index labels, without
    N x V float32 temporaries.

    Args:
        logits: (N, vocab_size) bfloat16, float16 or float32, any strides.
        labels: (N,) int64 or int32 class indices in [0, vocab_size), or ``ignore_index``.
        ignore_index: rows with this label contribute 0 and are not counted by 'mean'.
        reduction: 'none' (per row), 'sum', or 'mean' (over non-ignored rows; NaN when all are
            ignored, as torch).
        label_smoothing: eps in [0, 1]: loss = (1 - eps) (-log p_y) + eps (-(1/V) sum_j log p_j).
        inplace_backward: write the logits' gradient into their storage (see
            :func:`logits_stats`).{backend}

    Returns:
        the loss in the logits dtype (as torch): shape (N,) for 'none', a scalar otherwise;
        computed in float32 before that final rounding.
{raises}
        ValueError for a bad ``reduction`` or ``label_smoothing``, or logits that are not 2-D.
        Class weights (torch's ``weight``) are not offered: every ``weight`` argument of
        rl_kernels is an lm_head weight.
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(cross_entropy, extra_positional)
    if labels is None:
        raise TypeError("labels: expected a torch.Tensor of class indices, got None")
    check_choice("reduction", reduction, REDUCTIONS)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing: expected a float in [0, 1], got {label_smoothing!r}")
    if isinstance(logits, torch.Tensor) and logits.dim() != 2:
        raise ValueError(f"logits: expected 2-D (N, vocab_size), got {describe(logits)}")
    eps = float(label_smoothing)
    out = _run(logits, labels, 1.0, ignore_index, False, eps > 0, inplace_backward, backend, fn_name="cross_entropy")
    log_probs, mean_log_p = out.log_probs, out.mean_log_p
    valid = labels != ignore_index
    loss = -(1.0 - eps) * log_probs
    if eps > 0:
        loss = torch.where(valid, loss - eps * mean_log_p, torch.zeros((), device=loss.device))
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / valid.sum()
    return loss.to(logits.dtype)


@public_signature
def topk_log_probs_from_logits(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    *extra_positional,
    temperature: float = 1.0,
    return_tail: bool = False,
    backend: str = "auto",
    process_group=None,
    vocab_start_index: int | None = None,
):
    """Log-probabilities ``log softmax(logits / temperature)`` at K given token ids per row (the
    student side of a top-K distillation loss), without an N x V intermediate; optionally the
    log-probability of everything outside those K ids (the tail).

    Args:{args}
        token_ids: (..., K) int64 or int32 ids in [0, vocab_size), the logits' leading shape then
            K >= 1 ids per row (any K, duplicates allowed: their gradients add up; with
            ``return_tail`` they must be distinct in each row).
        return_tail: also return log q_tail, the log of the probability outside the row's K ids
            (the tail bucket of verl RFC #7856, "Tail-aware top-k KL for on-policy
            distillation"): tail_lse - lse with tail_lse the logsumexp of z over the columns not
            among the ids, computed by the kernels in the same read with those columns at -inf,
            never as log(1 - sum_k q_k) (which cancels: q_tail ~ 1e-30 keeps its digits here), and
            the difference formed relative to the row max (its error does not grow with the
            logits' offset). -inf when the K ids are the whole vocabulary; at most 0.{backend}
        process_group: a ``torch.distributed`` group over which the vocabulary is sharded:
            ``logits`` is then this rank's contiguous (..., V_r) vocab shard (shards ordered by
            group rank, sizes may differ; e.g. Megatron's vocab-parallel logits), ``token_ids``
            are global ids. One all_gather of (N, 1 + 2K) float32 (the shard's lse, its logits at
            the ids it owns and the ownership; with ``return_tail`` (N, 4 + 2K): also its row max,
            log-sum and tail log-probability) merges the shards in rank order, so every rank
            returns the same bits; backward gives each rank the gradient of its own shard (every
            rank computes the same loss: the Megatron convention).
        vocab_start_index: global id of the shard's first column; None derives it from the group
            (one small all_gather) and checks the ids against the whole vocabulary.

    Returns:
        float32 log-probs (nats), shape ``token_ids.shape``; with ``return_tail`` the pair
        ``(log_probs, tail_log_probs)``, tail_log_probs float32 shaped ``token_ids.shape[:-1]``.
        Both differentiable w.r.t. ``logits`` (the gradient is written in the logits dtype).

    Memory: forward reads the logits once (the from-logits kernels' logsumexp) and gathers the K
    logits; O(N) saved for backward, which writes the gradient as the one N x V tensor it
    allocates: softmax times g_lse = -sum_k g_k from the same kernels, then the K columns of each
    row overwritten with p g_lse + (sum of g over the slots with that id), computed in float32 and
    rounded once (no atomic add into the gradient). With ``return_tail`` the same read also
    keeps a second (max, sum) over the columns outside the row's ids (sorted ids, O(N K)), and
    the backward adds g_tail exp(z_j - tail_lse) at every column before the K columns are
    overwritten. Under ``torch.compile`` the same code runs inside the from-logits family's
    ``rl_kernels::logits_forward`` / ``logits_backward`` custom ops.

    Formula: log p_k = z_{{id_k}} - logsumexp(z), z = logits / T; d log p_k / dz_j = [j == id_k] - p_j
    (the softmax derivative, module docstring), times 1 / T for the logits. Tail: d tail_lse / dz_j
    = exp(z_j - tail_lse) outside the ids, 0 at them (``rl_kernels.autograd.logits``, "top-K
    log-probs").
{raises}
        ValueError naming ``token_ids`` for an id outside [0, vocab_size) (with
        ``process_group``: of the whole vocabulary, or held by no shard), a wrong shape or device,
        or, with ``return_tail``, an id repeated in a row; TypeError for a non-integer dtype;
        TypeError / ValueError / RuntimeError naming ``process_group`` / ``vocab_start_index`` for
        a bad group (not a ProcessGroup, torch.distributed not initialized) or start.
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(topk_log_probs_from_logits, extra_positional)
    check_logits(logits)
    temperature = check_temperature(temperature)
    check_bool_arg("return_tail", return_tail)
    check_token_ids("token_ids", token_ids, logits, "logits")
    tp = parallel_params(process_group, vocab_start_index, False, -100, logits.shape[-1], logits.device,
                         allow_reduce_hidden_grad=False)
    inv_temperature, runtime_temperature = split_temperature(temperature)
    params = LogitsParams(backend=get_backend(backend, logits.device), inv_temperature=inv_temperature,
                          ignore_index=-100, return_entropy=False, name="topk_log_probs_from_logits",
                          return_tail=return_tail, ids_name="token_ids")
    vocab_size, k = logits.shape[-1], token_ids.shape[-1]
    ids = token_ids.reshape(-1, k)  # (global ids with a group: checked on the shards' merge)
    ids = checked_token_ids(ids, vocab_size, "token_ids") if tp is None else ids.long()
    log_probs, tail = topk_log_probs(logits.reshape(-1, vocab_size), ids, None, params, runtime_temperature, tp)
    if return_tail:
        return log_probs.view(token_ids.shape), tail.view(token_ids.shape[:-1])
    return log_probs.view(token_ids.shape)


@public_signature
def topk_kl_from_logits(
    logits: torch.Tensor,
    teacher_token_ids: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    *extra_positional,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    mask: torch.Tensor | None = None,
    kind: str = "forward",
    renormalize_teacher: bool = False,
    tail: bool = False,
    reduction: str = "mean",
    backend: str = "auto",
    process_group=None,
    vocab_start_index: int | None = None,
) -> torch.Tensor:
    """KL divergence to a top-K teacher from materialized student logits: the from-logits twin of
    :func:`rl_kernels.linear_topk_kl` (same semantics, options and checks).

    With z = logits / T and log q_k = z_{{id_k}} - logsumexp(z) (:func:`topk_log_probs_from_logits`):
        forward KL:  T^2 * sum_k p_t,k (log p_t,k - log q_k)
        reverse KL:  T^2 * sum_k q_k (log q_k - log p_t,k)        (over the teacher's K ids)
    The T^2 factor keeps gradient magnitudes comparable across temperatures (Hinton, Vinyals, Dean
    2015, "Distilling the Knowledge in a Neural Network", sec. 2); with K = V and a renormalized
    teacher it is the full KL.

    With ``tail=True``, the tail-aware KL of verl RFC #7856 ("Tail-aware top-k KL for on-policy
    distillation"): the exact KL of the (K+1)-category distributions (the K ids, then one bucket for
    the rest of the vocabulary), adding T^2 p_tail log(p_tail / q_tail) (forward) or
    T^2 q_tail log(q_tail / p_tail) (reverse), with P = sum_k p_t,k, p_tail = max(0, 1 - P) (float64)
    and q_tail the student's mass outside the K ids, formed as exp(tail_lse - lse) with tail_lse the
    logsumexp of z over the columns not among the ids, computed directly with those columns masked
    (never 1 - sum_k q_k, which cancels). Inside a logarithm a probability is floored at 2^-126, so
    q_tail = 0 (K = V) or a zero teacher probability (reverse) costs a finite amount; 0 log 0 = 0
    (``rl_kernels.distill.topk_kl_per_token``).

    Args:{args}
        teacher_token_ids: (..., K) int64/int32 ids in [0, vocab_size) (K >= 1, any K <= V).
        teacher_log_probs: (..., K) float teacher log-probs (nats) at those ids, taken as given
            (already at ``temperature``); no gradient flows to them. -inf marks a zero-probability
            slot, which adds exactly 0 to the loss and the gradient (forward: 0 log 0 = 0;
            reverse: left out; with ``tail`` every slot is a category, so reverse adds
            q_k log(q_k / 2^-126) there); ``renormalize_teacher`` renormalizes over the other
            slots. NaN or +inf entries raise ValueError.
        labels: optional (...) int64/int32; positions whose label is ``ignore_index`` contribute
            0 and get exactly zero gradient (even when their logits are non-finite); other values
            must lie in [0, vocab_size) and are not used otherwise.
        ignore_index: int, see ``labels``.
        mask: optional (...) bool or 0/1 (verl's response mask): positions with mask 0 are
            excluded like ignored labels. With both ``labels`` and ``mask``, a position counts
            when both say so.
        kind: 'forward' (mode covering) or 'reverse' (mode seeking), as above.
        renormalize_teacher: log-softmax the teacher log-probs over the K ids first (not with
            ``tail``: a renormalized teacher has no tail).
        tail: the tail-aware (K+1)-category KL above. The teacher's ids must then be distinct in
            every position that counts and its top-K mass P at most 1 + 1e-2 there (a mass above 1
            by rounding gives p_tail = 0).
        reduction: 'mean' (default: sum over the positions that count / their number), 'sum',
            'none' (shape ``...``), 'batchmean' (sum / size of the first dim, as
            ``torch.nn.functional.kl_div``).{backend}
        process_group: vocab-sharded student logits, as for :func:`topk_log_probs_from_logits`:
            ``logits`` is this rank's (..., V_r) shard, ``teacher_token_ids`` global ids, and every
            rank returns the same loss (bitwise); backward gives each rank its shard's gradient.
        vocab_start_index: global id of the shard's first column; None derives it from the group.

    Returns:
        float32 loss (nats x T^2): shape ``logits.shape[:-1]`` for 'none', a scalar otherwise;
        differentiable w.r.t. ``logits`` (gradient in the logits dtype).
{raises}
        TypeError / ValueError naming the argument for 1-D logits (at least one token dim is
        needed), teacher ids or log-probs of a wrong type, dtype, shape or device, ids outside
        [0, vocab_size), NaN / +inf teacher log-probs, a bad ``labels`` / ``mask`` / ``kind`` /
        ``reduction`` / ``renormalize_teacher`` / ``tail``; with ``tail``: ValueError for
        ``renormalize_teacher=True``, naming ``teacher_token_ids`` for an id repeated in a position
        that counts, naming ``teacher_log_probs`` for a top-K mass above 1 + 1e-2 there; with
        ``process_group`` as :func:`topk_log_probs_from_logits`.

    Memory: O(N K) besides the logits; backward allocates the gradient as its one N x V tensor
    (:func:`topk_log_probs_from_logits`).
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(topk_kl_from_logits, extra_positional)
    check_choice("kind", kind, KINDS)
    check_choice("reduction", reduction, LOSS_REDUCTIONS)
    check_bool_arg("renormalize_teacher", renormalize_teacher)
    check_bool_arg("tail", tail)
    if tail and renormalize_teacher:
        raise ValueError("renormalize_teacher: True with tail=True; the tail-aware KL keeps the teacher's "
                         "mass outside its K ids (p_tail = 1 - sum_k p_k), which renormalizing would drop")
    t = check_temperature(temperature)
    check_logits(logits)
    if logits.dim() < 2:
        raise ValueError(f"logits: expected shape (..., vocab_size) with at least one token dim (e.g. "
                         f"(N, vocab_size)), got {describe(logits)}")
    _check_teacher(logits, teacher_token_ids, teacher_log_probs, check_values=False, like_name="logits")
    tp = parallel_params(process_group, vocab_start_index, False, ignore_index, logits.shape[-1], logits.device,
                         allow_reduce_hidden_grad=False)
    vocab_size, k = logits.shape[-1], teacher_token_ids.shape[-1]
    # ids and labels are global with a group: checked against the whole vocabulary when known
    valid, any_excluded = checked_positions(logits, labels, ignore_index, mask, vocab_size, tp, hidden_name="logits",
                                            teacher_token_ids=teacher_token_ids, teacher_log_probs=teacher_log_probs,
                                            tail=tail)
    inv_temperature, runtime_temperature = split_temperature(t)
    params = LogitsParams(backend=get_backend(backend, logits.device), inv_temperature=inv_temperature,
                          ignore_index=-100, return_entropy=False, name="topk_kl_from_logits", return_tail=tail,
                          ids_name="teacher_token_ids")
    ids = teacher_token_ids.reshape(-1, k).long()
    # positions that do not count: rows labelled ignore_index for the kernels (exactly zero gradient)
    rows = None if any_excluded is False else torch.where(valid, ids[:, 0], params.ignore_index)
    log_q, tail_log_q = topk_log_probs(logits.reshape(-1, vocab_size), ids, rows, params, runtime_temperature, tp)
    return topk_kl_loss(log_q, teacher_log_probs, valid, logits.shape[:-1], temperature=t, kind=kind,
                        renormalize_teacher=renormalize_teacher, reduction=reduction, tail_log_probs=tail_log_q)


def _fill_docs(fn):
    fn.__doc__ = fn.__doc__.format(args=_ARGS_DOC, backend=_BACKEND_DOC, raises=_RAISES_DOC, tp=_TP_DOC)


for _fn in (logits_stats, log_probs_from_logits, entropy_from_logits, logsumexp, sum_pi_squared_from_logits,
            cross_entropy, topk_log_probs_from_logits, topk_kl_from_logits):
    _fill_docs(_fn)
