"""Torch twin of the from-logits kernels (``rl_kernels.ops.logits``): the same per-row
statistics (row max, log-sum, log-probs, entropy, mean log p, sum of squared probabilities) and
the same backward, in float32 row chunks, on any device. Formulas: ``rl_kernels.logits``."""
from __future__ import annotations

import torch

from .linear import per_row

# logits elements per row chunk (x 4 bytes per float32 temporary: 256 MiB; a few temporaries
# live at once). 2^24 measured 5% slower end to end on an H100.
CHUNK_ELEMENTS = 1 << 26


def excluded_columns(tail_ids, v: int) -> torch.Tensor:
    """(R, v) bool: True at the columns among each row's ``tail_ids`` (R, K) (ids outside [0, v)
    match no column), the twin of ``ops.building_blocks.among_ids``."""
    safe = torch.where((tail_ids >= 0) & (tail_ids < v), tail_ids, v).long()
    hit = torch.zeros((tail_ids.shape[0], v + 1), dtype=torch.bool, device=tail_ids.device)
    return hit.scatter_(1, safe, True)[:, :v]


def torch_logits_forward(logits, labels, params, tail_ids=None):
    """Torch twin of ``ops.logits_forward`` (same arguments but the tiles, same outputs), in
    float32 row chunks of at most ``CHUNK_ELEMENTS`` elements. With ``tail_ids`` (N, K) (local
    column ids; ids outside [0, V) match none) also ``tail_lse``: the logsumexp over the other
    columns, computed with the ids' columns at -inf (-inf when none is left), and
    ``tail_log_probs`` = tail_lse - lse, formed relative to the row max (no rounding at the lse's
    magnitude), at most 0."""
    inv_temperature, ignore_index = params.inv_temperature, params.ignore_index
    return_entropy, return_mean_log_p = params.return_entropy, params.return_mean_log_p
    return_sum_pi_squared = params.return_sum_pi_squared
    n, v = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    out = {k: torch.empty(n, **f32) for k in ("row_max", "log_sum")}
    if labels is not None:
        out["log_probs"] = torch.empty(n, **f32)
        valid = labels != ignore_index
        # out-of-range labels raise after the forward (the caller checks); never index out of bounds
        safe = torch.where(valid & (labels >= 0) & (labels < v), labels, 0).long()
    if return_entropy:
        out["entropy"] = torch.empty(n, **f32)
    if return_mean_log_p:
        out["mean_log_p"] = torch.empty(n, **f32)
    if return_sum_pi_squared:
        out["sum_pi_squared"] = torch.empty(n, **f32)
    if tail_ids is not None:
        out["tail_lse"] = torch.empty(n, **f32)
        out["tail_log_probs"] = torch.empty(n, **f32)
    step = max(1, CHUNK_ELEMENTS // v)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        z = logits[r0:r1].to(torch.float32, copy=True).mul_(per_row(inv_temperature, slice(r0, r1)))
        m = z.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros((), device=m.device))
        z.sub_(m)
        ls = torch.logsumexp(z, dim=-1)
        if tail_ids is not None:  # (the masked row's own max inside logsumexp: no cancellation)
            tail = torch.logsumexp(z.masked_fill(excluded_columns(tail_ids[r0:r1], v), float("-inf")), dim=-1)
            out["tail_lse"][r0:r1] = m[:, 0] + tail
            out["tail_log_probs"][r0:r1] = (tail - ls).clamp_max_(0.0)
        out["row_max"][r0:r1] = m[:, 0]
        out["log_sum"][r0:r1] = ls
        if return_mean_log_p:
            out["mean_log_p"][r0:r1] = z.sum(dim=-1) / v - ls
        log_p = z.sub_(ls[:, None])
        if labels is not None:
            out["log_probs"][r0:r1] = log_p.gather(1, safe[r0:r1, None]).squeeze(1)
        if return_entropy or return_sum_pi_squared:
            p = log_p.exp()
        if return_entropy:
            out["entropy"][r0:r1] = -(p * torch.where(p > 0, log_p, 0.0)).sum(dim=-1)
        if return_sum_pi_squared:
            out["sum_pi_squared"][r0:r1] = (p * p).sum(dim=-1)
    out["lse"] = out["row_max"] + out["log_sum"]
    if labels is not None:
        zero = torch.zeros((), device=logits.device)
        out["log_probs"] = torch.where(valid, out["log_probs"], zero)
        if return_entropy:
            out["entropy"] = torch.where(valid, out["entropy"], zero)
        if return_sum_pi_squared:
            out["sum_pi_squared"] = torch.where(valid, out["sum_pi_squared"], zero)
    return out


def torch_logits_backward(logits, grad, labels, stats, grads, params):
    """Torch twin of ``ops.logits_backward`` (same contract): writes d loss / d logits into
    ``grad`` (the logits' dtype) in float32 row chunks. A ``tail_lse`` gradient g_t adds
    g_t exp(min(z_j - tail_lse, 0)) / T at every column (the caller overwrites the K columns), none
    where tail_lse = -inf."""
    inv_temperature, ignore_index = params.inv_temperature, params.ignore_index
    n, v = logits.shape
    dev = logits.device
    zero = torch.zeros((), device=dev)
    valid = (labels != ignore_index) if labels is not None else None
    g_lp, g_ent, grad_sum_pi_squared = grads.get("log_probs"), grads.get("entropy"), grads.get("sum_pi_squared")
    if valid is not None:
        g_lp = torch.where(valid, g_lp, zero) if g_lp is not None else None
        g_ent = torch.where(valid, g_ent, zero) if g_ent is not None else None
        grad_sum_pi_squared = torch.where(valid, grad_sum_pi_squared, zero) if grad_sum_pi_squared is not None else None
    coef = torch.zeros(n, dtype=torch.float32, device=dev)
    # rows that get exactly 0 (selected, not multiplied by 0): ignored, and no lse / smoothing
    # gradient reaches them
    active = valid.clone() if valid is not None else None
    for key, sign in (("lse", 1.0), ("mean_log_p", -1.0), ("tail_lse", 0.0)):
        if key in grads:
            if sign:
                coef = coef + sign * grads[key]
            if active is not None:
                active |= grads[key] != 0
    if g_lp is not None:
        coef = coef - g_lp
        safe = torch.where(valid, labels, 0).long()
    if "tail_lse" in grads:
        tail_on = stats["tail_lse"] > float("-inf")
        if active is not None:
            tail_on &= active
        k_tail = torch.where(tail_on, grads["tail_lse"], zero)
        offset_tail = torch.where(tail_on, stats["tail_lse"], float("inf"))
    step = max(1, CHUNK_ELEMENTS // v)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        z = logits[r0:r1].to(torch.float32, copy=True).mul_(per_row(inv_temperature, slice(r0, r1)))
        if "tail_lse" in grads:
            tail = (z - offset_tail[r0:r1, None]).clamp_max_(0.0).exp_().mul_(k_tail[r0:r1, None])
        log_p = z.sub_(stats["row_max"][r0:r1, None]).sub_(stats["log_sum"][r0:r1, None])
        p = log_p.exp()
        dz = p * coef[r0:r1, None]
        if g_ent is not None:
            dz -= g_ent[r0:r1, None] * p * torch.where(p > 0, log_p + stats["entropy"][r0:r1, None], 0.0)
        if grad_sum_pi_squared is not None:
            dz += (2.0 * grad_sum_pi_squared[r0:r1, None]) * p * (p - stats["sum_pi_squared"][r0:r1, None])
        if g_lp is not None:
            dz.scatter_add_(1, safe[r0:r1, None], g_lp[r0:r1, None])
        if "mean_log_p" in grads:
            dz += grads["mean_log_p"][r0:r1, None] / v
        if "tail_lse" in grads:
            dz += tail
        dz.mul_(per_row(inv_temperature, slice(r0, r1)))
        if active is not None:
            dz = torch.where(active[r0:r1, None], dz, zero)
        grad[r0:r1] = dz
    return grad


# ------------------------------------------------------------------ the family's functions (autograd.logits)
# The same names as in ``ops.logits`` (the Triton kernels).
def forward(logits, labels, params, label_check=None, tail_ids=None) -> dict:
    """``ops.logits.forward``'s twin (:func:`torch_logits_forward`; ``label_check`` unused)."""
    return torch_logits_forward(logits, labels, params, tail_ids)


def backward(logits, grad, labels, stats: dict, grads: dict, params) -> None:
    """``ops.logits.backward``'s twin (:func:`torch_logits_backward`)."""
    torch_logits_backward(logits, grad, labels, stats, grads, params)
