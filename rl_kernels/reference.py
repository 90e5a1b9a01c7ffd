"""Float64 references of the linear head and of the from-logits statistics (no autograd), the
yardsticks of tests, ``repro`` and ``bench``."""
from __future__ import annotations

import torch

from .api import LogProbsOutput, check_label_values, check_temperature
from .torch_backend import torch_forward


def reference_linear_log_probs(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    ignore_index: int = -100,
    chunk_elements: int = 1 << 24,
) -> LogProbsOutput:
    """``linear_log_probs`` computed in float64 from the given (possibly bf16) inputs, chunked
    over tokens (at most ``chunk_elements`` float64 logits at a time). Returns float64 tensors
    shaped like ``labels``. Raises as ``linear_log_probs`` for a bad temperature."""
    inv_temperature = 1.0 / check_temperature(temperature)
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    with torch.no_grad():
        lp, ent, _, _ = torch_forward(h, weight, labels.reshape(-1), inv_temperature, ignore_index, True,
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
