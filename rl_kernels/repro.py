"""Replay samples through every available backend and compare against a float64 reference."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from .api import linear_log_probs
from .ops_available import interpreting, triton_available
from .reference import reference_linear_log_probs
from .samples import Sample

# PASS needs max |error| <= atol (log-probs and entropy). Ours keep fp32 logits and land below
# 5e-5 on bf16 inputs; backends that round logits to bf16 land at ~7e-3 and fail, as they should.
DEFAULT_ATOL = 5e-4

Backend = Callable[[Sample], tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass
class Row:
    sample: str
    backend: str
    ours: bool
    err_log_probs: float
    err_entropy: float
    non_finite: int
    positive_log_probs: int
    passed: bool
    note: str = ""


def _ours(backend: str) -> Backend:
    def run(s: Sample):
        out = linear_log_probs(s.hidden_states, s.weight, s.labels, temperature=s.temperature,
                               ignore_index=s.ignore_index, backend=backend)
        return out.log_probs, out.entropy
    return run


def torch_eager(hidden_states, weight, labels, temperature=1.0, ignore_index=-100):
    """What an HF model + verl's default logits path computes: logits materialized in the input
    dtype (lm_head output), divided by the temperature, then log_softmax / entropy in float32.
    Differentiable; the comparison point of ``repro`` and the GPU benchmark."""
    logits = (hidden_states @ weight.T) / temperature
    log_p = torch.log_softmax(logits.float(), dim=-1)
    valid = labels != ignore_index
    lp = log_p.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def _torch_eager(s: Sample):
    return torch_eager(s.hidden_states, s.weight, s.labels, s.temperature, s.ignore_index)


def _verl_backends() -> dict[str, Backend]:
    """verl's fused kernels, when verl is importable (they need CUDA)."""
    found: dict[str, Backend] = {}
    try:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return found

    def verl_triton(s: Sample):
        lp, ent = linear_cross_entropy(s.hidden_states, s.weight, s.labels,
                                       float(s.temperature), "none")
        shape = s.labels.shape
        return lp.float().view(shape), ent.float().view(shape)

    found["verl linear_cross_entropy"] = verl_triton
    return found


def available_backends(device: torch.device) -> dict[str, tuple[Backend, bool]]:
    """name -> (callable, is_ours) for every backend that can run on ``device``."""
    backends: dict[str, tuple[Backend, bool]] = {}
    if triton_available() and (device.type == "cuda" or interpreting()):
        backends["rl_kernels triton"] = (_ours("triton"), True)
    backends["rl_kernels torch"] = (_ours("torch"), True)
    backends["torch eager"] = (_torch_eager, False)
    if device.type == "cuda":
        backends.update({k: (v, False) for k, v in _verl_backends().items()})
    return backends


def _to(s: Sample, device: torch.device) -> Sample:
    return dataclasses.replace(s, hidden_states=s.hidden_states.to(device),
                               weight=s.weight.to(device), labels=s.labels.to(device))


def check_sample(sample: Sample, device: torch.device, atol: float = DEFAULT_ATOL,
                 backends: dict[str, tuple[Backend, bool]] | None = None) -> list[Row]:
    """One Row per backend: errors vs the float64 reference (over non-ignored positions)."""
    backends = backends if backends is not None else available_backends(device)
    ref = reference_linear_log_probs(sample.hidden_states, sample.weight, sample.labels,
                                     temperature=sample.temperature,
                                     ignore_index=sample.ignore_index)
    valid = (sample.labels != sample.ignore_index).cpu()
    s_dev = _to(sample, device)
    rows = []
    for name, (fn, ours) in backends.items():
        try:
            with torch.no_grad():
                lp, ent = fn(s_dev)
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result to report
            rows.append(Row(sample.name, name, ours, math.nan, math.nan, -1, -1, False,
                            f"{type(exc).__name__}: {str(exc)[:80]}"))
            continue
        lp, ent = lp.double().cpu(), ent.double().cpu()
        non_finite = int((~torch.isfinite(lp[valid])).sum() + (~torch.isfinite(ent[valid])).sum())
        positive = int((lp[valid] > 0).sum())
        e_lp = (lp - ref.log_probs)[valid].abs().max().item() if valid.any() else 0.0
        e_ent = (ent - ref.entropy)[valid].abs().max().item() if valid.any() else 0.0
        passed = non_finite == 0 and positive == 0 and e_lp <= atol and e_ent <= atol
        rows.append(Row(sample.name, name, ours, e_lp, e_ent, non_finite, positive, passed))
    return rows


def format_table(rows: list[Row]) -> str:
    from tabulate import tabulate

    table = [[r.sample, r.backend, f"{r.err_log_probs:.2e}", f"{r.err_entropy:.2e}",
              r.non_finite, r.positive_log_probs, "PASS" if r.passed else "FAIL", r.note]
             for r in rows]
    headers = ["sample", "backend", "max|Δ log_probs|", "max|Δ entropy|", "non-finite",
               "log_probs>0", "result", "note"]
    return tabulate(table, headers=headers, tablefmt="github")
