"""Replay samples through every available backend and compare against a float64 reference.

A sample's temperature (a number, or a tensor with one temperature per row) goes to every backend
and to the reference as it is.

Linear-head samples (:class:`~rl_kernels.samples.Sample`) run through ``linear_log_probs`` (ours:
Triton and torch backends), torch eager and verl's fused kernels; from-logits samples
(:class:`~rl_kernels.samples.LogitsSample`) through ``logits_stats`` (ours: torch backend, and the
Triton kernels in each launch shape, one-level and two-level split) and torch eager.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable

import torch

from ..core.backends import interpreting, triton_available
from ..core.validation import check_labels, check_logits, check_temperature
from ..linear import linear_log_probs
from ..logits import logits_stats
from ..samples import LogitsSample, Sample
from .reference import reference_linear_log_probs, reference_logits_stats, torch_eager, torch_eager_logits

# PASS needs max |error| <= atol (log-probs and entropy). Ours keep fp32 logits and land below
# 5e-5 on bf16 inputs; backends that round logits to bf16 land at ~7e-3 and fail, as they should.
DEFAULT_ATOL = 5e-4

Backend = Callable[[Sample], tuple[torch.Tensor, torch.Tensor]]
LogitsBackend = Callable[[LogitsSample], tuple[torch.Tensor, torch.Tensor]]
TRITON_UNAVAILABLE = "needs CUDA or TRITON_INTERPRET=1 (Triton's CPU interpreter)"


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
    status: str = ""  # the table's result when not plain PASS / FAIL ("FAIL (baseline)", ...)

    @property
    def result(self) -> str:
        return self.status or ("PASS" if self.passed else "FAIL")


BASELINE_FAIL = "FAIL (baseline)"
"""The result of a baseline's row (a backend that is not rl-kernels' own) further from float64 than
the tolerance: that baseline's own error, explained in the row's note; never a failure of the run."""
INPUT_NON_FINITE = "n/a: input NaN/inf"
ERROR = "ERROR"


def error_row(sample: str, message: str) -> Row:
    """The row of a sample file that could not be loaded or checked (counts as a failure)."""
    return Row(sample, "-", False, math.nan, math.nan, -1, -1, False, message, ERROR)


def _ours(backend: str) -> Backend:
    def run(s: Sample):
        out = linear_log_probs(s.hidden_states, s.weight, s.labels, temperature=s.temperature,
                               softcap=s.softcap, ignore_index=s.ignore_index, backend=backend)
        return out.log_probs, out.entropy
    return run


def _torch_eager(s: Sample):
    return torch_eager(s.hidden_states, s.weight, s.labels, s.temperature, s.ignore_index, softcap=s.softcap)


def _verl_backends() -> dict[str, Backend]:
    """verl's fused Triton head, when verl is importable (it needs CUDA)."""
    try:
        from .verl_kernels import verl_linear_kernels

        head = verl_linear_kernels()["verl triton"]
    except Exception:  # noqa: BLE001 - any import failure means "not available here"
        return {}
    # verl's head has no soft-capping: on a capped sample it computes the uncapped logits, as
    # verl's fused forwards do for such models (the bundled sample's baseline_bugs says so)
    def run(s: Sample):
        if isinstance(s.temperature, torch.Tensor):
            raise ValueError("verl's linear_cross_entropy takes one temperature per call; this sample has one per row")
        return head(s.hidden_states, s.weight, s.labels, s.temperature)

    return {"verl linear_cross_entropy": run}


def _torch_eager_logits(s: LogitsSample):
    return torch_eager_logits(s.logits, s.labels, s.temperature, s.ignore_index)


def _ours_logits_torch(s: LogitsSample):
    out = logits_stats(s.logits, s.labels, temperature=s.temperature, ignore_index=s.ignore_index,
                       backend="torch")
    return out.log_probs, out.entropy


def _ours_logits_triton(two_level: bool) -> LogitsBackend:
    """The Triton forward in one launch shape, forced (``logits_stats`` picks one by N), after
    the public API's checks (a label out of range must not reach the kernel)."""
    def run(s: LogitsSample):
        from .. import ops
        from ..autograd.head_family import split_temperature
        from ..autograd.logits import LogitsParams
        from ..core.backends import get_backend

        check_logits(s.logits)
        # a number: 1 / T; a per-row tensor: its (N,) float32 1 / T (values checked), as logits_stats
        inv_temperature, _ = split_temperature(check_temperature(s.temperature, s.logits[..., 0], "logits.shape[:-1]"))
        check_labels(s.labels, s.logits, "logits", s.logits.shape[-1], s.ignore_index)
        x = s.logits.reshape(-1, s.logits.shape[-1])
        params = LogitsParams(backend=get_backend("triton", x.device), inv_temperature=inv_temperature,
                              ignore_index=int(s.ignore_index), return_entropy=True, name="repro")
        out = ops.logits_forward(x, s.labels.reshape(-1), params, ops.logits_config(x.device), two_level=two_level)
        return out["log_probs"].view(s.labels.shape), out["entropy"].view(s.labels.shape)
    return run


def _quiet_interpreter():
    """``ops.launch.quiet_interpreter()`` under Triton's CPU interpreter; else nothing (and no
    import of ``ops``, which needs Triton)."""
    if not (interpreting() and triton_available()):
        return contextlib.nullcontext()
    from ..ops.launch import quiet_interpreter

    return quiet_interpreter()


def _triton_runs_on(device: torch.device) -> bool:
    return triton_available() and (device.type == "cuda" or interpreting())


def unavailable_backends(device: torch.device) -> dict[str, str]:
    """name -> why, for our backends that cannot run on ``device`` (listed, not run)."""
    if _triton_runs_on(device):
        return {}
    return {"rl_kernels triton (linear; from-logits 1-level and 2-level)":
            TRITON_UNAVAILABLE if triton_available() else "triton is not installed"}


def available_logits_backends(device: torch.device) -> dict[str, tuple[LogitsBackend, bool]]:
    """name -> (callable, is_ours) for every from-logits backend that can run on ``device``."""
    backends: dict[str, tuple[LogitsBackend, bool]] = {}
    if _triton_runs_on(device):
        backends["rl_kernels triton 1-level"] = (_ours_logits_triton(False), True)
        backends["rl_kernels triton 2-level"] = (_ours_logits_triton(True), True)
    backends["rl_kernels torch"] = (_ours_logits_torch, True)
    backends["torch eager"] = (_torch_eager_logits, False)
    return backends


def available_backends(device: torch.device) -> dict[str, tuple[Backend, bool]]:
    """name -> (callable, is_ours) for every linear-head backend that can run on ``device``."""
    backends: dict[str, tuple[Backend, bool]] = {}
    if _triton_runs_on(device):
        backends["rl_kernels triton"] = (_ours("triton"), True)
    backends["rl_kernels torch"] = (_ours("torch"), True)
    backends["torch eager"] = (_torch_eager, False)
    if device.type == "cuda":
        backends.update({k: (v, False) for k, v in _verl_backends().items()})
    return backends


def _to(s: Sample | LogitsSample, device: torch.device) -> Sample | LogitsSample:
    """The sample on ``device``: its tensors, a per-row temperature too."""
    t = s.temperature.to(device) if isinstance(s.temperature, torch.Tensor) else s.temperature
    if isinstance(s, LogitsSample):
        return dataclasses.replace(s, logits=s.logits.to(device), labels=s.labels.to(device), temperature=t)
    return dataclasses.replace(s, hidden_states=s.hidden_states.to(device),
                               weight=s.weight.to(device), labels=s.labels.to(device), temperature=t)


def _positions(mask: torch.Tensor, limit: int = 8) -> str:
    """``[1, 3]`` (1-D) or ``[(0, 1), (1, 2)]``: the first ``limit`` True entries of ``mask``."""
    idx = mask.nonzero().tolist()
    text = ", ".join(str(i[0] if len(i) == 1 else tuple(i)) for i in idx[:limit])
    return f"[{text}{f', ... ({len(idx)} in all)' if len(idx) > limit else ''}]"


def non_finite_inputs(sample: Sample | LogitsSample) -> tuple[torch.Tensor, str]:
    """(mask shaped like ``sample.labels``: the rows whose inputs hold NaN/inf, a description ""
    when none). A NaN/inf in ``weight`` reaches every row."""
    if isinstance(sample, LogitsSample):
        bad = ~torch.isfinite(sample.logits).all(-1).cpu()
        return bad, (f"input holds NaN/inf in rows {_positions(bad)} of {tuple(bad.shape)}"
                     if bad.any() else "")
    bad = ~torch.isfinite(sample.hidden_states).all(-1).cpu()
    bad_vocab = ~torch.isfinite(sample.weight).all(-1).cpu()
    if bad_vocab.any():
        return torch.ones_like(bad), (f"input holds NaN/inf in weight rows (vocab ids) "
                                      f"{_positions(bad_vocab)}: every row depends on them")
    return bad, (f"input holds NaN/inf in rows {_positions(bad)} of hidden_states "
                 f"{tuple(sample.hidden_states.shape)}" if bad.any() else "")


def _baseline_bug(sample: Sample | LogitsSample, backend: str) -> str | None:
    return next((why for prefix, why in getattr(sample, "baseline_bugs", {}).items()
                 if backend.startswith(prefix)), None)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def baseline_error(sample: Sample | LogitsSample, backend: str) -> str:
    """The note of a baseline's row that fails (``FAIL (baseline)``): that it is the baseline's own
    error, what the baseline computes differently from float64 (the same words for a bundled sample
    and for the file it is saved as, for ``save_sample`` and anomaly-capture files), and the
    known bug of that baseline which the sample reproduces, when it names one (``baseline_bugs``)."""
    if backend.startswith("torch eager"):
        if isinstance(sample, LogitsSample):
            per_row = isinstance(sample.temperature, torch.Tensor)
            how = (f"logits divided by {'the per-row ' if per_row else ''}T in {_dtype(sample.logits)} (the "
                   f"logits' dtype), as verl's logits path does" if per_row or sample.temperature != 1.0 else
                   f"float32 log-softmax of the {_dtype(sample.logits)} logits")
        else:
            how = (f"logits computed in {_dtype(sample.hidden_states)} (the inputs' dtype), as "
                   f"verl's default path does")
    elif backend.startswith("verl"):
        how = "verl's own kernel"
    else:
        how = "not an rl-kernels backend"
    bug = _baseline_bug(sample, backend)
    return f"baseline's own error: {how}" + (f"; known bug: {bug}" if bug else "")


def check_sample(sample: Sample | LogitsSample, device: torch.device, atol: float = DEFAULT_ATOL,
                 backends: dict[str, tuple[Backend | LogitsBackend, bool]] | None = None) -> list[Row]:
    """One Row per backend: errors vs the float64 reference (over non-ignored positions).
    ``backends`` must match the sample's kind (default: :func:`available_backends` for a
    :class:`Sample`, :func:`available_logits_backends` for a :class:`LogitsSample`).

    Rows whose inputs hold NaN/inf (:func:`non_finite_inputs`) are left out of the comparison and
    named in each row's note (the input, not a kernel, is non-finite); when no row is left, the
    result is ``n/a: input NaN/inf``. A failing row of a baseline (``ours`` False: torch eager,
    verl) is ``FAIL (baseline)``, its note saying what that baseline does (:func:`baseline_error`):
    the baseline's error, not a failure of rl-kernels, whether the sample is bundled or a file.
    Under Triton's CPU interpreter every backend runs in
    :func:`~rl_kernels.ops.launch.quiet_interpreter` (no numpy warnings from its masked-off lanes)."""
    if isinstance(sample, LogitsSample):
        backends = backends if backends is not None else available_logits_backends(device)
        ref = reference_logits_stats(sample.logits, sample.labels, temperature=sample.temperature,
                                     ignore_index=sample.ignore_index)
    else:
        backends = backends if backends is not None else available_backends(device)
        ref = reference_linear_log_probs(sample.hidden_states, sample.weight, sample.labels,
                                         temperature=sample.temperature, softcap=sample.softcap,
                                         ignore_index=sample.ignore_index)
    bad_input, input_note = non_finite_inputs(sample)
    valid = (sample.labels != sample.ignore_index).cpu() & ~bad_input
    nothing_to_compare = bool(bad_input.any()) and not valid.any()
    s_dev = _to(sample, device)
    rows = []
    for name, (fn, ours) in backends.items():
        try:
            with torch.no_grad(), _quiet_interpreter():
                lp, ent = fn(s_dev)
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result to report
            row = Row(sample.name, name, ours, math.nan, math.nan, -1, -1, False,
                      f"{type(exc).__name__}: {' '.join(str(exc).split())}")
        else:
            lp, ent = lp.double().cpu(), ent.double().cpu()
            non_finite = int((~torch.isfinite(lp[valid])).sum() + (~torch.isfinite(ent[valid])).sum())
            positive = int((lp[valid] > 0).sum())
            e_lp = (lp - ref.log_probs)[valid].abs().max().item() if valid.any() else 0.0
            e_ent = (ent - ref.entropy)[valid].abs().max().item() if valid.any() else 0.0
            passed = non_finite == 0 and positive == 0 and e_lp <= atol and e_ent <= atol
            row = Row(sample.name, name, ours, e_lp, e_ent, non_finite, positive, passed)
            if nothing_to_compare:
                row.passed, row.status = True, INPUT_NON_FINITE
        if not ours and not row.passed:
            row.status = BASELINE_FAIL
            row.note = "; ".join(x for x in (baseline_error(sample, name), row.note) if x)
        if input_note:
            row.note = "; ".join(x for x in (input_note + " (not compared)", row.note) if x)
        rows.append(row)
    return rows


TABLE_WIDTH = 120
"""The width the repro output keeps to: the table of the bundled samples, and the prose lines
(wrapped); a sample's name, a note or metadata is printed in full, whatever its length."""


def row_note(row: Row) -> str:
    """Everything a row has to say besides its errors and result, in full: the count of non-finite
    log-prob / entropy values and of log-probs > 0 (when not 0), then the row's note."""
    counts = [] if row.status in (ERROR, INPUT_NON_FINITE) else [
        text for n, text in ((row.non_finite, f"{row.non_finite} non-finite log_probs/entropy value(s)"),
                             (row.positive_log_probs, f"{row.positive_log_probs} log_probs > 0")) if n > 0]
    return "; ".join(counts + ([row.note] if row.note else []))


def format_table(rows: list[Row]) -> str:
    """The GitHub-markdown table of ``rows``, one line per row (to paste into an issue, or grep):
    sample, backend, max |error| of log-probs and of entropy against float64 (Δ), result, and a
    note's number; then, after a blank line, each note once, in full (``[1] text``): the same note
    on several rows (a baseline's own error) is one number, and a long note (an error message, the
    NaN rows) never widens the table."""
    from tabulate import tabulate

    def err(x: float, r: Row) -> str | None:
        return None if r.status in (ERROR, INPUT_NON_FINITE) else f"{x:.2e}"

    notes: dict[str, int] = {}
    table = []
    for r in rows:
        note = row_note(r)
        ref = f"[{notes.setdefault(note, len(notes) + 1)}]" if note else ""
        table.append([r.sample, r.backend, err(r.err_log_probs, r), err(r.err_entropy, r), r.result, ref])
    headers = ["sample", "backend", "Δ log_probs", "Δ entropy", "result", "note"]
    text = tabulate(table, headers=headers, tablefmt="github", missingval="-")
    if notes:
        text += "\n\n" + "\n".join(f"[{i}] {note}" for note, i in notes.items())
    return text
