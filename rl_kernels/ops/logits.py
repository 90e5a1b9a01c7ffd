"""From-logits kernels: softmax statistics of materialized logits, forward and backward.

Memory-bound: the forward reads the N x V logits once and writes O(N); the backward reads them
once more and writes the N x V gradient once (optionally over the logits themselves).

Forward, per row (z = logits * inv_temperature in float32): the vocabulary is cut into splits of
SPLIT_V columns, each read in BLOCK_V chunks; a split's partial is (m, s, b, t, q) with m its max,
s = sum exp(z - m), b = sum exp(z - m)(z - m), t = sum z (for label smoothing) and, on request,
q = sum exp(2 (z - m)) (for sum_j p_j^2 = q / s^2). Partials are merged left to right with
``merge_stats`` / ``merge_q``. Two launch shapes compute exactly the same arithmetic:

* one level (many rows): a program per row walks its splits and finalizes;
* two levels (few rows, long rows): a program per (row, split) writes its partial, then a combine
  program per row merges the S partials in the same order and finalizes.

Every split's partial comes from ``_split_stats``, and both paths merge and finalize through the
one helper ``_merge_and_finalize`` (which calls ``_finalize``), so the results are bitwise identical
between the two paths and independent of N (batch invariant).

Finalize: log_sum = log s (>= 0 when s >= 1), lse = m + log_sum, log p_y = (z_y - m) - log_sum (no lse cancellation),
entropy H = log_sum - b / s, mean log p = t / V - lse. Ignored rows (label == ignore_index) get
log p 0 and entropy 0.

Backward (per element, with p = exp((z - m) - log_sum), S = sum_k p_k^2):
    d/dz_j = p_j (g_lse - g_lp - grad_mean_log_p - g_ent (log p_j + H) + 2 grad_sum_pi_squared (p_j - S))
             + g_lp [j == y] + grad_mean_log_p / V
and d/dlogits = d/dz * inv_temperature, where g_lp, g_ent, g_lse, grad_mean_log_p and grad_sum_pi_squared are per-row
upstream gradients of log p_y, H, lse, mean_j log p_j and S. Source: the softmax derivative
d p_k / dz_j = p_k ([k == j] - p_j), which gives d log p_y / dz = onehot - p, dH/dz = -p (log p + H),
d lse / dz = p and dS/dz_j = sum_k 2 p_k p_k ([k == j] - p_j) = 2 p_j (p_j - S).
"""
from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from ..core._logging import log_once, logger
from ..core.label_flag import label_flag as host_flag
from .building_blocks import (among_ids, log_sum_lse, merge_stats, merge_q, multiprocessors, row_temperature,
                              row_temperature_args, scalar_inv_temperature, stats_entropy)
from .config import LogitsConfig, logits_config
from .launch import Launcher


@triton.jit
def _no_stats():
    """The merge identity (m, s, b, t, q) = (-inf, 0, 0, 0, 0) (fp32 scalars)."""
    zero = tl.zeros((), tl.float32)
    return tl.full((), float("-inf"), tl.float32), zero, zero, zero, zero


@triton.jit
def _split_stats(row_ptr, stride_v, v_begin, V, inv_temperature,
                 SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr,
                 ENTROPY: tl.constexpr, MEAN_LOG_P: tl.constexpr, SUM_PI_SQUARED: tl.constexpr,
                 PREFETCH: tl.constexpr, row=0, ids_ptr=None, stride_ids=0, n_ids=0,
                 TAIL: tl.constexpr = False, BLOCK_IDS: tl.constexpr = 1):
    """Partial (m, s, b, t, q) of columns [v_begin, min(v_begin + SPLIT_V, V)) of one row. With
    PREFETCH the next chunk is loaded before this chunk's math (twice the bytes in flight per
    program; the same values in the same order, so the same bits).

    Per element (the instruction count bounds this loop on a 4.8 TB/s part): the chunk's max is
    taken over the raw values (x / T is monotone in x for T > 0 and so is its rounding, so
    max(x) / T is the max of the scaled logits exactly), and the exponent is base 2 with log2(e) / T
    folded into one scale: e = 2^(x c2 - max(x) c2) with c2 = log2(e) / T, one multiply-add and one
    ``ex2``; b = ln 2 * sum e (x c2 - max(x) c2).

    With TAIL also (mt, st): the same (max, sum) over the columns that are not among the row's
    sorted ids (``ids_ptr`` row ``row``, ``n_ids`` of them: ``among_ids``), those columns read as
    -inf; a split with no such column keeps the identity (-inf, 0). Without TAIL (mt, st) is the
    identity and no instruction computes it."""
    m, s, b, t, q = _no_stats()
    mt, st = m, s
    if TAIL:
        tail_row = tl.zeros((1,), tl.int64) + row  # (a one-row tile for among_ids)
    scale2 = inv_temperature * 1.4426950408889634  # log2(e) / T
    v_end = tl.minimum(v_begin + SPLIT_V, V)
    if PREFETCH:  # the first chunk's load; each iteration issues the next one before its math
        nxt = tl.arange(0, BLOCK_V) + v_begin
        x_next = tl.load(row_ptr + nxt.to(tl.int64) * stride_v, mask=nxt < v_end, other=float("-inf"))
    for c0 in range(v_begin, v_end, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)
        mask = cols < v_end
        if PREFETCH:  # same values, same arithmetic: the next chunk's bytes are in flight meanwhile
            x = x_next
            nxt = cols + BLOCK_V
            x_next = tl.load(row_ptr + nxt.to(tl.int64) * stride_v, mask=nxt < v_end, other=float("-inf"))
        else:
            x = tl.load(row_ptr + cols.to(tl.int64) * stride_v, mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        x_max = tl.max(x, 0)
        cm = x_max * inv_temperature  # the chunk's max of z = x / T
        cm2 = tl.where(x_max == float("-inf"), 0.0, x_max * scale2)
        d2 = x * scale2 - cm2  # (z - cm) log2(e)
        e = tl.exp2(d2)  # ex2.approx.ftz: subnormal terms flushed to 0
        cs = tl.sum(e, 0)
        if ENTROPY:  # e * d with d = -inf (a -inf logit or a padded column) counts 0: clamping d
            # to the lowest float gives e * d = -0 there (one min-max instead of a compare and a
            # select; the sum is the same, a NaN stays NaN through e)
            cb = tl.sum(e * tl.maximum(d2, -3.4028234663852886e38), 0) * 0.6931471805599453
        else:
            cb = tl.zeros((), tl.float32)
        if SUM_PI_SQUARED:  # (before m, s move on: the merge needs both sides' maxima)
            q = merge_q(m, s, q, cm, cs, tl.sum(e * e, 0))
        m, s, b = merge_stats(m, s, b, cm, cs, cb)
        if MEAN_LOG_P:
            t += tl.sum(tl.where(mask, x * inv_temperature, 0.0), 0)
        if TAIL:  # the chunk's columns among the row's ids read as -inf (a padded column is -inf already)
            hit = among_ids(ids_ptr, stride_ids, tail_row, tail_row >= 0, cols, c0, BLOCK_V, n_ids, BLOCK_IDS)
            xt = tl.where(tl.reshape(hit, (BLOCK_V,)), float("-inf"), x)
            xt_max = tl.max(xt, 0)
            d2t = xt * scale2 - tl.where(xt_max == float("-inf"), 0.0, xt_max * scale2)
            mt, st, _ = merge_stats(mt, st, 0.0, xt_max * inv_temperature, tl.sum(tl.exp2(d2t), 0), 0.0)
    return m, s, b, t, q, mt, st


# The forward's per-row outputs: one (7, N) float32 block, a row per statistic in this order (the
# kernels address slot k at out_ptr + k * N; one pointer instead of seven keeps the launch cheap).
OUT_SLOTS = ("row_max", "log_sum", "lse", "log_probs", "entropy", "mean_log_p", "sum_pi_squared", "tail_lse",
             "tail_log_probs")
# (the last two rows only with TAIL: the lse of the columns outside the row's ids, and log q_tail)
# The two-level split's partials: one (5, S, N) float32 block, field f of split j of row i at
# part_ptr + (f * S + j) * N + i, fields (m, s, b, t, q) in this order, then with TAIL (mt, st), the
# tail's max and sum (a (7, S, N) block).
PART_FIELDS = ("m", "s", "b", "t", "q", "mt", "st")


@triton.jit
def _finalize(row, m, s, b, t, q, x_ptr, stride_n, stride_v, labels_ptr, stride_lab, out_ptr, N, V,
              inv_temperature, ignore_index, label_flag_ptr, check_id,
              LOG_PROBS: tl.constexpr, ENTROPY: tl.constexpr, MEAN_LOG_P: tl.constexpr, SUM_PI_SQUARED: tl.constexpr,
              mt=0.0, st=0.0, TAIL: tl.constexpr = False):
    """Write the per-row outputs from the merged statistics (scalars of one row) into their slots
    of the (7, N) block (``OUT_SLOTS``; (9, N) with TAIL: tail_lse = mt + log st, -inf for a row
    whose every column is among its ids, and tail_log_probs = log q_tail = tail_lse - lse formed as
    (mt - m) + (log st - log s), at most 0: no term of the lse's magnitude is rounded, so its error
    does not grow with the logits' offset)."""
    out_ptr += row
    log_sum, lse = log_sum_lse(m, s)  # log s clamped at 0 for a finite m (see there)
    tl.store(out_ptr, m)  # row_max
    tl.store(out_ptr + 2 * N, lse)
    valid = True
    if LOG_PROBS:
        label = tl.load(labels_ptr + row.to(tl.int64) * stride_lab)
        valid = label != ignore_index
        in_range = (label >= 0) & (label < V)
        # a label outside [0, V) that is not ignore_index: never read out of bounds; the row's
        # log-prob and (through the saved log_sum) its gradient become NaN, and the call id goes
        # to the host-visible flag word (label_check.deferred_label_check; 0 = checked on the host)
        bad = valid & (in_range == 0)
        tl.store(label_flag_ptr, check_id, mask=bad & (check_id != 0))
        safe = tl.where(valid & in_range, label, 0).to(tl.int64)
        zy = tl.load(x_ptr + row.to(tl.int64) * stride_n + safe * stride_v).to(tl.float32)
        zy = zy * inv_temperature
        log_p = tl.minimum((zy - m) - log_sum, 0.0, propagate_nan=tl.PropagateNan.ALL)
        tl.store(out_ptr + 3 * N, tl.where(bad, float("nan"), tl.where(valid, log_p, 0.0)))
        tl.store(out_ptr + N, tl.where(bad, float("nan"), log_sum))
    else:
        tl.store(out_ptr + N, log_sum)
    if ENTROPY:
        tl.store(out_ptr + 4 * N, tl.where(valid, stats_entropy(log_sum, b, s), 0.0))
    if MEAN_LOG_P:
        tl.store(out_ptr + 5 * N, t / V - lse)
    if SUM_PI_SQUARED:  # sum_j p_j^2 = q / s^2 (0 for ignored rows, as log p and entropy)
        tl.store(out_ptr + 6 * N, tl.where(valid, q / (s * s), 0.0))
    if TAIL:  # (mt, st) = (-inf, 0) gives -inf + log 0 = -inf, never NaN
        tail_log_sum, tail_lse = log_sum_lse(mt, st)
        tl.store(out_ptr + 7 * N, tail_lse)
        tail_log_p = (mt - m) + (tail_log_sum - log_sum)
        tl.store(out_ptr + 8 * N, tl.minimum(tail_log_p, 0.0, propagate_nan=tl.PropagateNan.ALL))


@triton.jit
def _merge_and_finalize(
    row, x_ptr, stride_n, stride_v, labels_ptr, stride_lab, part_ptr, out_ptr,
    N, V, num_splits, inv_temperature, ignore_index, label_flag_ptr, check_id,
    SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, FROM_PARTS: tl.constexpr,
    LOG_PROBS: tl.constexpr, ENTROPY: tl.constexpr, MEAN_LOG_P: tl.constexpr, SUM_PI_SQUARED: tl.constexpr,
    PREFETCH: tl.constexpr = False, inv_temperature_ptr=None, ROW_TEMPERATURE: tl.constexpr = False,
    ids_ptr=None, stride_ids=0, n_ids=0, TAIL: tl.constexpr = False, BLOCK_IDS: tl.constexpr = 1,
):
    """Merge the S split partials of ``row`` left to right and finalize it: the one path of both
    launch shapes. Each partial is computed here by ``_split_stats`` (one level) or, with
    FROM_PARTS (the two-level combine), read from the (5, S, N) block that the first level wrote
    (volatile loads: in the one-launch combine other programs wrote them, so no L1 line may serve).
    With ROW_TEMPERATURE the row's 1 / T is read from ``inv_temperature_ptr``; with TAIL the tail's
    (mt, st) are merged alongside (fields 5 and 6 of the block)."""
    inv_temperature = row_temperature(inv_temperature_ptr, row, None, inv_temperature, 1.0, 1.0,
                                      False, ROW_TEMPERATURE, False)[0]
    m, s, b, t, q = _no_stats()
    mt, st = m, s
    if FROM_PARTS:
        field = (tl.zeros((), tl.int64) + num_splits) * N  # elements between two fields (int64;
        # num_splits and N may be the constexpr 1, which Triton specializes)
        part_ptr += row
    else:
        row_ptr = x_ptr + row.to(tl.int64) * stride_n
    for split in range(0, num_splits):
        if FROM_PARTS:
            pm = tl.load(part_ptr, volatile=True)
            ps = tl.load(part_ptr + field, volatile=True)
            pb = tl.load(part_ptr + 2 * field, volatile=True)
            pt = tl.load(part_ptr + 3 * field, volatile=True)
            if SUM_PI_SQUARED:
                pq = tl.load(part_ptr + 4 * field, volatile=True)
            else:
                pq = q  # not read
            if TAIL:
                pmt = tl.load(part_ptr + 5 * field, volatile=True)
                pst = tl.load(part_ptr + 6 * field, volatile=True)
            else:
                pmt, pst = mt, st  # not read
            part_ptr += N
        else:
            pm, ps, pb, pt, pq, pmt, pst = _split_stats(row_ptr, stride_v, split * SPLIT_V, V, inv_temperature,
                                                        SPLIT_V, BLOCK_V, ENTROPY, MEAN_LOG_P, SUM_PI_SQUARED,
                                                        PREFETCH, row, ids_ptr, stride_ids, n_ids, TAIL, BLOCK_IDS)
        if SUM_PI_SQUARED:
            q = merge_q(m, s, q, pm, ps, pq)
        m, s, b = merge_stats(m, s, b, pm, ps, pb)
        t += pt
        if TAIL:
            mt, st, _ = merge_stats(mt, st, 0.0, pmt, pst, 0.0)
    _finalize(row, m, s, b, t, q, x_ptr, stride_n, stride_v, labels_ptr, stride_lab, out_ptr, N, V,
              inv_temperature, ignore_index, label_flag_ptr, check_id,
              LOG_PROBS, ENTROPY, MEAN_LOG_P, SUM_PI_SQUARED, mt, st, TAIL)


@triton.jit(do_not_specialize=["check_id"])
def _logits_fwd_kernel(
    x_ptr, stride_n, stride_v, labels_ptr, stride_lab, part_ptr, out_ptr, counter_ptr,
    N, V, num_splits, inv_temperature, ignore_index, label_flag_ptr, check_id,
    SPLIT_V: tl.constexpr, BLOCK_V: tl.constexpr, TWO_LEVEL: tl.constexpr, LAST_COMBINES: tl.constexpr,
    LOG_PROBS: tl.constexpr, ENTROPY: tl.constexpr, MEAN_LOG_P: tl.constexpr, SUM_PI_SQUARED: tl.constexpr,
    PREFETCH: tl.constexpr = False, inv_temperature_ptr=None, ROW_TEMPERATURE: tl.constexpr = False,
    ids_ptr=None, stride_ids=0, n_ids=0, TAIL: tl.constexpr = False, BLOCK_IDS: tl.constexpr = 1,
):
    """One level: program = row, merges all splits and finalizes. Two levels: program =
    (row, split), writes the split's partial (m, s, b, t, q) into the (5, S, N) block; with
    LAST_COMBINES the row's last program to finish (an acq_rel count of finished splits in
    ``counter_ptr[row]``, int32, zero on entry and reset to zero here) merges the row's partials
    in split order and finalizes it, as the combine kernel would (same bits), in the same launch.
    With TAIL (``ids_ptr``: (N, n_ids) int32 sorted ids per row, ``BLOCK_IDS`` >= n_ids a power of
    two) also the lse of the columns outside the row's ids (``_split_stats``; fields mt, st)."""
    pid = tl.program_id(0)
    if TWO_LEVEL:
        row = pid // num_splits
        split = pid % num_splits
        row_ptr = x_ptr + row.to(tl.int64) * stride_n
        row_inv_temperature = row_temperature(inv_temperature_ptr, row, None, inv_temperature, 1.0, 1.0,
                                              False, ROW_TEMPERATURE, False)[0]
        m, s, b, t, q, mt, st = _split_stats(row_ptr, stride_v, split * SPLIT_V, V, row_inv_temperature,
                                             SPLIT_V, BLOCK_V, ENTROPY, MEAN_LOG_P, SUM_PI_SQUARED, PREFETCH,
                                             row, ids_ptr, stride_ids, n_ids, TAIL, BLOCK_IDS)
        field = (tl.zeros((), tl.int64) + num_splits) * N  # (int64; see _merge_and_finalize)
        part_ptr += split.to(tl.int64) * N + row
        tl.store(part_ptr, m)
        tl.store(part_ptr + field, s)
        tl.store(part_ptr + 2 * field, b)
        tl.store(part_ptr + 3 * field, t)
        if SUM_PI_SQUARED:
            tl.store(part_ptr + 4 * field, q)
        if TAIL:
            tl.store(part_ptr + 5 * field, mt)
            tl.store(part_ptr + 6 * field, st)
        if LAST_COMBINES:
            tl.debug_barrier()  # the partial's stores are issued before the count (release below)
            finished = tl.atomic_add(counter_ptr + row, 1, sem="acq_rel", scope="gpu")
            if finished == num_splits - 1:  # every other split of the row has stored its partial
                tl.store(counter_ptr + row, 0)  # ready for the next call on this stream
                _merge_and_finalize(row, x_ptr, stride_n, stride_v, labels_ptr, stride_lab,
                                    part_ptr - split.to(tl.int64) * N - row, out_ptr,
                                    N, V, num_splits, inv_temperature, ignore_index, label_flag_ptr,
                                    check_id, 1, 1, True, LOG_PROBS, ENTROPY, MEAN_LOG_P, SUM_PI_SQUARED,
                                    False, inv_temperature_ptr, ROW_TEMPERATURE, ids_ptr, stride_ids, n_ids, TAIL,
                                    BLOCK_IDS)
    else:
        _merge_and_finalize(pid, x_ptr, stride_n, stride_v, labels_ptr, stride_lab, part_ptr, out_ptr,
                            N, V, num_splits, inv_temperature, ignore_index, label_flag_ptr, check_id,
                            SPLIT_V, BLOCK_V, False, LOG_PROBS, ENTROPY, MEAN_LOG_P, SUM_PI_SQUARED, PREFETCH,
                            inv_temperature_ptr, ROW_TEMPERATURE, ids_ptr, stride_ids, n_ids, TAIL, BLOCK_IDS)


@triton.jit(do_not_specialize=["check_id"])
def _logits_combine_kernel(
    x_ptr, stride_n, stride_v, labels_ptr, stride_lab, part_ptr, out_ptr, counter_ptr,
    N, V, num_splits, inv_temperature, ignore_index, label_flag_ptr, check_id,
    LOG_PROBS: tl.constexpr, ENTROPY: tl.constexpr, MEAN_LOG_P: tl.constexpr, SUM_PI_SQUARED: tl.constexpr,
    inv_temperature_ptr=None, ROW_TEMPERATURE: tl.constexpr = False, TAIL: tl.constexpr = False,
):
    """Second level: program = row; merges the row's S partials in split order and finalizes."""
    _merge_and_finalize(tl.program_id(0), x_ptr, stride_n, stride_v, labels_ptr, stride_lab, part_ptr, out_ptr,
                        N, V, num_splits, inv_temperature, ignore_index, label_flag_ptr, check_id,
                        1, 1, True, LOG_PROBS, ENTROPY, MEAN_LOG_P, SUM_PI_SQUARED,  # SPLIT_V, BLOCK_V unused
                        False, inv_temperature_ptr, ROW_TEMPERATURE, None, 0, 0, TAIL, 1)


@triton.jit
def _logits_bwd_kernel(
    x_ptr, stride_n, stride_v, grad_ptr, stride_gn, stride_gv, labels_ptr, stride_lab,
    row_max_ptr, log_sum_ptr, entropy_ptr, sum_pi_squared_ptr,
    g_lp_ptr, g_ent_ptr, g_lse_ptr, grad_mean_log_p_ptr, grad_sum_pi_squared_ptr,
    V, inv_temperature, ignore_index,
    BLOCK_V: tl.constexpr, HAS_LABELS: tl.constexpr, HAS_GRAD_LOG_PROBS: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr, HAS_GRAD_MEAN_LOG_P: tl.constexpr, HAS_GRAD_SUM_PI_SQUARED: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr = 1, inv_temperature_ptr=None, ROW_TEMPERATURE: tl.constexpr = False,
    tail_lse_ptr=None, g_tail_lse_ptr=None, HAS_GRAD_TAIL_LSE: tl.constexpr = False,
):
    """Program = (row, BLOCKS_PER_PROGRAM column blocks): grad[row, cols] = d loss / d logits in
    grad's dtype. The row's statistics are read once per program; with several blocks, block j + 1
    is loaded before block j's math (more bytes in flight; every element's arithmetic unchanged).
    Per element: log2 p in one multiply-add, one ``ex2`` and up to three multiply-adds against
    per-row scalars (the instruction count, not the bytes, bounds this kernel on a 4.8 TB/s part).

    HAS_GRAD_TAIL_LSE: a gradient g_t of tail_lse = logsumexp of z over the columns outside the
    row's top-K ids (``tail_lse_ptr``, the forward's) adds g_t exp(z_j - tail_lse) / T at EVERY
    column j: the K columns get a wrong tail term here, which the caller overwrites with their
    exact value (``autograd.logits.topk_columns``: their d tail_lse / dz is 0), so no mask is read.
    The exponent is clamped at 0 (exact for the tail columns, where z_j <= tail_lse up to
    rounding), so a K column far above the tail gets at most g_t / T, never inf or 0 * inf. A row
    with tail_lse = -inf (no tail mass) or inactive gets no tail term."""
    row = tl.program_id(0).to(tl.int64)
    inv_temperature = row_temperature(inv_temperature_ptr, row, None, inv_temperature, 1.0, 1.0,
                                      False, ROW_TEMPERATURE, False)[0]  # the row's own 1 / T
    row_max = tl.load(row_max_ptr + row)
    log_sum = tl.load(log_sum_ptr + row)
    # d/dlogits_j = p_j (c + k log2 p_j + a p_j) + [j == y] g_lp / T + grad_mean_log_p / (V T): the
    # row's terms folded into three scalars (times 1 / T), so an element costs an exp and three
    # fused multiply-adds (see the module docstring for the derivative)
    c = tl.zeros((), tl.float32)  # g_lse - g_lp - grad_mean_log_p - g_ent H - 2 grad_sum_pi_squared S
    valid = True
    # an ignored row gets exactly 0 unless an lse / smoothing gradient reaches it, and never a
    # product with 0 (a NaN/inf row would leak NaN into the logits' producer): see offset2 below
    active = True
    if HAS_LABELS:  # rows with label == ignore_index have constant log p and entropy (0)
        label = tl.load(labels_ptr + row * stride_lab)
        valid = label != ignore_index
        active = valid
    uniform = tl.zeros((), tl.float32)  # added at every column: grad_mean_log_p / (V T); at y also g_lp / T
    if HAS_GRAD_LOG_PROBS:
        g_lp = tl.where(valid, tl.load(g_lp_ptr + row), 0.0)
        c -= g_lp
    if HAS_GRAD_LSE:
        g_lse = tl.load(g_lse_ptr + row)
        c += g_lse
        active = active | (g_lse != 0)
    if HAS_GRAD_TAIL_LSE:  # an lse's gradient too: it makes an ignored row active
        g_tail_lse = tl.load(g_tail_lse_ptr + row)
        tail_lse = tl.load(tail_lse_ptr + row)
        active = active | (g_tail_lse != 0)
    if HAS_GRAD_MEAN_LOG_P:
        grad_mean_log_p = tl.load(grad_mean_log_p_ptr + row)
        c -= grad_mean_log_p
        uniform = grad_mean_log_p / V * inv_temperature
        active = active | (grad_mean_log_p != 0)
    if HAS_GRAD_ENTROPY:
        g_ent = tl.where(valid, tl.load(g_ent_ptr + row), 0.0)
        c -= g_ent * tl.load(entropy_ptr + row)
        k = -g_ent * inv_temperature * 0.6931471805599453  # (times ln 2: it multiplies log2 p)
    if HAS_GRAD_SUM_PI_SQUARED:  # d(sum p^2)/dz_j = 2 p_j (p_j - sum p^2)
        twice_grad_sum_pi_squared = 2.0 * tl.where(valid, tl.load(grad_sum_pi_squared_ptr + row), 0.0)
        c -= twice_grad_sum_pi_squared * tl.load(sum_pi_squared_ptr + row)
        a = twice_grad_sum_pi_squared * inv_temperature
    c *= inv_temperature
    # log2 p = x log2(e) / T - (row_max + log_sum) log2(e): one multiply-add per element
    scale2 = inv_temperature * 1.4426950408889634
    offset2 = (row_max + log_sum) * 1.4426950408889634
    # an inactive row: its logits are not read (0), offset2 = +inf makes every p 0 and every row
    # scalar is 0, so each element is 0 * 0 + 0 = 0 exactly, whatever the row held (NaN / inf)
    # and without a select per element
    offset2 = tl.where(active, offset2, float("inf"))
    c = tl.where(active, c, 0.0)
    uniform = tl.where(active, uniform, 0.0)
    if HAS_GRAD_LOG_PROBS:
        g_lp = tl.where(active, g_lp, 0.0)
    if HAS_GRAD_ENTROPY:
        k = tl.where(active, k, 0.0)
    if HAS_GRAD_SUM_PI_SQUARED:
        a = tl.where(active, a, 0.0)
    if HAS_GRAD_TAIL_LSE:
        tail_on = active & (tail_lse > float("-inf"))
        k_tail = tl.where(tail_on, g_tail_lse * inv_temperature, 0.0)
        offset_tail2 = tl.where(tail_on, tail_lse * 1.4426950408889634, float("inf"))
    x_row = x_ptr + row * stride_n
    first = tl.program_id(1) * (BLOCKS_PER_PROGRAM * BLOCK_V)
    if HAS_GRAD_LOG_PROBS:
        onehot = g_lp * inv_temperature + uniform
        # the label's column among this program's (int32, -1 when elsewhere): one 32-bit compare
        # per element against the block's own offsets, not a 64-bit one against ``cols``
        label_at = label - first
        label_at = tl.where((label_at >= 0) & (label_at < BLOCKS_PER_PROGRAM * BLOCK_V), label_at, -1).to(tl.int32)
    read = tl.full((BLOCK_V,), 1, tl.int1) & active  # (a vector: the interpreter's & of a vector
    # compare and a scalar one gives int32, not a mask)
    cols = first + tl.arange(0, BLOCK_V)
    x_next = tl.load(x_row + cols.to(tl.int64) * stride_v, mask=(cols < V) & read, other=0.0)
    for j in tl.static_range(BLOCKS_PER_PROGRAM):
        cols = first + j * BLOCK_V + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = x_next
        if j + 1 < BLOCKS_PER_PROGRAM:
            nxt = cols + BLOCK_V
            x_next = tl.load(x_row + nxt.to(tl.int64) * stride_v, mask=(nxt < V) & read, other=0.0)
        log2_p = z.to(tl.float32) * scale2 - offset2
        p = tl.exp2(log2_p)  # ex2.approx.ftz: p < 2^-126 flushed to 0
        inner = c
        if HAS_GRAD_ENTROPY:  # log2 p clamped at -1500 (p is 0 below -150): a -inf logit gives
            # p * inner = 0, not 0 * inf = NaN
            inner = inner + k * tl.maximum(log2_p, -1500.0)
        if HAS_GRAD_SUM_PI_SQUARED:
            inner = inner + a * p
        if HAS_GRAD_LOG_PROBS:  # (onehot includes uniform)
            dz = p * inner + tl.where(tl.arange(0, BLOCK_V) == label_at - j * BLOCK_V, onehot, uniform)
        elif HAS_GRAD_MEAN_LOG_P:
            dz = p * inner + uniform
        else:
            dz = p * inner
        if HAS_GRAD_TAIL_LSE:
            dz = dz + k_tail * tl.exp2(tl.minimum(z.to(tl.float32) * scale2 - offset_tail2, 0.0))
        tl.store(grad_ptr + row * stride_gn + cols.to(tl.int64) * stride_gv, dz.to(grad_ptr.dtype.element_ty),
                 mask=mask)


def use_two_level(n: int, v: int, cfg: LogitsConfig, device: torch.device) -> bool:
    """Two levels when one program per row would leave the GPU short of work: fewer rows than
    ``cfg.rows_per_sm`` per multiprocessor, and more than one split per row."""
    if v <= cfg.split_v:
        return False
    return n < cfg.rows_per_sm * multiprocessors(device)


def logits_forward(
    logits: torch.Tensor, labels: torch.Tensor | None, params, cfg: LogitsConfig, two_level: bool | None = None,
    label_check: tuple[torch.Tensor, int] | None = None, last_combines: bool | None = None,
    tail_ids: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Softmax statistics of 2-D ``logits`` (N, V) (any strides; bf16/fp16/fp32).

    ``labels``: (N,) int32/int64 or None (no log-probs). ``params``: the from-logits parameter
    record (``inv_temperature``, ``ignore_index``, ``return_entropy``, ``return_mean_log_p``,
    ``return_sum_pi_squared``). Returns a dict of (N,) float32 tensors: ``row_max``, ``log_sum``,
    ``lse`` always; ``log_probs`` with labels; ``entropy``, ``mean_log_p`` (mean over the vocabulary
    of log p) and ``sum_pi_squared`` (sum_j p_j^2) when asked. ``two_level=None`` picks the
    launch shape with :func:`use_two_level` (logged at debug level); both shapes give bitwise
    identical results. ``label_check``: (flag, check_id): where a label outside [0, V) that is
    not ``ignore_index`` is reported (``label_check.deferred_label_check``); such a row's log-prob
    and saved ``log_sum`` are NaN either way. ``last_combines`` (two levels): the row's last
    split to finish merges the row in the same launch (one launch: host time at small N), else a
    second, combine launch does; None = the former except while a CUDA graph is being captured
    (the one-launch path keeps its row counters across calls). Same bits either way.
    ``tail_ids``: None, or (N, K) int32 contiguous ids per row sorted ascending, local to these
    columns (``autograd.head_family.sorted_tail_ids``; ids outside [0, V) match no column): then also
    ``tail_lse``, the logsumexp of z over the columns outside the row's ids (-inf when there are
    none), and ``tail_log_probs`` = tail_lse - lse (<= 0, formed without rounding either, see
    ``_finalize``), from the same read (the TAIL variant of the kernels; without it the kernels
    are the ones without TAIL).
    """
    return_entropy, return_mean_log_p = params.return_entropy, params.return_mean_log_p
    return_sum_pi_squared = params.return_sum_pi_squared
    n, v = logits.shape
    dev = logits.device
    tail = tail_ids is not None
    block = torch.empty((len(OUT_SLOTS) - 2 * (not tail), n), dtype=torch.float32, device=dev)
    asked = (True, True, True, labels is not None, return_entropy, return_mean_log_p, return_sum_pi_squared, tail,
             tail)
    out = {name: row for name, row, a in zip(OUT_SLOTS, block.unbind(0), asked) if a}
    if n == 0:
        return out
    num_splits = -(-v // cfg.split_v)
    if two_level is None:
        two_level = use_two_level(n, v, cfg, dev)
        if logger.isEnabledFor(logging.DEBUG):  # (the message costs host time at small N)
            log_once(logging.DEBUG, f"rl_kernels: from-logits forward, {n} x {v}: "
                     f"{'two-level split' if two_level else 'one level'} ({num_splits} splits per row)")
    if label_check is not None:
        flag, check_id = label_check
    else:
        flag, check_id = host_flag(dev), 0
    lab = labels if labels is not None else flag  # (a placeholder: not read without labels)
    counters = flag  # (a placeholder: read only when the last split combines)
    if two_level:
        part = torch.empty((len(PART_FIELDS) - 2 * (not tail), num_splits, n), dtype=torch.float32, device=dev)
        if last_combines is None:  # not while a CUDA graph is captured: no state kept across calls
            last_combines = not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing())
        if last_combines:
            counters = row_counters(dev, n)
    else:
        part, last_combines = block, False
    args = (logits, logits.stride(0), logits.stride(1), lab, lab.stride(0), part, block, counters,
            n, v, num_splits, scalar_inv_temperature(params.inv_temperature), params.ignore_index, flag, check_id)
    flags = dict(LOG_PROBS=labels is not None, ENTROPY=return_entropy, MEAN_LOG_P=return_mean_log_p,
                 SUM_PI_SQUARED=return_sum_pi_squared, **row_temperature_args(params.inv_temperature, block))
    # the tail's arguments, placeholders without it (never read: TAIL off is the kernel without the
    # tail; the same argument types either way keep the launcher's fast path for both)
    tail_args = dict(ids_ptr=flag, stride_ids=0, n_ids=0, TAIL=False, BLOCK_IDS=1)
    if tail:
        k = tail_ids.shape[1]
        tail_args = dict(ids_ptr=tail_ids, stride_ids=tail_ids.stride(0), n_ids=k, TAIL=True,
                         BLOCK_IDS=triton.next_power_of_2(k))
    _FWD.launch((n * num_splits if two_level else n,), args,
                dict(SPLIT_V=cfg.split_v, BLOCK_V=cfg.block_v, TWO_LEVEL=two_level, LAST_COMBINES=last_combines,
                     PREFETCH=cfg.prefetch, **flags, **tail_args, num_warps=cfg.num_warps))
    if two_level and not last_combines:
        flags["num_warps"] = 1
        _COMBINE.launch((n,), args, dict(flags, TAIL=tail))
    return out


_counters: dict = {}  # (device index, raw stream) -> int32 zeros, the one-launch combine's row counts


def row_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 counters, all zero, for a two-level forward with the last split
    combining (``LAST_COMBINES``): one buffer per (device, stream), kept across calls (each
    launch leaves it zero again, and launches on one stream run in order, so no memset per call);
    fresh zeros on the CPU interpreter."""
    if device.type != "cuda":
        return torch.zeros(n, dtype=torch.int32, device=device)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    buf = _counters.get(key)
    if buf is None or buf.numel() < n:
        if len(_counters) >= 64:  # many streams seen: start afresh (a dropped buffer's memory is
            _counters.clear()  # reused only on its own stream, after its pending kernels)
        buf = _counters[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def logits_backward(
    logits: torch.Tensor, grad: torch.Tensor, labels: torch.Tensor | None, stats: dict,
    grads: dict, params, cfg: LogitsConfig,
) -> torch.Tensor:
    """Write d loss / d logits into ``grad`` (same shape as ``logits``, any strides; may be the
    logits tensor itself). ``stats``: the forward's ``row_max``, ``log_sum`` and (with an entropy
    gradient) ``entropy``. ``grads``: optional (N,) float32 per-row upstream gradients under keys
    ``log_probs``, ``entropy``, ``lse``, ``mean_log_p`` (the last: of the row's mean log p) and
    ``sum_pi_squared`` (then ``stats`` holds the forward's ``sum_pi_squared`` too) and
    ``tail_lse`` (then ``stats`` holds the forward's ``tail_lse``: its term reaches every column,
    the caller overwrites the K columns; see the kernel). ``params``: the from-logits parameter
    record (``inv_temperature``, ``ignore_index``)."""
    inv_temperature, ignore_index = params.inv_temperature, params.ignore_index
    n, v = logits.shape
    if n == 0 or v == 0:
        return grad
    dummy = stats["row_max"]
    lab = labels if labels is not None else host_flag(logits.device)  # (a placeholder: not read)
    per_program = cfg.bwd_blocks_per_program
    # (placeholders without a tail gradient, never read: see logits_forward)
    tail_args = dict(tail_lse_ptr=dummy, g_tail_lse_ptr=dummy, HAS_GRAD_TAIL_LSE=False)
    if "tail_lse" in grads:
        tail_args = dict(tail_lse_ptr=stats["tail_lse"], g_tail_lse_ptr=grads["tail_lse"], HAS_GRAD_TAIL_LSE=True)
    _BWD[(n, -(-v // (cfg.bwd_block_v * per_program)))](
        logits, logits.stride(0), logits.stride(1), grad, grad.stride(0), grad.stride(1),
        lab, lab.stride(0), stats["row_max"], stats["log_sum"], stats.get("entropy", dummy),
        stats.get("sum_pi_squared", dummy),
        grads.get("log_probs", dummy), grads.get("entropy", dummy), grads.get("lse", dummy),
        grads.get("mean_log_p", dummy), grads.get("sum_pi_squared", dummy), v, scalar_inv_temperature(inv_temperature),
        ignore_index, **row_temperature_args(inv_temperature, dummy),
        BLOCK_V=cfg.bwd_block_v, HAS_LABELS=labels is not None, HAS_GRAD_LOG_PROBS="log_probs" in grads, HAS_GRAD_ENTROPY="entropy" in grads,
        HAS_GRAD_LSE="lse" in grads, HAS_GRAD_MEAN_LOG_P="mean_log_p" in grads, HAS_GRAD_SUM_PI_SQUARED="sum_pi_squared" in grads,
        BLOCKS_PER_PROGRAM=per_program, **tail_args, num_warps=cfg.bwd_num_warps)
    return grad


_FWD, _COMBINE, _BWD = (Launcher(k) for k in (_logits_fwd_kernel, _logits_combine_kernel, _logits_bwd_kernel))


# ------------------------------------------------------------------ the family's functions (autograd.logits)
# The same names as in ``torch_ops.logits``: the autograd bodies call one module or the other.
def forward(logits, labels, params, label_check=None, tail_ids=None) -> dict:
    """The from-logits statistics (:func:`logits_forward` on this device's ``logits_config``; the
    last combines in one launch where ``params.combine_in_one_launch``)."""
    return logits_forward(logits, labels, params, logits_config(logits.device), label_check=label_check,
                          last_combines=None if params.combine_in_one_launch else False, tail_ids=tail_ids)


def backward(logits, grad, labels, stats: dict, grads: dict, params) -> None:
    """d loss / d logits into ``grad`` (:func:`logits_backward` on this device's ``logits_config``)."""
    logits_backward(logits, grad, labels, stats, grads, params, logits_config(logits.device))
