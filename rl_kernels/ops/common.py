"""Triton building blocks shared by the linear-head kernel families.

* ``logits_tile``: one (BLOCK_M x BLOCK_N) tile of ``hidden @ weight.T / temperature`` with an
  fp32 accumulator (the K-loop GEMM tile).
* ``grouped_tile``: maps a 1-D program id to (pid_m, pid_n) in groups of GROUP_M row blocks, so
  that the programs resident at one time share a few hidden-state blocks and weight tiles in L2.
* ``merge_stats``: the associative merge of two softmax partials (m, s, b), where
  ``s = sum exp(z - m)`` and ``b = sum exp(z - m) * (z - m)`` (b is kept relative to m so that the
  entropy ``log s - b / s`` never subtracts two large numbers). Identity: (-inf, 0, 0).
  ``merge_sum_sq`` merges ``q = sum exp(2 (z - m))`` alongside (sum_j p_j^2 = q / s^2).

Both are ``@triton.jit`` helpers inlined into the kernels of ``linear_forward``, ``split_combine``
and ``linear_backward``.
"""
import logging

import torch
import triton
import triton.language as tl

from .._logging import log_once
from ..ops_available import interpreting

try:  # host-side tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether 2-D ``tensors`` can be read through tensor descriptors (TMA): a Hopper-or-newer GPU
    (or the interpreter), unit last stride, 16-byte aligned base and row stride. When not, the
    pointer path runs; that choice is logged once per reason."""
    if TensorDescriptor is None:
        log_once(logging.INFO, "rl_kernels: this Triton has no tensor descriptors; the linear-head "
                 "kernels use pointer loads")
        return False
    dev = tensors[0].device
    if not interpreting() and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9):
        log_once(logging.INFO, f"rl_kernels: no TMA on {dev} (needs sm90+); pointer loads")
        return False
    for t in tensors:
        if (t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16
                or t.data_ptr() % 16 or t.shape[0] == 0):
            log_once(logging.INFO, f"rl_kernels: a {tuple(t.shape)} operand with strides {t.stride()} "
                     f"is not TMA-aligned (unit last stride, 16-byte rows and base); pointer loads")
            return False
    return True


@triton.jit
def logits_tile(
    h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
    stride_hn, stride_hk, stride_wv, stride_wk,
    inv_temperature,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr = False,
    row0=0, col0=0,
):
    """z[i, j] = (h[rows[i]] . w[cols[j]]) * inv_temperature, fp32; masked entries are garbage-free
    zeros before scaling (callers mask columns to -inf themselves). Offsets are int64.

    With USE_TMA, ``h_ptr`` / ``w_ptr`` are tensor descriptors with blocks (BLOCK_M, BLOCK_K) /
    (BLOCK_N, BLOCK_K), ``rows`` / ``cols`` are the ranges starting at ``row0`` / ``col0``, and the
    copy engine fills out-of-bounds elements with zeros, so the masks are not needed. Both paths
    sum K in the same BLOCK_K steps.
    """
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, H, BLOCK_K):
            a = h_ptr.load([row0, k0])
            b = w_ptr.load([col0, k0])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
    else:
        h_base = h_ptr + rows.to(tl.int64)[:, None] * stride_hn
        w_base = w_ptr + cols.to(tl.int64)[None, :] * stride_wv
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < H
            a = tl.load(h_base + ks.to(tl.int64)[None, :] * stride_hk,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_base + ks.to(tl.int64)[:, None] * stride_wk,
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if UPCAST:  # the CPU interpreter computes bf16 dots wrongly; do them in fp32 there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc * inv_temperature


@triton.jit
def merge_scales(m1, s1, m2, s2):
    """The common max m of two partials and each one's shift d = m_i - m and scale a = exp(d).
    An operand with s == 0 is the identity (-inf, 0, 0): d = 0, so exp(-inf - (-inf)) = NaN never
    arises."""
    m = tl.maximum(m1, m2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d1 = tl.where(s1 > 0, m1 - m_safe, 0.0)
    d2 = tl.where(s2 > 0, m2 - m_safe, 0.0)
    return m, d1, d2, tl.exp(d1), tl.exp(d2)


@triton.jit
def merge_stats(m1, s1, b1, m2, s2, b2):
    """(m1, s1, b1) (+) (m2, s2, b2) -> (m, s, b); see ``merge_scales``."""
    m, d1, d2, a1, a2 = merge_scales(m1, s1, m2, s2)
    s = a1 * s1 + a2 * s2
    b = a1 * (b1 + s1 * d1) + a2 * (b2 + s2 * d2)
    return m, s, b


@triton.jit
def merge_sum_sq(m1, s1, q1, m2, s2, q2):
    """Merged q = sum exp(2 (z - m)) of two partials (relative to their maxima m1, m2): each
    scales by exp(2 d) = a^2. With s: sum_j p_j^2 = q / s^2."""
    _, _, _, a1, a2 = merge_scales(m1, s1, m2, s2)
    return a1 * a1 * q1 + a2 * a2 * q2


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program ``pid`` of a 1-D grid of num_m * num_n -> (pid_m, pid_n), GROUP_M row blocks at a
    time with the column index moving slowest inside a group. Changes only the order in which
    tiles run, never what a tile computes."""
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    inner = pid % per_group
    return first_m + inner % group_m, inner // group_m
