"""Torch twin of the fused linear head (``rl_kernels.ops.linear``): the CPU / no-Triton backend,
and in float64 the oracle of the tests.

Same math as the Triton kernels, computed in ``compute_dtype``
(float32 for the backend, float64 for the reference) over chunks of token rows, so that at most
one (rows x V) logits chunk exists at a time. The inputs are cast to ``compute_dtype`` once per
call (one copy of ``weight`` in that dtype).
"""
from __future__ import annotations

import torch

# logits elements per chunk (x 4 bytes in float32: 256 MiB)
DEFAULT_CHUNK_ELEMENTS = 1 << 26


def per_row(inv_temperature, rows: slice = slice(None), dtype: torch.dtype | None = None):
    """``inv_temperature`` as the multiplier of the logits of ``rows``: a float as it is; a per-row
    (N,) tensor (a per-row temperature) as the column (rows, 1) of those rows, in ``dtype`` when
    given (else its own float32)."""
    if not isinstance(inv_temperature, torch.Tensor):
        return inv_temperature
    col = inv_temperature[rows, None]
    return col if dtype is None else col.to(dtype)


def capped_logits(raw: torch.Tensor, inv_temperature, softcap: float | None):
    """(z, tanh) of the raw logits h . w (``inv_temperature``: a float or a column of
    :func:`per_row`): z = raw * inv_temperature, or with ``softcap`` c
    z = c tanh(raw / c) * inv_temperature (tanh returned for the backward's 1 - tanh^2; None
    without a cap). An infinite raw logit gives NaN under the cap (as ``ops.building_blocks.soft_cap``):
    a non-finite hidden row stays non-finite."""
    if softcap is None:
        return raw * inv_temperature, None
    t = torch.tanh(raw / softcap)
    t = torch.where(raw.isinf(), torch.full((), float("nan"), dtype=t.dtype, device=t.device), t)
    return t * (softcap * inv_temperature), t


def torch_forward(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    params,
    compute_dtype: torch.dtype = torch.float32,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
    tail_ids: torch.Tensor | None = None,
) -> tuple:
    """(log_probs, entropy, lse, sum_pi_squared), each (N,) in ``compute_dtype``; entropy /
    sum_pi_squared (sum_j p_j^2) None unless ``params.return_entropy`` /
    ``params.return_sum_pi_squared``. With ``tail_ids`` (N, K) int (columns of ``weight``; values
    outside [0, V) are ignored) a 5th output, tail_lse (N,): the logsumexp of the logits with the
    row's ids masked to -inf (-inf when nothing is left), the ``ops.linear`` TAIL variant's.

    hidden_states (N, H), weight (V, H), labels (N,) int. Positions equal to
    ``params.ignore_index`` get log-prob 0 and entropy 0. Entropy is -sum p log p (no lse - E[z]
    cancellation). With ``params.softcap`` the logits are c tanh(h . w / c) / T (``capped_logits``).
    """
    inv_temperature, ignore_index, softcap = params.inv_temperature, params.ignore_index, params.softcap
    return_entropy, return_sum_pi_squared = params.return_entropy, params.return_sum_pi_squared
    n = hidden_states.shape[0]
    v = weight.shape[0]
    w = weight.to(compute_dtype)
    valid = labels != ignore_index
    # ids outside [0, V) (a vocab shard's "label in another shard") gather column 0, unused
    safe_labels = torch.where(valid & (labels >= 0) & (labels < v), labels, 0).long()
    log_probs = torch.empty(n, dtype=compute_dtype, device=hidden_states.device)
    lse = torch.empty_like(log_probs)
    entropy = torch.empty_like(log_probs) if return_entropy else None
    sum_pi_squared = torch.empty_like(log_probs) if return_sum_pi_squared else None
    tail_lse = torch.empty_like(log_probs) if tail_ids is not None else None
    rows = max(1, chunk_elements // max(v, 1))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        z, _ = capped_logits(hidden_states[r0:r1].to(compute_dtype) @ w.T,
                             per_row(inv_temperature, slice(r0, r1), compute_dtype), softcap)
        lse_c = torch.logsumexp(z, dim=-1)
        lse[r0:r1] = lse_c
        if tail_ids is not None:
            tail_lse[r0:r1] = torch.logsumexp(z.masked_fill(among(tail_ids[r0:r1], 0, v), float("-inf")), dim=-1)
        log_probs[r0:r1] = z.gather(1, safe_labels[r0:r1, None]).squeeze(1) - lse_c
        if return_entropy or return_sum_pi_squared:
            log_p = z.sub_(lse_c[:, None])
            p = log_p.exp()
        if return_entropy:
            entropy[r0:r1] = -(p * log_p).sum(dim=-1)
        if return_sum_pi_squared:
            sum_pi_squared[r0:r1] = (p * p).sum(dim=-1)
    zero = torch.zeros((), dtype=compute_dtype, device=log_probs.device)
    log_probs = torch.where(valid, log_probs, zero)
    if return_entropy:
        entropy = torch.where(valid, entropy, zero)
    if return_sum_pi_squared:
        sum_pi_squared = torch.where(valid, sum_pi_squared, zero)
    out = (log_probs, entropy, lse, sum_pi_squared)
    return out if tail_lse is None else out + (tail_lse,)


def among(ids: torch.Tensor, col_start: int, width: int) -> torch.Tensor:
    """(rows, width) bool: True at column j where col_start + j is one of the row's ``ids`` (rows, K)
    (ids outside the columns never match): the tail-aware top-K KL's exclusion mask
    (``ops.building_blocks.among_ids``' twin)."""
    local = ids.long() - col_start
    inside = (local >= 0) & (local < width)
    mask = torch.zeros(ids.shape[0], width + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, torch.where(inside, local, width), True)
    return mask[:, :width]


def torch_dlogits(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    saved,
    grads,
    rows: slice,
    cols: slice,
    out: torch.Tensor,
    params,
    tail_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch twin of ``rl_kernels.ops.linear_dlogits`` (the same arguments but the tiles):
    d(loss)/d(h.w) for logits[rows, cols] computed in ``out.dtype`` and written into ``out``
    (with ``params.softcap``, through the cap: times 1 - tanh^2). With ``tail_ids`` (N, K) and
    ``grads.tail_lse``: + g_tail * [j not among the ids] * exp(z_j - saved.tail_lse)."""
    lse, entropy, sum_pi_squared = saved.lse, saved.entropy, saved.sum_pi_squared
    grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared = grads.log_probs, grads.entropy, grads.lse, \
        grads.sum_pi_squared
    ignore_index, softcap = params.ignore_index, params.softcap
    dt = out.dtype
    inv_temperature = per_row(params.inv_temperature, rows, dt)
    lab = labels[rows]
    z, t = capped_logits(hidden_states[rows].to(dt) @ weight[cols].to(dt).T, inv_temperature, softcap)
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
    if grad_sum_pi_squared is not None:
        dz += (2 * grad_sum_pi_squared[rows].to(dt))[:, None] * p * (p - sum_pi_squared[rows].to(dt)[:, None])
    if tail_ids is not None and grads.tail_lse is not None:  # masked before the exp (no 1 / q_tail values)
        log_p_tail = (z - saved.tail_lse[rows].to(dt)[:, None]).masked_fill(
            among(tail_ids[rows], cols.start, cols.stop - cols.start), float("-inf"))
        dz += grads.tail_lse[rows].to(dt)[:, None] * log_p_tail.exp()
    if t is not None:
        dz *= (1 - t) * (1 + t)
    valid = (lab != ignore_index)[:, None]
    out.copy_(torch.where(valid, dz * inv_temperature, torch.zeros((), dtype=dt, device=z.device)))
    return out


def torch_gathered_logits(hidden_states, weight, ids, params, chunk_elements=1 << 25):
    """(N, K) float32 z[i, k] = h_i . w_{ids[i, k]} * params.inv_temperature (``capped_logits``
    with ``params.softcap``), in row chunks of at most ``chunk_elements`` float32 elements of the gathered
    (rows, K, H) weight rows."""
    n, k = ids.shape
    h = hidden_states.shape[1]
    out = torch.empty(n, k, dtype=torch.float32, device=hidden_states.device)
    step = max(1, chunk_elements // max(1, k * h))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        w = weight[ids[r0:r1]].float()
        out[r0:r1] = capped_logits(torch.einsum("nh,nkh->nk", hidden_states[r0:r1].float(), w),
                                   per_row(params.inv_temperature, slice(r0, r1)), params.softcap)[0]
    return out


# ------------------------------------------------------------------ the family's functions (autograd.linear)
# The same names as in ``ops.linear`` (the Triton kernels): the autograd bodies call one module or the
# other (``autograd.head_family.kernels``).
def forward(hidden_states, weight, labels, params, label_check=None, tail_ids=None) -> tuple:
    """``ops.linear.forward``'s twin: (log_probs, entropy, lse, sum_pi_squared, tail_lse, None, None)
    from :func:`torch_forward` (``label_check`` unused: the labels were checked on the host). It
    selects no top K: with ``params.top_k`` the caller takes them from ``torch_ops.linear_topk.select``,
    a pass of its own."""
    log_probs, entropy, lse, sum_pi_squared, *tail = torch_forward(hidden_states, weight, labels, params,
                                                                   tail_ids=tail_ids)
    return log_probs, entropy, lse, sum_pi_squared, tail[0] if tail else None, None, None


def dlogits(hidden_states, weight, labels, saved, grads, params, tail_ids=None) -> tuple:
    """``ops.linear.dlogits``' twin: (window function (:func:`torch_dlogits`), float32, 1, "ieee")."""
    def window(rows, cols, out):
        return torch_dlogits(hidden_states, weight, labels, saved, grads, rows, cols, out, params, tail_ids)
    return window, torch.float32, 1, "ieee"


def gathered_logits(hidden_states, weight, ids, params) -> torch.Tensor:
    """``ops.linear.gathered_logits``' twin (:func:`torch_gathered_logits`)."""
    return torch_gathered_logits(hidden_states, weight, ids, params)
