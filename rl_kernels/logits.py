"""Log-probs, entropy, logsumexp, sum of squared probabilities, cross-entropy and top-K log-probs
from already-materialized logits (their top-K KL: ``distill.topk_kl_from_logits``): one read of the
logits forward, one backward (which writes the gradient once, in the logits' dtype), O(N) saved in
between. Backends: ``triton`` (CUDA, or Triton's CPU interpreter with TRITON_INTERPRET=1) and ``torch``
(any device), with the same results.

With z = logits / temperature, p = softmax(z), lse = logsumexp(z), S = sum_j p_j^2:
    log p_y = z_y - lse,  H = -sum_j p_j log p_j
    d log p_y / dz = onehot(y) - p,  d lse / dz = p,  dH / dz_j = -p_j (log p_j + H),  dS / dz_j = 2 p_j (p_j - S)
from the softmax derivative d p_j / dz_k = p_j ([j = k] - p_k); d / dlogits = (d / dz) / temperature.
Cross-entropy with label smoothing eps: (1 - eps) (-log p_y) + eps (-(1 / V) sum_j log p_j) (Szegedy et al.
2016, "Rethinking the Inception Architecture for Computer Vision", sec. 7; ``torch.nn.functional.cross_entropy``).
How the kernels compute them: docs/design.md, section "From materialized logits".
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from .autograd.head_family import split_temperature
from .autograd.logits import (LogitsOutputs, LogitsParams, LogitsStatsFunction, asked_outputs, checked_token_ids,
                              logits_forward_call, topk_log_probs)
from .autograd.vocab_parallel import parallel_params
from .core.backends import get_backend
from .core.validation import (check_bool_arg, check_choice, check_labels, check_logits, check_temperature,
                              check_token_ids, check_unit_interval, describe, public_signature, raise_extra_positional)

__all__ = ["LogitsStats", "logits_stats", "log_probs_from_logits", "entropy_from_logits", "logsumexp",
           "sum_pi_squared_from_logits", "cross_entropy",
           "topk_log_probs_from_logits"]  # the public names (rl_kernels/__init__.py exports them)

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
                         LogitsStatsFunction.apply(logits2d, labels1d, None, params, runtime_temperature, tp)))
        outs = (stats.get("log_probs"), stats.get("entropy"), stats["lse"], stats.get("mean_log_p"),
                stats.get("sum_pi_squared"))  # (LogitsOutputs' fields)
    else:  # no gradient wanted: the same forward without an autograd node (host cost at small N)
        outs = logits_forward_call(logits2d, labels1d, None, params, runtime_temperature, tp)[:5]  # (the same fields)
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

# The docstrings' shared entries (one text per concept), filled in by ``_fill_docs`` below.
_DOC = dict(
    logits="""logits: (..., V) bfloat16, float16 or float32, V >= 1, any leading shape and strides (a layout
            that cannot be viewed as (N, V) is copied once). Differentiable.""",
    temperature="""temperature: a Python number in [2.9e-39, 8.5e37] (1 / T a normal float32), or a float tensor
            of such values shaped ``logits.shape[:-1]`` (one per row, read once on the host; not requiring grad).""",
    inplace_backward="""inplace_backward: bool; True: backward writes the logits' gradient into their own storage
            (no N x V allocation; autograd is told, so a later backward through the logits raises torch's "modified
            by an inplace operation"). Not for vocab-sharded logits (a process group), logits that cannot be
            viewed as (N, V) or whose elements overlap (expanded).""",
    backend="""backend: 'auto' (Triton on CUDA, torch elsewhere), 'triton' (CUDA, or TRITON_INTERPRET=1), 'torch'.""",
    process_group="""process_group: a torch.distributed group sharding the vocabulary: ``logits`` is this rank's
            contiguous (..., V_r) shard (group-rank order), token ids are global; every rank returns the same
            outputs, and backward gives each rank the gradient of its shard.""",
    vocab_start_index="""vocab_start_index: int >= 0, global id of the shard's first column (only with
            ``process_group``); None derives it from the group (one small all_gather).""",
    nonfinite="""A row of non-finite logits (NaN, +inf) gets non-finite outputs (that row only); -inf logits are
        columns of probability 0.""",
    raises="""
    Raises:
        TypeError: an argument of the wrong type or dtype (the message names it).
        ValueError: an argument outside the domain stated above: shape, device, value (the message names it).
        RuntimeError: backend 'triton' without CUDA or TRITON_INTERPRET=1, or without triton;
            ``process_group`` with torch.distributed not initialized; a double backward.""",
    raises_labels="""
    Raises:
        TypeError: an argument of the wrong type or dtype (the message names it).
        ValueError: an argument outside the domain stated above: shape, device, value (the message names it).
            On CUDA with the Triton backend a label outside [0, V) is found without a host sync (the row's outputs
            are NaN) and raised by the next rl_kernels call or backward (RL_KERNELS_SYNC_LABEL_CHECK=1: the call).
        RuntimeError: backend 'triton' without CUDA or TRITON_INTERPRET=1, or without triton;
            ``process_group`` with torch.distributed not initialized; a double backward.""",
)


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
    """Log-probs of ``labels``, entropy, logsumexp and sum of squared probabilities of
    softmax(logits / temperature), from one read of the logits (O(N) extra memory).

    Args:
        {logits}
        labels: None (no log-probs) or int64/int32 of shape ``logits.shape[:-1]``, each in [0, V) or
            ``ignore_index``.
        {temperature}
        ignore_index: int that fits the labels' dtype (negative with ``process_group``): the label of rows whose
            log-prob, entropy and sum_pi_squared are 0 and pass no gradient (lse is still computed).
        return_entropy: bool; False: entropy is None (not computed).
        return_sum_pi_squared: bool; True: also sum_pi_squared (differentiable).
        {inplace_backward}
        {backend}
        {process_group}
        {vocab_start_index}

    Returns:
        ``LogitsStats(log_probs, entropy, lse, sum_pi_squared)``: float32 shaped ``logits.shape[:-1]``, in nats
        (sum_pi_squared: a probability; None where not asked), differentiable w.r.t. ``logits``.
        {nonfinite}
{raises_labels}
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
    """Log-probabilities of ``labels`` under softmax(logits / temperature), log p_y = z_y - logsumexp(z) with
    z = logits / temperature, from one read of the logits (O(N) saved for backward).

    Args:
        {logits}
        labels: int64/int32 of shape ``logits.shape[:-1]``, each in [0, V) or ``ignore_index``.
        {temperature}
        ignore_index: int that fits the labels' dtype (negative with ``process_group``): the label of positions
            that get log-prob 0 and pass no gradient.
        {inplace_backward}
        {backend}
        {process_group}
        {vocab_start_index}

    Returns:
        float32 log-probs (nats) shaped like ``labels``, differentiable w.r.t. ``logits``.
        {nonfinite}
{raises_labels}
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
    """Shannon entropy H = -sum_j p_j log p_j of p = softmax(logits / temperature) over the last dim, from one read
    of the logits (O(N) saved for backward).

    Args:
        {logits}
        {temperature}
        {backend}
        {process_group}
        {vocab_start_index}

    Returns:
        float32 entropy (nats), shape ``logits.shape[:-1]``, differentiable w.r.t. ``logits``.
        {nonfinite}
{raises}
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(entropy_from_logits, extra_positional)
    return _run(logits, None, temperature, -100, True, False, False, backend, process_group,
                vocab_start_index, fn_name="entropy_from_logits").entropy


@public_signature
def logsumexp(logits: torch.Tensor, *extra_positional, temperature: float | torch.Tensor = 1.0, backend: str = "auto",
              process_group=None, vocab_start_index: int | None = None) -> torch.Tensor:
    """log sum_j exp(logits_j / temperature) over the last dim, in float32 (not rounded to a 16-bit input dtype,
    unlike ``torch.logsumexp``), from one read of the logits.

    Args:
        {logits}
        {temperature}
        {backend}
        {process_group}
        {vocab_start_index}

    Returns:
        float32 (nats), shape ``logits.shape[:-1]``, differentiable w.r.t. ``logits`` (d lse / dz = softmax(z)).
        {nonfinite}
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
    """Sum of squared probabilities sum_j p_j^2 of p = softmax(logits / temperature) over the last dim (the
    collision probability, used by verl's optimal-token-baseline advantage estimators), from one read of the logits.

    Args:
        {logits}
        {temperature}
        {backend}
        {process_group}
        {vocab_start_index}

    Returns:
        float32 in (0, 1], shape ``logits.shape[:-1]``, differentiable w.r.t. ``logits``.
        {nonfinite}
{raises}
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
    """Drop-in for ``torch.nn.functional.cross_entropy(logits, labels, ignore_index=..., reduction=...,
    label_smoothing=...)`` on (N, V) logits, without N x V float32 temporaries (torch's per-class weights are not
    offered). loss = (1 - eps) (-log p_y) + eps (-(1 / V) sum_j log p_j), p = softmax(logits), eps =
    label_smoothing (Szegedy et al. 2016, "Rethinking the Inception Architecture for Computer Vision", sec. 7).

    Args:
        logits: (N, V) bfloat16, float16 or float32, V >= 1, any strides. Differentiable.
        labels: (N,) int64/int32 class indices, each in [0, V) or ``ignore_index``.
        ignore_index: int that fits the labels' dtype: rows with this label add 0 and are not counted by 'mean'.
        label_smoothing: Python number eps in [0, 1].
        {inplace_backward}
        reduction: 'none' (per row), 'sum' or 'mean' (over the rows not ignored; NaN when all are, as torch).
        {backend}

    Returns:
        the loss in the logits' dtype (as torch; computed in float32, rounded once): (N,) for 'none', else a
        scalar; differentiable w.r.t. ``logits``.
        {nonfinite}

    Raises:
        TypeError: an argument of the wrong type or dtype (the message names it).
        ValueError: an argument outside the domain stated above: shape, device, value (the message names it).
            On CUDA with the Triton backend a label outside [0, V) is found without a host sync (the row's loss
            is NaN) and raised by the next rl_kernels call or backward (RL_KERNELS_SYNC_LABEL_CHECK=1: the call).
        RuntimeError: backend 'triton' without CUDA or TRITON_INTERPRET=1, or without triton; a double backward.
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(cross_entropy, extra_positional)
    if labels is None:
        raise TypeError("labels: expected a torch.Tensor of class indices, got None")
    check_choice("reduction", reduction, REDUCTIONS)
    check_unit_interval("label_smoothing", label_smoothing)
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
    """Log-probabilities of softmax(logits / temperature) at K given ids per row (the student side of a top-K
    distillation loss), without an N x V intermediate; optionally the log-probability outside those ids.

    log p_k = z_(id_k) - logsumexp(z), z = logits / temperature; log q_tail = tail_lse - logsumexp(z), tail_lse
    the logsumexp of z over the columns not among the row's ids (the tail bucket of verl RFC #7856, "Tail-aware
    top-k KL for on-policy distillation").

    Args:
        {logits}
        token_ids: (..., K) int64/int32 ids in [0, V): the logits' leading shape, then K >= 1 ids per row
            (repeated ids allowed: their gradients add up; with ``return_tail``, distinct in each row).
        temperature: a positive Python number in [2.9e-39, 8.5e37] (1 / T a normal float32).
        return_tail: bool; True: also return log q_tail (at most 0; -inf when the ids cover the vocabulary).
        {backend}
        {process_group}
        {vocab_start_index}

    Returns:
        float32 log-probs (nats) shaped like ``token_ids``; with ``return_tail`` the pair (log_probs,
        tail_log_probs), the latter float32 shaped ``token_ids.shape[:-1]``. Differentiable w.r.t. ``logits``.
        {nonfinite}
{raises}
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


def _fill_docs(fn):
    if fn.__doc__ is not None:  # (python -OO strips docstrings)
        fn.__doc__ = fn.__doc__.format(**_DOC)


for _fn in (logits_stats, log_probs_from_logits, entropy_from_logits, logsumexp, sum_pi_squared_from_logits,
            cross_entropy, topk_log_probs_from_logits):
    _fill_docs(_fn)
