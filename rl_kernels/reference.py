"""Float64 reference of the linear head (no autograd), the yardstick of tests and ``repro``."""
from __future__ import annotations

import torch

from .api import LogProbsOutput, check_temperature
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
    inv_t = 1.0 / check_temperature(temperature)
    h = hidden_states.reshape(-1, hidden_states.shape[-1])
    with torch.no_grad():
        lp, ent, _ = torch_forward(h, weight, labels.reshape(-1), inv_t, ignore_index, True,
                                   compute_dtype=torch.float64, chunk_elements=chunk_elements)
    return LogProbsOutput(lp.view(labels.shape), ent.view(labels.shape))
