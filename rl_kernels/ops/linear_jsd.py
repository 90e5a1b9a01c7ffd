"""Generalized Jensen-Shannon divergence between two linear heads, without N x V logits.

Student z_s = h_s W_s^T / T and teacher z_t = h_t W_t^T / T share the vocabulary V (their hidden
sizes may differ). With log q = z_s - lse_s, log p = z_t - lse_t (the lse of each head comes from
the fused forward, ``linear_split_stats`` + ``split_combine``) and M = beta p + (1 - beta) q:

    MODE 0 (beta = 0):  L = sum_v p (log p - log q)                    forward KL(p || q)
    MODE 1 (beta = 1):  L = sum_v q (log q - log p)                    reverse KL(q || p)
    MODE 2 (else):      L = sum_v beta p (log p - log M) + (1 - beta) q (log q - log M)

(Agarwal et al. 2024, "On-Policy Distillation of Language Models", eq. for JSD(beta); beta = 0 / 1
are taken as the two KL limits, as Liger-Kernel's JSD does.) log M is a logaddexp of
log beta + log p and log(1 - beta) + log q, so no 0 * log 0 appears. Gradient w.r.t. the student
logits (teacher gets none), with G a per-row sum from the forward:

    MODE 0:  dL/dz_s = q - p
    MODE 1:  dL/dz_s = q (log q - log p - L)                 (G = L)
    MODE 2:  dL/dz_s = g - q G,  g = (1 - beta) q (log q - log M),  G = sum_v g

``jsd_split_sums``: program (pid_m, pid_s) runs both GEMM tiles for each BLOCK_N tile of its
vocab split and writes per-split partial row sums of L and G; ``_sum_splits_kernel`` adds the S
partials of a row in a fixed order (batch invariant, no atomics). ``jsd_dlogits`` recomputes both
tiles of a (rows x cols) window and writes dL/dz_s * grad_scale / T in the student's dtype, for the
chunked matmul backward of ``rl_kernels.autograd``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .building_blocks import gemm_meta, grouped_tile, logits_tile, store_window, tma_operands, window_grid, window_tile
from ..torch_ops.linear_jsd import torch_jsd_sums
from .config import BwdTile, KernelConfig, default_config


def jsd_mode(beta: float) -> int:
    return 0 if beta == 0.0 else (1 if beta == 1.0 else 2)


@triton.jit
def _jsd_terms(lq, lp, beta, log_beta, log_1mbeta, MODE: tl.constexpr):
    """Elementwise loss term and g (MODE 2; zeros otherwise) from log q and log p tiles."""
    q = tl.exp(lq)
    if MODE == 0:
        loss = tl.exp(lp) * (lp - lq)
        g = tl.zeros_like(lq)
    elif MODE == 1:
        loss = q * (lq - lp)
        g = tl.zeros_like(lq)
    else:
        a = log_beta + lp
        b = log_1mbeta + lq
        # NaN-propagating: a NaN teacher logit must make g (hence the student's gradient) NaN
        hi = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
        log_m = hi + tl.log(1.0 + tl.exp(tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL) - hi))
        g = (1.0 - beta) * q * (lq - log_m)
        loss = beta * tl.exp(lp) * (lp - log_m) + g
    return loss, g, q


@triton.jit
def _two_tiles(hs_ptr, ws_ptr, ht_ptr, wt_ptr, rows, cols, row_mask, col_mask, HS, HT,
               stride_hsn, stride_hsk, stride_wsv, stride_wsk,
               stride_htn, stride_htk, stride_wtv, stride_wtk, inv_temperature,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
               FUSED_K: tl.constexpr, row0, col0):
    """(z_s, z_t) tiles. FUSED_K (TMA and HS == HT): one K loop loads all four operand blocks and
    feeds both accumulators (one software pipeline instead of two); the K steps, hence the bits,
    are those of two ``logits_tile`` calls."""
    if FUSED_K and USE_TMA:
        acc_s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_t = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, HS, BLOCK_K):
            a = hs_ptr.load([row0, k0])
            b = ws_ptr.load([col0, k0])
            c = ht_ptr.load([row0, k0])
            d = wt_ptr.load([col0, k0])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
                c = c.to(tl.float32)
                d = d.to(tl.float32)
            acc_s = tl.dot(a, b.T, acc_s, input_precision=DOT_PRECISION)
            acc_t = tl.dot(c, d.T, acc_t, input_precision=DOT_PRECISION)
        return acc_s * inv_temperature, acc_t * inv_temperature
    else:
        zs = logits_tile(hs_ptr, ws_ptr, rows, cols, row_mask, col_mask, HS,
                         stride_hsn, stride_hsk, stride_wsv, stride_wsk, inv_temperature,
                         BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, col0)
        zt = logits_tile(ht_ptr, wt_ptr, rows, cols, row_mask, col_mask, HT,
                         stride_htn, stride_htk, stride_wtv, stride_wtk, inv_temperature,
                         BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, col0)
        return zs, zt


@triton.jit
def _jsd_split_sums_kernel(
    hs_ptr, ws_ptr, ht_ptr, wt_ptr, lse_s_ptr, lse_t_ptr, part_l_ptr, part_g_ptr,
    N, V, HS, HT,
    stride_hsn, stride_hsk, stride_wsv, stride_wsk,
    stride_htn, stride_htk, stride_wtv, stride_wtk,
    inv_temperature, beta, log_beta, log_1mbeta,
    SPLIT_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MODE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, FUSED_K: tl.constexpr,
):
    pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(V, SPLIT_V), GROUP_M)
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    lse_s = tl.load(lse_s_ptr + rows, mask=row_mask, other=0.0)
    lse_t = tl.load(lse_t_ptr + rows, mask=row_mask, other=0.0)
    acc_l = tl.zeros((BLOCK_M,), tl.float32)
    acc_g = tl.zeros((BLOCK_M,), tl.float32)
    v_begin = pid_s * SPLIT_V
    v_end = tl.minimum(v_begin + SPLIT_V, V)
    for v0 in range(v_begin, v_end, BLOCK_N):
        cols = v0 + tl.arange(0, BLOCK_N)
        col_mask = cols < v_end
        zs, zt = _two_tiles(hs_ptr, ws_ptr, ht_ptr, wt_ptr, rows, cols, row_mask, col_mask, HS, HT,
                            stride_hsn, stride_hsk, stride_wsv, stride_wsk,
                            stride_htn, stride_htk, stride_wtv, stride_wtk, inv_temperature,
                            BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, FUSED_K,
                            row0, v0)
        loss, g, q = _jsd_terms(zs - lse_s[:, None], zt - lse_t[:, None], beta, log_beta,
                                log_1mbeta, MODE)
        acc_l += tl.sum(tl.where(col_mask[None, :], loss, 0.0), axis=1)
        if MODE == 2:
            acc_g += tl.sum(tl.where(col_mask[None, :], g, 0.0), axis=1)
    out = pid_s.to(tl.int64) * N + rows
    tl.store(part_l_ptr + out, acc_l, mask=row_mask)
    if MODE == 2:
        tl.store(part_g_ptr + out, acc_g, mask=row_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, N, S, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, S):  # fixed order: batch invariant
        acc += tl.load(part_ptr + s * N + rows, mask=mask, other=0.0)
    tl.store(out_ptr + rows, acc, mask=mask)


def _strides(*tensors):
    return [s for t in tensors for s in (t.stride(0), t.stride(1))]


def _beta_args(beta: float):
    # log(0) would be -inf; MODE 0 / 1 never read these
    return (beta, math.log(beta) if beta > 0 else 0.0, math.log1p(-beta) if beta < 1 else 0.0)


def _fused_k(cfg: KernelConfig, student_hidden, teacher_hidden) -> bool:
    # one K loop for both heads (``_two_tiles``) needs equal hidden sizes
    return cfg.jsd_fused_k and student_hidden.shape[1] == teacher_hidden.shape[1]


def jsd_split_sums(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t,
                   params, cfg: KernelConfig, tile: BwdTile):
    """(L, G): (N,) float32 per-row divergence (module docstring, before any T^2 or reduction) and
    the backward's row sum G (MODE 2; L itself for MODE 1; None for MODE 0).

    student_hidden (N, Hs), student_weight (V, Hs), teacher_hidden (N, Ht), teacher_weight (V, Ht),
    all one float dtype; lse_s, lse_t (N,) contiguous float32 of the two heads at 1/T. ``params``:
    the JSD parameter record (``inv_temperature``, ``beta``). ``tile``: rows x columns per program
    (two fp32 accumulators are live: half the forward's tile).
    """
    inv_temperature, beta = params.inv_temperature, params.beta
    n = student_hidden.shape[0]
    v = student_weight.shape[0]
    mode = jsd_mode(beta)
    num_splits = triton.cdiv(v, cfg.split_v)
    parts = torch.empty((2 if mode == 2 else 1, num_splits, n), dtype=torch.float32,
                        device=student_hidden.device)
    use_tma, operands = tma_operands(cfg, tile.block_m, tile.block_n, (student_hidden, student_weight),
                                     (teacher_hidden, teacher_weight))
    _jsd_split_sums_kernel[(triton.cdiv(n, tile.block_m) * num_splits,)](
        *operands, lse_s, lse_t, parts[0], parts[-1],
        n, v, student_hidden.shape[1], teacher_hidden.shape[1],
        *_strides(student_hidden, student_weight, teacher_hidden, teacher_weight),
        inv_temperature, *_beta_args(beta),
        SPLIT_V=cfg.split_v, MODE=mode, FUSED_K=_fused_k(cfg, student_hidden, teacher_hidden),
        **gemm_meta(cfg, tile, student_hidden.dtype, use_tma),
    )
    sums = torch.empty((parts.shape[0], n), dtype=torch.float32, device=student_hidden.device)
    block = 128
    for i in range(parts.shape[0]):
        _sum_splits_kernel[(triton.cdiv(n, block),)](parts[i], sums[i], n, num_splits, BLOCK=block)
    loss = sums[0]
    return loss, (sums[1] if mode == 2 else (loss if mode == 1 else None))


@triton.jit
def _jsd_dlogits_kernel(
    hs_ptr, ws_ptr, ht_ptr, wt_ptr, lse_s_ptr, lse_t_ptr, g_sum_ptr, scale_ptr, dz_ptr,
    row_start, n_rows, col_start, n_cols, HS, HT,
    stride_hsn, stride_hsk, stride_wsv, stride_wsk,
    stride_htn, stride_htk, stride_wtv, stride_wtk,
    stride_dzm, stride_dzn,
    inv_temperature, beta, log_beta, log_1mbeta,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    MODE: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GROUP_M: tl.constexpr, USE_TMA: tl.constexpr, FUSED_K: tl.constexpr,
):
    local_rows, local_cols, rows, cols, row_mask, col_mask, row0, col0 = window_tile(
        row_start, n_rows, col_start, n_cols, BLOCK_M, BLOCK_N, GROUP_M)
    zs, zt = _two_tiles(hs_ptr, ws_ptr, ht_ptr, wt_ptr, rows, cols, row_mask, col_mask, HS, HT,
                        stride_hsn, stride_hsk, stride_wsv, stride_wsk,
                        stride_htn, stride_htk, stride_wtv, stride_wtk, inv_temperature,
                        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, FUSED_K,
                        row0, col0)
    rows64 = rows.to(tl.int64)
    lq = zs - tl.load(lse_s_ptr + rows64, mask=row_mask, other=0.0)[:, None]
    lp = zt - tl.load(lse_t_ptr + rows64, mask=row_mask, other=0.0)[:, None]
    loss, g, q = _jsd_terms(lq, lp, beta, log_beta, log_1mbeta, MODE)
    if MODE == 0:
        d = q - tl.exp(lp)
    elif MODE == 1:
        d = q * (lq - lp - tl.load(g_sum_ptr + rows64, mask=row_mask, other=0.0)[:, None])
    else:
        d = g - q * tl.load(g_sum_ptr + rows64, mask=row_mask, other=0.0)[:, None]
    scale = tl.load(scale_ptr + rows64, mask=row_mask, other=0.0)
    # a row with scale 0 (masked token) gets exact zeros even if non-finite
    store_window(dz_ptr, d * (scale * inv_temperature)[:, None], scale != 0, local_rows, local_cols,
                 row_mask, col_mask, stride_dzm, stride_dzn)


def jsd_dlogits(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t,
                g_sum, scale, rows: slice, cols: slice, out: torch.Tensor, params, cfg: KernelConfig,
                tile: BwdTile) -> torch.Tensor:
    """Write d(scale * L)/d(h_s . w_s) for student logits[rows, cols] into ``out`` ((rows, cols)).

    ``scale`` (N,) contiguous float32 (upstream gradient x T^2; 0 for masked rows), ``g_sum`` (N,)
    float32 from ``jsd_split_sums`` (ignored for beta = 0); the rest as there.
    """
    inv_temperature, beta = params.inv_temperature, params.beta
    n_rows, n_cols, grid = window_grid(rows, cols, tile)
    use_tma, operands = tma_operands(cfg, tile.block_m, tile.block_n, (student_hidden, student_weight),
                                     (teacher_hidden, teacher_weight))
    _jsd_dlogits_kernel[grid](
        *operands, lse_s, lse_t, g_sum if g_sum is not None else lse_s, scale, out,
        rows.start, n_rows, cols.start, n_cols, student_hidden.shape[1], teacher_hidden.shape[1],
        *_strides(student_hidden, student_weight, teacher_hidden, teacher_weight),
        out.stride(0), out.stride(1),
        inv_temperature, *_beta_args(beta),
        MODE=jsd_mode(beta), FUSED_K=_fused_k(cfg, student_hidden, teacher_hidden),
        **gemm_meta(cfg, tile, student_hidden.dtype, use_tma),
    )
    return out


# ------------------------------------------------------------------ the family's functions (autograd.linear_jsd)
# The same names as in ``torch_ops.linear_jsd``: the autograd bodies call one module or the other.
def sums(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t, params):
    """Per-row (loss sum, g sum or None), float32 (N,): :func:`jsd_split_sums` (no rows: the twin's)."""
    args = (student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t, params)
    if not student_hidden.shape[0]:
        return torch_jsd_sums(*args)
    cfg = default_config(student_hidden.device, student_hidden.dtype)
    return jsd_split_sums(*args, cfg, cfg.jsd_fwd)


def dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, params):
    """(window function (:func:`jsd_dlogits`), dlogits dtype, column-width multiple, float32 product
    form) for the backward schedule."""
    cfg = default_config(hs.device, hs.dtype)

    def window(rows, cols, out):
        return jsd_dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, rows, cols, out, params, cfg, cfg.jsd_bwd)
    return window, hs.dtype, cfg.jsd_bwd.block_n, cfg.fp32_backward
