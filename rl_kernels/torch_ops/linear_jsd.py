"""Torch twin of the JSD kernels (``rl_kernels.ops.linear_jsd``): the same per-row sums and
dlogits windows, computed in a given dtype over row chunks (the formulas are in that module's
docstring)."""
from __future__ import annotations

import math

import torch

from .linear import DEFAULT_CHUNK_ELEMENTS


def jsd_terms(log_q, log_p, beta):
    """Torch twin of ``ops.linear_jsd._jsd_terms``: elementwise (loss term, g, q)."""
    q = log_q.exp()
    if beta == 0.0:
        return log_p.exp() * (log_p - log_q), None, q
    if beta == 1.0:
        return q * (log_q - log_p), None, q
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    g = (1.0 - beta) * q * (log_q - log_m)
    return beta * log_p.exp() * (log_p - log_m) + g, g, q


def two_heads(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t,
               rows, cols, inv_temperature, dt):
    zs = (student_hidden[rows].to(dt) @ student_weight[cols].to(dt).T) * inv_temperature
    zt = (teacher_hidden[rows].to(dt) @ teacher_weight[cols].to(dt).T) * inv_temperature
    return zs - lse_s[rows].to(dt)[:, None], zt - lse_t[rows].to(dt)[:, None]


def torch_jsd_sums(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t,
                   params, compute_dtype=torch.float32, chunk_elements=DEFAULT_CHUNK_ELEMENTS):
    """Torch twin of ``ops.linear_jsd.jsd_split_sums``: (L, G) per row in ``compute_dtype``, over
    row chunks of at most ``chunk_elements`` logits per head."""
    inv_temperature, beta = params.inv_temperature, params.beta
    n, v = student_hidden.shape[0], student_weight.shape[0]
    loss = torch.empty(n, dtype=compute_dtype, device=student_hidden.device)
    g_sum = torch.empty_like(loss) if 0.0 < beta < 1.0 else None
    step = max(1, chunk_elements // max(v, 1))
    for r0 in range(0, n, step):
        rows = slice(r0, min(n, r0 + step))
        log_q, log_p = two_heads(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                  lse_s, lse_t, rows, slice(0, v), inv_temperature, compute_dtype)
        term, g, _ = jsd_terms(log_q, log_p, beta)
        loss[rows] = term.sum(-1)
        if g_sum is not None:
            g_sum[rows] = g.sum(-1)
    return loss, (g_sum if g_sum is not None else (loss if beta == 1.0 else None))


def torch_jsd_dlogits(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t,
                      g_sum, scale, rows, cols, out, params):
    """Torch twin of ``ops.linear_jsd.jsd_dlogits`` (computed in ``out.dtype``)."""
    inv_temperature, beta = params.inv_temperature, params.beta
    dt = out.dtype
    log_q, log_p = two_heads(student_hidden, student_weight, teacher_hidden, teacher_weight,
                              lse_s, lse_t, rows, cols, inv_temperature, dt)
    _, g, q = jsd_terms(log_q, log_p, beta)
    if beta == 0.0:
        d = q - log_p.exp()
    elif beta == 1.0:
        d = q * (log_q - log_p - g_sum[rows].to(dt)[:, None])
    else:
        d = g - q * g_sum[rows].to(dt)[:, None]
    s = scale[rows].to(dt)[:, None]
    out.copy_(torch.where(s != 0, d * (s * inv_temperature), torch.zeros((), dtype=dt, device=d.device)))
    return out


# ------------------------------------------------------------------ the family's functions (autograd.linear_jsd)
# The same names as in ``ops.linear_jsd`` (the Triton kernels).
def sums(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t, params):
    """``ops.linear_jsd.sums``' twin (:func:`torch_jsd_sums`)."""
    return torch_jsd_sums(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t, params)


def dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, params):
    """``ops.linear_jsd.dlogits``' twin: (window function (:func:`torch_jsd_dlogits`), float32, 1, "ieee")."""
    def window(rows, cols, out):
        return torch_jsd_dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, rows, cols, out, params)
    return window, torch.float32, 1, "ieee"
