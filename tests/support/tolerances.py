"""Tolerances of the numerical tests, derived from float32 rounding, never tuned to one machine.

A float32 result computed from exact inputs passes through chains of dependent roundings: a dot
product over the hidden size H (a logit), sums over the V columns of a row (the softmax
normalizer, the entropy's mean), a gradient's sum over V columns (dh) or N rows (dW). The
classical bound for a chain of n roundings (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., 2002, §3.1, Lemma 3.1 and eq. 3.5) is

    |error| <= gamma_n * (the magnitude summed),   gamma_n = n u / (1 - n u),   u = 2**-24,

whatever the order of the sum: any BLAS kernel (MKL picks its kernels by instruction set,
``MKL_ENABLE_INSTRUCTIONS=SSE4_2`` / ``AVX2`` / ``AVX512``; so does numpy's OpenBLAS, which the Triton
interpreter's ``tl.dot`` runs on, ``OPENBLAS_CORETYPE=Nehalem`` / ``Haswell`` / ``SkylakeX``), vector width
(``ATEN_CPU_CAPABILITY``), thread count or tiling satisfies it. A bound of that form holds on every
machine; a bound read off one machine's errors does not.

What the magnitude is, for this project's heads: a logit z = h . w / T is rounded by up to
gamma_H * sum_k |h_k w_k| / T, and everything computed from logits through exp and log (log p,
entropy, lse, a KL term, p itself relative to its size, hence every gradient relative to its size)
inherits that absolute error, plus the row sums' own. So the bound of a compared tensor is

    ||actual - expected||_inf <= gamma_depth * logits * max(||expected||_inf, floor)

* ``depth``: the longest chain of dependent roundings (each test says how it counts it, e.g.
  ``H + V`` for a log-prob from hidden states, ``H + 2 V`` for its dh, ``V`` from materialized logits);
* ``logits``: the logits' magnitude factor, 1 + the largest |logit term| (:func:`head_magnitude`,
  :func:`logits_magnitude`; 1 for a computation without a softmax);
* ``floor``: 1 for values that are logs of probabilities or sums of them (their error is absolute, of
  the logits' size, even where the value is near 0), 0 for gradients (their error is relative).

A 16-bit output adds its own rounding (half an ulp of ``||expected||_inf``). Rounding errors grow
like sqrt(n) u in practice (random signs), not n u; the sqrt(n) >= 4 left over is the room for the
norm-wise form's condition factor (||A|| ||B|| / ||A B|| of a random product is a small constant). A
wrong formula, a missed or phantom column, a wrong temperature or a row mixed with another is off by
far more (1e-3 relative and up), so the bound still fails every bug the tests look for.
"""
from __future__ import annotations

import os

import torch

U32 = 2.0 ** -24
"""float32's unit roundoff (half its machine epsilon)."""


def gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u) for float32 (Higham, 2002, Lemma 3.1)."""
    assert 0 < n * U32 < 1, n
    return n * U32 / (1 - n * U32)


def head_magnitude(hidden: torch.Tensor, weight: torch.Tensor, temperature=1.0) -> float:
    """1 + max_{i,v} sum_k |hidden_ik weight_vk| / T: the magnitude of the terms of the head's logits
    (``temperature`` a number or a per-row tensor; rows of ``hidden`` flattened)."""
    h = hidden.detach().double().reshape(-1, hidden.shape[-1]).abs()
    terms = h @ weight.detach().double().abs().T
    t = torch.as_tensor(temperature, dtype=torch.float64).reshape(-1, 1) if torch.is_tensor(temperature) \
        else float(temperature)
    return 1.0 + float((terms / t).max())


def logits_magnitude(logits: torch.Tensor, temperature=1.0) -> float:
    """1 + max |logits| / T over the finite logits (``temperature`` a number or a per-row tensor)."""
    z = logits.detach().double()
    t = torch.as_tensor(temperature, dtype=torch.float64).reshape(*z.shape[:-1], 1) if torch.is_tensor(temperature) \
        else float(temperature)
    z = (z / t)[torch.isfinite(z)]
    return 1.0 + (float(z.abs().max()) if z.numel() else 0.0)


def f32_bound(depth: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """gamma_depth * scale, plus a 16-bit ``dtype``'s own rounding of ``scale`` (half an ulp)."""
    bound = gamma(depth) * scale
    if dtype in (torch.float16, torch.bfloat16):
        bound += torch.finfo(dtype).eps / 2 * scale
    return bound


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_inf in float64; infinities of the same sign agree, a NaN in either gives NaN."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, (tuple(a.shape), tuple(e.shape))
    same_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(same_inf, 0.0, (a - e).abs())
    return float(diff.max()) if diff.numel() else 0.0


def assert_close_f32(actual: torch.Tensor, expected: torch.Tensor, *, depth: int, logits: float = 1.0,
                     floor: float = 1.0, msg: str = "") -> float:
    """``||actual - expected||_inf <= gamma_depth * logits * max(||expected||_inf, floor)`` (module
    docstring), ``expected`` a float64 reference. Infinities must agree; a NaN in either fails.
    Returns the error. With ``TOLERANCE_LOG=path`` set, each call appends error / bound to ``path``."""
    e = expected.detach().double()
    finite = e[torch.isfinite(e)]
    size = max(float(finite.abs().max()) if finite.numel() else 0.0, floor)
    bound = gamma(depth) * logits * size
    if actual.dtype in (torch.float16, torch.bfloat16):
        bound += torch.finfo(actual.dtype).eps / 2 * size
    err = max_error(actual, expected)
    if os.environ.get("TOLERANCE_LOG"):  # how much room each comparison has, on this machine
        with open(os.environ["TOLERANCE_LOG"], "a") as f:
            f.write(f"{err / bound if bound else float('inf'):.3e}\t{os.environ.get('PYTEST_CURRENT_TEST', '?')}"
                    f"\t{msg}\n")
    assert err <= bound, (f"{msg + ': ' if msg else ''}max |error| {err:.3e} > gamma_{depth} * {logits:.3g} * "
                          f"{size:.3g} = {bound:.3e} (float32 rounding bound, tests/support/tolerances.py)")
    return err
