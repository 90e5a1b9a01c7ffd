"""Triton building blocks shared by the linear-head kernel families.

* ``logits_tile``: one (BLOCK_M x BLOCK_N) tile of ``hidden @ weight.T / temperature`` with an
  fp32 accumulator (the K-loop GEMM tile).
* ``grouped_tile``: maps a 1-D program id to (pid_m, pid_n) in groups of GROUP_M row blocks, so
  that the programs resident at one time share a few hidden-state blocks and weight tiles in L2.
* ``merge_stats``: the associative merge of two softmax partials (m, s, b), where
  ``s = sum exp(z - m)`` and ``b = sum exp(z - m) * (z - m)`` (b is kept relative to m so that the
  entropy ``log s - b / s`` never subtracts two large numbers). Identity: (-inf, 0, 0).

Both are ``@triton.jit`` helpers inlined into the kernels of ``linear_forward``, ``split_combine``
and ``linear_backward``.
"""
import triton
import triton.language as tl


@triton.jit
def logits_tile(
    h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
    stride_hn, stride_hk, stride_wv, stride_wk,
    inv_temperature,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """z[i, j] = (h[rows[i]] . w[cols[j]]) * inv_temperature, fp32; masked entries are garbage-free
    zeros before scaling (callers mask columns to -inf themselves). Offsets are int64."""
    offs_k = tl.arange(0, BLOCK_K)
    h_base = h_ptr + rows.to(tl.int64)[:, None] * stride_hn
    w_base = w_ptr + cols.to(tl.int64)[None, :] * stride_wv
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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
def merge_stats(m1, s1, b1, m2, s2, b2):
    """(m1, s1, b1) (+) (m2, s2, b2) -> (m, s, b). An operand with s == 0 is the identity
    (-inf, 0, 0) and contributes nothing, which avoids exp(-inf - (-inf)) = NaN."""
    m = tl.maximum(m1, m2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d1 = tl.where(s1 > 0, m1 - m_safe, 0.0)
    d2 = tl.where(s2 > 0, m2 - m_safe, 0.0)
    a1 = tl.exp(d1)
    a2 = tl.exp(d2)
    s = a1 * s1 + a2 * s2
    b = a1 * (b1 + s1 * d1) + a2 * (b2 + s2 * d2)
    return m, s, b


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
