"""Input validation for every public function: one place for the checks and their messages.

Each check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, device or
value) whose message starts with the argument's name and says what was expected and what was
given (shape, dtype, device). Nothing here launches a kernel; the label-value checks read the
labels once (one host sync).
"""
from __future__ import annotations

import inspect
import logging
import math
import numbers
import os
from collections.abc import Mapping

import torch

from ._logging import log_once

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LABEL_DTYPES = (torch.int64, torch.int32)

# the kernels scale logits by 1 / temperature in float32: both T and 1 / T must be normal float32
# numbers, or the scale overflows to inf (T < 2.9e-39) or flushes to 0 (T > 8.5e37)
TEMPERATURE_RANGE = (1.0 / torch.finfo(torch.float32).max, 1.0 / torch.finfo(torch.float32).tiny)
# The checks below compare with these bounds written as literals (tests/api/test_no_silent_errors.py
# checks both edges): a module-level float is a symbolic input of a graph that torch.compile traces
# with dynamic=True, which Dynamo then specializes in a second trace of the whole function.

# float16 backward windows hold dz / T: far from T = 1 they leave float16's range
FP16_TEMPERATURE_RANGE = (1e-2, 1e2)


def describe(t: torch.Tensor) -> str:
    """``shape (..), dtype .., device ..`` of a tensor, for error messages."""
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _got(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def dtype_names(dtypes) -> str:
    """``bfloat16, float16 or float32``: the names of ``dtypes`` (torch dtypes), for messages."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_dtype(name: str, t: torch.Tensor, dtypes, what: str = "") -> None:
    """TypeError naming ``name`` unless ``t``'s dtype is one of ``dtypes``: the message lists them
    (``what``: words after the list, e.g. " token ids") and describes ``t`` (the one rule of every
    dtype check here)."""
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected {dtype_names(dtypes)}{what}, got {describe(t)}")


def check_no_grad(name: str, t: torch.Tensor, why: str, fix: str = "") -> None:
    """The one rule for a tensor that a function with a differentiable result does not
    differentiate (a per-row ``temperature``, ``teacher_log_probs``, ``mask``, ``linear_jsd``'s
    teacher head): ValueError naming ``name`` when it requires grad while grad mode is on, since the
    gradient it asks for would not come; refused rather than silently detached (``why``: why no
    gradient flows to it; ``fix``: another way out than ``.detach()``). Under ``torch.no_grad``
    nothing asks for a gradient, and nothing is refused."""
    if t.requires_grad and torch.is_grad_enabled():
        raise ValueError(f"{name}: requires grad, but no gradient flows to it ({why}); pass {name}.detach()"
                         + (f" or {fix}" if fix else ""))


# ----------------------------------------------------------------------------- call shape
# Tensors are positional, every other argument keyword-only (rl_kernels/__init__.py). A public
# function catches extra positional arguments in a trailing ``*extra_positional`` (an empty tuple
# on a normal call: no wrapper, no extra Python frame, nothing for torch.compile to trace) and
# raises :func:`raise_extra_positional`'s TypeError, which says what to write instead of Python's
# "takes 3 positional arguments but 4 were given"; :func:`public_signature` hides the catch-all
# from ``inspect.signature``.
def public_signature(fn=None, *, required: tuple = ()):
    """Decorate a public function whose ``*extra_positional`` only catches misplaced keyword-only
    arguments: ``inspect.signature`` (help(), the package docstring's summary, the argument-order
    tests) then shows the function without it. ``required``: keyword-only arguments the function
    requires although they default to None (``linear_topk``'s ``k``: with a Python default of its
    own, a call that passes it by position would stop at Python's "missing argument" before the
    body could say where it belongs), shown without a default, as required, and named first by
    :func:`raise_extra_positional`. Returns ``fn`` itself (``@public_signature`` or
    ``@public_signature(required=(...))``)."""
    if fn is None:
        return lambda f: public_signature(f, required=required)
    sig = inspect.signature(fn)
    params = [p.replace(default=p.empty) if p.name in required else p
              for p in sig.parameters.values() if p.kind is not p.VAR_POSITIONAL]
    fn.__signature__ = sig.replace(parameters=params)
    return fn


def raise_extra_positional(fn, extra: tuple):
    """TypeError for a call of the public function ``fn`` with the positional arguments ``extra``
    after its tensors: it names the function and its positional arguments, says that the
    arguments after the tensors are keyword-only (listing them), and spells the call with
    keywords. The extras are read as the function's required keyword-only arguments first (its
    ``inspect.signature``: ``linear_topk(h, W, 5)`` -> ``k=5``, "k is required and keyword-only"),
    then as the others in their order (``temperature=0.7``), as Python would have bound them."""
    params = inspect.signature(fn).parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    keyword = [p.name for p in params if p.kind is p.KEYWORD_ONLY]
    required = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    meant = [*required, *(name for name in keyword if name not in required)]
    spelled = ", ".join([*positional, *(f"{name}={_short_repr(value)}" for name, value in zip(meant, extra))])
    if required:
        said = (f"{' and '.join(required)} {'is' if len(required) == 1 else 'are'} required and keyword-only, as is "
                f"every other argument after the tensors ({', '.join(keyword)})")
    else:
        said = (("temperature and every other argument" if "temperature" in keyword else "every argument")
                + f" after the tensors is keyword-only ({', '.join(keyword)})")
    raise TypeError(f"{fn.__name__}() takes {len(positional)} positional argument{'s' * (len(positional) > 1)} "
                    f"({', '.join(positional)}) but {len(positional) + len(extra)} were given: {said}; "
                    f"write {fn.__name__}({spelled}"
                    + (")" if len(extra) <= len(keyword) else ", ...): more arguments than it takes"))


def _short_repr(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor of shape {tuple(value.shape)}>"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# ----------------------------------------------------------------------------- scalars
def _positive_number(name: str, value, what: str = "a positive finite") -> float:
    """``value`` as a float; TypeError naming ``name`` unless it is a Python number (bool and
    tensors rejected), ValueError unless it is positive and finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {what} Python number (float or int), got {type(value).__name__}"
                        + (f"; pass float({name})" if isinstance(value, torch.Tensor) else ""))
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not 0 < number < math.inf:  # (NaN fails too; comparisons also trace under torch.compile)
        raise ValueError(f"{name}: expected {what} number, got {value!r}")
    return number


TEMPERATURE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_temperature(temperature, rows: torch.Tensor | None = None, rows_name: str = "labels",
                      differentiable: bool = True):
    """Return ``temperature`` as a float, or, for a function that takes a per-row temperature
    (``rows``: the labels, or the logits' leading part, whose shape it must have), a float tensor
    of that shape on ``rows``' device as it is (``rows_name``: how the errors name ``rows``). Raise
    TypeError / ValueError when it is neither a
    positive finite Python number (bool rejected) inside ``TEMPERATURE_RANGE`` (where 1 /
    temperature is a normal float32 number) nor such a tensor; a tensor that requires grad is
    refused (:func:`check_no_grad`) unless the function's result has no gradient at all
    (``differentiable`` False: ``linear_topk``). A tensor's values are checked where they are
    first read on the host (:func:`row_inv_temperature`)."""
    if isinstance(temperature, torch.Tensor) and rows is not None and temperature.dim() > 0:
        check_dtype("temperature", temperature, TEMPERATURE_DTYPES, " (a per-row temperature)")
        if temperature.shape != rows.shape:
            raise ValueError(f"temperature: a per-row temperature must have the shape of {rows_name}, "
                             f"{tuple(rows.shape)}, got {tuple(temperature.shape)}")
        if temperature.device != rows.device:
            raise ValueError(f"temperature: on {temperature.device}, expected {rows.device} (the device of "
                             f"{rows_name})")
        if differentiable:
            check_no_grad("temperature", temperature, "a per-row temperature is a constant of the softmax")
        return temperature
    value = _positive_number("temperature", temperature)
    if not 2.938736052218037e-39 <= value <= 8.507059173023462e+37:  # TEMPERATURE_RANGE
        lo, hi = TEMPERATURE_RANGE
        raise ValueError(f"temperature: {value!r} is outside the usable range [{lo:.3g}, {hi:.3g}] "
                         f"(1 / temperature must be a normal float32 number: the logits are "
                         f"scaled by it in float32)")
    return value


def row_inv_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """The (N,) float32 1 / T of a checked per-row ``temperature`` (any shape, flattened), computed
    in float64 and rounded once (the bits a Python-number temperature T gives the kernels, 1 / T
    rounded to float32). Raises ValueError, naming the first bad row, unless every T is positive,
    finite and inside ``TEMPERATURE_RANGE``: one host read of the check (a sync on CUDA)."""
    t = temperature.reshape(-1).double()
    bad = ~((t >= 2.938736052218037e-39) & (t <= 8.507059173023462e+37))  # TEMPERATURE_RANGE (NaN too)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        lo, hi = TEMPERATURE_RANGE
        raise ValueError(f"temperature: row {i} is {float(t[i])!r}; every per-row temperature must be positive, "
                         f"finite and inside [{lo:.3g}, {hi:.3g}] (1 / temperature must be a normal float32 number)")
    return (1.0 / t).float()


def check_softcap(softcap, temperature) -> float | None:
    """Return ``softcap`` as a float (None stays None: no cap); raise TypeError / ValueError when it
    is not a positive finite Python number whose inverse, and whose ratio to the (checked)
    ``temperature``, are normal float32 numbers (the kernels scale the GEMM tile by 1 / softcap and
    the tanh by softcap / temperature, in float32)."""
    if softcap is None:
        return None
    value = _positive_number("softcap", softcap, "None or a positive finite")
    if isinstance(temperature, torch.Tensor):  # per-row: softcap / T in float32 is the kernels' care
        temperature = 1.0
    if not (2.938736052218037e-39 <= value <= 8.507059173023462e+37  # TEMPERATURE_RANGE, for both
            and 2.938736052218037e-39 <= value / temperature <= 8.507059173023462e+37):
        lo, hi = TEMPERATURE_RANGE
        raise ValueError(f"softcap: {value!r} with temperature {temperature!r} is outside the usable range: "
                         f"1 / softcap and softcap / temperature must be normal float32 numbers "
                         f"(within [{lo:.3g}, {hi:.3g}])")
    return value


def warn_fp16_temperature(dtype: torch.dtype, temperature: float) -> None:
    """Log a warning (once) for float16 inputs with a temperature outside
    ``FP16_TEMPERATURE_RANGE``: the backward keeps dz / T in float16 for its matmuls."""
    lo, hi = FP16_TEMPERATURE_RANGE
    if dtype != torch.float16:
        return
    if isinstance(temperature, torch.Tensor):  # per-row: the extremes (float16 inputs only; one host read)
        temperature = next((t for t in torch.stack(temperature.aminmax()).tolist() if not lo <= t <= hi), lo)
    if not lo <= temperature <= hi:
        log_once(logging.WARNING, f"rl_kernels: float16 inputs with temperature {temperature:g}: the backward "
                 f"keeps d loss / d logits / T in float16 for its matmuls, whose range loses gradient "
                 f"precision when T is outside {FP16_TEMPERATURE_RANGE} (measured: 2% dh error at T = 1e5); "
                 f"use bfloat16 or float32 inputs")


def check_ignore_index(ignore_index, labels: torch.Tensor | None = None) -> int:
    """Return ``ignore_index`` as an int; raise TypeError for a non-int (bool included) and
    ValueError when it does not fit ``labels``' dtype (int64, or int32 for int32 labels): a value
    that wraps around would silently ignore other rows."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral):
        raise TypeError(f"ignore_index: expected an int, got {type(ignore_index).__name__}")
    dtype = labels.dtype if labels is not None and labels.dtype in LABEL_DTYPES else torch.int64
    info = torch.iinfo(dtype)
    if not info.min <= int(ignore_index) <= info.max:
        raise ValueError(f"ignore_index: {int(ignore_index)} does not fit the labels' dtype {dtype} "
                         f"(range [{info.min}, {info.max}])")
    return int(ignore_index)


def check_bool_arg(name: str, value) -> bool:
    """``value`` when it is a real bool (not 'no', 0 or None); TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool (True or False), got {_got(value)}")
    return value


def check_choice(name: str, value, choices: tuple) -> str:
    """``value`` when it is one of ``choices``; ValueError naming ``name`` otherwise."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value


def check_int_arg(name: str, value, minimum: int = 0) -> int:
    """``value`` as an int >= ``minimum``; TypeError for a bool, float, str ..., ValueError below
    the minimum, both naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int >= {minimum}, got {_got(value)}")
    if value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


MAX_TOPK = 128  # the largest top-K the kernels select (their candidate list lives in registers)


def check_top_k(name: str, k, vocab_size: int | None, weight: torch.Tensor, minimum: int = 1) -> int:
    """``k``, an int in [minimum, min(MAX_TOPK, vocab_size)] (``vocab_size`` None: a vocab shard whose
    total is not known, MAX_TOPK alone); TypeError / ValueError naming ``name`` otherwise."""
    top = MAX_TOPK if vocab_size is None else min(MAX_TOPK, vocab_size)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{name}: expected an int in [{minimum}, min({MAX_TOPK}, vocab_size)], got "
                        + (f"None ({name} is required: {name}=64)" if k is None else type(k).__name__))
    if not minimum <= k <= top:
        raise ValueError(f"{name}: expected an int in [{minimum}, min({MAX_TOPK}, vocab_size)] = [{minimum}, {top}], "
                         f"got {k}" + (f" (weight {describe(weight)})" if vocab_size is not None and k > vocab_size
                                       else ""))
    return k


def check_float_arg(name: str, value, minimum: float = 0.0, inclusive: bool = True) -> float:
    """``value`` as a finite float >= ``minimum`` (> with ``inclusive=False``); TypeError for a
    bool, str, tensor ..., ValueError for NaN, inf or out of range, both naming ``name``."""
    want = f"a finite number {'>=' if inclusive else '>'} {minimum:g}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {want}, got {_got(value)}")
    f = float(value)
    if not math.isfinite(f) or f < minimum or (not inclusive and f == minimum):
        raise ValueError(f"{name}: expected {want}, got {value!r}")
    return f


def check_unit_interval(name: str, value) -> float:
    """``value`` as a float in [0, 1]; TypeError unless it is a Python number (bool rejected),
    ValueError outside [0, 1] (NaN included), both naming ``name`` (``beta``, ``label_smoothing``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a Python number in [0, 1], got {_got(value)}")
    if not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name}: expected a Python number in [0, 1], got {value!r}")
    return float(value)


def check_path_arg(name: str, value) -> str:
    """A non-empty str / os.PathLike as a str; TypeError / ValueError naming ``name``."""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name}: expected a path (str or os.PathLike), got {_got(value)}")
    path = os.fspath(value)
    if not isinstance(path, str):
        raise TypeError(f"{name}: expected a str path, got {_got(path)}")
    if not path:
        raise ValueError(f"{name}: expected a non-empty path, got {value!r}")
    return path


def check_metadata_arg(name: str, value) -> dict:
    """None or a mapping (its values are stored as strings) as a dict; TypeError naming ``name``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{name}: expected a dict or None, got {_got(value)}")
    return dict(value)


# ----------------------------------------------------------------------------- tensors
def check_tensor_arg(name: str, t) -> None:
    """TypeError unless ``t`` is a torch.Tensor; ValueError for one without data (meta)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        raise ValueError(f"{name}: a meta tensor holds no data ({describe(t)}); pass a real CPU or CUDA tensor")


def check_same_device(name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    """ValueError naming ``name`` when ``t`` is on another device than ``like``."""
    if t.device != like.device:
        raise ValueError(f"{name}: on {t.device}, but {like_name} is on {like.device}; "
                         f"all inputs must be on one device")


def check_hidden_weight(hidden_states, weight, hidden_name: str = "hidden_states",
                        weight_name: str = "weight", min_dim: int = 1) -> None:
    """Validate a (hidden states, lm_head weight) pair: tensors with data, hidden (..., H) with
    at least ``min_dim`` dims, bfloat16/float16/float32, H >= 1; weight (vocab_size >= 1, H) of
    the same dtype and device. TypeError / ValueError naming the argument."""
    check_tensor_arg(hidden_name, hidden_states)
    check_tensor_arg(weight_name, weight)
    if hidden_states.dim() < max(min_dim, 1):
        raise ValueError(f"{hidden_name}: expected shape (..., H)"
                         f"{' with at least one token dim (e.g. (N, H))' if min_dim > 1 else ''}, "
                         f"got {describe(hidden_states)}")
    check_dtype(hidden_name, hidden_states, FLOAT_DTYPES)
    if hidden_states.shape[-1] == 0:
        raise ValueError(f"{hidden_name}: expected shape (..., H) with hidden size H >= 1, got "
                         f"{describe(hidden_states)}")
    if weight.dim() != 2 or weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(f"{weight_name}: expected shape (vocab_size, H) with H = {hidden_name}.shape[-1] = "
                         f"{hidden_states.shape[-1]}, got {describe(weight)}")
    if weight.shape[0] == 0:
        raise ValueError(f"{weight_name}: expected (vocab_size >= 1, H) rows: vocab_size must be >= 1, "
                         f"got {describe(weight)}")
    if weight.dtype != hidden_states.dtype:
        raise TypeError(f"{weight_name}: dtype {weight.dtype} differs from {hidden_name} dtype "
                        f"{hidden_states.dtype}; cast one of them")
    check_same_device(weight_name, weight, hidden_states, hidden_name)


def check_logits(logits) -> None:
    """Validate materialized logits: a tensor with data, (..., vocab_size >= 1), bf16/fp16/fp32."""
    check_tensor_arg("logits", logits)
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits: expected shape (..., vocab_size) with vocab_size >= 1, got {describe(logits)}")
    check_dtype("logits", logits, FLOAT_DTYPES)


def check_labels(labels, like: torch.Tensor, like_name: str, vocab_size: int, ignore_index,
                 check_values: bool = True, report_ignored: bool = False) -> bool | None:
    """Validate ``labels`` against ``like`` (hidden_states or logits): a tensor, int64/int32,
    shape ``like.shape[:-1]``, same device, and (unless ``check_values`` is False, for callers
    that run :func:`check_label_values` themselves) values in [0, vocab_size) or
    ``ignore_index``. Raises TypeError / ValueError naming the argument. Returns
    :func:`check_label_values`' result, or None without ``check_values``."""
    if labels is None:
        raise TypeError("labels: expected a torch.Tensor of token ids, got None")
    check_tensor_arg("labels", labels)
    check_dtype("labels", labels, LABEL_DTYPES)
    if tuple(labels.shape) != tuple(like.shape[:-1]):
        raise ValueError(f"labels: expected shape {tuple(like.shape[:-1])} "
                         f"({like_name} without its last dim), got {describe(labels)}")
    check_same_device("labels", labels, like, like_name)
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


def check_token_ids(name: str, token_ids, like: torch.Tensor, like_name: str) -> None:
    """``token_ids``: a tensor, int64/int32, shape ``like.shape[:-1] + (K,)`` with K >= 1 (``like``:
    the logits, or the hidden states, named ``like_name``), on ``like``'s device (values:
    :func:`check_token_id_values`). TypeError / ValueError naming ``name``."""
    check_tensor_arg(name, token_ids)
    lead = tuple(like.shape[:-1])
    check_dtype(name, token_ids, LABEL_DTYPES, " token ids")
    if token_ids.dim() != len(lead) + 1 or tuple(token_ids.shape[:-1]) != lead or token_ids.shape[-1] == 0:
        raise ValueError(f"{name}: expected shape {lead + ('K',)} ({like_name}' leading shape, then K >= 1 ids), "
                         f"got {describe(token_ids)}")
    check_same_device(name, token_ids, like, like_name)


def check_token_id_values(token_ids: torch.Tensor, vocab_size: int, name: str) -> None:
    """ValueError naming ``name`` when a token id lies outside [0, vocab_size) (the count, the
    first flat position and its value, the min and max; one host read): the top-K ids of
    ``topk_log_probs_from_logits`` and the teachers' ids of the distillation losses."""
    if not token_ids.numel():
        return
    bad = (token_ids < 0) | (token_ids >= vocab_size)
    if bool(bad.any()):
        first = bad.reshape(-1).nonzero()[0, 0].item()
        raise ValueError(f"{name}: values must lie in [0, vocab_size={vocab_size}); {int(bad.sum())} do not, "
                         f"first at flat position {first}: {token_ids.reshape(-1)[first].item()} (min "
                         f"{int(token_ids.min())}, max {int(token_ids.max())})")


def check_mask(mask, lead: tuple, like: torch.Tensor, like_name: str, check_values: bool = True) -> None:
    """Validate a position mask: None, or a bool / 0-1 tensor of shape ``lead`` on ``like``'s
    device, not requiring grad (:func:`check_no_grad`; the 0-1 values read on the host unless
    ``check_values`` is False). TypeError (not a tensor) / ValueError naming ``mask`` otherwise."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask: expected None or a bool/0-1 tensor of shape {tuple(lead)}, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(lead) or mask.device != like.device:
        raise ValueError(f"mask: expected a bool/0-1 tensor of shape {tuple(lead)} on {like.device} "
                         f"({like_name} without its last dim), got {describe(mask)}")
    check_no_grad("mask", mask, "it only selects the positions that count")
    if check_values and mask.dtype != torch.bool and mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"mask: expected bool or 0/1 values, got other values ({describe(mask)}; e.g. "
                         f"{mask[(mask != 0) & (mask != 1)].reshape(-1)[0].item()!r})")


def check_head_inputs(hidden_states, weight, labels, ignore_index, check_values: bool = True) -> bool | None:
    """Validate the inputs of ``linear_log_probs``: the (hidden_states, weight) pair and the
    labels. Label values are checked against ``weight.shape[0]`` unless ``check_values`` is
    False (a vocab shard: the caller checks global ids). Returns whether a label equals
    ``ignore_index`` (None when the values were not checked)."""
    check_hidden_weight(hidden_states, weight)
    return check_labels(labels, hidden_states, "hidden_states", weight.shape[0], ignore_index, check_values,
                        report_ignored=True)


def check_vocab_parallel_args(process_group, vocab_start_index, reduce_hidden_grad, ignore_index,
                              allow_reduce_hidden_grad: bool = True) -> None:
    """Validate the vocab-parallel trio (``process_group``, ``vocab_start_index``,
    ``reduce_hidden_grad``) of every function that takes it, without a collective: without a
    group the other two must be left at their defaults; with one, it must be a ProcessGroup of an
    initialized ``torch.distributed``, ``vocab_start_index`` None or an int >= 0,
    ``reduce_hidden_grad`` a bool (``allow_reduce_hidden_grad`` False: functions of logits, whose
    gradient is the shard's own), and ``ignore_index`` negative (global ids are shifted per
    shard). TypeError / ValueError / RuntimeError naming the argument."""
    check_bool_arg("reduce_hidden_grad", reduce_hidden_grad)
    if process_group is None:
        if vocab_start_index is not None or reduce_hidden_grad:
            raise ValueError("vocab_start_index / reduce_hidden_grad: only meaningful with process_group")
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group: expected a torch.distributed.ProcessGroup (e.g. "
                        f"torch.distributed.group.WORLD or a new_group()), got {type(process_group).__name__}")
    if reduce_hidden_grad and not allow_reduce_hidden_grad:
        raise ValueError("reduce_hidden_grad: only meaningful for the linear-head functions")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, numbers.Integral) or ignore_index >= 0:
        raise ValueError(f"ignore_index: with process_group it must be a negative int (global ids "
                         f"are shifted per shard), got {ignore_index!r}")
    if vocab_start_index is not None and (isinstance(vocab_start_index, bool)
                                          or not isinstance(vocab_start_index, numbers.Integral)
                                          or vocab_start_index < 0):
        raise ValueError(f"vocab_start_index: expected a non-negative int, got {vocab_start_index!r}")
