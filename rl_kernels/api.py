"""Public functional API: ``linear_log_probs``."""
from __future__ import annotations

import logging
import math
import numbers
from typing import NamedTuple

import torch

from ._logging import log_once
from .autograd import HeadParams, LinearLogProbsFunction

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_LABEL_DTYPES = (torch.int64, torch.int32)
BACKENDS = ("auto", "triton", "torch")


class LogProbsOutput(NamedTuple):
    """log_probs, entropy and sum_pi_squared, float32, shaped like ``labels`` (entropy /
    sum_pi_squared None when not asked)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    sum_pi_squared: torch.Tensor | None = None


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


# the kernels scale logits by 1 / temperature in float32: both T and 1 / T must be normal float32
# numbers, or the scale overflows to inf (T < 2.9e-39) or flushes to 0 (T > 8.5e37)
TEMPERATURE_RANGE = (1.0 / torch.finfo(torch.float32).max, 1.0 / torch.finfo(torch.float32).tiny)


# float16 backward windows hold dz / T: far from T = 1 they leave float16's range
FP16_TEMPERATURE_RANGE = (1e-2, 1e2)


def check_temperature(temperature) -> float:
    """Return ``temperature`` as a float; raise TypeError / ValueError when it is not a positive
    finite Python number (bool and tensors are rejected) inside ``TEMPERATURE_RANGE`` (where
    1 / temperature is a normal float32 number)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature: expected a positive finite Python number (float or int), "
                        f"got {type(temperature).__name__}"
                        + ("; pass float(temperature)" if isinstance(temperature, torch.Tensor) else ""))
    try:
        value = float(temperature)
    except OverflowError:
        value = math.inf
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"temperature: expected a positive finite number, got {temperature!r}")
    lo, hi = TEMPERATURE_RANGE
    if not lo <= value <= hi:
        raise ValueError(f"temperature: {value!r} is outside the usable range [{lo:.3g}, {hi:.3g}] "
                         f"(1 / temperature must be a normal float32 number: the logits are "
                         f"scaled by it in float32)")
    return value


def check_ignore_index(ignore_index, labels: torch.Tensor | None = None) -> int:
    """Return ``ignore_index`` as an int; raise TypeError for a non-int (bool included) and
    ValueError when it does not fit ``labels``' dtype (int64, or int32 for int32 labels): a value
    that wraps around would silently ignore other rows."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    dtype = labels.dtype if labels is not None and labels.dtype in _LABEL_DTYPES else torch.int64
    info = torch.iinfo(dtype)
    if not info.min <= int(ignore_index) <= info.max:
        raise ValueError(f"ignore_index: {int(ignore_index)} does not fit the labels' dtype {dtype} "
                         f"(range [{info.min}, {info.max}])")
    return int(ignore_index)


def check_head_inputs(hidden_states, weight, labels, ignore_index, check_values: bool = True) -> bool | None:
    """Validate the linear-head inputs; raise TypeError / ValueError naming the argument. Label
    values are checked against ``weight.shape[0]`` unless ``check_values`` is False (a vocab
    shard: the caller checks global ids). Returns whether a label equals ``ignore_index`` (None
    when the values were not checked)."""
    for name, t in (("hidden_states", hidden_states), ("weight", weight), ("labels", labels)):
        check_tensor_arg(name, t)
    if hidden_states.dim() < 1:
        raise ValueError("hidden_states: expected shape (..., H), got a 0-d tensor")
    if hidden_states.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden_states: expected bfloat16, float16 or float32, got {_describe(hidden_states)}")
    check_hidden_size(hidden_states, "hidden_states")
    if weight.dim() != 2 or weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(f"weight: expected shape (vocab_size, H) with H = hidden_states.shape[-1] = "
                         f"{hidden_states.shape[-1]}, got {_describe(weight)}")
    if weight.shape[0] == 0:
        raise ValueError(f"weight: vocab_size must be >= 1, got {_describe(weight)}")
    if weight.dtype != hidden_states.dtype:
        raise TypeError(f"weight: dtype {weight.dtype} differs from hidden_states dtype "
                        f"{hidden_states.dtype}; cast one of them")
    if weight.device != hidden_states.device:
        raise ValueError(f"weight: on {weight.device}, but hidden_states is on {hidden_states.device}; "
                         f"all inputs must be on one device")
    return check_labels(labels, hidden_states, "hidden_states", weight.shape[0], ignore_index, check_values,
                        report_ignored=True)


def check_has_data(t: torch.Tensor, name: str) -> None:
    """Raise ValueError for a tensor without data (the meta device)."""
    if t.device.type == "meta":
        raise ValueError(f"{name}: a meta tensor holds no data ({_describe(t)}); pass a real CPU or CUDA tensor")


def check_tensor_arg(name: str, t) -> None:
    """TypeError unless ``t`` is a torch.Tensor; ValueError for one without data (meta)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    check_has_data(t, name)


def check_hidden_size(hidden_states: torch.Tensor, name: str) -> None:
    """Raise ValueError when the last dim (the hidden size H) of ``hidden_states`` is 0."""
    if hidden_states.shape[-1] == 0:
        raise ValueError(f"{name}: expected shape (..., H) with hidden size H >= 1, got {_describe(hidden_states)}")


def check_labels(labels, like: torch.Tensor, like_name: str, vocab_size: int, ignore_index,
                 check_values: bool = True, report_ignored: bool = False) -> bool | None:
    """Validate ``labels`` against ``like`` (hidden_states or logits): int64/int32, shape
    ``like.shape[:-1]``, same device, and (unless ``check_values`` is False, for callers that run
    :func:`check_label_values` themselves) values in [0, vocab_size) or ``ignore_index``. Raises
    TypeError / ValueError naming the argument. Returns :func:`check_label_values`' result, or
    None without ``check_values``."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels: expected a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in _LABEL_DTYPES:
        raise TypeError(f"labels: expected int64 or int32, got {_describe(labels)}")
    if tuple(labels.shape) != tuple(like.shape[:-1]):
        raise ValueError(f"labels: expected shape {tuple(like.shape[:-1])} "
                         f"({like_name} without its last dim), got {_describe(labels)}")
    if labels.device != like.device:
        raise ValueError(f"labels: on {labels.device}, but {like_name} is on {like.device}; "
                         f"all inputs must be on one device")
    check_ignore_index(ignore_index, labels)
    return check_label_values(labels, vocab_size, ignore_index, report_ignored) if check_values else None


def check_label_values(labels: torch.Tensor, vocab_size: int, ignore_index,
                       report_ignored: bool = False) -> bool | None:
    """Raise TypeError for a non-int ``ignore_index`` and ValueError for a label outside
    [0, vocab_size) that is not ``ignore_index`` (naming the count and the first position).
    With ``report_ignored``, returns whether any label equals ``ignore_index``, read in the same
    host sync (two more small reductions); otherwise None."""
    check_ignore_index(ignore_index, labels)
    if not labels.numel():
        return False if report_ignored else None
    kept = labels != ignore_index
    bad = kept & ((labels < 0) | (labels >= vocab_size))
    if report_ignored:
        any_bad, all_kept = torch.stack([bad.any(), kept.all()]).tolist()
        any_ignored = not all_kept
    else:
        any_bad, any_ignored = bool(bad.any()), None
    if any_bad:
        flat = bad.reshape(-1).nonzero()[0, 0].item()
        raise ValueError(f"labels: {int(bad.sum())} entries lie outside [0, vocab_size={vocab_size}) "
                         f"and are not ignore_index={ignore_index}; first at flat position {flat}: "
                         f"{labels.reshape(-1)[flat].item()}")
    return None if any_ignored is None else bool(any_ignored)


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map 'auto' | 'triton' | 'torch' to the backend that runs; raise when it cannot run."""
    from .ops_available import interpreting, triton_available

    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        chosen = "triton" if device.type == "cuda" and triton_available() else "torch"
        log_once(logging.INFO, f"rl_kernels: backend='auto' runs '{chosen}' for {device.type} tensors"
                 + ("" if chosen == "triton" or device.type != "cuda" else " (Triton is not installed)"))
        return chosen
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton': the triton package is not installed")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(f"backend='triton' needs CUDA tensors, got tensors on {device}; set "
                               f"TRITON_INTERPRET=1 before importing rl_kernels to use Triton's CPU "
                               f"interpreter, or use backend='torch'")
    return backend


def linear_log_probs(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = True,
    return_sum_pi_squared: bool = False,
    backend: str = "auto",
    process_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = False,
) -> LogProbsOutput:
    """Log-probability of ``labels`` and entropy of softmax(hidden_states @ weight.T / temperature),
    without materializing the (tokens x vocab) logits.

    With z_v = (h . w_v) / T:  log p(y) = z_y - logsumexp(z),  entropy = -sum_v p_v log p_v.

    Args:
        hidden_states: (..., H) bfloat16, float16 or float32, any strides (e.g. (B, T, H) or the
            (total_nnz, H) of remove-padding). Differentiable.
        weight: (V, H) like ``lm_head.weight``, same dtype and device. Differentiable.
        labels: int64/int32 with shape ``hidden_states.shape[:-1]``; each in [0, V) or
            ``ignore_index``.
        temperature: positive finite Python number (int accepted); logits are divided by it.
        ignore_index: label value whose position gets log-prob 0, entropy 0 and zero gradient.
        return_entropy: when False, entropy is not computed and returned as None.
        return_sum_pi_squared: also return sum_v p_v^2 (the collision probability used by verl's
            optimal-token-baseline estimators): one more accumulator in the same GEMM tiles,
            merged by the same split tree; differentiable (d/dz_v = 2 p_v (p_v - sum p^2)).
        backend: "auto" (Triton on CUDA, torch elsewhere; the choice is logged once), "triton"
            (CUDA, or the CPU interpreter when TRITON_INTERPRET=1 was set before import), "torch".
        process_group: a ``torch.distributed`` group over which the vocabulary is sharded
            (Megatron-style vocab-parallel ``lm_head``; ``rl_kernels.parallel``). ``weight`` is
            then this rank's contiguous shard (V_r, H) (shards may differ in size, ordered by
            group rank), ``labels`` are global ids and ``ignore_index`` must be negative. One
            all_gather of four (N,) float32 rows merges the shards; every rank returns the same
            bits. Backward gives this shard's dW and this rank's partial dh.
        vocab_start_index: global id of ``weight``'s first row; None derives it (and the total
            vocab_size, for the label check) from the group with one small all_gather.
        reduce_hidden_grad: with ``process_group``, all-reduce (sum) dh over the group in the
            backward. Leave False under Megatron's ``ColumnParallelLinear`` convention, where
            the head's input region all-reduces it (``rl_kernels.parallel``).

    Returns:
        ``LogProbsOutput(log_probs, entropy, sum_pi_squared)``: float32 tensors shaped like
        ``labels``, in nats (sum_pi_squared: a probability; None unless asked). Rows whose label
        is ``ignore_index`` get 0 for all three.
        Logits are accumulated and kept in float32 on every backend. A row whose hidden state
        holds NaN/inf gets a non-finite log-prob and entropy; other rows are unaffected (in the
        backward, such a row's gradient reaches every dW row, as in any matmul). A row whose
        label is ``ignore_index`` contributes exactly nothing to dW and dh, even when its hidden
        state is non-finite (it is selected out, not multiplied by 0).

    Raises:
        TypeError: a non-tensor input, unsupported dtype, ``weight``/``hidden_states`` dtype
            mismatch, non-integer ``ignore_index``, non-number ``temperature``.
        ValueError: shape mismatch, hidden size H = 0, labels outside [0, V) other than
            ``ignore_index``, an ``ignore_index`` that does not fit the labels' dtype, a
            temperature <= 0, non-finite or outside ``TEMPERATURE_RANGE`` (1/T must be a normal
            float32: about [2.9e-39, 8.5e37]), inputs on different devices, unknown backend.
        RuntimeError: backend "triton" on CPU without TRITON_INTERPRET=1, or without triton;
            ``process_group`` without an initialized ``torch.distributed``; differentiating the
            gradient again (``create_graph=True`` gives correct first derivatives, whose own
            backward raises "double backward is not supported by rl_kernels.linear_log_probs").

    Formula: with p = softmax(z), log p(y) = z_y - logsumexp(z) and H = log s - b / s where
    s = sum exp(z - m), b = sum exp(z - m)(z - m), m = max z (no lse - E[z] cancellation);
    gradients d log p/dz = onehot - p, dH/dz = -p (log p + H) (Shannon entropy; softmax
    derivative), divided by T for the raw logits h.w.
    Bug cases covered: verl #2656/#2899 (padded vocab columns), verl PR #7439 (all-negative
    logits), verl #6913 (3-D hidden keeps its gradient).
    """
    inv_temperature = 1.0 / check_temperature(temperature)
    has_ignored = check_head_inputs(hidden_states, weight, labels, ignore_index,
                                    check_values=process_group is None)
    for name, flag in (("return_entropy", return_entropy), ("return_sum_pi_squared", return_sum_pi_squared)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    if not isinstance(reduce_hidden_grad, bool):
        raise TypeError(f"reduce_hidden_grad: expected a bool, got {type(reduce_hidden_grad).__name__}")
    if process_group is None and (vocab_start_index is not None or reduce_hidden_grad):
        raise ValueError("vocab_start_index / reduce_hidden_grad: only meaningful with process_group")
    resolved = resolve_backend(backend, hidden_states.device)
    if hidden_states.dtype == torch.float16 and not FP16_TEMPERATURE_RANGE[0] <= temperature <= FP16_TEMPERATURE_RANGE[1]:
        log_once(logging.WARNING, f"rl_kernels: float16 inputs with temperature {temperature:g}: the backward "
                 f"keeps d loss / d logits / T in float16 for its matmuls, whose range loses gradient "
                 f"precision when T is outside {FP16_TEMPERATURE_RANGE} (measured: 2% dh error at T = 1e5); "
                 f"use bfloat16 or float32 inputs")
    lead_shape = labels.shape
    h2, labels1 = hidden_states.reshape(-1, hidden_states.shape[-1]), labels.reshape(-1)

    def params(has_ignored):
        return HeadParams(backend=resolved, inv_temperature=inv_temperature,
                          ignore_index=int(ignore_index), return_entropy=return_entropy,
                          may_have_ignored=has_ignored is not False,
                          return_sum_pi_squared=return_sum_pi_squared)

    if process_group is not None:
        from .parallel import ParallelParams, VocabParallelLinearFunction, shard_layout

        start, total = shard_layout(process_group, weight.shape[0], vocab_start_index,
                                    hidden_states.device, ignore_index)
        if total is not None:
            has_ignored = check_label_values(labels, total, ignore_index, report_ignored=True)
        tp = ParallelParams(process_group, start, total, reduce_hidden_grad)
        out = VocabParallelLinearFunction.apply(h2, weight, labels1, params(has_ignored), tp)
    else:
        out = LinearLogProbsFunction.apply(h2, weight, labels1, params(has_ignored))
    outs = list(out) if isinstance(out, tuple) else [out]
    log_probs = outs.pop(0).view(lead_shape)
    entropy = outs.pop(0).view(lead_shape) if return_entropy else None
    sum_sq = outs.pop(0).view(lead_shape) if return_sum_pi_squared else None
    return LogProbsOutput(log_probs, entropy, sum_sq)
