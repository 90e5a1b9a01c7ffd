"""Regression samples: the bundled bug catalogue (generated deterministically) and sample files.

A sample file is ``.safetensors`` or ``.pt`` holding either

* ``hidden_states`` (..., H), ``weight`` (V, H), ``labels`` (...): a linear-head sample
  (:class:`Sample`, replayed through ``linear_log_probs``), or
* ``logits`` (..., V), ``labels`` (...): a from-logits sample (:class:`LogitsSample`, replayed
  through ``logits_stats``),

and optionally ``temperature`` and ``ignore_index``; a linear-head sample
also ``softcap`` (the cap c of logits c tanh(h . w / c), e.g. Gemma 2's
``final_logit_softcapping``; absent or NaN: none). ``temperature`` is a 0-d tensor (or a number): one
temperature for every row, or a float tensor shaped like ``labels``: a temperature per row (a
per-sample temperature laid out per token, as the heads take it; float32 / float64, or bfloat16 /
float16, stored in its own dtype). ``save_sample`` /
``save_logits_sample`` write one from tensors captured in training; ``load_sample`` reads either
kind back; ``sample_files`` lists those of a directory. Both check the tensors with the public
API's rules (TypeError / ValueError naming the argument; :class:`SampleError`, a ValueError naming
the file, from ``load_sample``).
"""
from __future__ import annotations

import dataclasses
import json
import os

import torch

SAMPLE_TENSORS = ("hidden_states", "weight", "labels")
LOGITS_SAMPLE_TENSORS = ("logits", "labels")


@dataclasses.dataclass
class Sample:
    """A linear-head sample. ``baseline_bugs``: backend name (prefix) -> the known bug of that
    baseline which this sample shows (bundled samples; kept in a file's metadata by
    :func:`write_sample`); repro names it in that baseline's failing row."""

    name: str
    hidden_states: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    temperature: float | torch.Tensor = 1.0  # a number, or a per-row float tensor shaped like labels
    ignore_index: int = -100
    description: str = ""
    metadata: dict = dataclasses.field(default_factory=dict)
    baseline_bugs: dict = dataclasses.field(default_factory=dict)
    softcap: float | None = None  # logits c tanh(h . w / c) before the temperature


@dataclasses.dataclass
class LogitsSample:
    """A from-logits sample: ``logits`` (..., V) in their captured dtype, ``labels`` (...);
    ``temperature`` a number or a per-row float tensor shaped like ``labels``."""

    name: str
    logits: torch.Tensor
    labels: torch.Tensor
    temperature: float | torch.Tensor = 1.0
    ignore_index: int = -100
    description: str = ""
    metadata: dict = dataclasses.field(default_factory=dict)
    baseline_bugs: dict = dataclasses.field(default_factory=dict)


class SampleError(ValueError):
    """A sample file that cannot be replayed: missing, unreadable, not a sample, or holding inputs
    the public API rejects. ``str()`` is ``"<path>: <reason>"``; ``path`` and ``reason`` too."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def _fspath(path) -> str:
    from .core.validation import check_path_arg

    return check_path_arg("path", path)


def _sample_path(path) -> str:
    path = _fspath(path)
    if not path.endswith((".safetensors", ".pt")):
        raise ValueError(f"path: expected a .safetensors or .pt file name, got {path!r}")
    return path


def _check_target(path: str) -> None:
    """ValueError naming ``path`` unless a file can be created there: not a directory, and its
    directory exists."""
    if os.path.isdir(path):
        raise ValueError(f"path: {path!r} is a directory; expected a file name ending in .safetensors or .pt")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"path: cannot write {path!r}: directory {folder!r} does not exist")


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(mask)
    return mask


def _write(path: str, tensors: dict, temperature, ignore_index: int, metadata: dict,
           softcap: float | None = None) -> None:
    """Write the sample file. It ends with the mode of a file the user creates with ``open``
    (0o666 & ~umask), or keeps the mode of the file it replaces: safetensors writes through a
    private (0o600) temporary file renamed into place."""
    _check_target(path)
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        mode = 0o666 & ~_umask()
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    tensors["temperature"] = (temperature.detach().cpu().contiguous() if isinstance(temperature, torch.Tensor)
                              else torch.tensor(float(temperature), dtype=torch.float64))
    tensors["ignore_index"] = torch.tensor(int(ignore_index), dtype=torch.int64)
    if softcap is not None:
        tensors["softcap"] = torch.tensor(float(softcap), dtype=torch.float64)
    meta = {str(k): str(v) for k, v in metadata.items()}
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, path, metadata=meta)
    else:
        torch.save({**tensors, "metadata": meta}, path)
    if os.stat(path).st_mode & 0o7777 != mode:
        os.chmod(path, mode)


def _check_options(temperature, ignore_index, metadata) -> tuple:
    """(temperature, metadata) checked; a tensor temperature is left to :func:`_row_temperature`
    (its shape is that of tensors not checked yet), a number checked here, first."""
    from .core.validation import check_metadata_arg
    from .core.validation import check_ignore_index, check_temperature

    if not isinstance(temperature, torch.Tensor):
        temperature = check_temperature(temperature)
    check_ignore_index(ignore_index)
    return temperature, check_metadata_arg("metadata", metadata)


def _row_temperature(temperature, rows: torch.Tensor, rows_name: str = "labels"):
    """A tensor ``temperature`` checked with the heads' rules for a per-row temperature shaped like
    ``rows`` (:func:`~rl_kernels.core.validation.check_temperature`; its values with
    :func:`~rl_kernels.core.validation.row_inv_temperature`, one host read); a number as it is."""
    from .core.validation import check_temperature, row_inv_temperature

    if not isinstance(temperature, torch.Tensor):
        return temperature
    temperature = check_temperature(temperature, rows, rows_name)
    row_inv_temperature(temperature)
    return temperature


def save_sample(path: str | os.PathLike, hidden_states: torch.Tensor, weight: torch.Tensor,
                labels: torch.Tensor, *, temperature: float | torch.Tensor = 1.0, softcap: float | None = None,
                ignore_index: int = -100, metadata: dict | None = None) -> None:
    """Write a sample file that ``rl-kernels repro PATH`` loads.

    ``.safetensors`` (recommended) or ``.pt`` by the path's suffix; tensors are detached, moved to
    CPU and stored in their own dtypes; ``metadata`` values are stored as strings.
    hidden_states (..., H), weight (V, H), labels int (...); temperature: a positive finite
    Python number, or a float tensor shaped like ``labels`` (a temperature per row, e.g. verl's
    per-sample temperature laid out per token; float32, float64, bfloat16 or float16, stored in
    its dtype); softcap: None or a positive finite number. Every argument is checked first, with the
    rules of :func:`rl_kernels.linear_log_probs` (tensors of matching shapes, dtypes and device,
    labels in [0, V) or ``ignore_index``, every temperature positive and finite with 1 / T a normal
    float32, a per-row one on the labels' device and without grad): TypeError / ValueError naming
    it; ValueError for another suffix.
    """
    from .core.validation import check_head_inputs, check_softcap

    path = _sample_path(path)
    temperature, metadata = _check_options(temperature, ignore_index, metadata)
    softcap = check_softcap(softcap, temperature)
    check_head_inputs(hidden_states, weight, labels, ignore_index)
    temperature = _row_temperature(temperature, labels)
    _write(path, {"hidden_states": hidden_states, "weight": weight, "labels": labels},
           temperature, ignore_index, metadata, softcap)


def save_logits_sample(path: str | os.PathLike, logits: torch.Tensor, labels: torch.Tensor, *,
                       temperature: float | torch.Tensor = 1.0, ignore_index: int = -100,
                       metadata: dict | None = None) -> None:
    """Write a from-logits sample (``logits`` (..., V), ``labels`` (...)) that
    ``rl-kernels repro PATH`` loads; same file rules as :func:`save_sample`. Pass the logits as
    they were before the division by the temperature (the replay divides by ``temperature``: a
    positive finite number, or a float tensor shaped like ``labels``, one temperature per row).
    Arguments are checked with the rules of :func:`rl_kernels.logits_stats`: TypeError /
    ValueError naming the argument (labels not shaped ``logits.shape[:-1]``, a temperature tensor
    of another shape, a bad suffix ...)."""
    from .core.validation import check_labels
    from .core.validation import check_logits as _check_logits

    path = _sample_path(path)
    temperature, metadata = _check_options(temperature, ignore_index, metadata)
    _check_logits(logits)
    if isinstance(labels, torch.Tensor) and tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels: expected shape {tuple(logits.shape[:-1])} (logits.shape[:-1]), "
                         f"got {tuple(labels.shape)}")
    check_labels(labels, logits, "logits", logits.shape[-1], ignore_index)
    temperature = _row_temperature(temperature, logits[..., 0], "logits.shape[:-1]")
    _write(path, {"logits": logits, "labels": labels}, temperature, ignore_index, metadata)


BASELINE_BUGS_KEY = "rl_kernels.baseline_bugs"
"""The metadata key of a sample's ``baseline_bugs`` in a file (a JSON object: backend prefix -> bug)."""


def write_sample(path: str | os.PathLike, sample: Sample | LogitsSample) -> None:
    """Save a :class:`Sample` or :class:`LogitsSample` (its description and ``baseline_bugs`` go
    to the metadata, so that the file replays with the bundled sample's notes)."""
    meta = {**sample.metadata, "description": sample.description}
    if sample.baseline_bugs:
        meta[BASELINE_BUGS_KEY] = json.dumps(sample.baseline_bugs, sort_keys=True)
    if isinstance(sample, LogitsSample):
        save_logits_sample(path, sample.logits, sample.labels, temperature=sample.temperature,
                           ignore_index=sample.ignore_index, metadata=meta)
    else:
        save_sample(path, sample.hidden_states, sample.weight, sample.labels,
                    temperature=sample.temperature, softcap=sample.softcap,
                    ignore_index=sample.ignore_index, metadata=meta)


_KINDS = "a sample file is .safetensors or a torch.save .pt"
SAMPLE_SUFFIXES = (".safetensors", ".pt")


def sample_files(directory: str | os.PathLike) -> list[str]:
    """The sample files in ``directory``, sorted by name: its regular files ending in .safetensors
    or .pt (not those of its subfolders, nor hidden ones, such as a temporary file being written).
    OSError when it cannot be listed."""
    directory = os.fspath(directory)
    names = sorted(n for n in os.listdir(directory) if n.endswith(SAMPLE_SUFFIXES) and not n.startswith("."))
    return [os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))]


def _short(exc: BaseException) -> str:
    """One line of an exception's message, in full (torch.load's weights_only text reduced to
    its cause, without the generic advice around it)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
        text = text.split("Check the documentation of torch.load")[0]
    return " ".join(text.split()) or type(exc).__name__


def _looks_like_safetensors(head: bytes) -> bool:
    return len(head) >= 9 and head[8:9] == b"{"


def _read(path: str) -> tuple[dict, dict]:
    """(tensors and scalars, metadata) of a sample file; SampleError for anything unreadable."""
    if not os.path.exists(path):
        raise SampleError(path, "no such file")
    if os.path.isdir(path):
        raise SampleError(path, f"is a directory, not a sample file ({_KINDS})")
    if not os.path.isfile(path):  # a FIFO, socket or device: reading could block forever
        raise SampleError(path, f"is not a regular file ({_KINDS})")
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise SampleError(path, f"cannot be read ({exc.strerror or _short(exc)})") from exc
    if not head:
        raise SampleError(path, f"is empty, not a sample file ({_KINDS})")
    if path.endswith(".safetensors") or (not path.endswith(".pt") and _looks_like_safetensors(head)):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                data = {k: f.get_tensor(k) for k in f.keys()}
                meta = dict(f.metadata() or {})
        except Exception as exc:  # noqa: BLE001 - SafetensorError and friends: not a sample file
            raise SampleError(path, f"not a readable .safetensors file ({_short(exc)})") from exc
        return data, meta
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # zip or legacy pickle
        raise SampleError(path, ("not a torch.save file (no zip or pickle header)"
                                 if path.endswith(".pt") else f"not a sample file ({_KINDS})"))
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, EOFError, KeyError on garbage
        raise SampleError(path, f"not a torch.save file that torch.load(weights_only=True) "
                                f"reads ({type(exc).__name__}: {_short(exc)})") from exc
    if not isinstance(data, dict):
        raise SampleError(path, f"expected a dict of tensors, got {type(data).__name__}")
    meta = data.pop("metadata", None) or {}
    if not isinstance(meta, dict):
        raise SampleError(path, f"metadata: expected a dict, got {type(meta).__name__}")
    return data, {str(k): str(v) for k, v in meta.items()}


def _scalar(data: dict, key: str, default):
    """A 0-d (or one-element) tensor or a number as a Python number; ValueError otherwise."""
    value = data.get(key, default)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{key}: expected a scalar (0-d tensor or number), got a tensor of "
                             f"shape {tuple(value.shape)}")
        value = value.item()
    return value


def _per_row(temperature, labels) -> bool:
    """Whether a file's ``temperature`` is a temperature per row: a tensor of more than one element, or
    of the labels' shape (a one-element tensor of another shape is a scalar, as older files hold)."""
    return isinstance(temperature, torch.Tensor) and temperature.dim() > 0 and (
        temperature.numel() != 1 or (isinstance(labels, torch.Tensor) and temperature.shape == labels.shape))


def _validated(path: str, data: dict, meta: dict) -> Sample | LogitsSample:
    from .core.validation import check_head_inputs, check_labels, check_softcap, check_temperature
    from .core.validation import check_logits as _check_logits

    is_logits = "logits" in data and "hidden_states" not in data
    keys = LOGITS_SAMPLE_TENSORS if is_logits else SAMPLE_TENSORS
    missing = [k for k in keys if k not in data]
    if missing:
        if is_logits:
            raise SampleError(path, f"missing {missing}; a from-logits sample holds "
                                    f"{list(LOGITS_SAMPLE_TENSORS)} and optionally 'temperature', "
                                    f"'ignore_index'")
        raise SampleError(path, f"missing {missing}; a sample holds {list(SAMPLE_TENSORS)} (or "
                                f"{list(LOGITS_SAMPLE_TENSORS)} for a from-logits sample) and "
                                f"optionally 'temperature', 'ignore_index'")
    try:
        per_row = _per_row(data.get("temperature"), data["labels"])
        temperature = data["temperature"] if per_row else check_temperature(_scalar(data, "temperature", 1.0))
        softcap = _scalar(data, "softcap", None)
        if is_logits and softcap is not None:
            raise ValueError("softcap: a from-logits sample holds the model's logits, already capped; "
                             "store softcap with hidden_states / weight samples only")
        softcap = check_softcap(None if softcap is None or softcap != softcap else softcap, temperature)
        ignore_index = _scalar(data, "ignore_index", -100)
        if is_logits:
            logits, labels = data["logits"], data["labels"]
            _check_logits(logits)
            if isinstance(labels, torch.Tensor) and tuple(labels.shape) != tuple(logits.shape[:-1]):
                raise ValueError(f"labels {tuple(labels.shape)} do not match logits "
                                 f"{tuple(logits.shape)} (expected logits.shape[:-1])")
            check_labels(labels, logits, "logits", logits.shape[-1], ignore_index)
            temperature = _row_temperature(temperature, logits[..., 0], "logits.shape[:-1]")
        else:
            check_head_inputs(data["hidden_states"], data["weight"], data["labels"], ignore_index)
            temperature = _row_temperature(temperature, data["labels"])
    except (TypeError, ValueError) as exc:
        raise SampleError(path, str(exc)) from exc
    common = dict(name=os.path.basename(path), labels=data["labels"], temperature=temperature,
                  ignore_index=int(ignore_index), description=meta.get("description", ""),
                  metadata=meta, baseline_bugs=_baseline_bugs(path, meta))
    if is_logits:
        return LogitsSample(logits=data["logits"], **common)
    return Sample(hidden_states=data["hidden_states"], weight=data["weight"], softcap=softcap, **common)


def _baseline_bugs(path: str, meta: dict) -> dict:
    """The ``baseline_bugs`` a file's metadata holds (:func:`write_sample`); {} when none."""
    text = meta.get(BASELINE_BUGS_KEY)
    if text is None:
        return {}
    try:
        bugs = json.loads(text)
    except ValueError:
        bugs = None
    if not isinstance(bugs, dict) or not all(isinstance(v, str) for v in bugs.values()):
        raise SampleError(path, f"metadata {BASELINE_BUGS_KEY!r}: expected a JSON object of "
                                f"backend name -> text, got {' '.join(str(text).split())[:80]!r}")
    return bugs


def load_sample(path: str | os.PathLike) -> Sample | LogitsSample:
    """Read a sample file (see module docstring): a :class:`Sample` when it holds
    ``hidden_states``, else a :class:`LogitsSample` when it holds ``logits``.

    The sample is validated with the public API's rules (those of ``linear_log_probs`` /
    ``logits_stats``: tensor dtypes, shapes that fit together, labels in [0, V) or
    ``ignore_index``, a positive finite temperature: a scalar, or a float tensor shaped like the
    labels, one per row, kept in its stored dtype). Raises :class:`SampleError` (a
    ValueError) naming the path and what is wrong: no such file, a directory, an empty or
    unreadable file, a missing key, inputs the API rejects."""
    path = _fspath(path)
    data, meta = _read(path)
    return _validated(path, data, meta)
