"""Forward of the fused linear head: per (token block x vocab split) partial statistics.

Program (pid_m, pid_s) owns rows [pid_m*BLOCK_M, +BLOCK_M) and vocab columns
[pid_s*SPLIT_V, min(+SPLIT_V, V)). For each BLOCK_N tile of its split it runs the K-loop GEMM tile
(``tl.dot``, fp32 accumulator), sets columns >= V to -inf (verl #2656/#2899: padded columns must
carry no probability mass) and folds the tile into running per-row (m, s, b):
m = max z, s = sum exp(z - m), b = sum exp(z - m)(z - m). It writes these three [S, N] fp32
partials; ``split_combine`` merges them. The label logit z_y = h . w_y / T is a separate, cheap
kernel (N rows of W): gathering it inside the tile loop cost ~5% of the forward and its branch
blocked the loop flattening (H100 sweep, BENCHMARKS.md).
The split size is a constant, not a function of N, so every row sees the same reduction tree in
any batch (batch invariance) and there are no atomics (run-to-run identical bits).

Mainloop variants are ``tl.constexpr`` flags that change scheduling, never arithmetic:
USE_TMA (tensor-descriptor loads), FLATTEN (one software pipeline across the split's tiles, so the
next tile's loads overlap this tile's softmax epilogue), WARP_SPEC (producer/consumer warps),
EVEN_V (V is a multiple of BLOCK_N: no column masks in the epilogue). One flag changes the
arithmetic: SOFTCAP, the logit soft-capping of Gemma-2-style heads (z = (c / T) tanh(h . w / c),
``common.soft_cap``); without it the kernels are the uncapped ones, bit for bit.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import grouped_tile, logits_tile_log2, merge_stats, merge_q, soft_cap, softcap_args, tma_operands
from .config import KernelConfig, interpreting


@triton.jit
def _linear_split_stats_kernel(
    h_ptr, w_ptr,
    part_m_ptr, part_s_ptr, part_b_ptr, part_q_ptr,
    N, V, H,
    stride_hn, stride_hk, stride_wv, stride_wk,
    logit_scale, softcap_scale,
    SPLIT_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ENTROPY: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, EVEN_V: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPEC: tl.constexpr, SUM_PI_SQUARED: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False, LIBDEVICE: tl.constexpr = False,
):
    # logit_scale: 1 / T, or 1 / softcap with SOFTCAP (then z = softcap_scale * tanh(tile))
    pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(V, SPLIT_V), GROUP_M)
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < N

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    b = tl.zeros((BLOCK_M,), tl.float32)
    q = tl.zeros((BLOCK_M,), tl.float32)

    v_begin = pid_s * SPLIT_V
    v_end = tl.minimum(v_begin + SPLIT_V, V)
    for v0 in tl.range(v_begin, v_end, BLOCK_N, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        cols = v0 + tl.arange(0, BLOCK_N)
        col_mask = cols < v_end
        # base 2: z2 = log2(e) z (the tile's last scale carries log2(e)), e = 2^(z2 - max z2), one
        # ex2 per element (flushing e < 2^-126); m and b return to natural units per row. (An
        # epilogue on the raw accumulator, max over h . w then one multiply-add, issues fewer
        # instructions but measured 1.6% slower at 4096 rows on an H100, 2026-11-26: probably the
        # accumulator's registers stay busy longer and the next tile's MMAs wait.)
        z2, _ = logits_tile_log2(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
                                 stride_hn, stride_hk, stride_wv, stride_wk, logit_scale, softcap_scale,
                                 BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, v0,
                                 SOFTCAP, LIBDEVICE)
        if not EVEN_V:  # V % BLOCK_N != 0: the last tile's padded columns carry no mass
            z2 = tl.where(col_mask[None, :], z2, float("-inf"))
        tile_m2 = tl.max(z2, axis=1)
        tile_m = tile_m2 * 0.6931471805599453
        shifted2 = z2 - tile_m2[:, None]
        e = tl.exp2(shifted2)
        tile_s = tl.sum(e, axis=1)
        if ENTROPY:
            if EVEN_V:
                tile_b = tl.sum(e * shifted2, axis=1) * 0.6931471805599453
            else:  # exp(-inf) * -inf is NaN: zero the padded columns
                tile_b = tl.sum(tl.where(col_mask[None, :], e * shifted2, 0.0), axis=1) * 0.6931471805599453
        else:
            tile_b = tl.zeros((BLOCK_M,), tl.float32)
        if SUM_PI_SQUARED:  # sum exp(2 (z - m)), merged before m and s move on
            q = merge_q(m, s, q, tile_m, tile_s, tl.sum(e * e, axis=1))
        m, s, b = merge_stats(m, s, b, tile_m, tile_s, tile_b)

    out = pid_s.to(tl.int64) * N + rows
    tl.store(part_m_ptr + out, m, mask=row_mask)
    tl.store(part_s_ptr + out, s, mask=row_mask)
    if ENTROPY:
        tl.store(part_b_ptr + out, b, mask=row_mask)
    if SUM_PI_SQUARED:
        tl.store(part_q_ptr + out, q, mask=row_mask)


@triton.jit(do_not_specialize=["check_id"])
def _label_logits_kernel(
    h_ptr, w_ptr, labels_ptr, out_ptr,
    N, V, H, K,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_lab, stride_labk,
    logit_scale, softcap_scale, ignore_index, label_flag_ptr, check_id,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, MARK_BAD: tl.constexpr,
    SOFTCAP: tl.constexpr = False, LIBDEVICE: tl.constexpr = False,
):
    # rows index the N * K (hidden row, id) pairs: hidden row = rows // K, id column = rows % K
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < N * K
    h_rows = (rows // K).to(tl.int64)
    labels = tl.load(labels_ptr + h_rows * stride_lab + (rows % K).to(tl.int64) * stride_labk,
                     mask=row_mask, other=-1)
    valid = row_mask & (labels >= 0) & (labels < V)
    offs_k = tl.arange(0, BLOCK_K)
    h_base = h_ptr + h_rows[:, None] * stride_hn
    w_base = w_ptr + tl.where(valid, labels, 0).to(tl.int64)[:, None] * stride_wv
    acc = tl.zeros((BLOCK_R,), tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + offs_k
        mask = valid[:, None] & (ks < H)[None, :]
        a = tl.load(h_base + ks.to(tl.int64)[None, :] * stride_hk, mask=mask, other=0.0)
        b = tl.load(w_base + ks.to(tl.int64)[None, :] * stride_wk, mask=mask, other=0.0)
        acc += tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)
    out = acc * logit_scale
    if SOFTCAP:
        out, _ = soft_cap(out, softcap_scale, LIBDEVICE)
    if MARK_BAD:  # a label outside [0, V) that is not ignore_index: NaN, and the call id to the flag
        bad = row_mask & (labels != ignore_index) & ((labels < 0) | (labels >= V))
        ids = tl.full((BLOCK_R,), check_id, tl.int32)
        tl.store(label_flag_ptr + tl.zeros((BLOCK_R,), tl.int32), ids, mask=bad & (ids != 0))
        out = tl.where(bad, float("nan"), out)
    tl.store(out_ptr + rows, out, mask=row_mask)


def label_logits(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    params,
    label_check: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """z_y = (h_i . w_{y_i}) * inv_temperature (with ``params.softcap`` c: c * tanh(h_i . w_{y_i} /
    c) * inv_temperature), float32 (products and sum in float32), shaped like ``labels``: (N,) or
    (N, K) ids per row (K ids of row i all dot with h_i); ids outside [0, V) (``ignore_index``)
    get 0. Reads one row of W per id. ``label_check``: (flag, check_id): an id outside [0, V)
    other than ``params.ignore_index`` gets NaN instead, and check_id is written to flag
    (``label_check.deferred_label_check``; nothing written when check_id is 0)."""
    inv_temperature, softcap = params.inv_temperature, params.softcap
    n, h = hidden_states.shape
    k = labels.shape[1] if labels.dim() == 2 else 1
    out = torch.empty(labels.shape, dtype=torch.float32, device=hidden_states.device)
    block_r = 16 if interpreting() else 32
    flag, check_id, ignore_index = (*label_check, params.ignore_index) if label_check is not None else (out, 0, -1)
    _label_logits_kernel[(triton.cdiv(n * k, block_r),)](
        hidden_states, weight, labels, out,
        n, weight.shape[0], h, k,
        hidden_states.stride(0), hidden_states.stride(1), weight.stride(0), weight.stride(1),
        labels.stride(0), labels.stride(1) if labels.dim() == 2 else 0,
        **softcap_args(softcap, inv_temperature), ignore_index=ignore_index, label_flag_ptr=flag,
        check_id=check_id, BLOCK_R=block_r, BLOCK_K=128, MARK_BAD=label_check is not None,
    )
    return out


def linear_split_stats(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    params,
    cfg: KernelConfig,
    label_check: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Per-split partials of the linear head.

    hidden_states: (N, H), weight: (V, H), both bf16/fp16/fp32 of one dtype, any strides.
    labels: (N,) int32/int64 (any value; only equality with column ids is used). ``params``: the
    head's parameter record (``inv_temperature``, ``softcap``: logits soft-capped before the
    temperature when not None, ``return_entropy``, ``return_sum_pi_squared``, ``ignore_index``).
    Returns (m, s, b, z_y, q): m, s, b (S, N) float32 with S = ceil(V / cfg.split_v) (b is left
    uninitialised without ``return_entropy``), the label logits z_y (N,) float32, and q = sum
    exp(2 (z - m)) (S, N) with ``return_sum_pi_squared`` (else None): the input of
    ``split_combine``. ``label_check``: see :func:`label_logits`.
    """
    inv_temperature, softcap = params.inv_temperature, params.softcap
    return_entropy, return_sum_pi_squared = params.return_entropy, params.return_sum_pi_squared
    n, h = hidden_states.shape
    v = weight.shape[0]
    num_splits = triton.cdiv(v, cfg.split_v)
    parts = torch.empty((3 + return_sum_pi_squared, num_splits, n), dtype=torch.float32, device=hidden_states.device)
    grid = (triton.cdiv(n, cfg.block_m) * num_splits,)
    use_tma, operands = tma_operands(cfg, cfg.block_m, cfg.block_n, (hidden_states, weight))
    _linear_split_stats_kernel[grid](
        *operands,
        parts[0], parts[1], parts[2], parts[-1],
        n, v, h,
        hidden_states.stride(0), hidden_states.stride(1), weight.stride(0), weight.stride(1),
        **softcap_args(softcap, inv_temperature),
        SPLIT_V=cfg.split_v, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        ENTROPY=return_entropy, UPCAST=cfg.upcast(hidden_states.dtype),
        DOT_PRECISION=cfg.dot_precision(hidden_states.dtype), GROUP_M=cfg.group_m,
        USE_TMA=use_tma, EVEN_V=v % cfg.block_n == 0,
        FLATTEN=cfg.flatten, WARP_SPEC=cfg.warp_specialize, SUM_PI_SQUARED=return_sum_pi_squared,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return (parts[0], parts[1], parts[2],
            label_logits(hidden_states, weight, labels, params, label_check),
            parts[3] if return_sum_pi_squared else None)
