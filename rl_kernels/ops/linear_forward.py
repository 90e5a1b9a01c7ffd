"""Forward mainloop of the fused linear head: per (token block x vocab split) partial statistics.

Program (pid_m, pid_s) owns rows [pid_m*BLOCK_M, +BLOCK_M) and vocab columns
[pid_s*SPLIT_V, min(+SPLIT_V, V)). For each BLOCK_N tile of its split it runs the K-loop GEMM tile
(``tl.dot``, fp32 accumulator), sets columns >= V to -inf (verl #2656/#2899: padded columns must
carry no probability mass) and folds the tile into running per-row (m, s, b, z_y):
m = max z, s = sum exp(z - m), b = sum exp(z - m)(z - m), z_y = logit of the label when it lies in
this split (else 0). It writes these four [S, N] fp32 partials; ``split_combine`` merges them.
The split size is a constant, not a function of N, so every row sees the same reduction tree in
any batch (batch invariance) and there are no atomics (run-to-run identical bits).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import grouped_tile, logits_tile, merge_stats
from .config import KernelConfig


@triton.jit
def _linear_split_stats_kernel(
    h_ptr, w_ptr, labels_ptr,
    part_m_ptr, part_s_ptr, part_b_ptr, part_zy_ptr,
    N, V, H,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_lab,
    inv_temperature,
    SPLIT_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(V, SPLIT_V), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    labels = tl.load(labels_ptr + rows.to(tl.int64) * stride_lab, mask=row_mask, other=-1)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    b = tl.zeros((BLOCK_M,), tl.float32)
    zy = tl.zeros((BLOCK_M,), tl.float32)

    v_begin = pid_s * SPLIT_V
    v_end = tl.minimum(v_begin + SPLIT_V, V)
    for v0 in range(v_begin, v_end, BLOCK_N):
        cols = v0 + tl.arange(0, BLOCK_N)
        col_mask = cols < v_end
        z = logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
                        stride_hn, stride_hk, stride_wv, stride_wk, inv_temperature,
                        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION)
        z = tl.where(col_mask[None, :], z, float("-inf"))
        tile_m = tl.max(z, axis=1)
        shifted = z - tile_m[:, None]
        e = tl.exp(shifted)
        tile_s = tl.sum(e, axis=1)
        if COMPUTE_ENTROPY:
            tile_b = tl.sum(tl.where(col_mask[None, :], e * shifted, 0.0), axis=1)
        else:
            tile_b = tl.zeros((BLOCK_M,), tl.float32)
        m, s, b = merge_stats(m, s, b, tile_m, tile_s, tile_b)
        zy += tl.sum(tl.where(cols[None, :] == labels[:, None], z, 0.0), axis=1)

    out = pid_s.to(tl.int64) * N + rows
    tl.store(part_m_ptr + out, m, mask=row_mask)
    tl.store(part_s_ptr + out, s, mask=row_mask)
    tl.store(part_zy_ptr + out, zy, mask=row_mask)
    if COMPUTE_ENTROPY:
        tl.store(part_b_ptr + out, b, mask=row_mask)


def linear_split_stats(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_temperature: float,
    compute_entropy: bool,
    cfg: KernelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-split partials of the linear head.

    hidden_states: (N, H), weight: (V, H), both bf16/fp16/fp32 of one dtype, any strides.
    labels: (N,) int32/int64 (any value; only equality with column ids is used).
    Returns (m, s, b, z_y), each (S, N) float32 with S = ceil(V / cfg.split_v); b is left
    uninitialised when ``compute_entropy`` is False.
    """
    n, h = hidden_states.shape
    v = weight.shape[0]
    num_splits = triton.cdiv(v, cfg.split_v)
    parts = torch.empty((4, num_splits, n), dtype=torch.float32, device=hidden_states.device)
    grid = (triton.cdiv(n, cfg.block_m) * num_splits,)
    _linear_split_stats_kernel[grid](
        hidden_states, weight, labels,
        parts[0], parts[1], parts[2], parts[3],
        n, v, h,
        hidden_states.stride(0), hidden_states.stride(1), weight.stride(0), weight.stride(1),
        labels.stride(0),
        inv_temperature,
        SPLIT_V=cfg.split_v, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        COMPUTE_ENTROPY=compute_entropy, UPCAST=cfg.upcast(hidden_states.dtype),
        DOT_PRECISION=cfg.dot_precision(hidden_states.dtype), GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return parts[0], parts[1], parts[2], parts[3]
