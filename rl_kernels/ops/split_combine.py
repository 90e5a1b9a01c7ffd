"""Combine kernel: merges per-split softmax partials into log-probs, entropy and lse.

Input partials (m, s, b) are (S, N) float32 and the label logits z_y (N,) float32 (see
``linear_forward``); the S splits are merged in a fixed order with ``merge_stats`` (identity (-inf, 0, 0), never 0 for m: verl PR #7439).
The same merge serves vocab-parallel ranks, whose partials are stacked along S.
Per row: lse = m + log s, log p(y) = min(z_y - lse, 0), entropy = log s - b / s, and on request
sum_j p_j^2 = q / s^2 from the partials q = sum exp(2 (z - m)).
Rows whose label equals ``ignore_index`` get log-prob 0 and entropy 0 (lse is still written).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import log_sum_lse, merge_stats, merge_q, stats_entropy


@triton.jit
def _split_combine_kernel(
    part_m_ptr, part_s_ptr, part_b_ptr, zy_ptr,
    labels_ptr, stride_lab,
    log_probs_ptr, entropy_ptr, lse_ptr,
    N, num_splits, ignore_index, part_q_ptr, sum_pi_squared_ptr,
    BLOCK: tl.constexpr, ENTROPY: tl.constexpr, SUM_PI_SQUARED: tl.constexpr, MARK_BAD: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < N
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    b = tl.zeros((BLOCK,), tl.float32)
    q = tl.zeros((BLOCK,), tl.float32)
    for sp in range(0, num_splits):
        off = sp * N + rows.to(tl.int64)
        pm = tl.load(part_m_ptr + off, mask=row_mask, other=float("-inf"))
        ps = tl.load(part_s_ptr + off, mask=row_mask, other=0.0)
        if ENTROPY:
            pb = tl.load(part_b_ptr + off, mask=row_mask, other=0.0)
        else:
            pb = tl.zeros((BLOCK,), tl.float32)
        if SUM_PI_SQUARED:
            q = merge_q(m, s, q, pm, ps, tl.load(part_q_ptr + off, mask=row_mask, other=0.0))
        m, s, b = merge_stats(m, s, b, pm, ps, pb)
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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """Merge the partials of ``linear_split_stats`` ((S, N) float32 m, s, b, the (N,) label
    logits, and q (S, N) or None) into (log_probs, entropy, lse, sum_pi_squared), each (N,) float32.

    ``labels`` is (N,) int32/int64; positions equal to ``params.ignore_index`` get log-prob and
    entropy 0. ``entropy`` is None unless ``params.return_entropy`` (``b`` is then not read);
    ``sum_pi_squared`` (sum_j p_j^2) is None unless q is given. ``mark_bad``: the label logits
    carry NaN for bad labels (``label_logits``' label check); such a row's lse becomes NaN too, so
    that its gradient is NaN, never a finite wrong value.
    """
    part_m, part_s, part_b, label_logits, part_q = partials
    ignore_index, return_entropy = params.ignore_index, params.return_entropy
    num_splits, n = part_m.shape
    log_probs = torch.empty(n, dtype=torch.float32, device=part_m.device)
    lse = torch.empty_like(log_probs)
    entropy = torch.empty_like(log_probs) if return_entropy else None
    sum_pi_squared = torch.empty_like(log_probs) if part_q is not None else None
    _split_combine_kernel[(triton.cdiv(n, block),)](
        part_m, part_s, part_b, label_logits,
        labels, labels.stride(0),
        log_probs, entropy if return_entropy else log_probs, lse,
        n, num_splits, ignore_index,
        part_q if part_q is not None else part_m, sum_pi_squared if sum_pi_squared is not None else lse,
        BLOCK=block, ENTROPY=return_entropy, SUM_PI_SQUARED=part_q is not None, MARK_BAD=mark_bad,
    )
    return log_probs, entropy, lse, sum_pi_squared
