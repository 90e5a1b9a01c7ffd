"""The fused linear head's kernels (``hidden @ weight.T`` never stored), in its three stages:
the forward's per-split statistics, their combine, and the backward's dlogits windows.

Forward: per (token block x vocab split) partial statistics.

Program (pid_m, pid_s) owns rows [pid_m*BLOCK_M, +BLOCK_M) and vocab columns
[pid_s*SPLIT_V, min(+SPLIT_V, V)). For each BLOCK_N tile of its split it runs the K-loop GEMM tile
(``tl.dot``, fp32 accumulator), sets columns >= V to -inf (verl #2656/#2899: padded columns must
carry no probability mass) and folds the tile into running per-row (m, s, b):
m = max z, s = sum exp(z - m), b = sum exp(z - m)(z - m). It writes these three [S, N] fp32
partials; the combine merges them. The label logit z_y = h . w_y / T is a separate, cheap
kernel (N rows of W): gathering it inside the tile loop cost ~5% of the forward and its branch
blocked the loop flattening (H100 sweep, BENCHMARKS.md).
The split size is a constant, not a function of N, so every row sees the same reduction tree in
any batch (batch invariance) and there are no atomics (run-to-run identical bits).

Mainloop variants are ``tl.constexpr`` flags that change scheduling, never arithmetic:
USE_TMA (tensor-descriptor loads), FLATTEN (one software pipeline across the split's tiles, so the
next tile's loads overlap this tile's softmax epilogue), WARP_SPEC (producer/consumer warps),
EVEN_V (V is a multiple of BLOCK_N: no column masks in the epilogue). One flag changes the
arithmetic: SOFTCAP, the logit soft-capping of Gemma-2-style heads (z = (c / T) tanh(h . w / c),
``building_blocks.soft_cap``); without it the kernels are the uncapped ones, bit for bit.
TAIL (the tail-aware top-K KL, verl RFC #7856) adds a per-split tail sum s_t = sum exp(z - m) over the
columns that are not among the row's sorted ids, relative to the same running max m as s: the tile's
e = exp(z - tile max) with the ids' columns selected to 0 (``building_blocks.fill_ids``: each row's pointer
into its ids walks the split's tiles in column order, one compare and one select per element per id
of the tile's fullest row), summed, and rescaled with s when m moves on. It writes (m, s_t), which
the combine merges like (m, s) (s_t = 0: a row with no tail column in the split). Tail terms below
2^-126 of the split's max flush to 0 (as the lse's do), so a tail mass below ~1e-33 of the row loses
digits (finite; the tests' contract is 1e-5 of float64 for tail masses >= 1e-6). FLATTEN and
WARP_SPEC are off with it. Without TAIL the kernel is the one above, bit for bit.

Combine: merges per-split softmax partials into log-probs, entropy and lse.

Input partials (m, s, b) are (S, N) float32 and the label logits z_y (N,) float32 (the forward's);
the S splits are merged in a fixed order with ``merge_stats`` (identity (-inf, 0, 0), never 0 for
m: verl PR #7439).
The same merge serves vocab-parallel ranks, whose partials are stacked along S.
Per row: lse = m + log s, log p(y) = min(z_y - lse, 0), entropy = log s - b / s, and on request
sum_j p_j^2 = q / s^2 from the partials q = sum exp(2 (z - m)).
Rows whose label equals ``ignore_index`` get log-prob 0 and entropy 0 (lse is still written).
TAIL: the tail partials merged the same way into tail_lse = m_t + log s_t (-inf when the row's ids
cover the vocabulary; no clamp of log s_t: s_t < 1 is the normal case, relative to the row's max).

Backward: recompute logit tiles and write d(loss)/d(logits) chunks.

For a (rows x cols) window of the logits, program (pid_m, pid_n) recomputes its z tile with the
same K-loop GEMM as the forward, then from the saved per-row lse and entropy H:
    log p = z - lse,  p = exp(log p)
    dz    = g_lp * (onehot(y) - p) - g_H * p * (log p + H) + g_lse * p   (z - E_p[z] = log p + H)
            + 2 g_S * p * (p - S)                                         (S = sum_j p_j^2)
          = p * (c + k log p + a p) + g_lp onehot(y),  c = g_lse - g_lp - g_H H - 2 g_S S, k = -g_H, a = 2 g_S
and stores dz / temperature (the gradient w.r.t. the raw logits h.w) in the output dtype; the
second form is what runs (per-row scalars times 1 / T; per element log2 p = log2(e) (z - lse) in one
multiply-add, p = 2^(log2 p) and up to three multiply-adds).
With SOFTCAP (z = (c / T) tanh(h.w / c), ``building_blocks.soft_cap``) the stored gradient is
dz (1 - tanh^2) / T, the chain rule through the cap.
TAIL adds g_tail * [j not among the row's ids] * exp(z_j - tail_lse) (d tail_lse / dz_j) with no exp
of its own: exp(z_j - tail_lse) = p_j / q_tail, so the per-row g_tail exp(lse - tail_lse) / T joins the
inner factor by a select at the tail's columns (at the ids it is never added, so nothing has to
cancel: p_j / q_tail there can be ~1 / q_tail). exp(lse - tail_lse) has its exponent capped at 126
and the row's coefficient is clamped to +-1e38 (NaN-propagating): no inf, so no 0 * inf = NaN when
g_tail = 0 or the tail is empty (tail_lse = -inf), and a tail column's p_j <= q_tail keeps the
product finite; a tail mass below ~2^-126 keeps finite gradients, not accurate ones. The ids' columns
of a tile: each row's first id >= the tile's first column by a binary search and its next three ids,
loaded before the GEMM (the tiles come in grouped order, no walk carries over), then its first two
ids compared per element; a tile where some row has three or more (rarer: K = 64 over V = 152064
and 256-wide tiles) walks them all on a copy of p with the ids' columns selected to 0
(``building_blocks.fill_ids``) and adds that times the coefficient.
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

from .building_blocks import (TensorDescriptor, fill_ids, gemm_meta, grouped_tile, ids_below, log_sum_lse,
                              logits_tile_log2, merge_max_sum, merge_q, merge_scales, merge_stats, next_id,
                              persistent_programs, row_temperature, scalar_inv_temperature, soft_cap, softcap_args,
                              stats_entropy, store_window, tma_ok, tma_operands, topk_insert, topk_start, topk_store,
                              window_grid, window_tile)
from .config import BwdTile, KernelConfig, default_config, interpreting
from .linear_topk import merge_splits, topk_splits


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
    inv_temperature_ptr=None, ROW_TEMPERATURE: tl.constexpr = False,
    tail_ids_ptr=None, stride_tail_ids=0, n_tail_ids=0, part_mt_ptr=None, part_st_ptr=None,
    TAIL: tl.constexpr = False, BLOCK_IDS: tl.constexpr = 1,
    cand_v_ptr=None, cand_i_ptr=None, topk_split_v=1, topk_splits=1,
    TOPK: tl.constexpr = False, K: tl.constexpr = 1, KP: tl.constexpr = 1,
):
    # logit_scale: 1 / T, or 1 / softcap with SOFTCAP (then z = softcap_scale * tanh(tile)); with
    # ROW_TEMPERATURE each row's 1 / T (inv_temperature_ptr) multiplies the temperature's scale.
    # TAIL: also the tail sum s_t of the columns that are not among the row's sorted ids (tail_ids_ptr),
    # the tail-aware top-K KL's tail bucket, relative to m (written as the partials (m, s_t)).
    # TOPK: the program walks topk_split_v columns (a whole number of SPLIT_V chunks), storing each
    # chunk's partials at its last tile and starting the next from the identity (the same bits as a
    # program per chunk), and keeps each row's K largest logits (building_blocks.topk_insert)
    if TOPK:
        pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), topk_splits, GROUP_M)
    else:
        pid_m, pid_s = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_M), tl.cdiv(V, SPLIT_V), GROUP_M)
    row0 = pid_m * BLOCK_M
    rows = row0 + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    row_inv_temperature, tile_scale, cap_scale = row_temperature(
        inv_temperature_ptr, rows, row_mask, 1.0, logit_scale, softcap_scale, SOFTCAP, ROW_TEMPERATURE, True)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    b = tl.zeros((BLOCK_M,), tl.float32)
    q = tl.zeros((BLOCK_M,), tl.float32)
    if TOPK:
        v_begin = pid_s * topk_split_v
        v_end = tl.minimum(v_begin + topk_split_v, V)
        list_v, list_i, worst_v, worst_i = topk_start(rows, K, KP)
    else:
        v_begin = pid_s * SPLIT_V
        v_end = tl.minimum(v_begin + SPLIT_V, V)
    if TAIL:  # s_t: the tail's sum relative to the same running max m; (at, nxt): each row's next id
        s_t = tl.zeros((BLOCK_M,), tl.float32)
        rows64 = rows.to(tl.int64)
        tail_at = ids_below(tail_ids_ptr, stride_tail_ids, rows64, row_mask, n_tail_ids, v_begin, BLOCK_IDS)
        tail_next = next_id(tail_ids_ptr, stride_tail_ids, rows64, row_mask, n_tail_ids, tail_at)
    for v0 in tl.range(v_begin, v_end, BLOCK_N, flatten=FLATTEN, warp_specialize=WARP_SPEC):
        cols = v0 + tl.arange(0, BLOCK_N)
        col_mask = cols < v_end
        # base 2: z2 = log2(e) z (the tile's last scale carries log2(e)), e = 2^(z2 - max z2), one
        # ex2 per element (flushing e < 2^-126); m and b return to natural units per row. (An
        # epilogue on the raw accumulator, max over h . w then one multiply-add, issues fewer
        # instructions but measured 1.6% slower at 4096 rows on an H100, 2026-11-26: probably the
        # accumulator's registers stay busy longer and the next tile's MMAs wait.)
        z2, _ = logits_tile_log2(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
                                 stride_hn, stride_hk, stride_wv, stride_wk, tile_scale, cap_scale,
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
            else:  # exp(-inf) * -inf is NaN: zero the padded columns (their shift made finite first, so
                # the interpreter's numpy does not warn; the select after the product is kept)
                tile_b = tl.sum(tl.where(col_mask[None, :], e * tl.where(col_mask[None, :], shifted2, 0.0), 0.0),
                                axis=1) * 0.6931471805599453
        else:
            tile_b = tl.zeros((BLOCK_M,), tl.float32)
        if SUM_PI_SQUARED:  # sum exp(2 (z - m)), merged before m and s move on
            q = merge_q(m, s, q, tile_m, tile_s, tl.sum(e * e, axis=1))
        if TAIL:  # the same e without the row's ids (a select), rescaled as s is (before m moves on)
            e_t, tail_at, tail_next = fill_ids(e, 0.0, tail_ids_ptr, stride_tail_ids, rows64, row_mask, n_tail_ids,
                                               tail_at, tail_next, v0, BLOCK_N)
            _, _, _, a_run, a_tile = merge_scales(m, s, tile_m, tile_s)
            s_t = a_run * s_t + a_tile * tl.sum(e_t, axis=1)
        m, s, b = merge_stats(m, s, b, tile_m, tile_s, tile_b)
        if TOPK:  # the candidates; at a chunk's last tile its partials, and the identity again
            list_v, list_i, worst_v, worst_i = topk_insert(z2, v0, list_v, list_i, worst_v, worst_i, BLOCK_N)
            chunk_end = ((v0 + BLOCK_N) % SPLIT_V == 0) | (v0 + BLOCK_N >= v_end)
            _store_partials(part_m_ptr, part_s_ptr, part_b_ptr, part_q_ptr, part_mt_ptr, part_st_ptr,
                            (rows.to(tl.int64) * 0 + v0 // SPLIT_V) * N + rows, row_mask & chunk_end,
                            m, s, b, q, s_t if TAIL else s, ENTROPY, SUM_PI_SQUARED, TAIL)
            m = tl.where(chunk_end, float("-inf"), m)
            s = tl.where(chunk_end, 0.0, s)
            b = tl.where(chunk_end, 0.0, b)
            q = tl.where(chunk_end, 0.0, q)
            if TAIL:
                s_t = tl.where(chunk_end, 0.0, s_t)

    if TOPK:
        topk_store(cand_v_ptr, cand_i_ptr, rows, row_mask, pid_s, topk_splits, list_v, list_i, K, KP)
    else:
        _store_partials(part_m_ptr, part_s_ptr, part_b_ptr, part_q_ptr, part_mt_ptr, part_st_ptr,
                        pid_s.to(tl.int64) * N + rows, row_mask, m, s, b, q, s_t if TAIL else s,
                        ENTROPY, SUM_PI_SQUARED, TAIL)


@triton.jit
def _store_partials(part_m_ptr, part_s_ptr, part_b_ptr, part_q_ptr, part_mt_ptr, part_st_ptr, out, mask,
                    m, s, b, q, s_t, ENTROPY: tl.constexpr, SUM_PI_SQUARED: tl.constexpr, TAIL: tl.constexpr):
    """A split's (or, with TOPK, a chunk's) partials at ``out`` ((S, N) row-major offsets)."""
    tl.store(part_m_ptr + out, m, mask=mask)
    tl.store(part_s_ptr + out, s, mask=mask)
    if ENTROPY:
        tl.store(part_b_ptr + out, b, mask=mask)
    if SUM_PI_SQUARED:
        tl.store(part_q_ptr + out, q, mask=mask)
    if TAIL:  # (m, s_t): the tail's partials share the split's max
        tl.store(part_mt_ptr + out, m, mask=mask)
        tl.store(part_st_ptr + out, s_t, mask=mask)


@triton.jit(do_not_specialize=["check_id"])
def _label_logits_kernel(
    h_ptr, w_ptr, labels_ptr, out_ptr,
    N, V, H, K,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_lab, stride_labk,
    logit_scale, softcap_scale, ignore_index, label_flag_ptr, check_id,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, MARK_BAD: tl.constexpr,
    SOFTCAP: tl.constexpr = False, LIBDEVICE: tl.constexpr = False,
    inv_temperature_ptr=None, ROW_TEMPERATURE: tl.constexpr = False,
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
    row_inv_temperature, tile_scale, cap_scale = row_temperature(  # each hidden row's 1 / T
        inv_temperature_ptr, h_rows, row_mask, 1.0, logit_scale, softcap_scale, SOFTCAP, ROW_TEMPERATURE, False)
    out = acc * tile_scale
    if SOFTCAP:
        out, _ = soft_cap(out, cap_scale, LIBDEVICE)
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
        **softcap_args(softcap, inv_temperature, out), ignore_index=ignore_index, label_flag_ptr=flag,
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
    tail_ids: torch.Tensor | None = None,
    top_k: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Per-split partials of the linear head.

    hidden_states: (N, H), weight: (V, H), both bf16/fp16/fp32 of one dtype, any strides.
    labels: (N,) int32/int64 (any value; only equality with column ids is used). ``params``: the
    head's parameter record (``inv_temperature``, ``softcap``: logits soft-capped before the
    temperature when not None, ``return_entropy``, ``return_sum_pi_squared``, ``ignore_index``).
    Returns (m, s, b, z_y, q): m, s, b (S, N) float32 with S = ceil(V / cfg.split_v) (b is left
    uninitialised without ``return_entropy``), the label logits z_y (N,) float32, and q = sum
    exp(2 (z - m)) (S, N) with ``return_sum_pi_squared`` (else None): the input of
    :func:`split_combine`. ``label_check``: see :func:`label_logits`. ``tail_ids``: (N, K) int32
    contiguous, each row sorted (``autograd.head_family.sorted_tail_ids``): a 6th output, the (2, S, N) float32
    tail partials (m_t, s_t) over the columns that are not among the row's ids, m_t the split's max m
    (the TAIL variant; FLATTEN and WARP_SPEC are off in it: ``fill_ids``' loop stays out of the
    pipeliner). ``top_k`` (1 to 128): a last output, the row's top-K candidates (the TOPK variant:
    each program walks a run of whole splits, :func:`~.linear_topk.topk_splits` runs per row block,
    and stores every split's partials as a program per split would, the same bits): (values (N, R,
    top_k) float32 in base 2 (log2(e) z), local ids (N, R, top_k) int32), unordered, each run's exact
    top K, empty slots -inf with an id >= V (``autograd.linear.TritonHead`` merges them).
    """
    inv_temperature, softcap = params.inv_temperature, params.softcap
    return_entropy, return_sum_pi_squared = params.return_entropy, params.return_sum_pi_squared
    n, h = hidden_states.shape
    v = weight.shape[0]
    num_splits = triton.cdiv(v, cfg.split_v)
    parts = torch.empty((3 + return_sum_pi_squared, num_splits, n), dtype=torch.float32, device=hidden_states.device)
    grid = (triton.cdiv(n, cfg.block_m) * num_splits,)
    use_tma, operands = tma_operands(cfg, cfg.block_m, cfg.block_n, (hidden_states, weight))
    tail, tail_args, pipeline = None, {}, dict(FLATTEN=cfg.flatten, WARP_SPEC=cfg.warp_specialize)
    if tail_ids is not None:
        tail = torch.empty((2, num_splits, n), dtype=torch.float32, device=hidden_states.device)
        tail_args = tail_kernel_args(tail_ids, part_mt_ptr=tail[0], part_st_ptr=tail[1])
        pipeline = dict(FLATTEN=False, WARP_SPEC=False)
    candidates, topk_args = None, {}
    if top_k:
        row_blocks = triton.cdiv(n, cfg.block_m)
        runs = topk_splits(row_blocks, num_splits, hidden_states.device)
        run_v = triton.cdiv(num_splits, runs) * cfg.split_v
        runs = triton.cdiv(v, run_v)  # (every run non-empty)
        candidates = (torch.empty((n, runs, top_k), dtype=torch.float32, device=hidden_states.device),
                      torch.empty((n, runs, top_k), dtype=torch.int32, device=hidden_states.device))
        topk_args = dict(cand_v_ptr=candidates[0], cand_i_ptr=candidates[1], topk_split_v=run_v, topk_splits=runs,
                         TOPK=True, K=top_k, KP=triton.next_power_of_2(top_k))
        grid = (row_blocks * runs,)
        # (one pipeline across the run's tiles as linear_topk's, where it compiles: TMA, 16-bit, no tail)
        flatten = pipeline["FLATTEN"] and use_tma and hidden_states.dtype != torch.float32
        pipeline = dict(FLATTEN=flatten, WARP_SPEC=False)
    _linear_split_stats_kernel[grid](
        *operands,
        parts[0], parts[1], parts[2], parts[-1],
        n, v, h,
        hidden_states.stride(0), hidden_states.stride(1), weight.stride(0), weight.stride(1),
        **softcap_args(softcap, inv_temperature, parts),
        SPLIT_V=cfg.split_v, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        ENTROPY=return_entropy, UPCAST=cfg.upcast(hidden_states.dtype),
        DOT_PRECISION=cfg.dot_precision(hidden_states.dtype), GROUP_M=cfg.group_m,
        USE_TMA=use_tma, EVEN_V=v % cfg.block_n == 0, SUM_PI_SQUARED=return_sum_pi_squared,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pipeline, **tail_args, **topk_args,
    )
    out = (parts[0], parts[1], parts[2], label_logits(hidden_states, weight, labels, params, label_check),
           parts[3] if return_sum_pi_squared else None)
    out = out if tail is None else out + (tail,)
    return out if candidates is None else out + (candidates,)


def tail_kernel_args(tail_ids: torch.Tensor, **pointers) -> dict:
    """The TAIL variant's launch arguments for the sorted (N, K) int32 ``tail_ids``
    (``autograd.head_family.sorted_tail_ids``), plus ``pointers``."""
    if tail_ids.dtype != torch.int32 or tail_ids.dim() != 2 or not tail_ids.is_contiguous():
        raise ValueError(f"tail_ids: expected (N, K) int32 contiguous, got {tuple(tail_ids.shape)} {tail_ids.dtype}")
    k = tail_ids.shape[1]
    return dict(tail_ids_ptr=tail_ids, stride_tail_ids=tail_ids.stride(0) if k else 1, n_tail_ids=k, TAIL=True,
                BLOCK_IDS=triton.next_power_of_2(max(k, 1)), **pointers)


# ------------------------------------------------------------------ combine: the splits merged per row
@triton.jit
def _split_combine_kernel(
    part_m_ptr, part_s_ptr, part_b_ptr, zy_ptr,
    labels_ptr, stride_lab,
    log_probs_ptr, entropy_ptr, lse_ptr,
    N, num_splits, ignore_index, part_q_ptr, sum_pi_squared_ptr,
    BLOCK: tl.constexpr, ENTROPY: tl.constexpr, SUM_PI_SQUARED: tl.constexpr, MARK_BAD: tl.constexpr,
    part_mt_ptr=None, part_st_ptr=None, tail_lse_ptr=None, TAIL: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < N
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    b = tl.zeros((BLOCK,), tl.float32)
    q = tl.zeros((BLOCK,), tl.float32)
    if TAIL:  # the tail statistics, merged like the lse's (identity (-inf, 0))
        m_t = tl.full((BLOCK,), float("-inf"), tl.float32)
        s_t = tl.zeros((BLOCK,), tl.float32)
    for sp in range(0, num_splits):
        off = sp * N + rows.to(tl.int64)
        pm = tl.load(part_m_ptr + off, mask=row_mask, other=0.0)  # (rows past N: lse 0, not log 0)
        ps = tl.load(part_s_ptr + off, mask=row_mask, other=1.0)
        if ENTROPY:
            pb = tl.load(part_b_ptr + off, mask=row_mask, other=0.0)
        else:
            pb = tl.zeros((BLOCK,), tl.float32)
        if SUM_PI_SQUARED:
            q = merge_q(m, s, q, pm, ps, tl.load(part_q_ptr + off, mask=row_mask, other=0.0))
        m, s, b = merge_stats(m, s, b, pm, ps, pb)
        if TAIL:
            m_t, s_t = merge_max_sum(m_t, s_t, tl.load(part_mt_ptr + off, mask=row_mask, other=0.0),
                                     tl.load(part_st_ptr + off, mask=row_mask, other=1.0))
    zy = tl.load(zy_ptr + rows, mask=row_mask, other=0.0)

    log_s, lse = log_sum_lse(m, s)
    labels = tl.load(labels_ptr + rows.to(tl.int64) * stride_lab, mask=row_mask, other=ignore_index)
    valid = labels != ignore_index
    # z_y comes from its own dot product, so when p_y ~ 1 its rounding may put z_y - lse a few ulps
    # above 0; log p <= 0 exactly, so clamp (the clamp only ever reduces the error).
    log_p = tl.minimum(zy - lse, 0.0, propagate_nan=tl.PropagateNan.ALL)  # NaN rows stay NaN
    tl.store(log_probs_ptr + rows, tl.where(valid, log_p, 0.0), mask=row_mask)
    if MARK_BAD:  # label_logits made z_y NaN for a bad label: the saved lse too (a NaN gradient row)
        lse = tl.where(valid & (zy != zy), zy, lse)
    tl.store(lse_ptr + rows, lse, mask=row_mask)
    if TAIL:  # tail_lse = m_t + log s_t (-inf for a row with no tail); NaN with a bad label's lse
        # (no clamp of log s_t at 0: the forward's s_t is relative to the row's max, so s_t < 1)
        # (log s_t spelled so that s_t = 0, a row with no tail (K = V), gives log 0 = -inf without the
        # interpreter's numpy warning about the log of 0)
        tail_lse = m_t + tl.where(s_t == 0.0, float("-inf"), tl.log(tl.where(s_t == 0.0, 1.0, s_t)))
        if MARK_BAD:
            tail_lse = tl.where(valid & (zy != zy), zy, tail_lse)
        tl.store(tail_lse_ptr + rows, tail_lse, mask=row_mask)
    if ENTROPY:
        tl.store(entropy_ptr + rows, tl.where(valid, stats_entropy(log_s, b, s), 0.0), mask=row_mask)
    if SUM_PI_SQUARED:  # sum_j p_j^2 = q / s^2 (0 for ignored rows, as log p and entropy)
        tl.store(sum_pi_squared_ptr + rows, tl.where(valid, q / (s * s), 0.0), mask=row_mask)


def split_combine(
    partials: tuple,
    labels: torch.Tensor,
    params,
    mark_bad: bool = False,
    block: int = 128,
) -> tuple:
    """Merge the partials of ``linear_split_stats`` ((S, N) float32 m, s, b, the (N,) label
    logits, and q (S, N) or None) into (log_probs, entropy, lse, sum_pi_squared), each (N,) float32;
    with the tail partials (a 6th entry of ``partials``, its TAIL variant) a 5th output, tail_lse
    (N,) float32: the logsumexp over the columns outside the row's ids (-inf when there are none).

    ``labels`` is (N,) int32/int64; positions equal to ``params.ignore_index`` get log-prob and
    entropy 0. ``entropy`` is None unless ``params.return_entropy`` (``b`` is then not read);
    ``sum_pi_squared`` (sum_j p_j^2) is None unless q is given. ``mark_bad``: the label logits
    carry NaN for bad labels (``label_logits``' label check); such a row's lse becomes NaN too, so
    that its gradient is NaN, never a finite wrong value.
    """
    part_m, part_s, part_b, label_logits, part_q, *tail = partials
    ignore_index, return_entropy = params.ignore_index, params.return_entropy
    num_splits, n = part_m.shape
    log_probs = torch.empty(n, dtype=torch.float32, device=part_m.device)
    lse = torch.empty_like(log_probs)
    entropy = torch.empty_like(log_probs) if return_entropy else None
    sum_pi_squared = torch.empty_like(log_probs) if part_q is not None else None
    tail_lse = torch.empty_like(log_probs) if tail else None
    tail_args = dict(part_mt_ptr=tail[0][0], part_st_ptr=tail[0][1], tail_lse_ptr=tail_lse, TAIL=True) if tail else {}
    _split_combine_kernel[(triton.cdiv(n, block),)](
        part_m, part_s, part_b, label_logits,
        labels, labels.stride(0),
        log_probs, entropy if return_entropy else log_probs, lse,
        n, num_splits, ignore_index,
        part_q if part_q is not None else part_m, sum_pi_squared if sum_pi_squared is not None else lse,
        BLOCK=block, ENTROPY=return_entropy, SUM_PI_SQUARED=part_q is not None, MARK_BAD=mark_bad, **tail_args,
    )
    out = (log_probs, entropy, lse, sum_pi_squared)
    return out if tail_lse is None else out + (tail_lse,)


# ------------------------------------------------------------------ backward: dlogits windows
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
    inv_temperature_ptr=None, ROW_TEMPERATURE: tl.constexpr = False,
    tail_ids_ptr=None, stride_tail_ids=0, n_tail_ids=0, tail_lse_ptr=None, g_tail_ptr=None,
    TAIL: tl.constexpr = False, BLOCK_IDS: tl.constexpr = 1,
):
    # logit_scale: inv_temperature, or 1 / softcap with SOFTCAP (then z = softcap_scale * tanh(tile));
    # with ROW_TEMPERATURE (inv_temperature = 1) each row's 1 / T from inv_temperature_ptr.
    # TAIL: + g_tail * [j not among the row's sorted ids] * exp(z_j - tail_lse) (d tail_lse / dz), as
    # p_j times the row's g_tail exp(lse - tail_lse) (a select, no second exp)
    num_tiles = tl.cdiv(n_rows, BLOCK_M) * tl.cdiv(n_cols, BLOCK_N)
    # one tile per program (num_programs = num_tiles), or a persistent loop over tiles whose
    # flattened pipeline loads the next tile's operands during this tile's epilogue
    for tile_id in tl.range(tl.program_id(0), num_tiles, num_programs, flatten=FLATTEN):
        local_rows, local_cols, rows, cols, row_mask, col_mask, row0, col0 = window_tile(
            row_start, n_rows, col_start, n_cols, BLOCK_M, BLOCK_N, GROUP_M, tile_id)
        rows64 = rows.to(tl.int64)
        row_inv_temperature, tile_scale, cap_scale = row_temperature(
            inv_temperature_ptr, rows64, row_mask, inv_temperature, logit_scale, softcap_scale,
            SOFTCAP, ROW_TEMPERATURE, True)
        # z2 = log2(e) z, so log2 p = z2 - log2(e) lse is one multiply-add with the GEMM's scale
        # and p = 2^(log2 p) one ex2 (flushing p < 2^-126); t: the cap's tanh with SOFTCAP
        if TAIL:  # (before the GEMM: the ids' loads and searches are not spent with the tile in registers)
            # tiles in grouped order, not ascending per row: each finds its rows' first id >= col0
            tail_at = ids_below(tail_ids_ptr, stride_tail_ids, rows64, row_mask, n_tail_ids, col0, BLOCK_IDS)
            # the row's first two ids from col0 on, as tile offsets (>= BLOCK_N: none); a tile where a
            # row has a third id walks them all (``fill_ids``; a second tile of registers, rare)
            first = next_id(tail_ids_ptr, stride_tail_ids, rows64, row_mask, n_tail_ids, tail_at) - col0
            second = next_id(tail_ids_ptr, stride_tail_ids, rows64, row_mask, n_tail_ids, tail_at + 1) - col0
            third = next_id(tail_ids_ptr, stride_tail_ids, rows64, row_mask, n_tail_ids, tail_at + 2) - col0
        z2, t = logits_tile_log2(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
                                 stride_hn, stride_hk, stride_wv, stride_wk, tile_scale, cap_scale,
                                 BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, col0,
                                 SOFTCAP, LIBDEVICE)
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
        inner = (c * row_inv_temperature)[:, None]
        if HAS_GRAD_ENTROPY:
            inner = inner - (g_ent * (row_inv_temperature * 0.6931471805599453))[:, None] * log2_p
        if HAS_GRAD_SUM_PI_SQUARED:
            inner = inner + (twice_grad_sum_pi_squared * row_inv_temperature)[:, None] * p
        if TAIL:  # exp(z - tail_lse) = p exp(lse - tail_lse): + g_tail exp(lse - tail_lse) / T outside the ids
            tail_lse = tl.load(tail_lse_ptr + rows64, mask=row_mask, other=0.0)
            g_tail = tl.load(g_tail_ptr + rows64, mask=row_mask, other=0.0)
            # 1 / q_tail = exp(lse - tail_lse), its exponent capped at 126 (no inf: 0 * inf would be NaN
            # for a zero g_tail or an empty tail, tail_lse = -inf) and the coefficient at +-1e38, both
            # NaN-propagating; a tail column's p <= q_tail keeps p * coefficient <= |g_tail| / T
            inv_q_tail = tl.exp2(tl.minimum((lse - tail_lse) * 1.4426950408889634, 126.0,
                                            propagate_nan=tl.PropagateNan.ALL))
            tail_coef = tl.clamp(g_tail * row_inv_temperature * inv_q_tail, -1e38, 1e38,
                                 propagate_nan=tl.PropagateNan.ALL)
            if tl.max((third < BLOCK_N).to(tl.int32)) > 0:  # p * the coefficient, the ids' columns to 0
                tail_p, _, _ = fill_ids(p, 0.0, tail_ids_ptr, stride_tail_ids, rows64, row_mask, n_tail_ids, tail_at,
                                        first + col0, col0, BLOCK_N)
                tail_dz = p * inner + tail_p * tail_coef[:, None]
            else:
                offs = tl.arange(0, BLOCK_N)[None, :]
                tail_dz = p * tl.where((offs == first[:, None]) | (offs == second[:, None]), inner,
                                       inner + tail_coef[:, None])
        if HAS_GRAD_LOG_PROBS:
            # the label's column inside this tile (int32, -1 when elsewhere): a 32-bit compare per
            # element against the tile's own column offsets, not a 64-bit one against ``cols``
            label_at = labels - col0
            label_at = tl.where((label_at >= 0) & (label_at < BLOCK_N), label_at, -1).to(tl.int32)
            hit = tl.arange(0, BLOCK_N)[None, :] == label_at[:, None]
            label_dz = tl.where(hit, (g_lp * row_inv_temperature)[:, None], 0.0)
            if TAIL:
                dz = tail_dz + label_dz
            else:
                dz = p * inner + label_dz
        elif TAIL:
            dz = tail_dz
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
    tail_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write d(loss)/d(h.w) for logits[rows, cols] into ``out`` ((rows, cols), input dtype).

    hidden_states (N, H) and weight (V, H) share a dtype; labels (N,) int. ``saved``: the
    forward's (N,) float32 ``lse``, ``entropy`` (required with an entropy gradient) and
    ``sum_pi_squared`` (required with its gradient); ``grads``: upstream (N,) gradients
    ``log_probs`` / ``entropy`` (any stride, 0 allowed), ``lse`` / ``sum_pi_squared`` (contiguous
    float32), each None when absent (``autograd.linear.HeadOutputs`` records). ``params``: the
    head's parameter record (``inv_temperature``, ``ignore_index``, ``softcap``: the logits are
    soft-capped before the temperature when it is not None). ``tail_ids``: the sorted (N, K) int32 ids
    of ``autograd.head_family.sorted_tail_ids`` (columns local to ``weight``), with ``saved.tail_lse`` and
    ``grads.tail_lse`` (N,) float32 contiguous: the TAIL variant adds
    g_tail * [j not among the ids] * exp(z_j - tail_lse) (FLATTEN off in it).
    """
    lse, entropy, sum_pi_squared = saved.lse, saved.entropy, saved.sum_pi_squared
    grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared = grads.log_probs, grads.entropy, grads.lse, \
        grads.sum_pi_squared
    inv_temperature, ignore_index, softcap = params.inv_temperature, params.ignore_index, params.softcap
    tail_args = {}
    if tail_ids is not None:
        tail_args = tail_kernel_args(tail_ids, tail_lse_ptr=saved.tail_lse, g_tail_ptr=grads.tail_lse)
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
        scalar_inv_temperature(inv_temperature), ignore_index,
        sum_pi_squared if grad_sum_pi_squared is not None else lse, grad_sum_pi_squared if grad_sum_pi_squared is not None else lse,
        **softcap_args(softcap, inv_temperature, lse),
        HAS_GRAD_LOG_PROBS=has_lp, HAS_GRAD_ENTROPY=has_ent, HAS_GRAD_LSE=grad_lse is not None, HAS_GRAD_SUM_PI_SQUARED=grad_sum_pi_squared is not None,
        num_programs=programs, FLATTEN=cfg.flatten and programs < grid[0] and tail_ids is None,
        STORE_TMA=store_tma, OUT_DTYPE=TL_DTYPES[out.dtype] if store_tma else None,
        **gemm_meta(cfg, tile, hidden_states.dtype, use_tma), **tail_args,
    )
    return out


# ------------------------------------------------------------------ the family's functions (autograd.linear)
# The same names as in ``torch_ops.linear``: the autograd bodies call one module or the other
# (``autograd.head_family.kernels``).
LN2 = 0.6931471805599453  # (the forward's top-K candidates are log2(e) z)


def forward(hidden_states, weight, labels, params, label_check=None, tail_ids=None) -> tuple:
    """The head's statistics, no autograd: (log_probs, entropy, lse, sum_pi_squared, tail_lse,
    top_logits, top_ids), (N,) float32 each (None where not asked) but the top-K pair ((N,
    ``params.top_k``) float32 logits and int64 ids, -inf / -1 for an empty slot, by value descending then
    id ascending). :func:`linear_split_stats` and :func:`split_combine` (``label_check``, the
    sorted local ``tail_ids``: see there), the runs' top-K candidates merged (natural units)."""
    n = hidden_states.shape[0]
    top_k = params.top_k
    if n == 0:
        empty = hidden_states.new_empty(0, dtype=torch.float32)
        top = (hidden_states.new_empty((0, top_k), dtype=torch.float32),
               hidden_states.new_empty((0, top_k), dtype=torch.int64)) if top_k else (None, None)
        return (empty, empty.clone() if params.return_entropy else None, empty.clone(),
                empty.clone() if params.return_sum_pi_squared else None,
                empty.clone() if tail_ids is not None else None, *top)
    cfg = default_config(hidden_states.device, hidden_states.dtype)
    partials = linear_split_stats(hidden_states, weight, labels, params, cfg, label_check, tail_ids, top_k)
    if top_k:
        partials, (values, ids) = partials[:-1], partials[-1]
    log_probs, entropy, lse, sum_pi_squared, *tail = split_combine(partials, labels, params,
                                                                   mark_bad=label_check is not None)
    top_logits = top_ids = None
    if top_k:  # the runs' candidates merged (natural units); empty slots -> id -1
        top_logits, top_ids = merge_splits(values * LN2, ids, weight.shape[0])
    return log_probs, entropy, lse, sum_pi_squared, tail[0] if tail else None, top_logits, top_ids


def dlogits(hidden_states, weight, labels, saved, grads, params, tail_ids=None) -> tuple:
    """(window function, dlogits dtype, column-width multiple, float32 product form) for the
    backward schedule (``autograd.backward_schedule.chunked_backward``): ``window(rows, cols, out)``
    writes d loss / d logits of that window (:func:`linear_dlogits`) from the forward's ``saved``
    statistics and their upstream ``grads`` (records with ``lse``, ``entropy``, ...)."""
    cfg = default_config(hidden_states.device, hidden_states.dtype)

    def window(rows, cols, out):
        tile = cfg.dlogits_tile(cols.stop - cols.start, weight.shape[0])
        return linear_dlogits(hidden_states, weight, labels, saved, grads, rows, cols, out, params, cfg, tile, tail_ids)
    return window, hidden_states.dtype, cfg.bwd_cols.block_n, cfg.fp32_backward


def gathered_logits(hidden_states, weight, ids, params) -> torch.Tensor:
    """(N, K) float32 logits at ``ids`` (:func:`label_logits`)."""
    return label_logits(hidden_states, weight, ids, params)
