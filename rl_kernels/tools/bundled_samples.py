"""The bundled bug catalogue of ``rl-kernels repro``: regression samples generated
deterministically (no data files), each reproducing one known failure of a baseline or a corner of
the kernels. The sample format and its reading / writing: :mod:`rl_kernels.samples`."""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..samples import LogitsSample, Sample

# --------------------------------------------------------------------------- bundled samples

# the known bug of a baseline that a bundled sample reproduces (repro names it in a failing row's
# note; what torch eager computes differently, bf16 logits, repro says for every sample)
def _bugs(verl: str) -> dict:
    return {"verl": verl}


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
                              f"one dominant weight row (the last), all others very negative",
                  baseline_bugs=_bugs("verl #2656/#2899"))


def _vocab_tail_random() -> Sample:
    g = _gen(2)
    n, h, v = 64, 1024, 50304
    return Sample("vocab_tail_random_V50304",
                  torch.randn(n, h, generator=g).bfloat16(),
                  (0.02 * torch.randn(v, h, generator=g)).bfloat16(),
                  torch.randint(0, v, (n,), generator=g),
                  description="verl < 0.7.1: phantom padded columns bias log-probs by +0.0145 on "
                              "plain random data at V=50304 (H=1024); bf16 logits err ~7e-3",
                  baseline_bugs=_bugs("verl < 0.7.1: phantom padded columns"))


def _all_negative() -> Sample:
    g = _gen(3)
    n, h, v = 24, 64, 32003
    hidden = torch.rand(n, h, generator=g) + 0.5
    weight = -(torch.rand(v, h, generator=g) + 2.0)
    return Sample("all_negative_logits", hidden.bfloat16(), weight.bfloat16(),
                  torch.randint(0, v, (n,), generator=g),
                  description="verl PR #7439: every logit <= -100; a max initialised at 0 "
                              "underflows the sum -> inf/NaN",
                  baseline_bugs=_bugs("verl PR #7439"))


def _ignore_index_3d() -> Sample:
    g = _gen(4)
    b, t, h, v = 4, 9, 128, 1007
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[torch.rand(b, t, generator=g) < 0.3] = -100
    return Sample("ignore_index_3d", torch.randn(b, t, h, generator=g).bfloat16(),
                  (0.05 * torch.randn(v, h, generator=g)).bfloat16(), labels, temperature=0.7,
                  description="verl triton: labels -100 read uninitialised memory; (B, T, H) "
                              "hidden states (verl #6913)",
                  baseline_bugs=_bugs("verl #6913"))


def _hidden_not_multiple_of_128() -> Sample:
    g = _gen(5)
    n, h, v = 33, 904, 4099
    return Sample("hidden_904", torch.randn(n, h, generator=g).bfloat16(),
                  (0.02 * torch.randn(v, h, generator=g)).bfloat16(),
                  torch.randint(0, v, (n,), generator=g),
                  description="verl triton asserts H % 128 == 0; H = 896 + 8, odd V",
                  baseline_bugs=_bugs("verl triton asserts H % 128 == 0"))


def _softcap_past_cap() -> Sample:
    g = _gen(7)
    n, h, v = 48, 256, 2051
    hidden = torch.randn(n, h, generator=g)
    weight = 1.5 * torch.randn(v, h, generator=g)  # raw logits h . w ~ N(0, 24^2): a fifth past +-30
    weight[7] = 0.5 * hidden[0]  # row 0: one raw logit of ~130, far past the cap
    labels = torch.randint(0, v, (n,), generator=g)
    labels[0], labels[5] = 7, -100
    return Sample("softcap_past_cap", hidden.bfloat16(), weight.bfloat16(), labels, temperature=0.9,
                  softcap=30.0,
                  description="Gemma 2 final-logit soft-capping (c = 30, then T = 0.9): raw logits of std "
                              "24 (a fifth past the cap, the largest ~110); a head that skips the "
                              "cap (verl's fused forwards) is off by up to ~100 nats",
                  baseline_bugs=_bugs("verl's fused head applies no soft-capping"))


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
    "softcap_past_cap": _softcap_past_cap,
    "logits_bf16_temperature": _logits_bf16_temperature,
}


def bundled_samples() -> list[Sample | LogitsSample]:
    """The bug-catalogue samples (module docstring), generated deterministically (bf16, CPU); the
    last one is a from-logits sample."""
    return [make() for make in BUNDLED.values()]
