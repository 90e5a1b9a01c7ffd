"""Backward of the fused linear head: recompute logit tiles and write d(loss)/d(logits) chunks.

For a (rows x cols) window of the logits, program (pid_m, pid_n) recomputes its z tile with the
same K-loop GEMM as the forward, then from the saved per-row lse and entropy H:
    log p = z - lse,  p = exp(log p)
    dz    = g_lp * (onehot(y) - p) - g_H * p * (log p + H) + g_lse * p   (z - E_p[z] = log p + H)
            + 2 g_S * p * (p - S)                                         (S = sum_j p_j^2)
          = p * (c + k log p + a p) + g_lp onehot(y),  c = g_lse - g_lp - g_H H - 2 g_S S, k = -g_H, a = 2 g_S
and stores dz / temperature (the gradient w.r.t. the raw logits h.w) in the output dtype; the
second form is what runs (per-row scalars times 1 / T; per element log2 p = log2(e) (z - lse) in one
multiply-add, p = 2^(log2 p) and up to three multiply-adds).
With SOFTCAP (z = (c / T) tanh(h.w / c), ``common.soft_cap``) the stored gradient is
dz (1 - tanh^2) / T, the chain rule through the cap.
With ``KernelConfig.bwd_programs_per_sm`` > 0 the launch is persistent: a few programs per
multiprocessor each walk the window's tiles (same grouped order, same per-tile arithmetic, so the
same bits), in one flattened software pipeline that overlaps a tile's epilogue (exp, store) with
the next tile's operand loads. With ``KernelConfig.bwd_tma_store`` (and TMA operands) the tile
is stored through a tensor descriptor of the window.
Rows whose label is ``ignore_index`` get exactly 0 (a where, not a product, so a non-finite
ignored row cannot leak NaN into dW). The caller turns these chunks into dh = dz W and
dW = dz^T h with one matmul each (see ``rl_kernels.autograd``), so no N x V buffer exists.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (TensorDescriptor, gemm_meta, logits_tile_log2, persistent_programs, softcap_args,
                     store_window, tma_ok, tma_operands, window_grid, window_tile)
from .config import BwdTile, KernelConfig

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _linear_dlogits_kernel(
    h_ptr, w_ptr, labels_ptr, lse_ptr, entropy_ptr, g_lp_ptr, g_ent_ptr, g_lse_ptr, dz_ptr,
    row_start, n_rows, col_start, n_cols, H,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_lab,
    stride_glp, stride_gent, stride_dzm, stride_dzn,
    inv_temperature, ignore_index, sum_pi_squared_ptr, grad_sum_pi_squared_ptr, logit_scale, softcap_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_GRAD_LOG_PROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, HAS_GRAD_LSE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, HAS_GRAD_SUM_PI_SQUARED: tl.constexpr, num_programs, FLATTEN: tl.constexpr,
    STORE_TMA: tl.constexpr = False, OUT_DTYPE: tl.constexpr = None,
    SOFTCAP: tl.constexpr = False, LIBDEVICE: tl.constexpr = False,
):
    # logit_scale: inv_temperature, or 1 / softcap with SOFTCAP (then z = softcap_scale * tanh(tile))
    num_tiles = tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N)
    # one tile per program (num_programs = num_tiles), or a persistent loop over tiles whose
    # flattened pipeline loads the next tile's operands during this tile's epilogue
    for tile_id in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN):
        local_rows, local_cols, rows, cols, row_mask, col_mask, row0, col0 = window_tile(
            row_start, n_rows, col_start, n_cols, BLOCK_M, BLOCK_N, GROUP_M, tile_id)
        # z2 = log2(e) z, so log2 p = z2 - log2(e) lse is one multiply-add with the GEMM's scale
        # and p = 2^(log2 p) one ex2 (flushing p < 2^-126); t: the cap's tanh with SOFTCAP
        z2, t = logits_tile_log2(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
                                 stride_hn, stride_hk, stride_wv, stride_wk, logit_scale, softcap_scale,
                                 BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, col0,
                                 SOFTCAP, LIBDEVICE)
        rows64 = rows.to(tl.int64)
        labels = tl.load(labels_ptr + rows64 * stride_lab, mask=row_mask, other=ignore_index)
        lse = tl.load(lse_ptr + rows64, mask=row_mask, other=0.0)
        log2_p = z2 - (lse * 1.4426950408889634)[:, None]
        p = tl.exp2(log2_p)
        # dz = p (c + k log p + a p) + [j == y] g_lp, the row's terms folded into per-row scalars:
        # c = g_lse - g_lp - g_H H - 2 g_S S, k = -g_H, a = 2 g_S (one exp and up to three
        # multiply-adds per element; k times ln 2 multiplies log2 p)
        c = tl.zeros((BLOCK_M,), tl.float32)
        if HAS_GRAD_LOG_PROBS:
            g_lp = tl.load(g_lp_ptr + rows64 * stride_glp, mask=row_mask, other=0.0).to(tl.float32)
            c -= g_lp
        if HAS_GRAD_ENTROPY:
            g_ent = tl.load(g_ent_ptr + rows64 * stride_gent, mask=row_mask, other=0.0).to(tl.float32)
            c -= g_ent * tl.load(entropy_ptr + rows64, mask=row_mask, other=0.0)
        if HAS_GRAD_LSE:  # d lse / dz = p (contiguous (N,) float32)
            c += tl.load(g_lse_ptr + rows64, mask=row_mask, other=0.0)
        if HAS_GRAD_SUM_PI_SQUARED:  # d(sum p^2)/dz_j = 2 p_j (p_j - sum p^2) (contiguous (N,) float32 each)
            twice_grad_sum_pi_squared = 2.0 * tl.load(grad_sum_pi_squared_ptr + rows64, mask=row_mask, other=0.0)
            c -= twice_grad_sum_pi_squared * tl.load(sum_pi_squared_ptr + rows64, mask=row_mask, other=0.0)
        # (each scalar times 1 / T: the stored gradient is w.r.t. h.w, and no element is scaled)
        inner = (c * inv_temperature)[:, None]
        if HAS_GRAD_ENTROPY:
            inner = inner - (g_ent * (inv_temperature * 0.6931471805599453))[:, None] * log2_p
        if HAS_GRAD_SUM_PI_SQUARED:
            inner = inner + (twice_grad_sum_pi_squared * inv_temperature)[:, None] * p
        if HAS_GRAD_LOG_PROBS:
            # the label's column inside this tile (int32, -1 when elsewhere): a 32-bit compare per
            # element against the tile's own column offsets, not a 64-bit one against ``cols``
            label_at = labels - col0
            label_at = tl.where((label_at >= 0) & (label_at < BLOCK_N), label_at, -1).to(tl.int32)
            hit = tl.arange(0, BLOCK_N)[None, :] == label_at[:, None]
            dz = p * inner + tl.where(hit, (g_lp * inv_temperature)[:, None], 0.0)
        else:
            dz = p * inner
        if SOFTCAP:  # d z / d(h.w / T) = 1 - tanh^2
            dz = dz * ((1.0 - t) * (1.0 + t))
        if STORE_TMA:  # dz_ptr: a descriptor of the window; the copy engine clips its bounds
            dz = tl.where((labels != ignore_index)[:, None], dz, 0.0)
            dz_ptr.store([row0 - row_start, col0 - col_start], dz.to(OUT_DTYPE))
        else:
            store_window(dz_ptr, dz, labels != ignore_index, local_rows, local_cols,
                         row_mask, col_mask, stride_dzm, stride_dzn)


def linear_dlogits(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    saved,
    grads,
    rows: slice,
    cols: slice,
    out: torch.Tensor,
    params,
    cfg: KernelConfig,
    tile: BwdTile,
) -> torch.Tensor:
    """Write d(loss)/d(h.w) for logits[rows, cols] into ``out`` ((rows, cols), input dtype).

    hidden_states (N, H) and weight (V, H) share a dtype; labels (N,) int. ``saved``: the
    forward's (N,) float32 ``lse``, ``entropy`` (required with an entropy gradient) and
    ``sum_pi_squared`` (required with its gradient); ``grads``: upstream (N,) gradients
    ``log_probs`` / ``entropy`` (any stride, 0 allowed), ``lse`` / ``sum_pi_squared`` (contiguous
    float32), each None when absent (``autograd.linear.HeadOutputs`` records). ``params``: the
    head's parameter record (``inv_temperature``, ``ignore_index``, ``softcap``: the logits are
    soft-capped before the temperature when it is not None).
    """
    lse, entropy, sum_pi_squared = saved.lse, saved.entropy, saved.sum_pi_squared
    grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared = grads.log_probs, grads.entropy, grads.lse, \
        grads.sum_pi_squared
    inv_temperature, ignore_index, softcap = params.inv_temperature, params.ignore_index, params.softcap
    n_rows, n_cols, grid = window_grid(rows, cols, tile)
    programs = persistent_programs(grid[0], cfg.bwd_programs_per_sm, out.device)
    has_lp = grad_log_probs is not None
    has_ent = grad_entropy is not None
    use_tma, operands = tma_operands(cfg, tile.block_m, tile.block_n, (hidden_states, weight))
    store_tma = use_tma and cfg.bwd_tma_store and tma_ok(out)
    dz_out = TensorDescriptor.from_tensor(out, [tile.block_m, tile.block_n]) if store_tma else out
    _linear_dlogits_kernel[(programs,)](
        *operands, labels, lse,
        entropy if has_ent else lse,
        grad_log_probs if has_lp else lse,
        grad_entropy if has_ent else lse,
        grad_lse if grad_lse is not None else lse,
        dz_out,
        rows.start, n_rows, cols.start, n_cols, hidden_states.shape[1],
        hidden_states.stride(0), hidden_states.stride(1), weight.stride(0), weight.stride(1),
        labels.stride(0),
        grad_log_probs.stride(0) if has_lp else 0, grad_entropy.stride(0) if has_ent else 0,
        out.stride(0), out.stride(1),
        inv_temperature, ignore_index,
        sum_pi_squared if grad_sum_pi_squared is not None else lse, grad_sum_pi_squared if grad_sum_pi_squared is not None else lse,
        **softcap_args(softcap, inv_temperature),
        HAS_GRAD_LOG_PROBS=has_lp, HAS_GRAD_ENTROPY=has_ent, HAS_GRAD_LSE=grad_lse is not None, HAS_GRAD_SUM_PI_SQUARED=grad_sum_pi_squared is not None,
        num_programs=programs, FLATTEN=cfg.flatten and programs < grid[0],
        STORE_TMA=store_tma, OUT_DTYPE=TL_DTYPES[out.dtype] if store_tma else None,
        **gemm_meta(cfg, tile, hidden_states.dtype, use_tma),
    )
    return out
