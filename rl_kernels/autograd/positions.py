"""The losses' rule for which positions count, and its value checks, on both routes.

A position counts unless its label is ``ignore_index`` (when ``labels`` is given) or its ``mask``
entry is 0 (when ``mask`` is given). The checks read values on the host (labels, mask, the top-K
teacher's ids and log-probs): eagerly here, under torch.compile inside the
``rl_kernels::counted_positions`` custom op (opaque, so the traced function holds no data-dependent
Python), with the same messages. Used by the losses of ``rl_kernels.distill`` (fused and from logits).
"""
from __future__ import annotations

import math

import torch

from ..core.validation import check_labels, check_mask, check_token_id_values
from .head_family import plain_op
from .vocab_parallel import group_from_op


def check_teacher_log_probs(teacher_log_probs) -> None:
    """ValueError naming ``teacher_log_probs`` for NaN or +inf entries (one host read)."""
    bad = torch.isnan(teacher_log_probs) | (teacher_log_probs == float("inf"))
    if teacher_log_probs.numel() and bool(bad.any()):
        first = bad.reshape(-1).nonzero()[0, 0].item()
        raise ValueError(f"teacher_log_probs: {int(bad.sum())} entries are NaN or +inf (log-probs lie in "
                         f"[-inf, 0]; -inf marks a zero-probability slot); first at flat position "
                         f"{first}: {teacher_log_probs.reshape(-1)[first].item()}")


# the largest top-K teacher mass sum_k p_k that the tail-aware KL takes (rounding up to it is clamped:
# the teacher's tail is then 0); above it the log-probs are not one distribution's
TAIL_MASS_SLACK = 1e-2


def check_tail_teacher(token_ids, teacher_log_probs, valid, ids_name: str = "teacher_token_ids") -> None:
    """The tail-aware top-K KL's checks (the tail is the vocabulary minus the SET of a position's K
    ids, and the teacher's tail mass is 1 - sum_k p_k): ValueError naming ``ids_name`` when a counted
    position (``valid`` (N,) bool) repeats an id, naming ``teacher_log_probs`` (when given) when its
    K probabilities sum above 1 + ``TAIL_MASS_SLACK``. One host read."""
    ids = token_ids.reshape(valid.shape[0], -1)
    ordered = ids.sort(-1).values
    repeated = valid & (ordered[:, 1:] == ordered[:, :-1]).any(-1)
    over = torch.zeros_like(valid)
    if teacher_log_probs is not None:
        mass = teacher_log_probs.detach().reshape(ids.shape).double().exp().sum(-1)
        over = valid & (mass > 1.0 + TAIL_MASS_SLACK)
    any_repeated, any_over = torch.stack([repeated.any(), over.any()]).tolist()
    if any_repeated:
        i = int(repeated.nonzero()[0, 0])
        raise ValueError(f"{ids_name}: the tail (the probability outside a position's K ids) needs distinct ids "
                         f"per counted position; {int(repeated.sum())} positions repeat an id, first at flat "
                         f"position {i}: {ids[i].tolist()[:16]}")
    if any_over:
        i = int(over.nonzero()[0, 0])
        raise ValueError(f"teacher_log_probs: the tail-aware KL needs a top-K mass sum_k exp(log p_k) <= 1 + "
                         f"{TAIL_MASS_SLACK} per counted position (the teacher's tail is 1 - that sum); "
                         f"{int(over.sum())} positions exceed it, first at flat position {i}: "
                         f"{float(mass[i]):.6g}")


def counted_positions(hidden_states, labels, ignore_index, mask, vocab_size, check_values: bool,
                      hidden_name: str = "hidden_states"):
    """The one rule of the losses for which positions count: a position counts unless its label
    is ``ignore_index`` (when ``labels`` is given) or its ``mask`` entry is 0 (when ``mask`` is
    given); both may be given. Validates both (label values against ``vocab_size`` unless
    ``check_values`` is False) and returns ((N,) bool, whether any position is excluded, or None
    when unknown without a host sync)."""
    lead = tuple(hidden_states.shape[:-1])
    n = hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0]
    valid = torch.ones(n, dtype=torch.bool, device=hidden_states.device)
    any_excluded = False
    if labels is not None:
        any_excluded = check_labels(labels, hidden_states, hidden_name, vocab_size, ignore_index,
                                    check_values=check_values, report_ignored=True)
        valid = labels.reshape(-1) != ignore_index
    check_mask(mask, lead, hidden_states, hidden_name, check_values=check_values)
    if mask is not None:
        valid = valid & (mask.reshape(-1) != 0)
        any_excluded = None
    return valid, any_excluded


def _op_examples() -> list:
    """opcheck's arguments (``autograd.head_family.plain_op``): labels with an ignored row and the
    top-K teacher; a mask and the tail's checks."""
    g = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(5, 8, generator=g)
    labels = torch.tensor([1, -100, 3, 0, 10])
    ids = torch.stack([torch.randperm(11, generator=g)[:3] for _ in range(5)])
    teacher_log_probs = torch.log_softmax(torch.randn(5, 3, generator=g), -1) - 0.5
    mask = torch.tensor([1, 1, 0, 1, 1])
    return [(hidden_states, labels, None, ids, teacher_log_probs, 11, -100, "hidden_states", None, None),
            (hidden_states, None, mask, ids, teacher_log_probs, 11, -100, "hidden_states", None, None, True)]


@plain_op("rl_kernels::counted_positions",
          schema="(Tensor hidden_states, Tensor? labels, Tensor? mask, Tensor? teacher_token_ids, "
                 "Tensor? teacher_log_probs, SymInt vocab_size, int ignore_index, str hidden_name, str? group_name, "
                 "int? vocab_start_index, bool tail=False) -> Tensor",
          examples=_op_examples)
def _counted_positions_op(hidden_states, labels, mask, teacher_token_ids, teacher_log_probs, vocab_size,
                          ignore_index, hidden_name, group_name, vocab_start_index, tail=False):
    """torch.compile's route of :func:`checked_positions` (ValueError as in eager) -> (N,) bool,
    the positions that count. ``vocab_size``: the head's rows; with ``group_name`` (a vocab-sharded
    head) the whole vocabulary is derived as in eager (unknown when ``vocab_start_index`` is
    given). ``tail``: the tail-aware KL's checks too (:func:`check_tail_teacher`)."""
    tp = group_from_op(group_name, vocab_start_index, False, ignore_index, vocab_size, hidden_states.device)
    return eager_positions(hidden_states, labels, ignore_index, mask, vocab_size if tp is None else tp.vocab_size,
                           hidden_name, teacher_token_ids, teacher_log_probs, tail)[0]


@_counted_positions_op.register_fake
def _(hidden_states, *args, **kwargs):
    return hidden_states.new_empty(math.prod(hidden_states.shape[:-1]), dtype=torch.bool)


def eager_positions(hidden_states, labels, ignore_index, mask, vocab_size, hidden_name="hidden_states",
                    teacher_token_ids=None, teacher_log_probs=None, tail: bool = False):
    """:func:`checked_positions`' checks on the host against ``vocab_size`` (the whole vocabulary;
    None when unknown: label values then unchecked, teacher ids checked >= 0 only); with ``tail``
    also the tail-aware KL's checks (distinct ids, teacher mass: :func:`check_tail_teacher`)."""
    if teacher_log_probs is not None:
        check_teacher_log_probs(teacher_log_probs)
    if teacher_token_ids is not None:
        known = vocab_size if vocab_size is not None else torch.iinfo(torch.int64).max
        check_token_id_values(teacher_token_ids, known, "teacher_token_ids")
    valid, any_excluded = counted_positions(hidden_states, labels, ignore_index, mask, vocab_size,
                                            check_values=vocab_size is not None, hidden_name=hidden_name)
    if tail:
        check_tail_teacher(teacher_token_ids, teacher_log_probs, valid)
    return valid, any_excluded


def checked_positions(hidden_states, labels, ignore_index, mask, local_vocab: int, tp, hidden_name="hidden_states",
                      teacher_token_ids=None, teacher_log_probs=None, tail: bool = False):
    """(valid (N,) bool, whether any position is excluded, or None when unknown) after the values
    of ``labels``, ``mask`` and the teacher's ids / log-probs are checked (ValueError naming the
    argument). ``local_vocab``: the head's rows (the logits' columns); with ``tp`` (a vocab shard)
    labels and ids are global and checked against the whole vocabulary when it is known. Eagerly
    on the host here; while torch.compile traces through ``rl_kernels::counted_positions``. ``tail``:
    the tail-aware KL's checks too (distinct ids, teacher mass: :func:`check_tail_teacher`)."""
    if not torch.compiler.is_compiling():
        return eager_positions(hidden_states, labels, ignore_index, mask, local_vocab if tp is None else tp.vocab_size,
                               hidden_name, teacher_token_ids, teacher_log_probs, tail)
    counted_positions(hidden_states, labels, ignore_index, mask, None, False, hidden_name)  # metadata
    group = (None, None) if tp is None else (tp.process_group.group_name, tp.start)
    return torch.ops.rl_kernels.counted_positions(hidden_states, labels, mask, teacher_token_ids, teacher_log_probs,
                                                  local_vocab, ignore_index, hidden_name, *group, tail), None
