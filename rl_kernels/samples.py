"""Regression samples: the bundled bug catalogue (generated deterministically) and sample files.

A sample file is ``.safetensors`` or ``.pt`` holding ``hidden_states`` (..., H), ``weight`` (V, H),
``labels`` (...) and optionally ``temperature`` (0-d tensor or number) and ``ignore_index``.
``save_sample`` writes one from tensors captured in training; ``load_sample`` reads it back.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import torch

SAMPLE_TENSORS = ("hidden_states", "weight", "labels")


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


def save_sample(path: str | os.PathLike, hidden_states: torch.Tensor, weight: torch.Tensor,
                labels: torch.Tensor, *, temperature: float = 1.0, ignore_index: int = -100,
                metadata: dict | None = None) -> None:
    """Write a sample file that ``rl-kernels repro PATH`` loads.

    ``.safetensors`` (recommended) or ``.pt`` by the path's suffix; tensors are detached, moved to
    CPU and stored in their own dtypes; ``metadata`` values are stored as strings.
    Raises ValueError for another suffix.
    """
    path = os.fspath(path)
    tensors = {"hidden_states": hidden_states, "weight": weight, "labels": labels}
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


def load_sample(path: str | os.PathLike) -> Sample:
    """Read a sample file (see module docstring). Raises ValueError for a missing key or a
    from-logits sample (``logits``, ``labels``), which this version cannot replay."""
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
    if "logits" in data and "hidden_states" not in data:
        raise ValueError(f"{path}: a from-logits sample ('logits', 'labels'); replaying those "
                         f"needs the from-logits kernels, which this version does not have yet")
    missing = [k for k in SAMPLE_TENSORS if k not in data]
    if missing:
        raise ValueError(f"{path}: missing {missing}; a sample holds {list(SAMPLE_TENSORS)} "
                         f"and optionally 'temperature', 'ignore_index'")

    def scalar(key, default):
        value = data.get(key, default)
        return value.item() if isinstance(value, torch.Tensor) else value

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


BUNDLED: dict[str, Callable[[], Sample]] = {
    "vocab_tail_crafted_V152064": lambda: _vocab_tail_crafted(152064, 0),
    "vocab_tail_crafted_V129920": lambda: _vocab_tail_crafted(129920, 1),
    "vocab_tail_random_V50304": _vocab_tail_random,
    "all_negative_logits": _all_negative,
    "ignore_index_3d": _ignore_index_3d,
    "hidden_904": _hidden_not_multiple_of_128,
}


def bundled_samples() -> list[Sample]:
    """The bug-catalogue samples of design.md, generated deterministically (bf16, CPU)."""
    return [make() for make in BUNDLED.values()]
