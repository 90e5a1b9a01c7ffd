"""Log-probs and entropy from already-materialized logits (torch, chunked over rows).

This is the memory-lean torch path: logits are read in row chunks of at most
``CHUNK_ELEMENTS`` elements, each chunk is upcast to float32, and only O(N) statistics
(lse, entropy) are saved for backward, which recomputes the softmax chunk by chunk and writes
the gradient once, in the logits dtype (optionally into the logits' own storage). Torch eager
(verl's ``logprobs_from_logits`` + ``entropy_from_logits``) instead keeps several N x V copies
(softmax, ``softmax * logits``, per-row log-softmax outputs) alive until backward.

Formulas (z = logits / temperature, p = softmax(z), lse = logsumexp(z)):
    log p_y = z_y - lse
    H = -sum_j p_j log p_j                       (no lse - E[z] cancellation)
    d log p_y / dz = onehot(y) - p
    d H / dz_j = -p_j (log p_j + H)
and d/dlogits = (d/dz) / temperature. Source: the softmax cross-entropy gradient and the entropy
gradient derived in ``../shared/design.md`` (the same math as the fused kernels).
"""
from __future__ import annotations

import torch

from .api import _FLOAT_DTYPES, _describe, check_labels, check_temperature

# logits elements per row chunk (x 4 bytes per float32 temporary: 256 MiB; a few temporaries live
# at once). 2^24 measured 5% slower end to end on an H100 (scripts/verl_gpu_check.py).
CHUNK_ELEMENTS = 1 << 26


def _check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits: expected shape (..., vocab_size) with vocab_size >= 1, got {_describe(logits)}")
    if logits.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"logits: expected bfloat16, float16 or float32, got {_describe(logits)}")


def _rows_per_chunk(vocab_size: int) -> int:
    return max(1, CHUNK_ELEMENTS // vocab_size)


class _LogitsStatsFunction(torch.autograd.Function):
    """(log_probs or None, entropy or None) of 2-D logits; float32 outputs of shape (N,)."""

    @staticmethod
    def forward(ctx, logits, labels, inv_temperature, ignore_index, want_log_probs, want_entropy,
                inplace_backward):
        n, v = logits.shape
        # lse = row_max + log_sum, kept apart: log p = (z - row_max) - log_sum has no cancellation
        # at large |z| (z - lse in float32 loses ~|z| * 2^-24, e.g. 6e-4 nats at z = -1e4)
        row_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        log_sum = torch.empty_like(row_max)
        log_probs = torch.empty_like(row_max) if want_log_probs else None
        entropy = torch.empty_like(row_max) if want_entropy else None
        valid = safe = None
        if want_log_probs:
            valid = labels != ignore_index
            safe = torch.where(valid, labels, 0).long()
        step = _rows_per_chunk(v)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            z = logits[r0:r1].to(torch.float32, copy=True).mul_(inv_temperature)
            m = z.amax(dim=-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, torch.zeros((), device=m.device))
            z.sub_(m)
            ls = torch.logsumexp(z, dim=-1)
            row_max[r0:r1] = m[:, 0]
            log_sum[r0:r1] = ls
            log_p = z.sub_(ls[:, None])
            if want_log_probs:
                log_probs[r0:r1] = log_p.gather(1, safe[r0:r1, None]).squeeze(1)
            if want_entropy:
                entropy[r0:r1] = -(log_p.exp() * log_p).sum(dim=-1)
        if want_log_probs:
            log_probs = torch.where(valid, log_probs, torch.zeros((), device=row_max.device))
        ctx.save_for_backward(logits, safe if want_log_probs else None, valid if want_log_probs else None,
                              row_max, log_sum, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.inplace_backward = inplace_backward
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, safe, valid, row_max, log_sum, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        n, v = logits.shape
        if ctx.inplace_backward and logits.is_contiguous():
            grad = logits  # documented: the logits' storage receives their gradient
        else:
            grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
        if grad_log_probs is not None and valid is not None:
            grad_log_probs = torch.where(valid, grad_log_probs.float(), torch.zeros((), device=log_sum.device))
        step = _rows_per_chunk(v)
        inv_t = ctx.inv_temperature
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            log_p = (logits[r0:r1].to(torch.float32, copy=True).mul_(inv_t)
                     .sub_(row_max[r0:r1, None]).sub_(log_sum[r0:r1, None]))
            p = log_p.exp()
            dz = torch.zeros_like(p)
            if grad_entropy is not None:
                # dH/dz = -p (log p + H)
                dz -= p * (log_p + entropy[r0:r1, None]) * grad_entropy[r0:r1, None].float()
            if grad_log_probs is not None and safe is not None:
                g = grad_log_probs[r0:r1, None]
                dz -= p * g
                dz.scatter_add_(1, safe[r0:r1, None], g)
            grad[r0:r1] = dz.mul_(inv_t)
        return grad, None, None, None, None, None, None


def _run(logits, labels, temperature, ignore_index, want_log_probs, want_entropy, inplace_backward):
    inv_temperature = 1.0 / check_temperature(temperature)
    shape = logits.shape[:-1]
    logits2d = logits.reshape(-1, logits.shape[-1])
    labels1d = labels.reshape(-1) if labels is not None else None
    log_probs, entropy = _LogitsStatsFunction.apply(
        logits2d, labels1d, inv_temperature, ignore_index, want_log_probs, want_entropy,
        inplace_backward)
    return (log_probs.view(shape) if log_probs is not None else None,
            entropy.view(shape) if entropy is not None else None)


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    inplace_backward: bool = False,
) -> torch.Tensor:
    """Log-probabilities ``log softmax(logits / temperature)[labels]`` from materialized logits.

    Args:
        logits: (..., vocab_size) bfloat16, float16 or float32, any leading shape (a non-viewable
            layout is copied once by ``reshape``).
        labels: (...) int64 or int32 token ids in [0, vocab_size), or ``ignore_index``.
        temperature: positive Python number; logits are divided by it.
        ignore_index: label value whose position gets log-prob 0 and gradient 0.
        inplace_backward: when True, backward writes d loss / d logits into the logits' own
            storage (as verl's flash-attn path does) instead of allocating a new N x V tensor;
            the logits must not be read after backward then.

    Returns:
        float32 log-probs (nats), shape ``labels.shape``; differentiable w.r.t. ``logits``.

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype, shape, device or a
        label outside [0, vocab_size) that is not ``ignore_index``.

    Memory: O(N) saved for backward plus float32 row chunks of <= 2^26 elements at a time.
    Formula: log p_y = z_y - logsumexp(z), gradient onehot(y) - softmax(z) (see module docstring).
    """
    _check_logits(logits)
    check_labels(labels, logits, "logits", logits.shape[-1], ignore_index)
    return _run(logits, labels, temperature, int(ignore_index), True, False, bool(inplace_backward))[0]


def entropy_from_logits(logits: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """Shannon entropy ``-sum p log p`` of ``softmax(logits / temperature)`` over the last dim.

    Args:
        logits: (..., vocab_size) bfloat16, float16 or float32, any leading shape.
        temperature: positive Python number.

    Returns:
        float32 entropy (nats), shape ``logits.shape[:-1]``; differentiable w.r.t. ``logits``.

    Raises:
        TypeError / ValueError naming the argument for a wrong type, dtype or shape.

    Formula: H = -sum_j p_j log p_j, dH/dz_j = -p_j (log p_j + H) (see module docstring).
    """
    _check_logits(logits)
    return _run(logits, None, temperature, -100, False, True, False)[1]
