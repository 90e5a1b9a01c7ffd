"""The yardsticks: float64 oracles and the eager baselines, in one place for the tests,
``rl-kernels repro`` and the benchmark.

The oracles are independent of the backends: each computes its quantity from the mathematical
definition with torch primitives only (matmul, tanh, logsumexp, exp, log, gather, where,
autograd), in float64, and calls nothing of ``rl_kernels.torch_ops``, ``rl_kernels.ops`` (Triton)
or any helper those use (soft-capping, temperature scaling, logsumexp / split merging). A mistake
shared by the torch twin and the kernels therefore cannot pass both the backend and its oracle
(``tests/tools/test_reference.py`` checks the imports and hand-computed values). From ``validation``
they take only the argument checks, so that they raise as the public functions do; the checked
values themselves are not used.

Definitions (z: logits of one row, over the full vocabulary; p = softmax(z)):
    z_v = (h . w_v) / T,  or with a soft cap c:  z_v = c tanh((h . w_v) / c) / T
          (a raw logit h . w_v of +-inf gives NaN under the cap, as ``linear_log_probs`` documents)
    lse = log sum_v exp(z_v),   log p_v = z_v - lse
    log-prob = log p_y,   entropy = -sum_v p_v log p_v (0 log 0 = 0),   sum_pi_squared = sum_v p_v^2
and 0 for all of them where the label is ``ignore_index``. A row with NaN/inf inputs gives
non-finite values in that row only. Vocab-parallel and split variants of the backends compute the
same quantities on the full vocabulary, which is what these oracles take.

Oracles (float64, from the given, possibly 16-bit, inputs):
  * ``reference_linear_log_probs`` / ``reference_logits_stats``: chunked, no autograd;
  * ``reference_linear_grads``: dh, dW of sum(g_lp log p + g_H H), chunked, by autograd through
    the definition above (not the backends' hand-derived dlogits formulas);
  * ``dense_linear_log_probs``: materialized float64 log-softmax, differentiable (an autograd
    oracle);
  * ``reference_jsd``: the generalized JSD from dense logits, differentiable.
Inputs and error measure of the tests and measuring scripts: ``make_inputs`` (random, never
zeros), ``rel_err``.
Eager baselines (what a user's framework computes without rl-kernels; not oracles):
  * ``torch_eager``: HF lm_head + verl's default logits path;
  * ``torch_eager_logits``: verl's default from-logits path.
"""
from __future__ import annotations

import torch

from ..core.validation import check_label_values, check_softcap, check_temperature
from ..linear import LogProbsOutput


def _temperature(temperature, rows=None):
    """A checked temperature for the oracles: a Python float, or a per-row tensor as float64 (N,)."""
    t = check_temperature(temperature, rows)
    return t.detach().reshape(-1).double() if isinstance(t, torch.Tensor) else float(t)


def _rows_of(t, rows):
    """``t`` as the divisor of the logits of ``rows``: a float as it is, a per-row (N,) tensor as a
    column (written here: the oracles import nothing of the backends)."""
    return t[rows, None] if isinstance(t, torch.Tensor) else t


def _definition_logits(hidden_states, weight, temperature, softcap):
    """z = (h W^T) / T, or c tanh(h W^T / c) / T with a cap c (NaN where h W^T is +-inf), in the
    inputs' dtype (the callers pass float64). Written from the definition for the oracles."""
    raw = hidden_states @ weight.T
    if softcap is not None:
        capped = softcap * torch.tanh(raw / softcap)
        raw = torch.where(torch.isinf(raw), torch.full_like(capped, float("nan")), capped)
    return raw / temperature


def _definition_stats(z, labels, ignore_index):
    """Per row of z (..., V): (log p_label or None, entropy, lse, sum p^2), from
    lse = logsumexp(z), log p = z - lse, H = -sum p log p (p = 0 terms are 0, a NaN p stays NaN),
    sum p^2; log-prob, entropy and sum p^2 are 0 where ``labels == ignore_index``."""
    lse = torch.logsumexp(z, dim=-1)
    log_p = z - lse.unsqueeze(-1)
    p = torch.exp(log_p)
    ent = -(p * torch.where(p > 0, log_p, torch.zeros((), dtype=z.dtype, device=z.device))).sum(-1)
    sq = (p * p).sum(-1)
    if labels is None:
        return None, ent, lse, sq
    valid = labels != ignore_index
    lp = log_p.gather(-1, torch.where(valid, labels, 0).long().unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    return (torch.where(valid, lp, zero), torch.where(valid, ent, zero), lse, torch.where(valid, sq, zero))


def reference_linear_log_probs(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    chunk_elements: int = 1 << 24,
) -> LogProbsOutput:
    """``linear_log_probs`` computed in float64 from the given (possibly bf16) inputs, from the
    definition (module docstring), chunked over tokens (at most ``chunk_elements`` float64 logits
    at a time). Returns ``LogProbsOutput(log_probs, entropy, sum_pi_squared)`` of float64 tensors
    shaped like ``labels`` (0 where the label is ``ignore_index``). Raises as
    ``linear_log_probs`` for a bad temperature, softcap or label value."""
    t = _temperature(temperature, labels)
    check_softcap(softcap, t)
    c = None if softcap is None else float(softcap)
    v = weight.shape[0]
    check_label_values(labels, v, ignore_index)
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    y = labels.reshape(-1)
    n = h.shape[0]
    w64 = weight.double()
    lp = torch.empty(n, dtype=torch.float64, device=h.device)
    ent, sq = torch.empty_like(lp), torch.empty_like(lp)
    step = max(1, chunk_elements // max(v, 1))
    with torch.no_grad():
        for r0 in range(0, n, step):
            rows = slice(r0, min(n, r0 + step))
            z = _definition_logits(h[rows].double(), w64, _rows_of(t, rows), c)
            lp[rows], ent[rows], _, sq[rows] = _definition_stats(z, y[rows], ignore_index)
    return LogProbsOutput(lp.view(labels.shape), ent.view(labels.shape), sq.view(labels.shape))


def reference_logits_stats(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_elements: int = 1 << 24,
):
    """``logits_stats`` computed in float64 from the given (possibly bf16) logits: z = logits / T,
    lse = logsumexp(z), log p = z - lse, H = -sum p log p, sum p^2; rows at most
    ``chunk_elements`` float64 values at a time. Returns ``LogitsStats`` of float64 tensors shaped
    ``logits.shape[:-1]`` (log-probs None without labels; log-prob, entropy and sum_pi_squared 0
    where the label is ``ignore_index``; lse never masked). Raises as ``logits_stats`` for a bad
    temperature or label value."""
    from ..logits import LogitsStats

    t = _temperature(temperature, logits[..., 0])
    shape, v = logits.shape[:-1], logits.shape[-1]
    if labels is not None:
        check_label_values(labels, v, ignore_index)
    x = logits.reshape(-1, v)
    n = x.shape[0]
    y = labels.reshape(-1) if labels is not None else None
    lp = torch.empty(n, dtype=torch.float64, device=logits.device) if y is not None else None
    ent = torch.empty(n, dtype=torch.float64, device=logits.device)
    lse, sq = torch.empty_like(ent), torch.empty_like(ent)
    step = max(1, chunk_elements // max(v, 1))
    with torch.no_grad():
        for r0 in range(0, n, step):
            rows = slice(r0, min(n, r0 + step))
            lp_c, ent[rows], lse[rows], sq[rows] = _definition_stats(
                x[rows].double() / _rows_of(t, rows), None if y is None else y[rows], ignore_index)
            if y is not None:
                lp[rows] = lp_c
    return LogitsStats(lp.view(shape) if y is not None else None, ent.view(shape), lse.view(shape),
                       sq.view(shape))


def reference_linear_grads(hidden_states, weight, labels, grad_log_probs, grad_entropy, temperature=1.0,
                           ignore_index=-100, chunk=256, softcap=None):
    """Float64 (dh, dW) of sum(grad_log_probs * log_probs + grad_entropy * entropy) for the linear
    head: torch autograd through the definition (module docstring) in float64, ``chunk`` token
    rows at a time (no N x V float64 buffer beyond a chunk's). hidden_states (N, H), weight (V, H),
    labels (N,); either upstream gradient may be None. Rows whose label is ``ignore_index`` are
    left out (dh 0 there, nothing added to dW, even for a non-finite row)."""
    h64 = hidden_states.detach().double()
    w64 = weight.detach().double().requires_grad_()
    t = _temperature(temperature, labels)
    c = None if softcap is None else float(softcap)
    n = h64.shape[0]
    dh = torch.zeros_like(h64)
    dw = torch.zeros_like(w64, requires_grad=False)
    if grad_log_probs is None and grad_entropy is None:
        return dh, dw
    g_lp = None if grad_log_probs is None else grad_log_probs.detach().double()
    g_ent = None if grad_entropy is None else grad_entropy.detach().double()
    keep = (labels != ignore_index).nonzero().squeeze(-1)
    for k0 in range(0, keep.numel(), chunk):
        idx = keep[k0:k0 + chunk]
        h_c = h64[idx].requires_grad_()
        with torch.enable_grad():
            lp, ent, _, _ = _definition_stats(_definition_logits(h_c, w64, _rows_of(t, idx), c), labels[idx],
                                              ignore_index)
            loss = torch.zeros((), dtype=torch.float64, device=h64.device)
            if g_lp is not None:
                loss = loss + (g_lp[idx] * lp).sum()
            if g_ent is not None:
                loss = loss + (g_ent[idx] * ent).sum()
            gh, gw = torch.autograd.grad(loss, (h_c, w64))
        dh[idx] = gh
        dw += gw
    return dh, dw


def dense_linear_log_probs(hidden_states, weight, labels, temperature=1.0, ignore_index=-100, softcap=None):
    """(log_probs, entropy), float64, from the materialized float64 logits z = hidden_states @
    weight.T / T (with ``softcap`` c, c tanh(hidden_states @ weight.T / c) / T), log p = z -
    logsumexp(z), H = -sum p log p, written from the definition (module docstring);
    differentiable (an autograd oracle for dh and dW, which come back in the inputs' dtype).
    Positions whose label is ``ignore_index`` get 0."""
    t = _temperature(temperature, labels)
    t = t.view(labels.shape)[..., None] if isinstance(t, torch.Tensor) else t  # (per row: a column)
    z = _definition_logits(hidden_states.double(), weight.double(), t, None if softcap is None else float(softcap))
    lp, ent, _, _ = _definition_stats(z, labels, ignore_index)
    return lp, ent


def _kl_rows(a, log_a, log_b):
    """sum_v a_v (log a_v - log b_v) per row, with 0 log 0 = 0 (a NaN a stays NaN)."""
    diff = torch.where(a > 0, log_a - log_b, torch.zeros((), dtype=a.dtype, device=a.device))
    return (a * diff).sum(-1)


def reference_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta, temperature,
                  reduction, ignore_index=-100):
    """Generalized JSD (beta 0 / 1: the two KLs) x T^2 from dense logits of both heads, in the
    inputs' dtype (float64 for an oracle), differentiable; 0 where ``labels == ignore_index``.
    Same definition as ``linear_jsd``: q = softmax(student z), p = softmax(teacher z),
    M = beta p + (1 - beta) q, JSD = beta KL(p||M) + (1 - beta) KL(q||M); beta = 0: KL(p||q),
    beta = 1: KL(q||p); 'mean' divides by the positions that count, 'batchmean' by the first dim,
    'sum' sums, 'none' per position. Written from the definition (module docstring)."""
    t = float(temperature)
    zs = _definition_logits(student_hidden, student_weight, t, None)
    zt = _definition_logits(teacher_hidden, teacher_weight, t, None)
    log_q = zs - torch.logsumexp(zs, dim=-1, keepdim=True)
    log_p = zt - torch.logsumexp(zt, dim=-1, keepdim=True)
    q, p = log_q.exp(), log_p.exp()
    if beta == 0:
        per = _kl_rows(p, log_p, log_q)
    elif beta == 1:
        per = _kl_rows(q, log_q, log_p)
    else:
        log_m = torch.log(beta * p + (1 - beta) * q)
        per = beta * _kl_rows(p, log_p, log_m) + (1 - beta) * _kl_rows(q, log_q, log_m)
    valid = labels != ignore_index
    per = torch.where(valid, per * (t * t), torch.zeros((), dtype=per.dtype, device=per.device))
    if reduction == "none":
        return per
    if reduction == "sum":
        return per.sum()
    if reduction == "mean":
        return per.sum() / valid.sum()
    if reduction == "batchmean":
        return per.sum() / per.shape[0]
    raise KeyError(reduction)


def _eager_divisor(temperature, logits):
    """The baselines' divisor of ``logits`` (..., V): a number as it is; a per-row tensor (shaped
    like ``logits.shape[:-1]``) as a column in the logits' dtype (verl's
    ``logits / temperature.unsqueeze(-1).to(logits.dtype)``)."""
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        return temperature.to(logits.dtype).unsqueeze(-1)
    return temperature


def torch_eager(hidden_states, weight, labels, temperature=1.0, ignore_index=-100, softcap=None):
    """What an HF model + verl's default logits path computes: logits materialized in the input
    dtype (lm_head output; soft-capped in that dtype with ``softcap``, as Gemma 2's forward does),
    divided by the temperature (a number, or a per-row tensor shaped like ``labels``, cast to the
    logits' dtype first, as verl's logits path casts its per-token temperature), then log_softmax /
    entropy in float32. Differentiable; the comparison point of ``repro`` and the GPU benchmark."""
    logits = hidden_states @ weight.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / _eager_divisor(temperature, logits)
    log_p = torch.log_softmax(logits.float(), dim=-1)
    valid = labels != ignore_index
    lp = log_p.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def torch_eager_logits(logits, labels, temperature=1.0, ignore_index=-100):
    """verl's default from-logits path (``use_fused_kernels=False``) in float32, as
    :func:`torch_eager` is for the linear head: logits divided by the temperature in their own
    dtype (verl's ``logits / temperature``; skipped at a number T = 1 as verl does; a per-row
    temperature shaped like ``labels`` is cast to the logits' dtype first, as verl does), then
    ``logprobs_from_logits`` as float32 log_softmax + gather and ``entropy_from_logits`` as
    logsumexp(z) - sum(softmax(z) * z) on the float32 logits; ``ignore_index`` masked to 0.
    (verl's own ``entropy_from_logits``, and its ``logprobs_from_logits`` without flash-attn, run
    in the logits dtype, so verl's errors are at least these.) Differentiable; the comparison
    point of ``repro`` for logits samples and of ``rl-kernels bench --logits``."""
    unit = not isinstance(temperature, torch.Tensor) and temperature == 1.0
    z = (logits if unit else logits / _eager_divisor(temperature, logits)).float()
    valid = labels != ignore_index
    lp = torch.log_softmax(z, dim=-1).gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    ent = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def make_inputs(n, h, v, dtype, *, seed=0, device="cpu", w_scale=None, ignore_frac=0.2,
                lead=None):
    """h ~ N(0, 1), W ~ N(0, w_scale^2) (default 2 / sqrt(H): logits spread of a few nats),
    labels uniform with ``ignore_frac`` of them -100. Never zeros."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (w_scale if w_scale is not None else 2.0 / h ** 0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = -100
    if lead is not None:
        hidden, labels = hidden.view(*lead, h), labels.view(*lead)
    return hidden.to(device, dtype), weight.to(device, dtype), labels.to(device)


def rel_err(a, b):
    """||a - b||_F / ||b||_F in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()
