"""Opt-in anomaly capture: save the inputs of a suspicious head call as a repro sample.

Two kinds of call are checked:

* a fused head call (:meth:`AnomalyCapture.check`): ``hidden_states``, ``weight``, ``labels``,
  ``temperature`` (a number, or a float tensor shaped like ``labels``: one temperature per row),
  ``softcap``; an anomalous call is saved whole, as a linear-head sample
  (:func:`~rl_kernels.samples.save_sample`);
* a from-logits call (:meth:`AnomalyCapture.check_logits`): ``logits`` (..., V), ``labels`` (or
  None for an entropy-only call), ``temperature``; only its anomalous rows are saved, as a
  from-logits sample (:func:`~rl_kernels.samples.save_logits_sample`): their logits in the
  captured dtype, their labels (for a call without labels, each row's argmax stands in, named so
  in the metadata) and, for a per-row temperature, their temperatures. A file then holds a few
  rows of V values, not the N x V logits of the call.

A call is an anomaly when, on its counted positions (labels != ``ignore_index``; every row of an
entropy-only call),

* a log-prob or an entropy is NaN or +-inf,
* a log-prob is above ``max_log_prob`` (a probability > 1: the phantom-column bug of verl
  #2656 / #2899 gives +0.003 to +0.015), or
* on every ``recheck_every``-th call, a float32 torch re-computation of ``recheck_rows`` sampled
  rows differs from the returned log-prob or entropy by more than ``recheck_tolerance`` (nats).

The anomalous rows of a from-logits call are those that break a rule (for the re-check: the sampled
rows that differ).

**Vocabulary-parallel calls** (``process_group``: the call's weight or logits are this rank's shard
of the vocabulary, e.g. Megatron's tensor-parallel group): the outputs are the same bits on every
rank of the group, so every rank decides alike; the shards are all-gathered over the group (the
weight of a fused call; the anomalous rows of a from-logits call, or the re-check's sampled rows),
so that the sample holds the whole vocabulary and replays in one process, and the group's rank 0
writes it. Every rank of the group must call the check, as it called the head.

Files: ``<directory>/anomaly-<time>-rank<r>-pid<p>-call<c>.safetensors`` (r: the global
torch.distributed rank, 0 without one; c: this process's count of checked calls, fused and
from-logits together), with metadata (the reason, rank, call, time, and for a from-logits sample
the rows it holds), which ``rl-kernels repro`` loads and shows. ``directory`` is made absolute
when the capture is built (``~`` expanded; a relative path against this process's working directory). At most ``max_count`` files and
``max_bytes`` bytes are written per process (counted alike on every rank of a group); a from-logits
sample keeps the first of its anomalous rows that fit in the bytes left. Capture never raises: any
error inside it is logged (once per message) and training goes on. Checks read one scalar per call
back to the host (a device sync); the re-check costs one ``recheck_rows`` x vocab_size float32
matmul (fused) or log-softmax (from logits), and with a process group one all-gather of those rows.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref

import torch

from ..core._logging import log_once, logger
from ..core.validation import check_float_arg, check_int_arg, check_metadata_arg, check_path_arg

_WEIGHT_CHUNK = 8192
"""Vocabulary rows of the weight cast to float32 at a time by the fused re-check."""


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _group_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group)


def _gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    """``t`` concatenated along ``dim`` over the ranks of ``group`` in rank order (the vocabulary
    shards of a vocab-parallel call); ``t`` itself without a group."""
    if group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(_group_size(group))]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _rows_of(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The (len(rows), V) rows of ``logits`` (..., V) at flat row indices ``rows``, without
    flattening the logits (a copy of all of them, when they are a strided slice)."""
    if logits.dim() <= 2:
        return logits.reshape(-1, logits.shape[-1])[rows]  # (a view)
    return logits[torch.unravel_index(rows, logits.shape[:-1])]


def _positions(idx: list[int], limit: int = 16) -> str:
    return ", ".join(map(str, idx[:limit])) + (f", ... ({len(idx)} in all)" if len(idx) > limit else "")


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


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
    # the logits of the last from-logits sample and its rows (the same anomaly seen again by the
    # next call on the same logits, e.g. verl's entropy then log-probs, is not saved twice)
    _last_saved: tuple = dataclasses.field(default=(None, frozenset()), init=False, repr=False, compare=False)

    def __post_init__(self):
        """Validate every field: TypeError / ValueError naming it (a str count, a bool, NaN ...).
        ``directory`` becomes absolute (``~`` expanded, a relative path against this process's working
        directory)."""
        self.directory = os.path.abspath(os.path.expanduser(check_path_arg("directory", self.directory)))
        for name in ("max_count", "max_bytes", "recheck_every", "recheck_rows", "calls", "saved",
                     "saved_bytes"):
            check_int_arg(name, getattr(self, name))
        # log-probs are <= 0: a negative bound would flag every call
        check_float_arg("max_log_prob", self.max_log_prob)
        check_float_arg("recheck_tolerance", self.recheck_tolerance, inclusive=False)
        self.metadata = check_metadata_arg("metadata", self.metadata)
        # the checks run eagerly under torch.compile (verl compiles its entropy function): host reads
        # and file writes make no graph. Applied here, when a capture is built, not at import:
        # torch.compiler.disable imports Dynamo, which takes seconds
        self.check = torch.compiler.disable(self.check)
        self.check_logits = torch.compiler.disable(self.check_logits)

    # ------------------------------------------------------------------ fused head calls
    def check(self, hidden_states, weight, labels, *, temperature, ignore_index, log_probs, entropy, softcap=None,
              metadata=None, process_group=None) -> str | None:
        """Check one fused head call's outputs; save the call as a sample when anomalous. Returns
        the reason or None. hidden_states (..., H); weight (V, H), or this rank's vocabulary shard
        with ``process_group`` (gathered for the sample); labels (...) global ids; temperature: a
        number or a float tensor shaped like ``labels``; log_probs / entropy shaped like
        ``labels`` (entropy None when not computed)."""
        self.calls += 1
        try:
            with torch.no_grad():
                valid = (labels != ignore_index).reshape(-1)
                lp = log_probs.detach().float().reshape(-1)
                ent = None if entropy is None else entropy.detach().float().reshape(-1)
                reason, _ = self._flags(lp, ent, valid)
                if reason is None and self._recheck_due():
                    reason = self._recheck_fused(hidden_states, weight, labels, temperature, softcap, valid,
                                                 lp, ent, process_group)
                if reason is not None:
                    self._save_fused(reason, hidden_states, weight, labels, temperature, softcap, ignore_index,
                                     metadata, process_group)
            return reason
        except Exception as exc:  # capture must never stop training
            log_once(logging.WARNING, f"rl_kernels anomaly capture failed and is skipped: {exc!r}")
            return None

    def _flags(self, lp, ent, valid):
        """(reason, mask of the rows that break a rule) from the outputs, or (None, None); one host read."""
        bad = torch.zeros_like(valid)
        if lp is not None:
            bad |= ~torch.isfinite(lp)
        if ent is not None:
            bad |= ~torch.isfinite(ent)
        bad &= valid
        high = (lp > self.max_log_prob) & valid if lp is not None else torch.zeros_like(valid)
        flags = torch.stack([bad.any(), high.any()]).tolist()
        if flags[0]:
            return "non-finite log-prob or entropy", bad | high
        if flags[1]:
            return f"log-prob above {self.max_log_prob:g} (max {lp[valid].max().item():.3g})", high
        return None, None

    def _recheck_due(self) -> bool:
        return bool(self.recheck_every) and self.calls % self.recheck_every == 0 and self.recheck_rows > 0

    def _sampled(self, n: int, device) -> torch.Tensor:
        return torch.linspace(0, n - 1, min(self.recheck_rows, n), device=device).round().long()

    @staticmethod
    def _inv_temperature(temperature, rows):
        """1 / T of ``rows`` as a multiplier: a float, or a (rows, 1) float32 column of a per-row T."""
        from ..core.validation import row_inv_temperature

        if isinstance(temperature, torch.Tensor):
            return row_inv_temperature(temperature)[rows, None]
        return 1.0 / temperature

    def _differing(self, z, y, valid, lp, ent, rows):
        """(max difference, mask over ``rows``) of the float32 re-computation from the full-vocabulary
        logits ``z`` (r, V) of the sampled ``rows`` against the returned log-probs / entropy."""
        log_p = torch.log_softmax(z, dim=-1)
        ok = valid[rows]
        diff = torch.zeros(rows.shape[0], device=z.device)
        if lp is not None and y is not None:
            ref = log_p.gather(-1, torch.where(ok, y[rows], 0)[:, None].long())[:, 0]
            diff = torch.maximum(diff, torch.where(ok, (ref - lp[rows]).abs(), 0.0))
        if ent is not None:
            p = log_p.exp()
            ref = -torch.where(p > 0, p * log_p, 0.0).sum(-1)
            diff = torch.maximum(diff, torch.where(ok, (ref - ent[rows]).abs(), 0.0))
        off = ~(diff <= self.recheck_tolerance) & ok  # NaN counts as off
        return diff.max().item(), off

    def _recheck_fused(self, hidden_states, weight, labels, temperature, softcap, valid, lp, ent, group):
        from ..torch_ops.linear import capped_logits

        h = hidden_states.detach().reshape(-1, hidden_states.shape[-1])
        n = h.shape[0]
        if n == 0:
            return None
        rows = self._sampled(n, h.device)
        h_rows = h[rows].float()
        w = weight.detach()
        raw = torch.cat([h_rows @ w[v0:v0 + _WEIGHT_CHUNK].float().T for v0 in range(0, w.shape[0], _WEIGHT_CHUNK)],
                        -1)
        z, _ = capped_logits(_gather(raw, group, -1), self._inv_temperature(temperature, rows), softcap)
        diff, off = self._differing(z, labels.reshape(-1), valid, lp, ent, rows)
        if bool(off.any()):
            return f"float32 re-check differs by {diff:.3g} > {self.recheck_tolerance:g}"
        return None

    def _room(self, size: int) -> bool:
        """Whether another file of ``size`` bytes fits the limits (logged when not)."""
        if self.saved < self.max_count and self.saved_bytes + size <= self.max_bytes:
            return True
        log_once(logging.WARNING, f"rl_kernels anomaly capture: limit reached (max_count={self.max_count}, "
                 f"max_bytes={self.max_bytes}); further anomalies are only logged")
        return False

    def _target(self, metadata, group) -> tuple[str | None, dict]:
        """(the file to write, or None on a rank of ``group`` other than its rank 0; its metadata)."""
        rank = _rank()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        meta = {**self.metadata, **(metadata or {}), "rank": rank, "call": self.calls, "time": stamp}
        if group is not None:
            meta["vocab_parallel"] = (f"vocabulary gathered over a process group of {_group_size(group)} ranks; "
                                      f"written by its rank 0")
            if torch.distributed.get_rank(group) != 0:
                return None, meta
        os.makedirs(self.directory, exist_ok=True)
        name = f"anomaly-{stamp}-rank{rank}-pid{os.getpid()}-call{self.calls}.safetensors"
        return os.path.join(self.directory, name), meta

    def _written(self, reason, path) -> None:
        logger.warning("rl_kernels anomaly: %s; inputs saved to %s (replay: rl-kernels repro %s)",
                       reason, path, path)

    def _save_fused(self, reason, hidden_states, weight, labels, temperature, softcap, ignore_index, metadata, group):
        from ..samples import save_sample

        size = _nbytes(hidden_states, labels, temperature) + _nbytes(weight) * _group_size(group)
        if not self._room(size):
            logger.warning("rl_kernels anomaly (not saved): %s", reason)
            return
        weight = _gather(weight.detach(), group, 0)
        self.saved += 1
        self.saved_bytes += size
        path, meta = self._target(metadata, group)
        if path is None:
            return
        save_sample(path, hidden_states, weight, labels, temperature=temperature, softcap=softcap,
                    ignore_index=ignore_index, metadata={**meta, "reason": reason})
        self._written(reason, path)

    # ------------------------------------------------------------------ from-logits calls
    def check_logits(self, logits, labels, *, log_probs, entropy, temperature=1.0, ignore_index=-100, metadata=None,
                     process_group=None) -> str | None:
        """Check one from-logits call's outputs; save its anomalous rows as a from-logits sample.
        Returns the reason or None. logits (..., V), or this rank's vocabulary shard (..., V_r)
        with ``process_group`` (the rows are gathered for the sample); labels (...) global ids, or
        None for an entropy-only call; log_probs / entropy shaped ``logits.shape[:-1]`` or None (not
        computed); temperature: a number or a float tensor shaped ``logits.shape[:-1]``, the one
        the call divided the logits by."""
        self.calls += 1
        try:
            with torch.no_grad():
                key, logits = logits, logits.detach()  # (key: the caller's tensor, for _last_saved)
                n = logits.shape[:-1].numel()
                y = None if labels is None else labels.detach().reshape(-1)
                valid = torch.ones(n, dtype=torch.bool, device=logits.device) if y is None else y != ignore_index
                lp = None if log_probs is None else log_probs.detach().float().reshape(-1)
                ent = None if entropy is None else entropy.detach().float().reshape(-1)
                reason, rows = self._flags(lp, ent, valid)
                if reason is None and self._recheck_due() and n:
                    sampled = self._sampled(n, logits.device)
                    z = _gather(_rows_of(logits, sampled).float(), process_group, -1) * \
                        self._inv_temperature(temperature, sampled)
                    diff, off = self._differing(z, y, valid, lp, ent, sampled)
                    if bool(off.any()):
                        reason = f"float32 re-check differs by {diff:.3g} > {self.recheck_tolerance:g}"
                        rows = torch.zeros_like(valid)
                        rows[sampled[off]] = True
                if reason is not None:
                    self._save_logits(reason, rows, key, logits, y, temperature, ignore_index, metadata,
                                      process_group)
            return reason
        except Exception as exc:  # capture must never stop training
            log_once(logging.WARNING, f"rl_kernels anomaly capture failed and is skipped: {exc!r}")
            return None

    def _save_logits(self, reason, rows, key, logits, y, temperature, ignore_index, metadata, group):
        from ..samples import save_logits_sample

        idx = rows.nonzero()[:, 0].tolist()
        last, last_rows = self._last_saved
        if last is not None and last() is key and set(idx) <= last_rows:
            logger.warning("rl_kernels anomaly: %s, in rows of these logits already saved", reason)
            return
        n = logits.shape[:-1].numel()
        per_row = isinstance(temperature, torch.Tensor)
        row_bytes = (logits.shape[-1] * _group_size(group) * logits.element_size() + 8
                     + (temperature.element_size() if per_row else 0))
        fit = min(len(idx), max(0, self.max_bytes - self.saved_bytes) // row_bytes)
        if not self._room(max(fit, 1) * row_bytes):
            logger.warning("rl_kernels anomaly (not saved): %s", reason)
            return
        kept = torch.tensor(idx[:fit], dtype=torch.long, device=logits.device)
        rows_logits = _gather(_rows_of(logits, kept), group, -1)
        self.saved += 1
        self.saved_bytes += fit * row_bytes
        self._last_saved = (weakref.ref(key), frozenset(idx))
        path, meta = self._target(metadata, group)
        if path is None:
            return
        meta["rows"] = f"{_positions(idx[:fit])} of the call's {n} rows" + (
            f" (the first {fit} of its {len(idx)} anomalous rows: max_bytes)" if fit < len(idx) else "")
        if y is None:
            labels = rows_logits.argmax(-1)
            meta["labels"] = "each row's argmax (the call took no labels: entropy only)"
        else:
            labels = y[kept]
        save_logits_sample(path, rows_logits, labels, temperature=temperature.reshape(-1)[kept] if per_row
                           else temperature, ignore_index=ignore_index, metadata={**meta, "reason": reason})
        self._written(reason, path)
