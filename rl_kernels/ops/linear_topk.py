"""The fused top-K head's kernels: the K largest logits z = hidden @ weight.T / T of each row (their
ids and values) and the row's logsumexp, in one pass over the GEMM tiles; the (N x V) logits are
never stored.

Selection. Program (pid_m, pid_s) owns rows [pid_m*BLOCK_M, +BLOCK_M) and the vocab columns of its
top-K split (a whole number of lse chunks, below). It walks the split's BLOCK_N tiles in column
order (the K-loop GEMM tile of ``building_blocks.logits_tile``, fp32 accumulator) and keeps, per row, a
candidate list of the K best (value, id) pairs in registers, updated per tile by
``building_blocks.topk_insert`` (the exact top K of what the program has seen, ties to the smaller
id; NaN and -inf logits never selected; about K / t entries into the list in the t-th tile of a
split for logits in random order, so a few per tile after the first tens of tiles of a long split).
Statistics. The same tile feeds the running (m, s) = (max z, sum exp(z - m)) of the row, stored
and reset at the end of every lse chunk of ``cfg.split_v`` columns (the fused head's split), so
the chunks' statistics, and the lse that ``_chunk_lse_kernel`` merges from them in chunk order,
do not depend on how many top-K splits run (batch invariant, like the head's). The candidate
values are the float32 logits themselves; the ids do not depend on the split count either (the
selection is exact), so the number of splits is chosen per launch to fill the GPU
(:func:`topk_splits`).
Output: per (row, split) the K candidates (float32 values, int32 local ids, unordered; a slot
that nothing valid filled keeps the value -inf and an id >= the shard's width) and per (row,
chunk) the (m, s) statistics; ``torch_ops.linear_topk.merge_candidates`` merges the splits.

Variants are ``tl.constexpr`` flags: USE_TMA / FLATTEN (scheduling only), EVEN_V (V is a multiple
of BLOCK_N), SOFTCAP (z = (c / T) tanh(h . w / c), ``building_blocks.soft_cap``), ROW_TEMPERATURE (each
row's own 1 / T).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from .building_blocks import (grouped_tile, log_sum_lse, logits_tile, merge_stats,
                              multiprocessors, row_temperature, soft_cap, softcap_args, tma_operands, topk_insert,
                              topk_start, topk_store)
from ..torch_ops.linear_topk import merge_candidates
from .config import KernelConfig, default_config



@dataclasses.dataclass(frozen=True)
class TopkTiles:
    """Launch shape of the top-K kernel: the GEMM tile, the lse chunk (a multiple of block_n) and
    the warps / stages of the K loop."""

    block_m: int
    block_n: int
    chunk: int
    num_warps: int
    num_stages: int
    flatten: bool = False  # one software pipeline across the split's tiles (the head's FLATTEN)


def topk_tiles(cfg: KernelConfig, kp: int) -> TopkTiles:
    """The top-K kernel's tiles on a device whose linear-head configuration is ``cfg``: the head's
    forward tile and split (the lse chunk), with half the rows for KP = 128 (the candidate list,
    2 x BLOCK_M x KP registers' worth, would otherwise crowd out the accumulator), and the head's
    FLATTEN (H200, 16384 x 3584 x 152064, K = 64: 1.63x -> 1.54x mm with it, same ids), applied
    with TMA loads and 16-bit inputs only (Triton 3.6 fails to compile the flattened loop for float32
    inputs: "scf.if op region control flow edge ... operands", H200, 2026-11-28)."""
    block_m = cfg.block_m if kp <= 64 else max(16, cfg.block_m // 2)
    return TopkTiles(block_m, cfg.block_n, cfg.split_v, cfg.num_warps, cfg.num_stages, cfg.flatten)


def topk_splits(row_blocks: int, n_chunks: int, device: torch.device) -> int:
    """Top-K splits per row block: as few as possible (each split's first tiles fill its list, K
    entries and more, and every split's list is merged), but enough programs to give ~90% of the
    multiprocessors one; at most one per lse chunk. Only the launch changes with it, not a bit of
    the results."""
    want = math.ceil(0.9 * multiprocessors(device) / max(1, row_blocks))
    return max(1, min(n_chunks, want))


@triton.jit
def _linear_topk_kernel(
    h_ptr, w_ptr, cand_v_ptr, cand_i_ptr, chunk_m_ptr, chunk_s_ptr,
    N, V, H, split_v, num_splits,
    stride_hn, stride_hk, stride_wv, stride_wk,
    logit_scale, softcap_scale,
    K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, EVEN_V: tl.constexpr, FLATTEN: tl.constexpr,
    SOFTCAP: tl.constexpr = False, LIBDEVICE: tl.constexpr = False,
    inv_temperature_ptr=None, ROW_TEMPERATURE: tl.constexpr = False,
):
    pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), num_splits, GROUP_M)
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    row_inv_temperature, tile_scale, cap_scale = row_temperature(
        inv_temperature_ptr, rows, row_mask, 1.0, logit_scale, softcap_scale, SOFTCAP, ROW_TEMPERATURE, True)

    list_v, list_i, worst_v, worst_i = topk_start(rows, K, KP)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)

    v_begin = pid_s * split_v
    v_end = tl.minimum(v_begin + split_v, V)
    for v0 in tl.range(v_begin, v_end, BLOCK_N, flatten=FLATTEN):
        cols = v0 + tl.arange(0, BLOCK_N)
        col_mask = cols < v_end
        z = logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
                        stride_hn, stride_hk, stride_wv, stride_wk, tile_scale,
                        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, v0)
        if SOFTCAP:
            z, _ = soft_cap(z, cap_scale, LIBDEVICE)
        if not EVEN_V:  # the padded columns of the last tile: no mass, never selected
            z = tl.where(col_mask[None, :], z, float("-inf"))

        # statistics of the chunk, stored and reset at its last tile
        tile_m = tl.max(z, axis=1)
        tile_s = tl.sum(tl.exp(z - tile_m[:, None]), axis=1)
        m, s, _ = merge_stats(m, s, s, tile_m, tile_s, tile_s)
        chunk_end = ((v0 + BLOCK_N) % CHUNK == 0) | (v0 + BLOCK_N >= v_end)
        out = (rows.to(tl.int64) * 0 + v0 // CHUNK) * N + rows  # (int64)
        tl.store(chunk_m_ptr + out, m, mask=row_mask & chunk_end)
        tl.store(chunk_s_ptr + out, s, mask=row_mask & chunk_end)
        m = tl.where(chunk_end, float("-inf"), m)
        s = tl.where(chunk_end, 0.0, s)

        list_v, list_i, worst_v, worst_i = topk_insert(z, v0, list_v, list_i, worst_v, worst_i, BLOCK_N)

    topk_store(cand_v_ptr, cand_i_ptr, rows, row_mask, pid_s, num_splits, list_v, list_i, K, KP)


@triton.jit
def _chunk_lse_kernel(chunk_m_ptr, chunk_s_ptr, lse_ptr, N, num_chunks, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < N
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for c in range(0, num_chunks):
        off = c * N + rows.to(tl.int64)
        pm = tl.load(chunk_m_ptr + off, mask=row_mask, other=0.0)  # (rows past N: lse 0, not log 0)
        ps = tl.load(chunk_s_ptr + off, mask=row_mask, other=1.0)
        m, s, _ = merge_stats(m, s, s, pm, ps, ps)
    _, lse = log_sum_lse(m, s)
    tl.store(lse_ptr + rows, lse, mask=row_mask)


def linear_topk_select(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    params,
    cfg: KernelConfig,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-K candidates and the lse of z = hidden_states @ weight.T / T (soft-capped first with
    ``params.softcap``; ``params.inv_temperature``: a float or a per-row (N,) float32 tensor).

    hidden_states (N, H) and weight (V, H), one dtype (bf16 / fp16 / fp32), any strides; 1 <= k <=
    128. ``splits``: top-K splits per row block (None: :func:`topk_splits`). Returns (values
    (N, S, k) float32, ids (N, S, k) int32 local ids, unordered: each split's exact top-k, empty
    slots -inf with an id >= V; lse (N,) float32, over all V columns).
    """
    n, h = hidden_states.shape
    v = weight.shape[0]
    kp = triton.next_power_of_2(k)
    tiles = topk_tiles(cfg, kp)
    n_chunks = triton.cdiv(v, tiles.chunk)
    row_blocks = triton.cdiv(n, tiles.block_m)
    num_splits = splits if splits is not None else topk_splits(row_blocks, n_chunks, hidden_states.device)
    num_splits = max(1, min(num_splits, n_chunks))
    split_v = triton.cdiv(n_chunks, num_splits) * tiles.chunk
    num_splits = triton.cdiv(v, split_v)  # (every split non-empty)
    device = hidden_states.device
    cand_v = torch.empty((n, num_splits, k), dtype=torch.float32, device=device)
    cand_i = torch.empty((n, num_splits, k), dtype=torch.int32, device=device)
    stats = torch.empty((2, n_chunks, n), dtype=torch.float32, device=device)
    use_tma, operands = tma_operands(cfg, tiles.block_m, tiles.block_n, (hidden_states, weight))
    _linear_topk_kernel[(row_blocks * num_splits,)](
        *operands, cand_v, cand_i, stats[0], stats[1],
        n, v, h, split_v, num_splits,
        hidden_states.stride(0), hidden_states.stride(1), weight.stride(0), weight.stride(1),
        **softcap_args(params.softcap, params.inv_temperature, stats),
        K=k, KP=kp, CHUNK=tiles.chunk,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=cfg.block_k,
        UPCAST=cfg.upcast(hidden_states.dtype), DOT_PRECISION=cfg.dot_precision(hidden_states.dtype),
        GROUP_M=cfg.group_m, USE_TMA=use_tma, EVEN_V=v % tiles.block_n == 0,
        FLATTEN=tiles.flatten and use_tma and hidden_states.dtype != torch.float32,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    lse = torch.empty(n, dtype=torch.float32, device=device)
    block = 128
    _chunk_lse_kernel[(triton.cdiv(n, block),)](stats[0], stats[1], lse, n, n_chunks, BLOCK=block)
    return cand_v, cand_i, lse


def select(hidden_states, weight, params) -> tuple:
    """The family's function (``torch_ops.linear_topk.select``'s Triton side): (values (N, k)
    float32, ids (N, k) int64 local, -1 for an empty slot, lse (N,) float32) of
    :func:`linear_topk_select` with ``params.k``, the splits' candidates merged
    (``torch_ops.linear_topk.merge_candidates``: value descending, id ascending)."""
    cfg = default_config(hidden_states.device, hidden_states.dtype)
    values, ids, lse = linear_topk_select(hidden_states, weight, params.k, params, cfg)
    return (*merge_splits(values, ids, weight.shape[0]), lse)


def merge_splits(values: torch.Tensor, ids: torch.Tensor, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (N, k), ids (N, k) int64) from the splits' candidates (N, S, k) (float values, int32
    local ids, an empty slot's id >= ``vocab``): the k best by value descending, then id ascending
    (``torch_ops.linear_topk.merge_candidates``), an empty slot id -1. Serves ``linear_topk``'s
    splits and the head's TOPK runs (``ops.linear.forward``)."""
    n, splits, k = values.shape
    ids = torch.where(ids < vocab, ids.long(), -1)
    return merge_candidates(values.reshape(n, splits * k), ids.reshape(n, splits * k), k)
