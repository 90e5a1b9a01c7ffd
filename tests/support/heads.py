"""The registry of public heads: one entry per public function that computes (``HEADS``), read by
the tests that every head must pass.

Adding a head: write its kernels and torch twin (``rl_kernels/ops/<family>.py``,
``rl_kernels/torch_ops/<family>.py``, ``rl_kernels/autograd/<family>.py``), export its public
function (in its public module's ``__all__``), then add ONE ``Head`` to ``HEADS`` below:

  * ``name``: the public function's name; ``family``: the stem of its ``<family>.py`` files;
    ``reads``: its per-row input, "hidden" (``hidden``, ``weight``) or "logits";
  * ``build(backend, reduction) -> f(hidden, weight, logits, labels, temperature=T)``: calls the
    function on the shared inputs (``inputs``; a head reads ``hidden`` and ``weight``, or
    ``logits``, and takes ``labels`` where it has them; the teacher's side comes from ``teacher``
    / ``jsd_teacher``) and returns a tuple of its outputs. ``reduction`` is passed on where the
    function has one (``Head.reduction`` is not None);
  * ``per_row_reference(hidden, weight, logits, labels, temperature)``: the same outputs per row
    (as with ``reduction='none'``), float64, written from the definitions with torch primitives
    (nothing of rl_kernels), differentiable w.r.t. float64 hidden, weight and logits;
  * the flags: ``takes_temperature`` (False: the function has no temperature), ``reduction`` (the
    default the shared tests use; None: no reduction argument), ``loss`` (KL / JSD values: a
    relative tolerance on the GPU), ``grad_rel_16bit`` (the GPU's bf16 / fp16 gradient tolerance,
    relative Frobenius).

Then, with no other edit, the head is covered by:
  * tests/api/test_public_api.py: exported, summarized with its real signature, one argument order and
    default per concept, the keyword-only message for positional arguments, docstring sections;
  * tests/autograd/test_compile.py: fullgraph ``torch.compile`` with no graph break equals eager (values and
    gradients, torch and Triton backends), within float64 of its reference, no recompilation for
    another batch size; with ``takes_temperature``: ten temperatures through one inductor graph,
    each within float64;
  * tests/api/test_no_silent_errors.py: a NaN or inf in one row of its input (``hidden`` for the linear
    families, ``logits`` for the logits family) gives non-finite outputs and input gradient in that
    row only, and float64's values and gradients in the others; double backward raises
    "double backward is not supported by rl_kernels.<name>" (both backends);
  * tests/gpu/test_gpu.py (CUDA): bf16 outputs and gradients against float64 at an odd moderate shape;
  * tests/gpu/test_gpu_configs.py (CUDA): the same on every configuration class, in bf16, fp16, fp32.
A public function without an entry fails tests/api/test_public_api.py (its FUNCTIONS must be
``rl_kernels.__all__``'s functions). Tests of a head's own options (soft cap, kinds, masks,
in-place backward, vocab parallelism, ...) stay in its own test file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import rl_kernels

N, H, V, K = 9, 16, 37, 3  # small odd shapes: each Triton interpreter launch costs ~0.3 s
T = 0.7
IGNORE = -100
IGNORED_ROW = 2  # the row of ``inputs`` whose label is ignore_index


def inputs(n=N, seed=0, device="cpu", dtype=torch.float32, h=H, v=V):
    """(hidden (n, h), weight (v, h), logits (n, v), labels (n,)): random normal values (weight
    scaled by 2 / sqrt(h), so the head's logits have a std of ~2 as the logits'), the float ones
    leaves that require grad, ``labels[IGNORED_ROW]`` = ignore_index. Drawn in float32 on the CPU
    from ``seed``, then cast: the same values on every device."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = 2 / h ** 0.5 * torch.randn(v, h, generator=g)
    logits = 2 * torch.randn(n, v, generator=g)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[IGNORED_ROW] = IGNORE
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (hidden, weight, logits)]
    return (*leaves, labels.to(device))


def teacher(n, v, device="cpu", k=K):
    """A teacher's top-K: k distinct ids per row ((i * 7 + j * 5) mod v, v >= 11) and float32
    log-probs, made without a Python loop over rows (a traced function stays shape-generic)."""
    ids = (torch.arange(n, device=device)[:, None] * 7 + torch.arange(k, device=device)[None, :] * 5) % v
    values = torch.sin(torch.arange(n * k, dtype=torch.float32, device=device)).reshape(n, k) * 3
    return ids, torch.log_softmax(values, -1)


def jsd_teacher(hidden, weight):
    """``linear_jsd``'s teacher head from the student's: its hidden features and its vocabulary
    reversed (exact in every dtype, so the float64 reference sees the same numbers as a bf16 call;
    no arithmetic that a compiler could round otherwise); neither carries a gradient."""
    return hidden.detach().flip(-1), weight.detach().flip(0)


@dataclass(frozen=True)
class Head:
    name: str
    family: str  # the stem of rl_kernels/{ops,torch_ops,autograd}/<family>.py ("linear", "logits", ...)
    reads: str  # the per-row input of the function: "hidden" (hidden_states, weight) or "logits"
    build: Callable  # (backend, reduction) -> f(hidden, weight, logits, labels, temperature=T) -> tuple
    per_row_reference: Callable  # (hidden, weight, logits, labels, temperature) -> tuple of float64
    takes_temperature: bool = True
    reduction: str | None = None  # the shared tests' reduction; None: the function has no reduction
    loss: bool = False
    grad_rel_16bit: float = 5e-3

    @property
    def fn(self):
        return getattr(rl_kernels, self.name)

    @property
    def row_input(self) -> int:
        """Where the per-row input is among (hidden, weight, logits, labels): 0 or 2."""
        return {"hidden": 0, "logits": 2}[self.reads]

    def call(self, backend, reduction=None):
        """f(hidden, weight, logits, labels, temperature=T) -> tuple of outputs, with ``reduction``
        (default: the entry's) where the function has one."""
        return self.build(backend, reduction or self.reduction)

    def per_row(self, backend):
        """``call`` with every output per row (reduction 'none'): row i of each output (its first
        dimension) depends on row i of hidden / logits alone."""
        return self.build(backend, "none" if self.reduction else None)

    def reference(self, hidden, weight, logits, labels, temperature=T, reduction=None):
        """float64 outputs of ``call(backend, reduction)`` from the same inputs."""
        outs = self.per_row_reference(hidden, weight, logits, labels, temperature)
        reduction = reduction or self.reduction
        if reduction in (None, "none"):
            return outs
        if reduction == "sum":
            return tuple(o.sum() for o in outs)
        assert reduction == "mean", reduction
        return tuple(o.sum() / (labels != IGNORE).sum() for o in outs)

    def tolerances(self, dtype):
        """(atol, rtol) of the outputs and the relative Frobenius tolerance of the gradients on the
        GPU, from tests/gpu/test_gpu.py and tests/gpu/test_gpu_configs.py: 16-bit inputs: values 5e-5
        absolute (losses also 2e-3 relative), gradients ``grad_rel_16bit`` (2.5e-3 the head's,
        5e-3 the logits', 1e-2 the top-K's and the JSD's); float32: 2e-5 (losses 1e-4 relative)
        and 1e-4."""
        if dtype == torch.float32:
            return 2e-5, (1e-4 if self.loss else 0.0), 1e-4
        return 5e-5, (2e-3 if self.loss else 0.0), self.grad_rel_16bit


def check_against_float64(head, *, n, h, v, dtype, device="cuda", backend="triton", seed=0):
    """The GPU tests' check of one head: on fresh ``inputs(n, seed, device, dtype, h, v)``, every
    output per row (``head.per_row``) and the gradients of sum_k weights_k . outputs_k (random
    weights) w.r.t. hidden, weight and logits, against ``head.reference`` from the same (possibly
    16-bit) values in float64, within ``head.tolerances(dtype)``. Returns a one-line summary."""
    from rl_kernels.tools.reference import rel_err

    args = inputs(n, seed, device, dtype, h, v)
    outs = head.per_row(backend)(*args)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    weights = [torch.randn(o.shape, device=device, generator=g) for o in outs]
    sum((o.float() * w).sum() for o, w in zip(outs, weights)).backward()
    leaves = [t.detach().double().requires_grad_() for t in args[:3]]
    refs = head.reference(*leaves, args[3], reduction="none")
    sum((r * w.double()).sum() for r, w in zip(refs, weights)).backward()
    atol, rtol, grad_rel = head.tolerances(dtype)
    line = [f"{head.name} {n}x{h}x{v} {dtype}:"]
    for i, (o, r) in enumerate(zip(outs, refs)):
        r = r.detach()
        assert o.shape == r.shape, (head.name, i, o.shape, r.shape)
        # an output in a 16-bit dtype (cross_entropy's, as torch's) also gets its rounding: eps / 2
        rounding = torch.finfo(o.dtype).eps / 2 if o.dtype != torch.float32 else 0.0
        err = (o.double() - r).abs()
        line.append(f"output {i} max|err| {err.max().item():.1e}")
        assert (err <= atol + (rtol + rounding) * r.abs()).all(), \
            f"{head.name} output {i}: max |error| {err.max().item():.2e} > {atol} + {rtol + rounding:.1e} |reference|"
    for which, t, ref in zip(("hidden", "weight", "logits"), args[:3], leaves):
        assert (t.grad is None) == (ref.grad is None), (head.name, which)
        if ref.grad is not None:
            e = rel_err(t.grad, ref.grad)
            line.append(f"d{which} {e:.1e}")
            assert e <= grad_rel, f"{head.name} d{which}: relative error {e:.2e} > {grad_rel}"
    return " ".join(line)


# ----------------------------------------------------------------------------- float64 definitions

def _linear_z(hidden, weight, temperature):
    return hidden.double() @ weight.double().T / temperature


def _label_stats(z, labels):
    """Per row of float64 logits z: log p_label (0 where ignored), entropy, lse, sum p^2, log p
    (p = softmax(z))."""
    keep = labels != IGNORE
    log_p = torch.log_softmax(z, -1)
    p = log_p.exp()
    lp = torch.where(keep, log_p.gather(1, torch.where(keep, labels, 0)[:, None])[:, 0], 0.0)
    return lp, -(p * log_p).sum(-1), torch.logsumexp(z, -1), (p * p).sum(-1), log_p


def _masked(labels, *values):
    keep = labels != IGNORE
    return tuple(torch.where(keep, v, 0.0) for v in values)


def _forward_kl(z, labels, temperature):
    """Forward KL over the teacher's K ids, x T^2, 0 where ignored."""
    ids, teacher_lp = teacher(z.shape[0], z.shape[1], z.device)
    log_q = torch.log_softmax(z, -1).gather(1, ids)
    t = teacher_lp.double()
    return _masked(labels, (t.exp() * (t - log_q)).sum(-1) * temperature ** 2)


# ----------------------------------------------------------------------------- the entries

def _linear_log_probs(backend, reduction):
    def f(hidden, weight, logits, labels, temperature=T):
        o = rl_kernels.linear_log_probs(hidden, weight, labels, temperature=temperature, return_sum_pi_squared=True,
                                        backend=backend)
        return o.log_probs, o.entropy, o.sum_pi_squared
    return f


def _linear_log_probs_ref(hidden, weight, logits, labels, temperature):
    lp, ent, _, sps, _ = _label_stats(_linear_z(hidden, weight, temperature), labels)
    return (lp, *_masked(labels, ent, sps))


def _logits_stats(backend, reduction):
    def f(hidden, weight, logits, labels, temperature=T):
        o = rl_kernels.logits_stats(logits, labels, temperature=temperature, return_sum_pi_squared=True,
                                    backend=backend)
        return o.log_probs, o.entropy, o.lse, o.sum_pi_squared
    return f


def _logits_stats_ref(hidden, weight, logits, labels, temperature):
    lp, ent, lse, sps, _ = _label_stats(logits.double() / temperature, labels)
    ent, sps = _masked(labels, ent, sps)
    return lp, ent, lse, sps


def _one(name, with_labels, **kw):
    """A from-logits function of one output: (logits[, labels], temperature=..., **kw)."""
    def build(backend, reduction):
        def f(hidden, weight, logits, labels, temperature=T):
            fn = getattr(rl_kernels, name)
            args = (logits, labels) if with_labels else (logits,)
            return (fn(*args, temperature=temperature, backend=backend, **kw),)
        return f
    return build


def _stat_ref(which):
    def ref(hidden, weight, logits, labels, temperature):
        lp, ent, lse, sps, _ = _label_stats(logits.double() / temperature, labels)
        return ({"log_probs": lp, "entropy": ent, "lse": lse, "sum_pi_squared": sps}[which],)
    return ref


def _cross_entropy(backend, reduction):
    def f(hidden, weight, logits, labels, temperature=T):  # (no temperature)
        return (rl_kernels.cross_entropy(logits, labels, label_smoothing=0.1, reduction=reduction, backend=backend),)
    return f


def _cross_entropy_ref(hidden, weight, logits, labels, temperature):
    lp, _, _, _, log_p = _label_stats(logits.double(), labels)
    return _masked(labels, -(0.9 * lp + 0.1 * log_p.mean(-1)))


def _topk_log_probs(backend, reduction):
    def f(hidden, weight, logits, labels, temperature=T):
        ids = teacher(logits.shape[0], logits.shape[1], logits.device)[0]
        return (rl_kernels.topk_log_probs_from_logits(logits, ids, temperature=temperature, backend=backend),)
    return f


def _topk_log_probs_ref(hidden, weight, logits, labels, temperature):
    z = logits.double() / temperature
    return (torch.log_softmax(z, -1).gather(1, teacher(z.shape[0], z.shape[1], z.device)[0]),)


def _topk_kl_from_logits(backend, reduction):
    def f(hidden, weight, logits, labels, temperature=T):
        ids, teacher_lp = teacher(logits.shape[0], logits.shape[1], logits.device)
        return (rl_kernels.topk_kl_from_logits(logits, ids, teacher_lp, temperature=temperature, labels=labels,
                                               reduction=reduction, backend=backend),)
    return f


def _linear_topk_kl(backend, reduction):
    def f(hidden, weight, logits, labels, temperature=T):
        ids, teacher_lp = teacher(hidden.shape[0], weight.shape[0], hidden.device)
        mask = torch.ones(hidden.shape[0], dtype=torch.long, device=hidden.device)
        return (rl_kernels.linear_topk_kl(hidden, weight, ids, teacher_lp, temperature=temperature, labels=labels,
                                          mask=mask, reduction=reduction, backend=backend),)
    return f


def _linear_jsd(backend, reduction):
    def f(hidden, weight, logits, labels, temperature=T):
        teacher_hidden, teacher_weight = jsd_teacher(hidden, weight)
        return (rl_kernels.linear_jsd(hidden, weight, teacher_hidden, teacher_weight, temperature=temperature,
                                      labels=labels, beta=0.3, reduction=reduction, backend=backend),)
    return f


def _linear_jsd_ref(hidden, weight, logits, labels, temperature):
    """Generalized JSD with beta = 0.3: beta KL(p || m) + (1 - beta) KL(q || m), m = beta p +
    (1 - beta) q (p the teacher's, q the student's distribution), x T^2, 0 where ignored."""
    log_q = torch.log_softmax(_linear_z(hidden, weight, temperature), -1)
    teacher_hidden, teacher_weight = jsd_teacher(hidden, weight)
    log_p = torch.log_softmax(_linear_z(teacher_hidden, teacher_weight, temperature), -1)
    log_m = (0.3 * log_p.exp() + 0.7 * log_q.exp()).log()
    jsd = 0.3 * (log_p.exp() * (log_p - log_m)).sum(-1) + 0.7 * (log_q.exp() * (log_q - log_m)).sum(-1)
    return _masked(labels, jsd * temperature ** 2)


HEADS = {h.name: h for h in [
    Head("linear_log_probs", "linear", "hidden", _linear_log_probs, _linear_log_probs_ref,
         grad_rel_16bit=2.5e-3),
    Head("logits_stats", "logits", "logits", _logits_stats, _logits_stats_ref),
    Head("log_probs_from_logits", "logits", "logits", _one("log_probs_from_logits", True), _stat_ref("log_probs")),
    Head("entropy_from_logits", "logits", "logits", _one("entropy_from_logits", False), _stat_ref("entropy")),
    Head("logsumexp", "logits", "logits", _one("logsumexp", False), _stat_ref("lse")),
    Head("sum_pi_squared_from_logits", "logits", "logits", _one("sum_pi_squared_from_logits", False),
         _stat_ref("sum_pi_squared")),
    Head("cross_entropy", "logits", "logits", _cross_entropy, _cross_entropy_ref, takes_temperature=False,
         reduction="mean"),
    Head("topk_log_probs_from_logits", "logits", "logits", _topk_log_probs, _topk_log_probs_ref,
         grad_rel_16bit=1e-2),
    Head("topk_kl_from_logits", "logits", "logits", _topk_kl_from_logits,
         lambda hidden, weight, logits, labels, temperature: _forward_kl(logits.double() / temperature, labels,
                                                                         temperature),
         reduction="none", loss=True, grad_rel_16bit=1e-2),
    Head("linear_topk_kl", "linear", "hidden", _linear_topk_kl,
         lambda hidden, weight, logits, labels, temperature: _forward_kl(_linear_z(hidden, weight, temperature),
                                                                         labels, temperature),
         reduction="none", loss=True, grad_rel_16bit=1e-2),
    Head("linear_jsd", "linear_jsd", "hidden", _linear_jsd, _linear_jsd_ref, reduction="sum", loss=True,
         grad_rel_16bit=1e-2),
]}


# the floor of a probability inside a logarithm in the tail-aware top-K KL (2^-126), as documented
LOG_TINY = -87.33654475055310898657


def reference_tail_kl(log_q, log_q_tail, t_lp, kind):
    """float64 per-token (K+1)-category KL (verl RFC #7856) from its definition, before T^2 and the
    reduction: p_tail = max(0, 1 - P), a zero mass floored at 2^-126 inside a logarithm, 0 log 0 = 0.
    ``log_q`` (N, K) and ``log_q_tail`` (N,): the student's float64 log-probs at the ids and outside
    them; ``t_lp`` (N, K) the teacher's log-probs."""
    log_p = t_lp.double()
    p = log_p.exp()
    p_tail = (1 - p.sum(-1)).clamp_min(0)
    log_p_tail = p_tail.log()
    q_tail_floored = log_q_tail.clamp_min(LOG_TINY)
    if kind == "forward":
        slots = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
        return slots + torch.where(p_tail > 0, p_tail * (log_p_tail - q_tail_floored), 0.0)
    slots = (log_q.exp() * (log_q - log_p.clamp_min(LOG_TINY))).sum(-1)
    return slots + q_tail_floored.exp() * (q_tail_floored - log_p_tail.clamp_min(LOG_TINY))
