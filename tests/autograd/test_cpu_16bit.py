"""16-bit inputs on the CPU's Triton path (the interpreter): the fused heads' gradients against float64.

The backward's schedules that hand a bfloat16 d loss / d logits window to ``torch.mm`` (the dh pass of
the two-pass schedule: a frozen weight, or N > V - 2) met torch 2.13's CPU bfloat16 matmul, which reads
a column-sliced window's padding (issue 52: NaN hidden-state gradients); ``backward_schedule`` now
gives it contiguous operands. Each case runs under the ``poison`` fixture (every torch.empty is NaN),
so that padding is NaN here, never whatever memory held.

What the interpreter does with 16-bit numbers (Triton 3.9, measured): loads are exact and the kernels
compute in float32 (they upcast bfloat16 before ``tl.dot``: the interpreter's bfloat16 dots and
arithmetic are wrong), but its float32 -> bfloat16 conversion, the dz windows' store, truncates
(relative error below 2^-7 = eps, one ulp; round-to-nearest on the GPU: eps / 2). So, with D the float64
d loss / d z of the same (exactly representable) inputs, z = hidden_states @ weight.T, and eps that of
the input dtype, norm-wise:
    || dh - dh64 || <= eps || |D| @ |weight| || + eps / 2 || dh64 || + 4 e32   (dW: |D|^T @ |hidden|),
the first term the windows' rounding (one ulp each), the second the gradient's own rounding to the
input dtype, e32 the float32 computation's share: the error of the same call on the torch backend in
float32 (no 16-bit rounding anywhere; the factor 4 for another order of float32 sums). Float32 outputs:
|| out - out64 || <= 4 e32 + 2^-24 || out64 || (their float32 rounding).
"""
import pytest
import torch

from heads import reference_tail_kl
from rl_kernels import linear_jsd, linear_log_probs, linear_topk_kl

T = 0.8
K = 3
U32 = 2.0 ** -24
# (N, H, V): "frozen": the weight gets no gradient (the two-pass schedule's dh pass alone); "N > V - 2":
# both gradients, and the float32 dh accumulator does not fit (the two-pass schedule, both passes)
SCHEDULES = {"frozen": (37, 16, 41), "N > V - 2": (37, 16, 13)}


def _inputs(n, h, v, dtype, seed):
    """hidden (n, h), weight (v, h) in ``dtype``, labels (n,) with one ignored row, a second head
    (teacher_hidden (n, h + 3), teacher_weight (v, h + 3)) and a top-K teacher (distinct ids,
    log-probs of mass below 1); random values, the weights scaled to logits of std ~2."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (2 / h ** 0.5 * torch.randn(v, h, generator=g)).to(dtype)
    teacher_hidden = torch.randn(n, h + 3, generator=g).to(dtype)
    teacher_weight = (2 / h ** 0.5 * torch.randn(v, h + 3, generator=g)).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[2] = -100
    ids = torch.stack([torch.randperm(v, generator=g)[:K] for _ in range(n)])
    t_lp = torch.log_softmax(2 * torch.randn(n, K + 1, generator=g), -1)[:, :K].contiguous()
    return hidden, weight, labels, (teacher_hidden, teacher_weight), (ids, t_lp)


def _masked(labels, x):
    return torch.where(labels != -100, x, torch.zeros((), dtype=x.dtype))


def _per_row(name, z, labels, teacher):
    """float64 per-row outputs of ``name`` from the raw logits z (N, V) float64."""
    log_q = torch.log_softmax(z / T, -1)
    if name == "linear_log_probs":
        lp = log_q.gather(1, labels.clamp_min(0)[:, None])[:, 0]
        return _masked(labels, lp), _masked(labels, -(log_q.exp() * log_q).sum(-1))
    if name == "linear_jsd":  # beta = 0.3
        teacher_hidden, teacher_weight = teacher
        log_p = torch.log_softmax(teacher_hidden.double() @ teacher_weight.double().T / T, -1)
        log_m = (0.3 * log_p.exp() + 0.7 * log_q.exp()).log()
        jsd = 0.3 * (log_p.exp() * (log_p - log_m)).sum(-1) + 0.7 * (log_q.exp() * (log_q - log_m)).sum(-1)
        return (_masked(labels, jsd * T * T),)
    ids, t_lp = teacher
    log_q_ids = log_q.gather(1, ids)
    if name == "linear_topk_kl":
        log_p = t_lp.double()
        return (_masked(labels, (log_p.exp() * (log_p - log_q_ids)).sum(-1) * T * T),)
    tail = torch.logsumexp((z / T).scatter(1, ids, float("-inf")), -1) - torch.logsumexp(z / T, -1)
    return (_masked(labels, reference_tail_kl(log_q_ids, tail, t_lp, "forward") * T * T),)


def _call(name, hidden, weight, labels, teacher, backend):
    if name == "linear_log_probs":
        out = linear_log_probs(hidden, weight, labels, temperature=T, backend=backend)
        return out.log_probs, out.entropy
    if name == "linear_jsd":
        return (linear_jsd(hidden, weight, *teacher, temperature=T, labels=labels, beta=0.3, reduction="none",
                           backend=backend),)
    return (linear_topk_kl(hidden, weight, *teacher, temperature=T, labels=labels, reduction="none",
                           tail=name == "linear_topk_kl tail", backend=backend),)


def _run(name, hidden, weight, labels, teacher, backend, frozen, upstream):
    """(outputs, dh, dW or None) of sum_k upstream_k . outputs_k."""
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_(not frozen)
    outs = _call(name, h, w, labels, teacher, backend)
    sum((o.float() * u).sum() for o, u in zip(outs, upstream)).backward()
    return [o.detach() for o in outs], h.grad, w.grad


def _norm(x):
    return x.double().norm().item()


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("name", ["linear_log_probs", "linear_topk_kl", "linear_topk_kl tail", "linear_jsd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_gradients_on_the_cpu_triton_path_match_float64(poison, dtype, name, schedule):
    n, h, v = SCHEDULES[schedule]
    frozen = schedule == "frozen"
    hidden, weight, labels, jsd_teacher, topk_teacher = _inputs(n, h, v, dtype, seed=len(name) + n + v)
    teacher = jsd_teacher if name == "linear_jsd" else topk_teacher
    # float64 from the same values: D = d loss / d z, z = hidden @ weight.T
    h64, w64 = hidden.double(), weight.double()
    z = (h64 @ w64.T).requires_grad_()
    refs = _per_row(name, z, labels, teacher)
    g = torch.Generator().manual_seed(7)
    upstream = [torch.randn(r.shape, generator=g) for r in refs]
    sum((r * u.double()).sum() for r, u in zip(refs, upstream)).backward()
    d = z.grad
    dh64, dw64 = d @ w64, d.T @ h64

    outs, dh, dw = _run(name, hidden, weight, labels, teacher, "triton", frozen, upstream)
    teacher32 = tuple(t.float() if name == "linear_jsd" else t for t in teacher)
    outs32, dh32, dw32 = _run(name, hidden.float(), weight.float(), labels, teacher32, "torch", frozen, upstream)
    assert torch.isfinite(dh).all(), f"{(~torch.isfinite(dh)).sum().item()} of {dh.numel()} dh elements not finite"
    assert (dw is None) == frozen and (frozen or torch.isfinite(dw).all())
    eps = torch.finfo(dtype).eps
    for o, o32, r in zip(outs, outs32, refs):
        r = r.detach()
        assert _norm(o - r) <= 4 * _norm(o32 - r) + U32 * _norm(r), (name, _norm(o - r))
    checks = [("dh", dh, dh32, dh64, d.abs() @ w64.abs())]
    if not frozen:
        checks.append(("dW", dw, dw32, dw64, d.abs().T @ h64.abs()))
    for which, got, got32, ref, scale in checks:
        err, bound = _norm(got - ref), eps * _norm(scale) + eps / 2 * _norm(ref) + 4 * _norm(got32 - ref)
        assert err <= bound, f"{name} {which}: ||error|| {err:.3e} > bound {bound:.3e} (||ref|| {_norm(ref):.3e})"
        assert bound < 0.05 * _norm(ref), (which, bound, _norm(ref))  # the check can fail: the bound says something
