"""Tolerances of the numerical tests, derived from float32 rounding, never tuned to one machine.

A float32 result computed from exact inputs passes through chains of dependent roundings: a dot
product over the hidden size H (a logit), a sum over the V columns of a row (the softmax
normalizer, the entropy's mean), a gradient's sum over V columns (dh) or N rows (dW). The
classical bound for a chain of n roundings (Higham, *Accuracy and Stability of Numerical
Algorithms*, 2nd ed., 2002, §3.1, Lemma 3.1 and eq. 3.5) is

    |error| <= gamma_n * (the magnitude summed),   gamma_n = n u / (1 - n u),   u = 2**-24,

whatever the order of the sum: any BLAS kernel (MKL picks its kernels by instruction set,
``MKL_ENABLE_INSTRUCTIONS=SSE4_2`` / ``AVX2`` / ``AVX512``), vector width
(``ATEN_CPU_CAPABILITY``), thread count or tiling satisfies it. A test bound of that form holds
on every machine; a bound read off one machine's errors does not.

The tests apply it norm-wise, in the max norm (:func:`assert_close_f32`):

    ||actual - expected||_inf <= gamma_depth * scale   (+ the rounding of a 16-bit output),

``depth`` the longest chain of dependent roundings of the compared value (each test says how it
counts it, e.g. ``H + V`` for a log-prob from hidden states: the logit's dot product, then the
row's sum), ``scale`` the magnitude the computation passes through: ``||expected||_inf`` by
default, or, where the result cancels (an entropy near 0 from logits of size 20, a gradient that
is a difference of nearly equal terms), the size of the terms it was made from, given by the test.
Rounding errors grow like sqrt(n) u in practice (random signs), not n u: the sqrt(n) >= 4 left
over is the room for a norm-wise comparison's condition factor (||A|| ||B|| / ||A B|| of a
random product is a small constant). A wrong formula, a missed column, a wrong temperature or a
row mixed with another is off by far more (1e-3 and up), so the bound still fails every bug the
tests look for.
"""
from __future__ import annotations

import torch

U32 = 2.0 ** -24
"""float32's unit roundoff (half its machine epsilon)."""


def gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u) for float32 (Higham, 2002, Lemma 3.1)."""
    assert 0 < n * U32 < 1, n
    return n * U32 / (1 - n * U32)


def f32_bound(depth: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """The max-norm error bound of a float32 computation of ``depth`` dependent roundings over
    magnitudes up to ``scale``; a result stored in a 16-bit ``dtype`` adds its own rounding (half
    an ulp of ``scale``)."""
    bound = gamma(depth) * scale
    if dtype in (torch.float16, torch.bfloat16):
        bound += torch.finfo(dtype).eps / 2 * scale
    return bound


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected||_inf in float64 (NaN where either is NaN at a place the other is not)."""
    a, e = actual.detach().double(), expected.detach().double()
    assert a.shape == e.shape, (tuple(a.shape), tuple(e.shape))
    both_inf = torch.isinf(a) & torch.isinf(e) & (torch.sign(a) == torch.sign(e))
    diff = torch.where(both_inf, 0.0, (a - e).abs())
    return float(diff.max()) if diff.numel() else 0.0


def assert_close_f32(actual: torch.Tensor, expected: torch.Tensor, *, depth: int, scale: float | None = None,
                     msg: str = "") -> float:
    """``||actual - expected||_inf <= f32_bound(depth, scale, actual.dtype)`` (module docstring);
    ``expected`` is float64 (a reference from the definitions), ``scale`` defaults to
    ``||expected||_inf``. Infinities must agree exactly; a NaN in either fails. Returns the error."""
    e = expected.detach().double()
    if scale is None:
        finite = e[torch.isfinite(e)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
    bound = f32_bound(depth, scale, actual.dtype)
    err = max_error(actual, expected)
    assert err <= bound, (f"{msg + ': ' if msg else ''}max |error| {err:.3e} > gamma_{depth} * {scale:.3g} = "
                          f"{bound:.3e} (float32 rounding bound)")
    return err
