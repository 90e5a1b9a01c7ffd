"""Torch implementation of the linear head: the CPU / no-Triton backend and the test oracle.

Same math as the Triton kernels (see ``rl_kernels.ops``), computed in ``compute_dtype``
(float32 for the backend, float64 for the reference) over chunks of token rows, so that at most
one (rows x V) logits chunk exists at a time. The inputs are cast to ``compute_dtype`` once per
call (one copy of ``weight`` in that dtype).
"""
from __future__ import annotations

import math

import torch

# logits elements per chunk (x 4 bytes in float32: 256 MiB)
DEFAULT_CHUNK_ELEMENTS = 1 << 26


def torch_forward(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    inv_temperature: float,
    ignore_index: int,
    return_entropy: bool,
    compute_dtype: torch.dtype = torch.float32,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    return_sum_pi_squared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(log_probs, entropy, lse, sum_sq), each (N,) in ``compute_dtype``; entropy / sum_sq
    (sum_j p_j^2) None if not asked.

    hidden_states (N, H), weight (V, H), labels (N,) int. Positions equal to ``ignore_index`` get
    log-prob 0 and entropy 0. Entropy is -sum p log p (no lse - E[z] cancellation).
    """
    n = hidden_states.shape[0]
    v = weight.shape[0]
    w = weight.to(compute_dtype)
    valid = labels != ignore_index
    # ids outside [0, V) (a vocab shard's "label in another shard") gather column 0, unused
    safe_labels = torch.where(valid & (labels >= 0) & (labels < v), labels, 0).long()
    log_probs = torch.empty(n, dtype=compute_dtype, device=hidden_states.device)
    lse = torch.empty_like(log_probs)
    entropy = torch.empty_like(log_probs) if return_entropy else None
    sum_sq = torch.empty_like(log_probs) if return_sum_pi_squared else None
    rows = max(1, chunk_elements // max(v, 1))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        z = (hidden_states[r0:r1].to(compute_dtype) @ w.T) * inv_temperature
        lse_c = torch.logsumexp(z, dim=-1)
        lse[r0:r1] = lse_c
        log_probs[r0:r1] = z.gather(1, safe_labels[r0:r1, None]).squeeze(1) - lse_c
        if return_entropy or return_sum_pi_squared:
            log_p = z.sub_(lse_c[:, None])
            p = log_p.exp()
        if return_entropy:
            entropy[r0:r1] = -(p * log_p).sum(dim=-1)
        if return_sum_pi_squared:
            sum_sq[r0:r1] = (p * p).sum(dim=-1)
    zero = torch.zeros((), dtype=compute_dtype, device=log_probs.device)
    log_probs = torch.where(valid, log_probs, zero)
    if return_entropy:
        entropy = torch.where(valid, entropy, zero)
    if return_sum_pi_squared:
        sum_sq = torch.where(valid, sum_sq, zero)
    return log_probs, entropy, lse, sum_sq


def torch_dlogits(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_log_probs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    rows: slice,
    cols: slice,
    inv_temperature: float,
    ignore_index: int,
    out: torch.Tensor,
    grad_lse: torch.Tensor | None = None,
    sum_sq: torch.Tensor | None = None,
    grad_sum_sq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch twin of ``rl_kernels.ops.linear_dlogits``: d(loss)/d(h.w) for logits[rows, cols]
    computed in ``out.dtype`` and written into ``out``."""
    dt = out.dtype
    lab = labels[rows]
    z = (hidden_states[rows].to(dt) @ weight[cols].to(dt).T) * inv_temperature
    log_p = z - lse[rows].to(dt)[:, None]
    p = log_p.exp()
    dz = torch.zeros_like(z)
    if grad_log_probs is not None:
        onehot = (torch.arange(cols.start, cols.stop, device=z.device)[None, :] == lab[:, None])
        dz += grad_log_probs[rows].to(dt)[:, None] * (onehot.to(dt) - p)
    if grad_entropy is not None:
        dz -= grad_entropy[rows].to(dt)[:, None] * p * (log_p + entropy[rows].to(dt)[:, None])
    if grad_lse is not None:
        dz += grad_lse[rows].to(dt)[:, None] * p
    if grad_sum_sq is not None:
        dz += (2 * grad_sum_sq[rows].to(dt))[:, None] * p * (p - sum_sq[rows].to(dt)[:, None])
    valid = (lab != ignore_index)[:, None]
    out.copy_(torch.where(valid, dz * inv_temperature, torch.zeros((), dtype=dt, device=z.device)))
    return out


def torch_gathered_logits(hidden_states, weight, ids, inv_temperature, chunk_elements=1 << 25):
    """(N, K) float32 z[i, k] = h_i . w_{ids[i, k]} * inv_temperature, in row chunks of at most
    ``chunk_elements`` float32 elements of the gathered (rows, K, H) weight rows."""
    n, k = ids.shape
    h = hidden_states.shape[1]
    out = torch.empty(n, k, dtype=torch.float32, device=hidden_states.device)
    step = max(1, chunk_elements // max(1, k * h))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = weight[ids[r0:r1]].float()
        out[r0:r1] = torch.einsum("nh,nkh->nk", hidden_states[r0:r1].float(), w) * inv_temperature
    return out


def _jsd_terms(log_q, log_p, beta):
    """Torch twin of ``ops.linear_jsd._jsd_terms``: elementwise (loss term, g, q)."""
    q = log_q.exp()
    if beta == 0.0:
        return log_p.exp() * (log_p - log_q), None, q
    if beta == 1.0:
        return q * (log_q - log_p), None, q
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    g = (1.0 - beta) * q * (log_q - log_m)
    return beta * log_p.exp() * (log_p - log_m) + g, g, q


def _two_heads(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t,
               rows, cols, inv_temperature, dt):
    zs = (student_hidden[rows].to(dt) @ student_weight[cols].to(dt).T) * inv_temperature
    zt = (teacher_hidden[rows].to(dt) @ teacher_weight[cols].to(dt).T) * inv_temperature
    return zs - lse_s[rows].to(dt)[:, None], zt - lse_t[rows].to(dt)[:, None]


def torch_jsd_sums(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t,
                   inv_temperature, beta, compute_dtype=torch.float32,
                   chunk_elements=DEFAULT_CHUNK_ELEMENTS):
    """Torch twin of ``ops.linear_jsd.jsd_split_sums``: (L, G) per row in ``compute_dtype``, over
    row chunks of at most ``chunk_elements`` logits per head."""
    n, v = student_hidden.shape[0], student_weight.shape[0]
    loss = torch.empty(n, dtype=compute_dtype, device=student_hidden.device)
    g_sum = torch.empty_like(loss) if 0.0 < beta < 1.0 else None
    step = max(1, chunk_elements // max(v, 1))
    for r0 in range(0, n, step):
        rows = slice(r0, min(n, r0 + step))
        log_q, log_p = _two_heads(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                  lse_s, lse_t, rows, slice(0, v), inv_temperature, compute_dtype)
        term, g, _ = _jsd_terms(log_q, log_p, beta)
        loss[rows] = term.sum(-1)
        if g_sum is not None:
            g_sum[rows] = g.sum(-1)
    return loss, (g_sum if g_sum is not None else (loss if beta == 1.0 else None))


def torch_jsd_dlogits(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t,
                      g_sum, scale, rows, cols, inv_temperature, beta, out):
    """Torch twin of ``ops.linear_jsd.jsd_dlogits`` (computed in ``out.dtype``)."""
    dt = out.dtype
    log_q, log_p = _two_heads(student_hidden, student_weight, teacher_hidden, teacher_weight,
                              lse_s, lse_t, rows, cols, inv_temperature, dt)
    _, g, q = _jsd_terms(log_q, log_p, beta)
    if beta == 0.0:
        d = q - log_p.exp()
    elif beta == 1.0:
        d = q * (log_q - log_p - g_sum[rows].to(dt)[:, None])
    else:
        d = g - q * g_sum[rows].to(dt)[:, None]
    s = scale[rows].to(dt)[:, None]
    out.copy_(torch.where(s != 0, d * (s * inv_temperature), torch.zeros((), dtype=dt, device=d.device)))
    return out
