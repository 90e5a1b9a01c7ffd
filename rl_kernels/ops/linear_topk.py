"""The fused top-K head's kernels: the K largest logits z = hidden @ weight.T / T of each row (their
ids and values) and the row's logsumexp, in one pass over the GEMM tiles; the (N x V) logits are
never stored.

Selection. Program (pid_m, pid_s) owns rows [pid_m*BLOCK_M, +BLOCK_M) and the vocab columns of its
top-K split (a whole number of lse chunks, below). It walks the split's BLOCK_N tiles in column
order and keeps, per row, a candidate list of K (value, id) pairs: (BLOCK_M, KP) tensors (KP = the
power of two >= K; slots K..KP-1 are pads that never leave) in its rows of the output, whose
values are loaded into registers only while a tile's elements enter it, and the list's worst
entry (value, id, slot) in registers. The order is (value descending, id ascending): a is better
than b when a.v > b.v, or a.v == b.v and a.id < b.id, so the list is the exact top-K of what the
program has seen, ties broken by the smaller id. Per tile part (below):
  * its elements above the worst value are the candidates (the worst entry comes from an earlier
    part or is an empty slot, whose ids are smaller / larger, so a tie never enters here); NaN
    and -inf logits never are;
  * while some row of the block has a candidate that may enter: each row takes its largest one
    (value max, then the smallest id among equal values: one max reduction with the index of its
    leftmost occurrence, the columns ascending); if it beats the row's worst entry it
    replaces it (in memory; the values in registers too), and the new worst is the smallest value
    (among equal ones the largest id, read from memory only on such a tie); the element is
    dropped either way. The loop count is the largest number of entries of one row of the block
    in this part: K in a split's first tile, then ~K / t in its t-th tile for logits in random
    order (a simulation of 128-row blocks of random logits, V = 152064, K = 64: 3.0 per
    256-column tile with one split, 6.0 with 4, 9.9 with 10), so long splits are cheaper.
Parts (TWO_PARTS): the GEMM tile (BLOCK_M x BLOCK_N, one K loop, the hidden block loaded once per
step) comes as two accumulators of BLOCK_N / 2 columns, taken one after the other: the selection's
working set (the part's candidates, their column offsets, the list's values) then fits the
registers that the second accumulator leaves. sm90 SASS (Triton 3.9, 128 x 256 tiles, 8 warps,
K = 64, TMA; 2026-11-28): a selection step of one part 1865 instructions with 8 spill loads
(576 bytes of stack) with two parts, against 3128 instructions with 401 spill loads (1456 bytes)
for the whole tile in one part (with a max, then a min over equal values for the index: 1949 / 78
loads with two parts); the fused head's forward kernel: 254 registers, no stack.
Statistics. The same parts feed the running (m, s) = (max z, sum exp(z - m)) of the row, stored
and reset at the end of every lse chunk of ``cfg.split_v`` columns (the fused head's split), so
the chunks' statistics, and the lse that ``_chunk_lse_kernel`` merges from them in chunk order,
do not depend on how many top-K splits run (batch invariant, like the head's). The candidate
values are the float32 logits themselves; the ids do not depend on the split count either (the
selection is exact), so the number of splits is chosen per launch to fill the GPU
(:func:`topk_splits`).
Output: per (row, split) the K candidates (float32 values, int32 local ids, unordered; a slot
that nothing valid filled keeps the value -inf and an id >= the shard's width) and per (row,
chunk) the (m, s) statistics; ``torch_ops.linear_topk.merge_candidates`` merges the splits.

Variants are ``tl.constexpr`` flags: USE_TMA / FLATTEN (scheduling only), TWO_PARTS (above; the
statistics are merged per part, so its bits differ from the one-part variant's, the ids do not),
EVEN_V (V is a multiple of BLOCK_N), SOFTCAP (z = (c / T) tanh(h . w / c), ``common.soft_cap``),
ROW_TEMPERATURE (each row's own 1 / T).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import triton
import triton.language as tl

from .common import (grouped_tile, log_sum_lse, logits_tile, merge_stats, multiprocessors, row_scales, soft_cap,
                     softcap_args, tma_operands)
from .config import KernelConfig

PAD_ID = -2  # the ids of the pad slots K..KP-1 (smaller than every id: never the worst entry)
EMPTY_ID = 2147483647  # (minus the slot) the ids of the empty slots: larger than every id


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
    two_parts: bool = True  # the tile's epilogue in two (block_m x block_n / 2) parts (TWO_PARTS)


def topk_tiles(cfg: KernelConfig, kp: int) -> TopkTiles:
    """The top-K kernel's tiles on a device whose linear-head configuration is ``cfg``: the head's
    forward tile and split (the lse chunk), with half the rows for KP = 128 (the candidate list,
    2 x BLOCK_M x KP registers' worth, would otherwise crowd out the accumulator). FLATTEN stays
    off: the selection's while loop inside the tile loop is not a shape the flattening pass was
    measured with (scripts/diag/linear_topk_bench.py --flatten tries it)."""
    block_m = cfg.block_m if kp <= 64 else max(16, cfg.block_m // 2)
    return TopkTiles(block_m, cfg.block_n, cfg.split_v, cfg.num_warps, cfg.num_stages)


def topk_splits(row_blocks: int, n_chunks: int, device: torch.device) -> int:
    """Top-K splits per row block: as few as possible (each split's first tiles fill its list, K
    entries and more, and every split's list is merged), but enough programs to give ~90% of the
    multiprocessors one; at most one per lse chunk. Only the launch changes with it, not a bit of
    the results."""
    want = math.ceil(0.9 * multiprocessors(device) / max(1, row_blocks))
    return max(1, min(n_chunks, want))


@triton.jit
def _two_tiles(
    h_ptr, w_ptr, rows, cols, row_mask, col_mask, col_mask1, H,
    stride_hn, stride_hk, stride_wv, stride_wk,
    BLOCK_M: tl.constexpr, PART_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, row0, col0,
):
    """The raw GEMM tiles h . w of columns [col0, +PART_N) and [col0 + PART_N, +PART_N) (``cols`` /
    ``col_mask``: the first part's), fp32, in one K loop: each step loads the hidden block once for
    both dots (as one (BLOCK_M x 2 PART_N) tile would), and the epilogue gets two accumulators of
    half the registers each (``common.logits_tile``'s conventions otherwise: masked entries 0;
    with USE_TMA, ``w_ptr`` is a descriptor with blocks (PART_N, BLOCK_K))."""
    offs_k = tl.arange(0, BLOCK_K)
    acc0 = tl.zeros((BLOCK_M, PART_N), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, PART_N), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, H, BLOCK_K):
            a = h_ptr.load([row0, k0])
            b0 = w_ptr.load([col0, k0])
            b1 = w_ptr.load([col0 + PART_N, k0])
            if UPCAST:
                a = a.to(tl.float32)
                b0 = b0.to(tl.float32)
                b1 = b1.to(tl.float32)
            acc0 = tl.dot(a, b0.T, acc0, input_precision=DOT_PRECISION)
            acc1 = tl.dot(a, b1.T, acc1, input_precision=DOT_PRECISION)
    else:
        h_base = h_ptr + rows.to(tl.int64)[:, None] * stride_hn
        w_base0 = w_ptr + cols.to(tl.int64)[None, :] * stride_wv
        w_base1 = w_base0 + PART_N * stride_wv
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < H
            a = tl.load(h_base + ks.to(tl.int64)[None, :] * stride_hk,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b0 = tl.load(w_base0 + ks.to(tl.int64)[:, None] * stride_wk,
                         mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            b1 = tl.load(w_base1 + ks.to(tl.int64)[:, None] * stride_wk,
                         mask=k_mask[:, None] & col_mask1[None, :], other=0.0)
            if UPCAST:  # the CPU interpreter computes bf16 dots wrongly; do them in fp32 there
                a = a.to(tl.float32)
                b0 = b0.to(tl.float32)
                b1 = b1.to(tl.float32)
            acc0 = tl.dot(a, b0, acc0, input_precision=DOT_PRECISION)
            acc1 = tl.dot(a, b1, acc1, input_precision=DOT_PRECISION)
    return acc0, acc1


@triton.jit
def _take_part(
    z, col0, v_end, m, s, worst_v, worst_i, worst_s,
    cand_v_ptr, cand_i_ptr, cand, keep, row_base, row_mask, slot,
    KP: tl.constexpr, PART_N: tl.constexpr, EVEN_V: tl.constexpr,
):
    """One part of a tile (logits ``z`` (BLOCK_M, PART_N) of columns [col0, +PART_N), scaled and
    capped) into the running statistics (m, s) and the candidate list (module docstring).
    Returns (m, s, worst_v, worst_i, worst_s)."""
    offs = tl.arange(0, PART_N)
    if not EVEN_V:  # the padded columns of the last tile: no mass, never selected
        z = tl.where((col0 + offs < v_end)[None, :], z, float("-inf"))
    tile_m = tl.max(z, axis=1)
    # (a part of the last tile may be all padding: -inf - -inf would make s NaN; with a shift of 0
    # it is the identity (-inf, 0), as merge_stats takes it)
    tile_s = tl.sum(tl.exp(z - tl.where(tile_m > float("-inf"), tile_m, 0.0)[:, None]), axis=1)
    m, s, _ = merge_stats(m, s, s, tile_m, tile_s, tile_s)

    # the part's elements above the row's worst value (the worst entry is an earlier part's or an
    # empty slot, so a tie never beats it here); NaN and -inf never do
    zc = tl.where(z > worst_v[:, None], z, float("-inf"))
    # each row's best remaining element: its value, then the smallest id among equal ones (one
    # reduction: the max with the index of its leftmost occurrence, columns ascending)
    best_v, best_at = tl.max(zc, axis=1, return_indices=True, return_indices_tie_break_left=True)
    if tl.max((best_v > worst_v).to(tl.int32), axis=0) > 0:
        list_v = tl.load(cand_v_ptr + cand, mask=keep, other=float("inf"))
        more = True
        while more:
            best_i = best_at.to(tl.int32) + col0
            enter = (best_v > worst_v) | ((best_v == worst_v) & (best_i < worst_i))
            enter = enter & (best_v > float("-inf")) & row_mask
            # it replaces the worst entry (in memory, and the values in registers), once every thread
            # has read the previous step's worst entry
            tl.debug_barrier()
            tl.store(cand_v_ptr + row_base + worst_s, best_v, mask=enter)
            tl.store(cand_i_ptr + row_base + worst_s, best_i, mask=enter)
            list_v = tl.where((slot[None, :] == worst_s[:, None]) & enter[:, None], best_v[:, None], list_v)
            # the new worst: the smallest value, and among equal ones the largest id
            worst_v = tl.min(list_v, axis=1)
            is_min = list_v == worst_v[:, None]
            tl.debug_barrier()  # (the stores above, read below by other threads)
            if tl.max(tl.sum(is_min.to(tl.int32), axis=1), axis=0) > 1:
                list_i = tl.load(cand_i_ptr + cand, mask=keep, other=-2)
                worst_i = tl.max(tl.where(is_min, list_i, -2147483647), axis=1)
                worst_s = tl.min(tl.where(is_min & (list_i == worst_i[:, None]), slot[None, :], KP), axis=1)
            else:
                worst_s = tl.min(tl.where(is_min, slot[None, :], KP), axis=1)
                worst_i = tl.load(cand_i_ptr + row_base + worst_s, mask=row_mask, other=0)
            # drop the element taken (or found not to enter: nothing after it in the row can);
            # go on while some row's next best may still enter (>=: a tie decided by the ids)
            zc = tl.where(offs[None, :] == best_at[:, None], float("-inf"), zc)
            best_v, best_at = tl.max(zc, axis=1, return_indices=True, return_indices_tie_break_left=True)
            more = tl.max(((best_v >= worst_v) & (best_v > float("-inf")) & row_mask).to(tl.int32), axis=0) > 0
        tl.debug_barrier()  # (the next part's loads)
    return m, s, worst_v, worst_i, worst_s


@triton.jit
def _linear_topk_kernel(
    h_ptr, w_ptr, cand_v_ptr, cand_i_ptr, chunk_m_ptr, chunk_s_ptr,
    N, V, H, split_v, num_splits,
    stride_hn, stride_hk, stride_wv, stride_wk,
    logit_scale, softcap_scale,
    K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, EVEN_V: tl.constexpr, FLATTEN: tl.constexpr, TWO_PARTS: tl.constexpr,
    SOFTCAP: tl.constexpr = False, LIBDEVICE: tl.constexpr = False,
    inv_temperature_ptr=None, ROW_TEMPERATURE: tl.constexpr = False,
):
    pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), num_splits, GROUP_M)
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    tile_scale, cap_scale = logit_scale, softcap_scale
    if ROW_TEMPERATURE:
        row_inv_temperature = tl.load(inv_temperature_ptr + rows, mask=row_mask, other=1.0)[:, None]
        tile_scale, cap_scale = row_scales(row_inv_temperature, logit_scale, softcap_scale, SOFTCAP)

    # the candidate list, in this program's rows of the output (L1 / L2 resident): K empty slots
    # (-inf, EMPTY_ID - slot: distinct ids, larger than every id; -inf logits are excluded, so
    # only real logits replace them). In registers: each row's worst entry (value, id, slot) and,
    # while a part's elements enter the list, its values (as loaded, KP - K pads of +inf: never
    # the worst); its ids are read from memory only to break a tie at the worst value.
    slot = tl.arange(0, KP)
    row_base = (rows.to(tl.int64) * num_splits + pid_s) * K
    cand = row_base[:, None] + slot[None, :]
    keep = row_mask[:, None] & (slot < K)[None, :]
    tl.store(cand_v_ptr + cand, tl.full((BLOCK_M, KP), float("-inf"), tl.float32), mask=keep)
    tl.store(cand_i_ptr + cand, (2147483647 - slot[None, :]) + tl.zeros((BLOCK_M, KP), tl.int32), mask=keep)
    worst_v = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    worst_i = tl.full((BLOCK_M,), 2147483647, tl.int32)  # slot 0's
    worst_s = tl.zeros((BLOCK_M,), tl.int32)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    tl.debug_barrier()  # (loads below may map elements to other threads than these stores)

    v_begin = pid_s * split_v
    v_end = tl.minimum(v_begin + split_v, V)
    for v0 in tl.range(v_begin, v_end, BLOCK_N, flatten=FLATTEN):
        if TWO_PARTS:  # two (BLOCK_M x BLOCK_N / 2) parts from one K loop, taken one after the other
            cols = v0 + tl.arange(0, BLOCK_N // 2)
            z0, z1 = _two_tiles(h_ptr, w_ptr, rows, cols, row_mask, cols < v_end, cols + BLOCK_N // 2 < v_end, H,
                                stride_hn, stride_hk, stride_wv, stride_wk,
                                BLOCK_M, BLOCK_N // 2, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, v0)
            z0 = z0 * tile_scale
            z1 = z1 * tile_scale
            if SOFTCAP:
                z0, _ = soft_cap(z0, cap_scale, LIBDEVICE)
                z1, _ = soft_cap(z1, cap_scale, LIBDEVICE)
            m, s, worst_v, worst_i, worst_s = _take_part(
                z0, v0, v_end, m, s, worst_v, worst_i, worst_s, cand_v_ptr, cand_i_ptr, cand, keep, row_base,
                row_mask, slot, KP, BLOCK_N // 2, EVEN_V)
            m, s, worst_v, worst_i, worst_s = _take_part(
                z1, v0 + BLOCK_N // 2, v_end, m, s, worst_v, worst_i, worst_s, cand_v_ptr, cand_i_ptr, cand, keep,
                row_base, row_mask, slot, KP, BLOCK_N // 2, EVEN_V)
        else:
            cols = v0 + tl.arange(0, BLOCK_N)
            z = logits_tile(h_ptr, w_ptr, rows, cols, row_mask, cols < v_end, H,
                            stride_hn, stride_hk, stride_wv, stride_wk, tile_scale,
                            BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, v0)
            if SOFTCAP:
                z, _ = soft_cap(z, cap_scale, LIBDEVICE)
            m, s, worst_v, worst_i, worst_s = _take_part(
                z, v0, v_end, m, s, worst_v, worst_i, worst_s, cand_v_ptr, cand_i_ptr, cand, keep, row_base,
                row_mask, slot, KP, BLOCK_N, EVEN_V)
        # the chunk's statistics, stored and reset at its last tile
        chunk_end = ((v0 + BLOCK_N) % CHUNK == 0) | (v0 + BLOCK_N >= v_end)
        out = (rows.to(tl.int64) * 0 + v0 // CHUNK) * N + rows  # (int64)
        tl.store(chunk_m_ptr + out, m, mask=row_mask & chunk_end)
        tl.store(chunk_s_ptr + out, s, mask=row_mask & chunk_end)
        m = tl.where(chunk_end, float("-inf"), m)
        s = tl.where(chunk_end, 0.0, s)


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
    part_n = tiles.block_n // 2 if tiles.two_parts else tiles.block_n
    use_tma, operands = tma_operands(cfg, tiles.block_m, part_n, (hidden_states, weight))
    _linear_topk_kernel[(row_blocks * num_splits,)](
        *operands, cand_v, cand_i, stats[0], stats[1],
        n, v, h, split_v, num_splits,
        hidden_states.stride(0), hidden_states.stride(1), weight.stride(0), weight.stride(1),
        **softcap_args(params.softcap, params.inv_temperature, stats),
        K=k, KP=kp, CHUNK=tiles.chunk,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=cfg.block_k,
        UPCAST=cfg.upcast(hidden_states.dtype), DOT_PRECISION=cfg.dot_precision(hidden_states.dtype),
        GROUP_M=cfg.group_m, USE_TMA=use_tma, EVEN_V=v % tiles.block_n == 0, FLATTEN=tiles.flatten,
        TWO_PARTS=tiles.two_parts,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )
    lse = torch.empty(n, dtype=torch.float32, device=device)
    block = 128
    _chunk_lse_kernel[(triton.cdiv(n, block),)](stats[0], stats[1], lse, n, n_chunks, BLOCK=block)
    return cand_v, cand_i, lse
