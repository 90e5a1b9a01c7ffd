"""Distillation losses on the fused linear head (the (tokens x vocab) logits never stored), and the top-K
KL from already-materialized logits.

``linear_topk_kl``: KL divergence between a teacher given by its top-K log-probs per token (e.g. from an
inference server) and the student's full-vocabulary softmax, over the teacher's K ids, or with one more
bucket for the rest of the vocabulary (the tail-aware KL of verl RFC #7856). ``topk_kl_from_logits``: the
same loss from logits (the student's log-probs at the teacher's ids from ``logits.topk_log_probs_from_logits``'
kernels: one read of the logits forward, one backward).

``linear_jsd``: generalized Jensen-Shannon divergence between a student head and a teacher head in the same
process (GKD, Agarwal et al. 2024); gradients reach the student only.

How they are computed: docs/design.md, section "Distillation".
"""
from __future__ import annotations

import torch

from .autograd.head_family import split_temperature
from .autograd.linear import HeadParams, linear_head
from .autograd.linear_jsd import JSDParams, LinearJSDFunction
from .autograd.logits import LogitsParams, checked_token_ids, topk_log_probs
from .autograd.positions import checked_positions
from .autograd.vocab_parallel import parallel_params
from .core.backends import get_backend
from .core.validation import (FLOAT_DTYPES, check_top_k, check_bool_arg, check_choice, check_dtype, check_head_inputs,
                              check_hidden_weight, check_logits, check_no_grad, check_same_device, check_softcap,
                              check_temperature, check_tensor_arg, check_token_ids,
                              check_unit_interval, describe, public_signature, raise_extra_positional)
from .logits import _fill_docs

# the public names (rl_kernels/__init__.py exports them)
__all__ = ["linear_topk_kl", "topk_kl_from_logits", "linear_jsd"]

KINDS = ("forward", "reverse")
REDUCTIONS = ("none", "sum", "mean", "batchmean")


def _check_teacher(like, ids, teacher_log_probs, like_name: str = "hidden_states") -> None:
    """The top-K teacher of the top-K KL losses: ``teacher_token_ids`` (..., K) int64/int32 with
    ``like``'s leading shape (``like``: the student's hidden states or logits, named ``like_name``)
    and K >= 1, ``teacher_log_probs`` of the same shape, bfloat16/float16/float32, not requiring
    grad (the teacher is a fixed target); both on ``like``'s device. TypeError (type, dtype) /
    ValueError (shape, device, requires grad) naming the argument. Their values are checked with the
    positions (``autograd.positions.checked_positions``), once the vocabulary is known."""
    check_token_ids("teacher_token_ids", ids, like, like_name)
    check_tensor_arg("teacher_log_probs", teacher_log_probs)
    check_dtype("teacher_log_probs", teacher_log_probs, FLOAT_DTYPES)
    if teacher_log_probs.shape != ids.shape:
        raise ValueError(f"teacher_log_probs: expected shape {tuple(ids.shape)} (as teacher_token_ids), got "
                         f"{describe(teacher_log_probs)}")
    check_same_device("teacher_log_probs", teacher_log_probs, like, like_name)
    check_no_grad("teacher_log_probs", teacher_log_probs, "the teacher is a fixed target of the loss")


def _check_loss_options(kind, reduction, renormalize_teacher, tail) -> None:
    """The top-K KL's options (``linear_topk_kl`` and ``topk_kl_from_logits``), each error naming its argument."""
    check_choice("kind", kind, KINDS)
    check_choice("reduction", reduction, REDUCTIONS)
    check_bool_arg("renormalize_teacher", renormalize_teacher)
    check_bool_arg("tail", tail)
    if tail and renormalize_teacher:
        raise ValueError("renormalize_teacher: True with tail=True; the tail-aware KL keeps the teacher's "
                         "mass outside its K ids (p_tail = 1 - sum_k p_k), which renormalizing would drop")


@public_signature
def linear_topk_kl(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
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
    reduce_hidden_grad: bool = False,
) -> torch.Tensor:
    """KL divergence between a top-K teacher and the student's softmax(z), z = hidden_states @ weight.T / T
    (T = temperature), over the teacher's K ids, without storing the (tokens x vocab) logits. With log q_k =
    z_(id_k) - logsumexp(z), p_k = exp(teacher_log_probs_k), per position: forward: T^2 sum_k p_k (log p_k - log q_k),
    reverse: T^2 sum_k q_k (log q_k - log p_k) (the T^2 of Hinton, Vinyals, Dean 2015, "Distilling the Knowledge
    in a Neural Network", sec. 2). ``tail``: the exact KL of the (K+1)-category distributions, the K ids and one
    bucket for the rest (verl RFC #7856, "Tail-aware top-k KL for on-policy distillation"), p_tail = max(0,
    1 - sum_k p_k), q_tail = exp(tail_lse - lse); a zero probability inside a log is floored at 2^-126.

    Args:
        hidden_states: (..., H) bfloat16, float16 or float32 (at least 2-D), H >= 1. Differentiable.
        weight: (V, H) student lm_head weight, same dtype and device. Differentiable.
        teacher_token_ids: (..., K) int64/int32 ids in [0, V), K >= 1. With ``tail``: distinct per position.
        teacher_log_probs: (..., K) bfloat16/float16/float32 nats at ``temperature`` already; no NaN or +inf; -inf:
            a slot of probability 0 (adds 0 without ``tail``). Not requiring grad. With ``tail``: sum_k p_k <= 1 + 1e-2.
        temperature: a positive Python number in [2.9e-39, 8.5e37]; divides the student's logits.
        labels: None or (...) int64/int32 in [0, V) or ``ignore_index``; positions labelled ``ignore_index``
            do not count (0 loss, exactly zero gradient).
        ignore_index: int (negative with ``process_group``); see ``labels``.
        mask: None or (...) bool or 0/1, not requiring grad: positions at 0 do not count (with ``labels``: both
            must count them).
        kind: 'forward' or 'reverse'.
        renormalize_teacher: bool; True: log-softmax the teacher over its K ids first (not with ``tail``).
        tail: bool; True: the tail-aware loss above.
        reduction: 'mean' (over the positions that count), 'sum', 'none' (shape (...)), 'batchmean' (the sum
            divided by the size of the first dim).
        backend: 'auto' (Triton on CUDA, torch elsewhere), 'triton' (CUDA, or TRITON_INTERPRET=1), 'torch'.
        process_group: a torch.distributed group sharding the vocabulary: ``weight`` is this rank's contiguous
            (V_r, H) shard (group-rank order), ids are global; every rank returns the same loss.
        vocab_start_index: int >= 0, global id of ``weight``'s first row (only with ``process_group``); None
            derives it from the group.
        reduce_hidden_grad: bool (only with ``process_group``): all-reduce the hidden gradient over the group.

    Returns:
        float32 loss in nats x T^2, shape (...) for 'none', else a scalar; differentiable in hidden_states, weight.

    Raises:
        TypeError: an argument of the wrong type or dtype (the message names it).
        ValueError: an argument outside the domain stated above: shape, device, value; an id that no shard holds.
        RuntimeError: backend 'triton' without CUDA or TRITON_INTERPRET=1, or without triton;
            ``process_group`` with torch.distributed not initialized; a double backward.
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(linear_topk_kl, extra_positional)
    _check_loss_options(kind, reduction, renormalize_teacher, tail)
    t = check_temperature(temperature)
    check_hidden_weight(hidden_states, weight, min_dim=2)
    _check_teacher(hidden_states, teacher_token_ids, teacher_log_probs)
    tp = parallel_params(process_group, vocab_start_index, reduce_hidden_grad, ignore_index, weight.shape[0],
                         hidden_states.device)
    # ids and labels are global with a group: checked against the whole vocabulary when known
    valid, any_excluded = checked_positions(hidden_states, labels, ignore_index, mask, weight.shape[0], tp,
                                            teacher_token_ids=teacher_token_ids, teacher_log_probs=teacher_log_probs,
                                            tail=tail)
    backend = get_backend(backend, hidden_states.device)
    lead = hidden_states.shape[:-1]
    h2 = hidden_states.reshape(-1, hidden_states.shape[-1])
    ids = teacher_token_ids.reshape(-1, teacher_token_ids.shape[-1])

    # student lse over the full vocabulary (fused head; positions that do not count get no gradient)
    row_labels = torch.where(valid, ids[:, 0], -100)
    params = HeadParams(backend=backend, inv_temperature=1.0 / t, ignore_index=-100,
                        return_entropy=False, name="linear_topk_kl", may_have_ignored=any_excluded is not False,
                        labels_checked=True, return_tail=tail)  # (row labels: checked teacher ids or ignore_index)
    head, log_q = head_at_ids(h2, weight, row_labels, ids, params, t, tp)
    return topk_kl_loss(log_q, teacher_log_probs, valid, lead, temperature=t, kind=kind,
                        renormalize_teacher=renormalize_teacher, reduction=reduction,
                        tail_log_probs=head.tail_lse - head.lse if tail else None)


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
    """KL divergence between a top-K teacher and softmax(z), z = logits / T (T = temperature), over the teacher's
    K ids: the from-logits twin of ``rl_kernels.linear_topk_kl`` (same options, checks and results). With
    log q_k = z_(id_k) - logsumexp(z), p_k = exp(teacher_log_probs_k), per position: forward:
    T^2 sum_k p_k (log p_k - log q_k), reverse: T^2 sum_k q_k (log q_k - log p_k) (the T^2 of Hinton, Vinyals,
    Dean 2015, "Distilling the Knowledge in a Neural Network", sec. 2). ``tail``: the exact KL of the
    (K+1)-category distributions, the K ids and one bucket for the rest (verl RFC #7856, "Tail-aware top-k KL for
    on-policy distillation"), p_tail = max(0, 1 - sum_k p_k); a zero probability inside a log is floored at 2^-126.

    Args:
        {logits} At least 2-D.
        teacher_token_ids: (..., K) int64/int32 ids in [0, V), K >= 1. With ``tail``: distinct per position.
        teacher_log_probs: (..., K) bfloat16/float16/float32 nats at ``temperature`` already; no NaN or +inf; -inf:
            a slot of probability 0 (adds 0 without ``tail``). Not requiring grad. With ``tail``: sum_k p_k <= 1 + 1e-2.
        temperature: a positive Python number in [2.9e-39, 8.5e37] (1 / T a normal float32).
        labels: None or (...) int64/int32 in [0, V) or ``ignore_index``; positions labelled ``ignore_index``
            do not count (0 loss, exactly zero gradient).
        ignore_index: int (negative with ``process_group``); see ``labels``.
        mask: None or (...) bool or 0/1, not requiring grad: positions at 0 do not count (with ``labels``: both
            must count them).
        kind: 'forward' or 'reverse'.
        renormalize_teacher: bool; True: log-softmax the teacher over its K ids first (not with ``tail``).
        tail: bool; True: the tail-aware loss above.
        reduction: 'mean' (over the positions that count), 'sum', 'none' (shape (...)), 'batchmean' (the sum
            divided by the size of the first dim).
        {backend}
        {process_group}
        {vocab_start_index}

    Returns:
        float32 loss in nats x T^2, shape (...) for 'none', else a scalar; differentiable w.r.t. ``logits``.
{raises}
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(topk_kl_from_logits, extra_positional)
    _check_loss_options(kind, reduction, renormalize_teacher, tail)
    t = check_temperature(temperature)
    check_logits(logits)
    if logits.dim() < 2:
        raise ValueError(f"logits: expected shape (..., vocab_size) with at least one token dim (e.g. "
                         f"(N, vocab_size)), got {describe(logits)}")
    _check_teacher(logits, teacher_token_ids, teacher_log_probs, like_name="logits")
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


_fill_docs(topk_kl_from_logits)  # the from-logits entries of its docstring, as logits.py's functions


def head_at_ids(h2, weight, labels, ids, params: HeadParams, temperature, tp=None):
    """The fused head's one route (a vocab shard with ``tp``) with the logits at ``ids`` ->
    (``HeadOutputs``, the log-probs at ``ids`` (N, K) float32 = z[ids] - lse, differentiable).
    ``h2`` (N, H), ``labels`` (N,), ``ids`` (N, K) int64 (checked), ``params`` (its
    ``inv_temperature`` is set here from the checked ``temperature``: a number, or N per-row values)."""
    inv_temperature, runtime_temperature = split_temperature(temperature)
    head = linear_head(h2, weight, labels, params._replace(inv_temperature=inv_temperature), ids,
                       runtime_temperature, tp)
    return head, head.gathered_logits - head.lse[:, None]


def linear_log_probs_at_ids(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                            token_ids: torch.Tensor, *, temperature: float = 1.0, softcap: float | None = None,
                            return_entropy: bool = False, backend: str = "auto", process_group=None,
                            vocab_start_index: int | None = None, reduce_hidden_grad: bool = False,
                            return_tail: bool = False, top_k: int = 0) -> tuple:
    """``linear_log_probs``' log-probs at ``labels`` (and entropy) together with the log-probs at K
    ids per position, from one fused head call: no N x V tensor in forward or backward. What top-K
    distillation on a fused forward needs (``rl_kernels.integrations.verl``: verl's PPO log-probs
    and the student's log-probs at the teacher's top-K ids). Not in ``__all__``: the public
    functions are ``linear_log_probs`` and ``linear_topk_kl``.

    Args:
        hidden_states: (..., H) bfloat16/float16/float32. Differentiable.
        weight: (vocab_size, H), same dtype and device. Differentiable.
        labels: (...) int64/int32 in [0, vocab_size) or -100 (ignored: log-prob 0, no gradient,
            and no gradient through that position's ids either).
        token_ids: (..., K) int64/int32 ids in [0, vocab_size), K >= 1.
        temperature, softcap, return_entropy, backend: as for ``linear_log_probs`` (a per-position
            temperature tensor shaped like ``labels`` included).
        process_group, vocab_start_index, reduce_hidden_grad: a vocab-parallel head, as for
            ``linear_log_probs``: ``weight`` is this rank's (V_r, H) shard, ``labels`` and
            ``token_ids`` are global ids (checked against the whole vocabulary when it is known,
            i.e. without ``vocab_start_index``); the outputs are identical on every rank.
        return_tail: also the log of the probability outside ``token_ids``, for the tail-aware
            top-K KL (verl RFC #7856; :func:`topk_kl_per_token`'s ``tail_log_probs``); the ids
            of each position whose label is not -100 must then be distinct.
        top_k: 0 (default), or the K (1 to 128) of the student's own top K, selected in the head's
            forward pass (verl's distillation overlap metrics: no pass of ``linear_topk`` of its own).

    Returns:
        ``(log_probs, entropy, log_probs_at_ids)``: float32 nats, shapes ``labels.shape`` (entropy
        None unless asked) and ``token_ids.shape``; log_probs_at_ids = z[ids] - logsumexp(z),
        z = hidden_states @ weight.T / temperature (soft-capped first with ``softcap``), the
        logsumexp over the whole vocabulary (all shards with ``process_group``). With
        ``return_tail`` a 4th output, ``tail_log_probs`` (shape ``labels.shape``, float32,
        differentiable) = tail_lse - logsumexp(z), tail_lse the logsumexp over the vocabulary
        without the position's ids, computed with those columns masked (no 1 - sum cancellation;
        -inf when the ids cover the vocabulary; computed for -100 positions too, without gradient).
        With ``top_k`` two more, last: ``(top_log_probs, top_ids)``, shape ``labels.shape + (top_k,)``,
        float32 nats and int64 global ids, no gradient: the ``top_k`` largest logits of each position by
        (value descending, id ascending) and their log-probs, the ids those of :func:`rl_kernels.linear_topk`
        (the selection is exact; values within two float32 roundings of its, as the kernels scale the
        logits by log2(e)); an empty slot (fewer than ``top_k`` logits that are neither NaN nor -inf)
        id -1 and log-prob NaN.

    Raises:
        TypeError / ValueError as ``linear_log_probs``, and naming ``token_ids`` for a wrong dtype,
        shape, device or an id outside [0, vocab_size); NotImplementedError for ``softcap`` with a
        gradient to compute (the gathered logits' gradient under a cap is not implemented) and for
        ``return_entropy`` with ``process_group`` (not implemented on a vocab shard with gathered
        logits: call ``linear_log_probs`` for the entropy); with ``return_tail``, ValueError naming
        ``token_ids`` for an id repeated at a position whose label is not -100 (one host read);
        TypeError / ValueError naming ``top_k`` for a K that is not an int in [0, min(128, vocab_size)].
    """
    check_head_inputs(hidden_states, weight, labels, -100, check_values=False)
    temperature = check_temperature(temperature, labels)  # (a number, or one per position)
    softcap = check_softcap(softcap, temperature)
    check_bool_arg("return_entropy", return_entropy)
    check_bool_arg("return_tail", return_tail)
    check_token_ids("token_ids", token_ids, hidden_states, "hidden_states")
    lead = tuple(labels.shape)
    if softcap is not None and torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad):
        raise NotImplementedError("linear_log_probs_at_ids: the gradient of the logits at token_ids under a "
                                  "softcap is not implemented")
    tp = parallel_params(process_group, vocab_start_index, reduce_hidden_grad, -100, weight.shape[0],
                         hidden_states.device)
    if tp is not None and return_entropy:
        raise NotImplementedError("linear_log_probs_at_ids: return_entropy with process_group (a vocab shard) is "
                                  "not implemented; call linear_log_probs for the entropy")
    k = token_ids.shape[-1]
    ids = token_ids.reshape(-1, k)
    vocab_size = weight.shape[0] if tp is None else tp.vocab_size  # (None: the shards' total is not known)
    ids = checked_token_ids(ids, torch.iinfo(torch.int64).max if vocab_size is None else vocab_size, "token_ids",
                            labels.reshape(-1) != -100 if return_tail else None)  # (one host read, or an op)
    check_top_k("top_k", top_k, vocab_size, weight, minimum=0)
    params = HeadParams(backend=get_backend(backend, hidden_states.device), inv_temperature=1.0,  # (head_at_ids)
                        ignore_index=-100, return_entropy=return_entropy, name="linear_log_probs_at_ids",
                        softcap=softcap, return_tail=return_tail, top_k=top_k)  # (labels: checked in the backend call)
    head, log_q = head_at_ids(hidden_states.reshape(-1, hidden_states.shape[-1]), weight, labels.reshape(-1),
                              ids, params, temperature, tp)
    entropy = head.entropy.view(lead) if return_entropy else None
    out = (head.log_probs.view(lead), entropy, log_q.view(token_ids.shape))
    if return_tail:
        out += ((head.tail_lse - head.lse).view(lead),)
    if top_k:
        top_log_probs = torch.where(head.top_ids >= 0, head.top_logits - head.lse[:, None],
                                    torch.full((), float("nan"), device=head.lse.device))
        out += (top_log_probs.detach().view(*lead, top_k), head.top_ids.view(*lead, top_k))
    return out


def topk_kl_loss(log_q, teacher_log_probs, valid, lead, *, temperature: float, kind: str,
                 renormalize_teacher: bool, reduction: str, tail_log_probs=None) -> torch.Tensor:
    """The loss of the top-K KL functions (``linear_topk_kl``, ``rl_kernels.topk_kl_from_logits``)
    from the student's log-probs at the teacher's ids: ``log_q`` (N, K) float32 (differentiable),
    ``teacher_log_probs`` (..., K) (validated; no gradient), ``valid`` (N,) bool (the positions that
    count), ``lead`` (the positions' shape), the checked ``temperature`` and options;
    ``tail_log_probs`` (N,) float32 (differentiable): the student's log-mass outside the K ids, for
    the tail-aware loss (:func:`topk_kl_per_token`). The per-token sum is x temperature^2 (Hinton et
    al. 2015) and reduced per ``reduction``. The student's log-probs of the positions that do not
    count are replaced by 0 first: a non-finite one (NaN logits in an ignored row) would otherwise
    send 0 * NaN = NaN back through the reverse kind's q log q (the rows' gradient must be 0)."""
    zero = torch.zeros((), device=log_q.device)
    log_q = torch.where(valid[:, None], log_q, zero)
    if tail_log_probs is not None:
        tail_log_probs = torch.where(valid, tail_log_probs, zero)
    per_token = topk_kl_per_token(log_q, teacher_log_probs.reshape(log_q.shape), kind=kind,
                                  renormalize_teacher=renormalize_teacher, tail_log_probs=tail_log_probs)
    per_token = torch.where(valid, per_token * (temperature * temperature), zero)
    return _reduce(per_token, valid, lead, reduction)


# log of the smallest normal float32 (2^-126): the floor of a probability inside a logarithm in the
# tail-aware loss, so a zero mass costs a finite amount instead of +inf
LOG_TINY = -87.33654475055310898657


def topk_kl_per_token(log_q, teacher_log_probs, *, kind: str, renormalize_teacher: bool = False,
                      tail_log_probs=None) -> torch.Tensor:
    """Per-token top-K KL (N,) float32 from ``log_q`` (N, K) float32, the student's log-probs at the
    teacher's K ids (differentiable), and ``teacher_log_probs`` (N, K) (no gradient).

    Without ``tail_log_probs``: the sums over the K ids of ``linear_topk_kl``; teacher slots at
    -inf are out of its support (0 to the sum, both kinds) and renormalization is over the others.

    With ``tail_log_probs`` (N,) float32, log q_tail = log of the student's probability outside the
    K ids (differentiable): the tail-aware KL (verl RFC #7856, "Tail-aware top-k KL for on-policy
    distillation"), the exact KL of the two (K+1)-category distributions (the K ids, then one tail
    bucket holding the rest of the vocabulary):
        forward:  sum_k p_k log(p_k / q_k) + p_tail log(p_tail / q_tail)
        reverse:  sum_k q_k log(q_k / p_k) + q_tail log(q_tail / p_tail)
    with p_tail = max(0, 1 - sum_k p_k) in float64 (a teacher's top-K mass above 1 by rounding
    gives p_tail = 0). Every slot is a category (a slot at -inf has p_k = 0). Inside a logarithm a
    probability is floored at 2^-126 (``LOG_TINY``): a zero q_tail (K = V) or, for the reverse
    kind, a zero teacher probability costs a finite amount; 0 log 0 = 0 (forward, p = 0)."""
    log_pt = teacher_log_probs.detach().float()
    zero = torch.zeros((), device=log_q.device)
    if tail_log_probs is None:
        # slots with teacher log-prob -inf (zero probability: filtered by the server) are out of the
        # teacher's support and contribute exactly 0 to the sum, forward and reverse alike
        support = log_pt > float("-inf")
        if renormalize_teacher:  # over the supported slots; a token with none keeps all -inf
            log_pt = torch.where(support.any(-1, keepdim=True), torch.log_softmax(log_pt, dim=-1), log_pt)
        log_pt = torch.where(support, log_pt, zero)  # any finite value: those terms are selected out
        if kind == "forward":
            terms = log_pt.exp() * (log_pt - log_q)
        else:
            terms = log_q.exp() * (log_q - log_pt)
        return torch.where(support, terms, zero).sum(-1)
    p_tail = (1.0 - log_pt.double().exp().sum(-1)).clamp(0.0, 1.0)
    log_p_tail = p_tail.log().float()  # (-inf where the teacher has no tail)
    log_q_tail = tail_log_probs.clamp_min(LOG_TINY)
    if kind == "forward":
        p = log_pt.exp()
        slots = torch.where(p > 0, p * (log_pt - log_q), zero).sum(-1)
        tail = torch.where(p_tail > 0, p_tail.float() * (log_p_tail - log_q_tail), zero)
        return slots + tail
    floored = log_pt.clamp_min(LOG_TINY)
    slots = (log_q.exp() * (log_q - floored)).sum(-1)
    return slots + log_q_tail.exp() * (log_q_tail - log_p_tail.clamp_min(LOG_TINY))


def _reduce(per_token, valid, lead, reduction):
    if reduction == "none":
        return per_token.view(lead)
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        return per_token.sum() / valid.sum()
    return per_token.sum() / (lead[0] if len(lead) else 1)


def _check_teacher_head(student_hidden, student_weight, teacher_hidden, teacher_weight) -> None:
    """The teacher head of ``linear_jsd``: a valid (hidden, weight) pair with the student's
    leading shape, dtype, device and vocabulary (its hidden size may differ), neither requiring
    grad (:func:`rl_kernels.core.validation.check_no_grad`)."""
    check_hidden_weight(teacher_hidden, teacher_weight, "teacher_hidden", "teacher_weight", min_dim=2)
    lead = tuple(student_hidden.shape[:-1])
    if tuple(teacher_hidden.shape[:-1]) != lead:
        raise ValueError(f"teacher_hidden: expected leading shape {lead} (as student_hidden), got "
                         f"{describe(teacher_hidden)}")
    if teacher_hidden.dtype != student_hidden.dtype:
        raise TypeError(f"teacher_hidden: dtype {teacher_hidden.dtype} differs from student_hidden's "
                        f"{student_hidden.dtype}; cast one of them")
    check_same_device("teacher_hidden", teacher_hidden, student_hidden, "student_hidden")
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"teacher_weight: vocab_size {teacher_weight.shape[0]} differs from "
                         f"student_weight's {student_weight.shape[0]}; the heads must share a vocabulary")
    check_no_grad("teacher_hidden", teacher_hidden, "linear_jsd's gradient reaches the student only",
                  "compute it under torch.no_grad()")
    check_no_grad("teacher_weight", teacher_weight, "linear_jsd's gradient reaches the student only",
                  "freeze the teacher (teacher.requires_grad_(False))")


@public_signature
def linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *extra_positional,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    mask: torch.Tensor | None = None,
    beta: float = 0.5,
    reduction: str = "mean",
    backend: str = "auto",
    process_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = False,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence between a student and a teacher lm_head, per position, without
    storing either head's (tokens x vocab) logits; gradients reach the student only.

    With T = temperature, q = softmax(student_hidden @ student_weight.T / T), p = softmax(teacher_hidden @
    teacher_weight.T / T) and M = beta p + (1 - beta) q: JSD = T^2 (beta KL(p || M) + (1 - beta) KL(q || M));
    beta = 0 gives T^2 KL(p || q), beta = 1 T^2 KL(q || p) (Agarwal et al. 2024, "On-Policy Distillation of
    Language Models: Learning from Self-Generated Mistakes" (GKD), generalized JSD; the T^2 of Hinton, Vinyals,
    Dean 2015, "Distilling the Knowledge in a Neural Network").

    Args:
        student_hidden: (..., Hs) bfloat16, float16 or float32 (at least 2-D), Hs >= 1. Differentiable.
        student_weight: (V, Hs), same dtype and device. Differentiable.
        teacher_hidden: (..., Ht): the student's leading shape, dtype and device (Ht may differ). Not requiring grad.
        teacher_weight: (V, Ht): the student's V, dtype and device. Not requiring grad (e.g. a frozen teacher's).
        temperature: a positive Python number in [2.9e-39, 8.5e37]; divides both heads' logits.
        labels: None or int64/int32 of the leading shape, in [0, V) or ``ignore_index``; positions labelled
            ``ignore_index`` do not count (0 loss, exactly zero gradient, even when non-finite).
        ignore_index: int (negative with ``process_group``); see ``labels``.
        mask: None or bool or 0/1 of the leading shape, not requiring grad: positions at 0 do not count (with
            ``labels``: both must count them).
        beta: Python number in [0, 1], the teacher's weight in M.
        reduction: 'mean' (over the positions that count), 'sum', 'none' (the leading shape), 'batchmean'
            (sum / the size of the first dim).
        backend: 'auto' (Triton on CUDA, torch elsewhere), 'triton' (CUDA, or TRITON_INTERPRET=1), 'torch'.
        process_group: a torch.distributed group sharding the vocabulary: both weights are this rank's contiguous
            shard of the same rows (group-rank order); every rank returns the same loss.
        vocab_start_index: int >= 0, global id of the shards' first row (only with ``process_group``); None
            derives it from the group.
        reduce_hidden_grad: bool (only with ``process_group``): all-reduce the student's hidden gradient.

    Returns:
        float32 loss in nats x T^2, shape per ``reduction``; differentiable w.r.t. ``student_hidden`` and
        ``student_weight``. A position whose hidden states are non-finite gets a non-finite loss.

    Raises:
        TypeError: an argument of the wrong type or dtype (the message names it).
        ValueError: an argument outside the domain stated above: shape, device, value (the message names it).
        RuntimeError: backend 'triton' without CUDA or TRITON_INTERPRET=1, or without triton;
            ``process_group`` with torch.distributed not initialized; a double backward.
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(linear_jsd, extra_positional)
    beta = check_unit_interval("beta", beta)
    check_choice("reduction", reduction, REDUCTIONS)
    t = check_temperature(temperature)
    check_hidden_weight(student_hidden, student_weight, "student_hidden", "student_weight", min_dim=2)
    _check_teacher_head(student_hidden, student_weight, teacher_hidden, teacher_weight)
    lead = tuple(student_hidden.shape[:-1])
    tp = parallel_params(process_group, vocab_start_index, reduce_hidden_grad, ignore_index,
                         student_weight.shape[0], student_hidden.device)
    # (labels only select positions: with a group and vocab_start_index their values are not checked)
    valid, any_excluded = checked_positions(student_hidden, labels, ignore_index, mask, student_weight.shape[0], tp,
                                            hidden_name="student_hidden")
    backend = get_backend(backend, student_hidden.device)
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    inv_temperature, runtime_temperature = split_temperature(t)
    params = JSDParams(backend=backend, inv_temperature=inv_temperature, beta=float(beta),
                       may_have_ignored=any_excluded is not False)
    per_token = LinearJSDFunction.apply(hs, student_weight, ht, teacher_weight.detach(), valid, params,
                                        runtime_temperature, tp)  # (one route, eager and compiled)
    return _reduce(per_token, valid, lead, reduction)
