"""The FSDP logits path (``use_fused_kernels=False``) of the verl patch: rl-kernels' from-logits
functions in place of verl's ``logprobs_from_logits``, ``entropy_from_logits``,
``entropy_from_logits_with_chunking`` and ``calculate_sum_pi_squared_from_logits``.

They replace verl's in ``verl.utils.torch_functional`` and in every loaded module that imported
them by name (:func:`~.patch_state.replace_by_name`); modules imported later take them from
``verl.utils.torch_functional``. Each is float32 (verl's non-flash-attn path returns the logits
dtype), chunked, with O(N) saved state, counted in :func:`~.patch_state.call_counts`, and checked by the
anomaly capture when it is on (:func:`capture_logits`: the anomalous rows' logits saved). Each takes
what verl's takes (:func:`~.patch_state.verl_fallback`): logits outside rl-kernels' kernels (float64,
meta, nested, integer / bool, 0-d, empty), and the labels and ranks on which verl's own function
returns another value or raises (:func:`_log_probs_domain`, :func:`_chunked_entropy_domain`) go to
verl's own function, with a WARNING logged once per function and reason. Under ``loss_rows_only``
on this path the model made logits for the loss rows only (:func:`~.fsdp_engine.lay_out_inputs`):
each function then computes those rows and hands verl the labels' shape, 0 elsewhere
(:func:`on_loss_rows`).
"""
from __future__ import annotations

import functools

import torch

import rl_kernels

from ...logits import _overlaps
from ...logits import entropy_from_logits as _rk_entropy_from_logits
from ...logits import log_probs_from_logits as _rk_log_probs_from_logits
from . import settings
from .patch_state import (VerlIntegrationError, check_chunk_size, outside_labels, record, replace_by_name,
                          saved_for_backward, scatter_rows, step_request, verl_fallback, verl_version)
from .signatures import check_verl_signature

LOGITS_FUNCTIONS = ("logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking")
SUM_PI_SQUARED_FUNCTION = "calculate_sum_pi_squared_from_logits"
TORCH_FUNCTIONAL = "verl.utils.torch_functional"


def _gradient_fits(logits: torch.Tensor) -> bool:
    """Whether the logits' storage can take their gradient in place: viewable as (N, vocab_size)
    without a copy, and no two elements sharing memory (not expanded)."""
    try:
        logits2d = logits.view(-1, logits.shape[-1])
    except RuntimeError:
        return False
    return not _overlaps(logits2d)


LOGITS_AS_PASSED = ("as verl passed them: already divided by verl's temperature (per sample or not), so "
                    "replayed with temperature 1")
"""The metadata of a logits-path anomaly sample: what its logits are."""


def capture_logits(function: str, logits, labels=None, log_probs=None, entropy=None, process_group=None) -> None:
    """The anomaly capture (when on) on one from-logits call of verl's logits path (``function``:
    verl's name, for the sample's metadata): its anomalous rows saved (:meth:`~rl_kernels.
    integrations.anomaly.AnomalyCapture.check_logits`; gathered over ``process_group``, a
    vocab-parallel shard's group)."""
    capture = settings.capture()
    if capture is not None:
        capture.check_logits(logits, labels, log_probs=log_probs, entropy=entropy, process_group=process_group,
                             metadata={"function": f"verl {function}", "logits": LOGITS_AS_PASSED})


def _check_tensor(name: str, value) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"logprobs_from_logits: {name}: expected a torch.Tensor, got {type(value).__name__}")


def _log_probs_domain(arguments) -> str | None:
    """Calls of ``logprobs_from_logits`` that go to verl's own function (found by the differential
    probe): 1-D logits (verl's gathers along the vocabulary, or raises, by dtype), and the labels
    of :func:`~.patch_state.outside_labels` (a label outside [0, vocab_size), -100 included: verl's
    flash-attn path gives 0, its torch path raises; labels that verl's broadcasts)."""
    logits, labels = arguments["logits"], arguments["labels"]
    if isinstance(logits, torch.Tensor) and logits.dim() == 1:
        return "1-D logits"
    if isinstance(logits, torch.Tensor):
        return outside_labels(labels, logits, logits.shape[-1])
    return None


def _chunked_entropy_domain(arguments) -> str | None:
    """``entropy_from_logits_with_chunking`` takes (batch, vocab_size) logits: others go to verl's
    (its (V,) zeros for 1-D logits, its error for 3-D and more)."""
    logits = arguments["logits"]
    if isinstance(logits, torch.Tensor) and logits.dim() != 2:
        return f"{logits.dim()}-D logits"
    return None


def on_loss_rows(with_labels: bool):
    """Decorator of a from-logits replacement (FSDP and Megatron logits paths): inside an engine step
    whose model's output layer ran on the loss rows only (``loss_rows_only`` on the logits path: the
    step request's ``inputs['logits_rows']``, the flat index of those rows among the
    ``logits_rows_total`` label rows, and ``logits_rows_made``, set by the output layer's hook), a
    call on

    * the loss rows' logits alone (``(selected, vocab_size)``: FSDP, where the model hands verl
      those), or
    * logits with every label row (``(..., vocab_size)``, 0 outside the loss rows: Megatron, whose
      engine asserts the logits have the labels' rows, :func:`.megatron_step.select_hidden_rows`)

    computes the loss rows (with the labels at those rows, ``with_labels``) and returns the labels'
    shape (``(logits_rows_total,)`` / ``logits.shape[:-1]``), 0 and no gradient elsewhere (no loss
    row: all 0, no function called). Every other call runs as it is."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(logits, *args, **kwargs):
            inputs = step_request.get().inputs
            index = inputs.get("logits_rows")
            if index is None or not inputs.get("logits_rows_made") or not isinstance(logits, torch.Tensor) \
                    or logits.dim() < 2:
                return fn(logits, *args, **kwargs)
            total, rows = inputs["logits_rows_total"], logits.shape[:-1].numel()
            index = index.to(logits.device)
            if logits.dim() == 2 and rows == index.numel():  # the loss rows alone
                shape = (total,)
            elif rows == total:  # every label row: the loss rows selected, kept in the logits' rank
                shape = logits.shape[:-1]
                logits = logits.reshape(total, -1).index_select(0, index)
                logits = logits.unsqueeze(0) if len(shape) == 2 else logits
            else:
                return fn(logits, *args, **kwargs)
            if index.numel() == 0:  # no loss row (on every rank of a TP group: they hold the same mask)
                return scatter_rows(logits.reshape(-1, logits.shape[-1])[:0].sum(-1).float(), index, shape)
            if with_labels:
                args = list(args)
                labels = args.pop(0) if args else kwargs.pop("labels")
                if isinstance(labels, torch.Tensor) and labels.numel() == total:
                    labels = labels.reshape(-1).index_select(0, index.to(labels.device)).view(logits.shape[:-1])
                args.insert(0, labels)
            return scatter_rows(fn(logits, *args, **kwargs).reshape(-1), index, shape)
        return torch.compiler.disable(wrapper)  # (as the replacement itself: eager, a context read)
    return decorate


@on_loss_rows(with_labels=True)
@verl_fallback(TORCH_FUNCTIONAL, "logprobs_from_logits", _log_probs_domain)
def logprobs_from_logits(logits, labels, inplace_backward=True):
    """rl-kernels replacement for ``verl.utils.torch_functional.logprobs_from_logits``.

    Same arguments: ``logits`` ``(..., vocab_size)`` (float32 / bfloat16 / float16; float64 and
    the other inputs of :func:`~.patch_state.outside_kernels` run verl's own function), ``labels`` int
    ``(...)``; float32 output of shape ``labels.shape``; ``inplace_backward=True`` writes the
    gradient into the logits' storage as verl's flash-attn path does (verl passes False when it
    also needs the logits for entropy). Raises TypeError naming the argument when ``logits`` or
    ``labels`` is not a torch.Tensor (a Python list, ...), and the errors of
    :func:`rl_kernels.log_probs_from_logits` otherwise.
    """
    _check_tensor("logits", logits)
    _check_tensor("labels", labels)
    if inplace_backward and not _gradient_fits(logits):
        # verl's flash-attn path reshapes such logits (a copy, e.g. verl 0.7.x dp_actor's
        # logits[:, -response_length - 1:-1] slice) and writes the gradient into that copy:
        # the same as not writing in place; expanded logits likewise get a gradient of their own
        inplace_backward = False
    if inplace_backward and saved_for_backward(logits):
        # rl-kernels' top-K distillation (verl's logits path) saved these logits for its backward,
        # which runs after this one's: its gradient goes to a tensor of its own
        inplace_backward = False
    out = _rk_log_probs_from_logits(logits, labels, inplace_backward=bool(inplace_backward))
    record("logits_log_probs_calls", "logits fsdp", labels.numel())
    capture_logits("logprobs_from_logits (FSDP logits path)", logits, labels, log_probs=out)
    return out


@on_loss_rows(with_labels=False)
@verl_fallback(TORCH_FUNCTIONAL, "entropy_from_logits")
def entropy_from_logits(logits):
    """rl-kernels replacement for ``verl.utils.torch_functional.entropy_from_logits``: float32
    entropy of shape ``logits.shape[:-1]`` (float64 logits: verl's own function). Errors as
    :func:`rl_kernels.entropy_from_logits`."""
    out = _rk_entropy_from_logits(logits)
    record("logits_entropy_calls", "logits fsdp", logits.shape[:-1].numel())
    capture_logits("entropy_from_logits (FSDP logits path)", logits, entropy=out)
    return out


@on_loss_rows(with_labels=False)
@verl_fallback(TORCH_FUNCTIONAL, "entropy_from_logits_with_chunking", _chunked_entropy_domain)
def entropy_from_logits_with_chunking(logits, chunk_size=2048):
    """rl-kernels replacement for ``entropy_from_logits_with_chunking``; rl-kernels always chunks
    (by elements, not rows), so ``chunk_size`` is only validated (:func:`~.patch_state.check_chunk_size`).
    float64 logits: verl's own function."""
    check_chunk_size(chunk_size)
    out = _rk_entropy_from_logits(logits)
    record("logits_entropy_calls", "logits fsdp", logits.shape[:-1].numel())
    capture_logits("entropy_from_logits_with_chunking (FSDP logits path)", logits, entropy=out)
    return out


@on_loss_rows(with_labels=False)
@verl_fallback(TORCH_FUNCTIONAL, SUM_PI_SQUARED_FUNCTION)
def calculate_sum_pi_squared_from_logits(logits):
    """rl-kernels replacement for ``verl.utils.torch_functional.calculate_sum_pi_squared_from_logits``:
    sum over the vocabulary of softmax(logits)^2 (float32, shape ``logits.shape[:-1]``; float64
    logits: verl's own function)."""
    out = rl_kernels.sum_pi_squared_from_logits(logits)
    record("sum_pi_squared_calls", "sum_pi_squared fsdp", logits.shape[:-1].numel())
    return out


REPLACEMENTS = {
    "logprobs_from_logits": logprobs_from_logits,
    "entropy_from_logits": entropy_from_logits,
    "entropy_from_logits_with_chunking": entropy_from_logits_with_chunking,
}
"""verl function name -> its rl-kernels replacement (the logits path)."""


def _checked(torch_functional, names) -> None:
    for name in names:
        fn = getattr(torch_functional, name, None)
        if fn is None:
            raise VerlIntegrationError(f"rl_kernels.integrations.verl: verl.utils.torch_functional has no "
                                       f"{name} in verl {verl_version()}")
        check_verl_signature(name, fn)


def patch_logits_path(torch_functional) -> list[str]:
    """Replace the three functions in ``torch_functional`` and wherever they were imported by name;
    returns the by-name places patched."""
    _checked(torch_functional, LOGITS_FUNCTIONS)
    return replace_by_name(torch_functional, REPLACEMENTS)


def patch_sum_pi_squared(torch_functional) -> list[str]:
    """Replace ``calculate_sum_pi_squared_from_logits`` in ``torch_functional`` and wherever it
    was imported by name; returns the by-name places patched."""
    _checked(torch_functional, (SUM_PI_SQUARED_FUNCTION,))
    return replace_by_name(torch_functional, {SUM_PI_SQUARED_FUNCTION: calculate_sum_pi_squared_from_logits})
