"""Opt-in anomaly capture: save the inputs of a suspicious linear-head call as a repro sample.

A call is an anomaly when, on its non-ignored positions,
  * a log-prob or an entropy is NaN or +-inf,
  * a log-prob is above ``max_log_prob`` (a probability > 1: the phantom-column bug of verl
    #2656 / #2899 gives +0.003 to +0.015), or
  * on every ``recheck_every``-th call, a float32 torch re-computation of ``recheck_rows`` sampled
    rows differs from the returned log-prob or entropy by more than ``recheck_tolerance`` (nats).
The inputs (``hidden_states``, ``weight``, ``labels``, ``temperature``, ``ignore_index``) and
metadata go to ``<directory>/anomaly-<time>-rank<r>-call<c>.safetensors``, which
``rl-kernels repro`` loads. At most ``max_count`` files and ``max_bytes`` bytes are written per
process. Capture never raises: any error inside it is logged (once per message) and training goes on.
Checks read one scalar per call back to the host (a device sync); the re-check costs one
``recheck_rows`` x vocab_size float32 matmul.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

import torch

from .._logging import log_once, logger
from ..validation import check_float_arg, check_int_arg, check_metadata_arg, check_path_arg


@dataclasses.dataclass
class AnomalyCapture:
    """Settings and per-process counters of anomaly capture (see module docstring)."""

    directory: str
    max_count: int = 4
    max_bytes: int = 8 << 30
    max_log_prob: float = 1e-5
    recheck_every: int = 0
    recheck_rows: int = 4
    recheck_tolerance: float = 1e-3
    metadata: dict = dataclasses.field(default_factory=dict)
    calls: int = 0
    saved: int = 0
    saved_bytes: int = 0

    def __post_init__(self):
        """Validate every field: TypeError / ValueError naming it (a str count, a bool, NaN ...)."""
        check_path_arg("directory", self.directory)
        for name in ("max_count", "max_bytes", "recheck_every", "recheck_rows", "calls", "saved",
                     "saved_bytes"):
            check_int_arg(name, getattr(self, name))
        # log-probs are <= 0: a negative bound would flag every call
        check_float_arg("max_log_prob", self.max_log_prob)
        check_float_arg("recheck_tolerance", self.recheck_tolerance, inclusive=False)
        self.metadata = check_metadata_arg("metadata", self.metadata)

    def check(self, hidden_states, weight, labels, *, temperature, ignore_index, log_probs, entropy, softcap=None,
              metadata=None) -> str | None:
        """Check one call's outputs; save a sample when anomalous. Returns the reason or None."""
        self.calls += 1
        try:
            reason = self._reason(hidden_states, weight, labels, temperature, softcap, ignore_index,
                                  log_probs, entropy)
            if reason is not None:
                self._save(reason, hidden_states, weight, labels, temperature, softcap, ignore_index, metadata)
            return reason
        except Exception as exc:  # capture must never stop training
            log_once(logging.WARNING, f"rl_kernels anomaly capture failed and is skipped: {exc!r}")
            return None

    def _reason(self, hidden_states, weight, labels, temperature, softcap, ignore_index, log_probs, entropy):
        with torch.no_grad():
            valid = labels != ignore_index
            lp = log_probs.detach().float()
            bad = ~torch.isfinite(lp)
            if entropy is not None:
                bad |= ~torch.isfinite(entropy.detach().float())
            bad &= valid
            too_high = (lp > self.max_log_prob) & valid
            flags = torch.stack([bad.any(), too_high.any()]).tolist()
            if flags[0]:
                return "non-finite log-prob or entropy"
            if flags[1]:
                return f"log-prob above {self.max_log_prob:g} (max {lp[valid].max().item():.3g})"
            if self.recheck_every and self.calls % self.recheck_every == 0:
                return self._recheck(hidden_states, weight, labels, temperature, softcap, ignore_index, lp, entropy)
        return None

    def _recheck(self, hidden_states, weight, labels, temperature, softcap, ignore_index, lp, entropy):
        from ..autograd.linear import HeadParams
        from ..backends import get_backend
        from ..torch_ops.linear import torch_forward

        h = hidden_states.detach().reshape(-1, hidden_states.shape[-1])
        y = labels.reshape(-1)
        n = h.shape[0]
        if n == 0 or self.recheck_rows == 0:
            return None
        rows = torch.linspace(0, n - 1, min(self.recheck_rows, n), device=h.device).round().long()
        params = HeadParams(backend=get_backend("torch", h.device), inv_temperature=1.0 / temperature,
                            ignore_index=ignore_index, return_entropy=entropy is not None, softcap=softcap)
        ref_lp, ref_ent, _, _ = torch_forward(h[rows], weight.detach(), y[rows], params)
        diff = (ref_lp - lp.reshape(-1)[rows]).abs().max()
        if entropy is not None:
            diff = torch.maximum(diff, (ref_ent - entropy.detach().float().reshape(-1)[rows]).abs().max())
        diff = diff.item()
        if not diff <= self.recheck_tolerance:
            return f"float32 re-check differs by {diff:.3g} > {self.recheck_tolerance:g}"
        return None

    def _save(self, reason, hidden_states, weight, labels, temperature, softcap, ignore_index, metadata):
        from ..samples import save_sample

        size = sum(t.numel() * t.element_size() for t in (hidden_states, weight, labels))
        if self.saved >= self.max_count or self.saved_bytes + size > self.max_bytes:
            log_once(logging.WARNING, f"rl_kernels anomaly capture: limit reached (max_count="
                     f"{self.max_count}, max_bytes={self.max_bytes}); further anomalies are only logged")
            logger.warning("rl_kernels anomaly (not saved): %s", reason)
            return
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and \
            torch.distributed.is_initialized() else 0
        os.makedirs(self.directory, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = os.path.join(self.directory, f"anomaly-{stamp}-rank{rank}-call{self.calls}.safetensors")
        meta = {**self.metadata, **(metadata or {}), "reason": reason, "rank": rank,
                "call": self.calls, "time": stamp}
        save_sample(path, hidden_states, weight, labels, temperature=temperature, softcap=softcap,
                    ignore_index=ignore_index, metadata=meta)
        self.saved += 1
        self.saved_bytes += size
        logger.warning("rl_kernels anomaly: %s; inputs saved to %s (replay: rl-kernels repro %s)",
                       reason, path, path)
