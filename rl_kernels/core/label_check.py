"""The deferred label check: label values checked inside the Triton kernels, without a host
synchronisation, and reported as a ValueError at the next rl_kernels call or backward (under the
CPU interpreter, whose kernels have run before the call returns: by the call itself).

A kernel that meets a label outside [0, vocab_size) that is not ``ignore_index`` makes that row's
outputs NaN (never a finite wrong value) and writes its call's id into a process-wide flag word in
pinned host memory; :func:`raise_label_errors`, called at the start of every public call and
backward (under torch.compile: at the start of every rl_kernels custom op's body; a CUDA-graph
replay runs no Python, so the next eager call raises), reads the word (no torch op, no sync) and
raises the error naming the call. The torch
backend, and ``$RL_KERNELS_SYNC_LABEL_CHECK=1``, check on the host instead
(``validation.check_label_values``, one sync per call)."""
from __future__ import annotations

import os

import torch

from .label_flag import label_flag, label_word
from .validation import check_label_values

SYNC_LABEL_CHECK_ENV = "RL_KERNELS_SYNC_LABEL_CHECK"
"""Set to 1 to check label values on the host inside every call (one host sync per call, the
error raised by the call itself) instead of in the kernels (see :func:`deferred_label_check`)."""

_label_calls: dict[int, tuple] = {}  # id -> (fn_name, labels shape, vocab_size, ignore_index, device)
_label_ids = iter(range(1, 2**31 - 1))


def sync_label_check() -> bool:
    """Whether ``$RL_KERNELS_SYNC_LABEL_CHECK=1`` asks for label values checked on the host."""
    return os.environ.get(SYNC_LABEL_CHECK_ENV, "") == "1"


def deferred_label_check(labels: torch.Tensor, vocab_size: int, ignore_index: int, fn_name: str,
                         in_kernel: bool) -> tuple[torch.Tensor, int]:
    """Label values for a kernel launch: returns ``(flag, call_id)`` for the kernel, which writes
    ``call_id`` into ``flag`` when it meets a label outside [0, vocab_size) that is not
    ``ignore_index``, and makes that row's outputs NaN (never a finite wrong value).

    When ``in_kernel`` is False, or ``$RL_KERNELS_SYNC_LABEL_CHECK=1``, the labels are checked
    here instead (:func:`check_label_values`, one host sync) and ``call_id`` is 0 (the kernel
    writes nothing). Otherwise no host sync happens: :func:`raise_label_errors` raises the
    ValueError at the first call of rl_kernels (or backward of one) that begins after the kernel
    has run; under the CPU interpreter the caller calls it right after its launch, so the call
    itself raises."""
    if not in_kernel or sync_label_check():
        check_label_values(labels, vocab_size, ignore_index)
        return label_flag(labels.device), 0
    call_id = next(_label_ids)
    if len(_label_calls) >= 256:  # keep the last calls only
        _label_calls.pop(next(iter(_label_calls)))
    _label_calls[call_id] = (fn_name, tuple(labels.shape), vocab_size, ignore_index, labels.device)
    return label_flag(labels.device), call_id


def raise_label_errors(this_call: int = 0) -> None:
    """Raise the ValueError of a bad label that a kernel has reported since the last check (see
    :func:`deferred_label_check`); O(1), no host sync. The flag is cleared first. ``this_call``:
    the id of the call that is raising, when its own kernel has run already (the CPU interpreter:
    :func:`raise_if_interpreted`); the message then says that this call found it, otherwise that
    the error comes from a later call than the one given the label."""
    word = label_word()
    if word is None or not word[0]:
        return
    call_id = int(word[0])
    word[0] = 0
    known = _label_calls.pop(call_id, None)
    if known is None:  # (older than the calls kept)
        what = ("labels: a value outside [0, vocab_size) that is not ignore_index was passed to an earlier "
                "rl_kernels call.")
    else:
        fn_name, shape, vocab_size, ignore_index, device = known
        what = (f"labels: a value outside [0, vocab_size={vocab_size}) that is not ignore_index={ignore_index} "
                f"was passed to rl_kernels.{fn_name} (labels of shape {shape} on {device}).")
    if call_id == this_call:
        raise ValueError(f"{what} Its kernel found it during this call (on the CPU the Triton interpreter has run "
                         f"the kernel before the call returns).")
    raise ValueError(
        f"{what} The kernel found it after that call returned, so this error comes from the next rl_kernels "
        f"call or backward; the offending rows' log-probs (and their gradient) are NaN. Set "
        f"{SYNC_LABEL_CHECK_ENV}=1 to check on the host inside the call instead (one sync per call).")


def raise_if_interpreted(label_check, device: torch.device) -> None:
    """After a launch with the deferred check: under the CPU interpreter the kernel has run
    already, so raise its label error in this call, saying so (on CUDA the next call raises)."""
    if label_check is not None and device.type == "cpu":
        raise_label_errors(this_call=label_check[1])


def checked_labels(labels: torch.Tensor, vocab_size: int, ignore_index: int, fn_name: str,
                   in_kernel: bool) -> tuple[tuple[torch.Tensor, int] | None, bool | None]:
    """The label-value check of one call, where it runs best: ``(label_check, has_ignored)``.
    With ``in_kernel`` (the Triton backend) and no ``$RL_KERNELS_SYNC_LABEL_CHECK=1``: the
    kernel's ``(flag, call_id)`` (:func:`deferred_label_check`, no host sync) and None (unknown
    whether a label is ``ignore_index``). Otherwise the labels are checked on the host here (one
    sync; ValueError now), and the result says whether any label equals ``ignore_index`` (which
    spares the backward its ignored-row check)."""
    if in_kernel and not sync_label_check():
        return deferred_label_check(labels, vocab_size, ignore_index, fn_name, in_kernel=True), None
    return None, check_label_values(labels, vocab_size, ignore_index, report_ignored=True)
