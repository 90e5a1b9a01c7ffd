"""Regression samples: the bundled bug catalogue (generated deterministically) and sample files.

A sample file is ``.safetensors`` or ``.pt`` holding either

* ``hidden_states`` (..., H), ``weight`` (V, H), ``labels`` (...): a linear-head sample
  (:class:`Sample`, replayed through ``linear_log_probs``), or
* ``logits`` (..., V), ``labels`` (...): a from-logits sample (:class:`LogitsSample`, replayed
  through ``logits_stats``),

and optionally ``temperature`` (0-d tensor or number) and ``ignore_index``. ``save_sample`` /
``save_logits_sample`` write one from tensors captured in training; ``load_sample`` reads either
kind back.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

SAMPLE_TENSORS = ("hidden_states", "weight", "labels")
LOGITS_SAMPLE_TENSORS = ("logits", "labels")


@dataclasses.dataclass
class Sample:
    name: str
    hidden_states: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    temperature: float = 1.0
    ignore_index: int = -100
    description: str = ""
    metadata: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class LogitsSample:
    """A from-logits sample: ``logits`` (..., V) in their captured dtype, ``labels`` (...)."""

    name: str
    logits: torch.Tensor
    labels: torch.Tensor
    temperature: float = 1.0
    ignore_index: int = -100
    description: str = ""
    metadata: dict = dataclasses.field(default_factory=dict)


def _write(path: str, tensors: dict, temperature: float, ignore_index: int,
           metadata: dict | None) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    tensors["temperature"] = torch.tensor(float(temperature), dtype=torch.float64)
    tensors["ignore_index"] = torch.tensor(int(ignore_index), dtype=torch.int64)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if path.endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, path, metadata=meta)
    elif path.endswith(".pt"):
        torch.save({**tensors, "metadata": meta}, path)
    else:
        raise ValueError(f"path: expected a .safetensors or .pt file name, got {path!r}")


def save_sample(path: str | os.PathLike, hidden_states: torch.Tensor, weight: torch.Tensor,
                labels: torch.Tensor, *, temperature: float = 1.0, ignore_index: int = -100,
                metadata: dict | None = None) -> None:
    """Write a sample file that ``rl-kernels repro PATH`` loads.

    ``.safetensors`` (recommended) or ``.pt`` by the path's suffix; tensors are detached, moved to
    CPU and stored in their own dtypes; ``metadata`` values are stored as strings.
    Raises ValueError for another suffix.
    """
    _write(os.fspath(path), {"hidden_states": hidden_states, "weight": weight, "labels": labels},
           temperature, ignore_index, metadata)


def save_logits_sample(path: str | os.PathLike, logits: torch.Tensor, labels: torch.Tensor, *,
                       temperature: float = 1.0, ignore_index: int = -100,
                       metadata: dict | None = None) -> None:
    """Write a from-logits sample (``logits`` (..., V), ``labels`` (...)) that
    ``rl-kernels repro PATH`` loads; same file rules as :func:`save_sample`. Pass the logits as
    they were before the division by the temperature (the replay divides by ``temperature``).
    Raises ValueError for another suffix or labels not shaped ``logits.shape[:-1]``."""
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels: expected shape {tuple(logits.shape[:-1])} (logits.shape[:-1]), "
                         f"got {tuple(labels.shape)}")
    _write(os.fspath(path), {"logits": logits, "labels": labels}, temperature, ignore_index,
           metadata)


def write_sample(path: str | os.PathLike, sample: Sample | LogitsSample) -> None:
    """Save a :class:`Sample` or :class:`LogitsSample` (its description goes to the metadata)."""
    meta = {**sample.metadata, "description": sample.description}
    if isinstance(sample, LogitsSample):
        save_logits_sample(path, sample.logits, sample.labels, temperature=sample.temperature,
                           ignore_index=sample.ignore_index, metadata=meta)
    else:
        save_sample(path, sample.hidden_states, sample.weight, sample.labels,
                    temperature=sample.temperature, ignore_index=sample.ignore_index, metadata=meta)


def load_sample(path: str | os.PathLike) -> Sample | LogitsSample:
    """Read a sample file (see module docstring): a :class:`Sample` when it holds
    ``hidden_states``, else a :class:`LogitsSample` when it holds ``logits``. Raises ValueError
    for a missing key, or labels of a from-logits sample not shaped ``logits.shape[:-1]``."""
    path = os.fspath(path)
    meta: dict = {}
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            data = {k: f.get_tensor(k) for k in f.keys()}
            meta = dict(f.metadata() or {})
    else:
        data = torch.load(path, map_location="cpu", weights_only=True)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a dict of tensors, got {type(data).__name__}")
        meta = dict(data.pop("metadata", {}) or {})

    def scalar(key, default):
        value = data.get(key, default)
        return value.item() if isinstance(value, torch.Tensor) else value

    if "logits" in data and "hidden_states" not in data:
        if "labels" not in data:
            raise ValueError(f"{path}: missing ['labels']; a from-logits sample holds "
                             f"{list(LOGITS_SAMPLE_TENSORS)} and optionally 'temperature', "
                             f"'ignore_index'")
        logits, labels = data["logits"], data["labels"]
        if tuple(labels.shape) != tuple(logits.shape[:-1]):
            raise ValueError(f"{path}: labels {tuple(labels.shape)} do not match logits "
                             f"{tuple(logits.shape)} (expected logits.shape[:-1])")
        return LogitsSample(name=os.path.basename(path), logits=logits, labels=labels,
                            temperature=float(scalar("temperature", 1.0)),
                            ignore_index=int(scalar("ignore_index", -100)),
                            description=meta.get("description", ""), metadata=meta)
    missing = [k for k in SAMPLE_TENSORS if k not in data]
    if missing:
        raise ValueError(f"{path}: missing {missing}; a sample holds {list(SAMPLE_TENSORS)} "
                         f"(or {list(LOGITS_SAMPLE_TENSORS)} for a from-logits sample) and "
                         f"optionally 'temperature', 'ignore_index'")

    return Sample(name=os.path.basename(path), hidden_states=data["hidden_states"],
                  weight=data["weight"], labels=data["labels"],
                  temperature=float(scalar("temperature", 1.0)),
                  ignore_index=int(scalar("ignore_index", -100)),
                  description=meta.get("description", ""), metadata=meta)


# --------------------------------------------------------------------------- bundled samples

def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _vocab_tail_crafted(vocab_size: int, seed: int) -> Sample:
    g = _gen(seed)
    n, h = 16, 64
    hidden = torch.rand(n, h, generator=g) + 0.5  # positive
    weight = -(torch.rand(vocab_size, h, generator=g) + 0.5)  # every row very negative
    weight[-1] = 0.05 + 0.01 * torch.rand(h, generator=g)  # the one dominant row, in the tail tile
    labels = torch.randint(0, vocab_size, (n,), generator=g)
    labels[::2] = vocab_size - 1
    return Sample(f"vocab_tail_crafted_V{vocab_size}", hidden.bfloat16(), weight.bfloat16(), labels,
                  temperature=1.5,
                  description=f"verl #2656/#2899: V={vocab_size} not a multiple of the tile; "
                              f"one dominant weight row (the last), all others very negative")


def _vocab_tail_random() -> Sample:
    g = _gen(2)
    n, h, v = 64, 1024, 50304
    return Sample("vocab_tail_random_V50304",
                  torch.randn(n, h, generator=g).bfloat16(),
                  (0.02 * torch.randn(v, h, generator=g)).bfloat16(),
                  torch.randint(0, v, (n,), generator=g),
                  description="verl < 0.7.1: phantom padded columns bias log-probs by +0.0145 on "
                              "plain random data at V=50304 (H=1024); bf16 logits err ~7e-3")


def _all_negative() -> Sample:
    g = _gen(3)
    n, h, v = 24, 64, 32003
    hidden = torch.rand(n, h, generator=g) + 0.5
    weight = -(torch.rand(v, h, generator=g) + 2.0)
    return Sample("all_negative_logits", hidden.bfloat16(), weight.bfloat16(),
                  torch.randint(0, v, (n,), generator=g),
                  description="verl PR #7439: every logit <= -100; a max initialised at 0 "
                              "underflows the sum -> inf/NaN")


def _ignore_index_3d() -> Sample:
    g = _gen(4)
    b, t, h, v = 4, 9, 128, 1007
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[torch.rand(b, t, generator=g) < 0.3] = -100
    return Sample("ignore_index_3d", torch.randn(b, t, h, generator=g).bfloat16(),
                  (0.05 * torch.randn(v, h, generator=g)).bfloat16(), labels, temperature=0.7,
                  description="verl triton: labels -100 read uninitialised memory; (B, T, H) "
                              "hidden states (verl #6913)")


def _hidden_not_multiple_of_128() -> Sample:
    g = _gen(5)
    n, h, v = 33, 904, 4099
    return Sample("hidden_904", torch.randn(n, h, generator=g).bfloat16(),
                  (0.02 * torch.randn(v, h, generator=g)).bfloat16(),
                  torch.randint(0, v, (n,), generator=g),
                  description="verl triton asserts H % 128 == 0; H = 896 + 8, odd V")


def _logits_bf16_temperature() -> LogitsSample:
    g = _gen(6)
    b, t, v = 2, 4, 1000
    logits = 3.0 * torch.randn(b, t, v, generator=g)
    logits[0, 1] = -(torch.rand(v, generator=g) * 20 + 100)  # every logit in [-120, -100]
    logits[1, 2] = torch.randn(v, generator=g) - 10.0
    logits[1, 2, -1] = 20.0  # one dominant column, the last (tail of the vocabulary)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, 1] = 3
    labels[1, 2] = v - 1
    labels[0, 3] = labels[1, 0] = -100
    return LogitsSample("logits_bf16_temperature", logits.bfloat16(), labels, temperature=0.7,
                        description="from-logits path (verl use_fused_kernels=False): (B, T, V) "
                                    "bf16 logits, which verl divides by T in bf16 (z rounded by "
                                    "up to |z| 2^-9: 0.17 nats here); labels -100; a row of "
                                    "logits <= -100 (PR #7439); a row dominated by the last "
                                    "column; V=1000")


BUNDLED: dict[str, Callable[[], Sample | LogitsSample]] = {
    "vocab_tail_crafted_V152064": lambda: _vocab_tail_crafted(152064, 0),
    "vocab_tail_crafted_V129920": lambda: _vocab_tail_crafted(129920, 1),
    "vocab_tail_random_V50304": _vocab_tail_random,
    "all_negative_logits": _all_negative,
    "ignore_index_3d": _ignore_index_3d,
    "hidden_904": _hidden_not_multiple_of_128,
    "logits_bf16_temperature": _logits_bf16_temperature,
}


def bundled_samples() -> list[Sample | LogitsSample]:
    """The bug-catalogue samples of design.md, generated deterministically (bf16, CPU); the
    last one is a from-logits sample."""
    return [make() for make in BUNDLED.values()]
