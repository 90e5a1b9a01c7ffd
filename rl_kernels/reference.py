"""The yardsticks: float64 oracles and the eager baselines, in one place for the tests,
``rl-kernels repro`` and the benchmark.

Oracles (float64, from the given, possibly 16-bit, inputs):
  * ``reference_linear_log_probs`` / ``reference_logits_stats``: chunked, no autograd;
  * ``reference_linear_grads``: dh, dW of sum(g_lp log p + g_H H), chunked;
  * ``dense_linear_log_probs``: materialized float64 log_softmax, differentiable (an autograd
    oracle);
  * ``reference_jsd``: the generalized JSD from dense logits, differentiable.
Inputs and error measure of the tests and measuring scripts: ``make_inputs`` (random, never
zeros), ``rel_err``.
Eager baselines (what a user's framework computes without rl-kernels):
  * ``torch_eager``: HF lm_head + verl's default logits path;
  * ``torch_eager_logits``: verl's default from-logits path.
"""
from __future__ import annotations

import torch

from .autograd.linear import HeadOutputs
from .linear import LogProbsOutput
from .torch_ops.linear import torch_dlogits, torch_forward
from .validation import check_label_values, check_softcap, check_temperature


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
    """``linear_log_probs`` computed in float64 from the given (possibly bf16) inputs, chunked
    over tokens (at most ``chunk_elements`` float64 logits at a time). Returns float64 tensors
    shaped like ``labels``. Raises as ``linear_log_probs`` for a bad temperature or softcap."""
    temperature = check_temperature(temperature)
    softcap = check_softcap(softcap, temperature)
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    with torch.no_grad():
        lp, ent, _, _ = torch_forward(h, weight, labels.reshape(-1), _head(temperature, ignore_index, softcap, h),
                                      compute_dtype=torch.float64, chunk_elements=chunk_elements)
    return LogProbsOutput(lp.view(labels.shape), ent.view(labels.shape))


def reference_logits_stats(
    logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_elements: int = 1 << 24,
):
    """``logits_stats`` computed in float64 from the given (possibly bf16) logits: z = logits / T,
    log p = log_softmax(z), H = -sum p log p, lse = logsumexp(z); rows at most
    ``chunk_elements`` float64 values at a time. Returns ``LogitsStats`` of float64 tensors shaped
    ``logits.shape[:-1]`` (log-probs None without labels; log-prob and entropy 0 where the label
    is ``ignore_index``). Raises as ``logits_stats`` for a bad temperature or label value."""
    from .logits import LogitsStats

    check_temperature(temperature)
    shape, v = logits.shape[:-1], logits.shape[-1]
    if labels is not None:
        check_label_values(labels, v, ignore_index)
    x = logits.reshape(-1, v)
    n = x.shape[0]
    lp = torch.zeros(n, dtype=torch.float64, device=logits.device)
    ent, lse = torch.empty_like(lp), torch.empty_like(lp)
    y = labels.reshape(-1) if labels is not None else None
    step = max(1, chunk_elements // max(v, 1))
    with torch.no_grad():
        for r0 in range(0, n, step):
            z = x[r0:r0 + step].double() / temperature
            log_p = torch.log_softmax(z, dim=-1)
            p = log_p.exp()
            ent[r0:r0 + step] = -(p * torch.where(p > 0, log_p, 0.0)).sum(-1)
            lse[r0:r0 + step] = torch.logsumexp(z, dim=-1)
            if y is not None:
                yc = y[r0:r0 + step]
                got = log_p.gather(-1, torch.where(yc != ignore_index, yc, 0).long()[:, None])[:, 0]
                lp[r0:r0 + step] = torch.where(yc != ignore_index, got, 0.0)
    if y is not None:
        ent = torch.where(y != ignore_index, ent, 0.0)
    return LogitsStats(lp.view(shape) if y is not None else None, ent.view(shape), lse.view(shape))


def _head(temperature, ignore_index, softcap, like):
    from .autograd.linear import HeadParams
    from .backends import get_backend

    return HeadParams(backend=get_backend("torch", like.device), inv_temperature=1.0 / temperature,
                      ignore_index=ignore_index, return_entropy=True, softcap=softcap)


def reference_linear_grads(hidden_states, weight, labels, grad_log_probs, grad_entropy, temperature=1.0,
                           ignore_index=-100, chunk=256, softcap=None):
    """Float64 (dh, dW) of sum(grad_log_probs * log_probs + grad_entropy * entropy) for the linear
    head, chunked over tokens (no N x V float64 buffer beyond ``chunk`` rows). hidden_states
    (N, H), weight (V, H), labels (N,); either upstream gradient may be None. Same formulas as
    ``linear_log_probs``' backward: d log p_y / dz = onehot(y) - p, dH/dz = -p (log p + H)."""
    h64, w64 = hidden_states.double(), weight.double()
    params = _head(temperature, ignore_index, softcap, h64)
    _, ent, lse, _ = torch_forward(h64, w64, labels, params, torch.float64)
    n, v = hidden_states.shape[0], weight.shape[0]
    dh = torch.empty_like(h64)
    dw = torch.zeros_like(w64)
    for r0 in range(0, n, chunk):
        rows = slice(r0, min(n, r0 + chunk))
        dz = torch.empty(rows.stop - r0, v, dtype=torch.float64, device=hidden_states.device)
        grads = HeadOutputs(None if grad_log_probs is None else grad_log_probs.double(),
                            None if grad_entropy is None else grad_entropy.double())
        torch_dlogits(h64, w64, labels, HeadOutputs(None, ent, lse), grads, rows, slice(0, v), dz, params)
        dh[rows] = dz @ w64
        dw += dz.T @ h64[rows]
    return dh, dw


def dense_linear_log_probs(hidden_states, weight, labels, temperature=1.0, ignore_index=-100, softcap=None):
    """(log_probs, entropy), float64, from the materialized float64 log_softmax(hidden_states @
    weight.T / T) (with ``softcap`` c, of c tanh(hidden_states @ weight.T / c) / T, written here
    from the formula); differentiable (an autograd oracle for dh and dW, which come back in the
    inputs' dtype). Positions whose label is ``ignore_index`` get 0."""
    raw = hidden_states.double() @ weight.double().T
    z = (raw if softcap is None else softcap * torch.tanh(raw / softcap)) / temperature
    log_p = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    lp = log_p.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def reference_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, labels, beta, temperature,
                  reduction, ignore_index=-100):
    """Generalized JSD (beta 0 / 1: the two KLs) x T^2 from dense logits of both heads, in the
    inputs' dtype (float64 for an oracle), differentiable; 0 where ``labels == ignore_index``.
    Same definition as ``linear_jsd``: M = beta p + (1 - beta) q, JSD = beta KL(p||M) +
    (1 - beta) KL(q||M); 'mean' divides by the positions that count."""
    log_q = torch.log_softmax(student_hidden @ student_weight.T / temperature, -1)
    log_p = torch.log_softmax(teacher_hidden @ teacher_weight.T / temperature, -1)
    if beta == 0:
        per = torch.nn.functional.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    elif beta == 1:
        per = torch.nn.functional.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    else:
        m = beta * log_p.exp() + (1 - beta) * log_q.exp()
        per = (beta * (log_p.exp() * (log_p - m.log())).sum(-1)
               + (1 - beta) * (log_q.exp() * (log_q - m.log())).sum(-1))
    valid = labels != ignore_index
    per = torch.where(valid, per * temperature**2, 0.0)
    return {"none": per, "sum": per.sum(), "mean": per.sum() / valid.sum(),
            "batchmean": per.sum() / per.shape[0]}[reduction]


def torch_eager(hidden_states, weight, labels, temperature=1.0, ignore_index=-100, softcap=None):
    """What an HF model + verl's default logits path computes: logits materialized in the input
    dtype (lm_head output; soft-capped in that dtype with ``softcap``, as Gemma 2's forward does),
    divided by the temperature, then log_softmax / entropy in float32. Differentiable; the
    comparison point of ``repro`` and the GPU benchmark."""
    logits = hidden_states @ weight.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    log_p = torch.log_softmax(logits.float(), dim=-1)
    valid = labels != ignore_index
    lp = log_p.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def torch_eager_logits(logits, labels, temperature=1.0, ignore_index=-100):
    """verl's default from-logits path (``use_fused_kernels=False``) in float32, as
    :func:`torch_eager` is for the linear head: logits divided by the temperature in their own
    dtype (verl's ``logits / temperature``; skipped at T = 1 as verl does), then
    ``logprobs_from_logits`` as float32 log_softmax + gather and ``entropy_from_logits`` as
    logsumexp(z) - sum(softmax(z) * z) on the float32 logits; ``ignore_index`` masked to 0.
    (verl's own ``entropy_from_logits``, and its ``logprobs_from_logits`` without flash-attn, run
    in the logits dtype, so verl's errors are at least these.) Differentiable; the comparison
    point of ``repro`` for logits samples and of ``rl-kernels bench --logits``."""
    z = (logits if temperature == 1.0 else logits / temperature).float()
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
