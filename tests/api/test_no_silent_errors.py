"""No silent wrong results, on both backends (Triton in the CPU interpreter): non-finite rows stay
non-finite (and only those rows), in-place backward is caught by autograd's version counter or
refused, double backward raises one clear error, an ignored non-finite row contributes nothing to
dW / dh, -inf teacher log-probs follow 0 log 0 = 0, and edge values get clear errors.

Every check compares against a float64 oracle on fresh random inputs; each class failed on the
code before the fix (NaN hidden by a NaN-dropping clamp, NaN * 0 in dW, 0 * -inf in the KL, ...).
The non-finite-row rule and the double-backward error are also checked for every head of the
registry (tests/support/heads.py), against its float64 reference; the other tests check specific rules.
"""
import math

import pytest
import torch

import rl_kernels
from rl_kernels import (cross_entropy, entropy_from_logits, linear_jsd, linear_log_probs, linear_topk_kl,
                        log_probs_from_logits, logits_stats, logsumexp, topk_kl_from_logits,
                        topk_log_probs_from_logits)
from rl_kernels.ops import logits as kernels

from rl_kernels.tools.reference import dense_linear_log_probs, make_inputs

import heads
from heads import HEADS

PATHS = [("torch", None), ("triton", False), ("triton", True)]  # (backend, two_level)
PATH_IDS = ["torch", "triton-1level", "triton-2level"]
BACKENDS = ["torch", "triton"]
TOL = dict(atol=2e-5, rtol=1e-5)


def _force(monkeypatch, two_level):
    if two_level is not None:
        monkeypatch.setattr(kernels, "use_two_level", lambda *a: two_level)


def _logits(n=5, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=g) * 2, torch.randint(0, v, (n,), generator=g)


def _ref_logits(x, labels, temperature=1.0):
    z = x.double() / temperature
    log_p = torch.log_softmax(z, -1)
    return (log_p.gather(1, labels[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1), torch.logsumexp(z, -1))


# ----------------------------------------------------------------------------- 1. non-finite rows

@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend,two_level", PATHS, ids=PATH_IDS)
def test_non_finite_logits_row_gives_non_finite_outputs_for_that_row_only(monkeypatch, backend, two_level, bad):
    _force(monkeypatch, two_level)
    x, labels = _logits()
    x[1, 7] = bad  # one element of row 1 (not its label column)
    labels[1] = 3
    ref_lp, ref_ent, ref_lse = _ref_logits(x, labels, 0.7)
    xg = x.clone().requires_grad_()
    s = logits_stats(xg, labels, temperature=0.7, backend=backend)
    ok = torch.arange(5) != 1
    for got, ref in ((s.log_probs, ref_lp), (s.entropy, ref_ent), (s.lse, ref_lse)):
        assert not torch.isfinite(got[1]), got
        torch.testing.assert_close(got[ok].double(), ref[ok], **TOL)
    # the single-output functions, and cross_entropy, agree
    assert not torch.isfinite(log_probs_from_logits(x, labels, temperature=0.7, backend=backend)[1])
    assert not torch.isfinite(entropy_from_logits(x, temperature=0.7, backend=backend)[1])
    assert not torch.isfinite(logsumexp(x, temperature=0.7, backend=backend)[1])
    ce = cross_entropy(x, labels, reduction="none", label_smoothing=0.1, backend=backend)
    assert not torch.isfinite(ce[1]) and torch.isfinite(ce[ok]).all()
    # backward: the row's gradient is non-finite, the others are finite and right
    (s.log_probs.sum() + s.entropy.sum() + s.lse.sum()).backward()
    assert not torch.isfinite(xg.grad[1]).all()
    z = x.double().requires_grad_()
    lp, ent, lse = _ref_logits(z, labels, 0.7)
    (lp[ok].sum() + ent[ok].sum() + lse[ok].sum()).backward()
    torch.testing.assert_close(xg.grad[ok].double(), z.grad[ok], **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_hidden_row_of_the_linear_head(backend):
    hidden, weight, labels = make_inputs(6, 24, 70, torch.float32, seed=1, ignore_frac=0.0)
    hidden[2, 5] = float("nan")
    out = linear_log_probs(hidden, weight, labels, temperature=0.9, backend=backend)
    ref_lp, ref_ent = dense_linear_log_probs(hidden, weight, labels, temperature=0.9)
    ok = torch.arange(6) != 2
    assert not torch.isfinite(out.log_probs[2]) and not torch.isfinite(out.entropy[2])
    torch.testing.assert_close(out.log_probs[ok].double(), ref_lp[ok], **TOL)
    torch.testing.assert_close(out.entropy[ok].double(), ref_ent[ok], **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_rows_of_the_distillation_losses(backend):
    hidden, weight, labels = make_inputs(6, 16, 50, torch.float32, seed=2, ignore_frac=0.0)
    hidden[4, 0] = float("nan")
    g = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(50, generator=g)[:4] for _ in range(6)])
    t_lp = torch.log_softmax(torch.randn(6, 4, generator=g), -1)
    kl = linear_topk_kl(hidden, weight, ids, t_lp, reduction="none", backend=backend)
    teacher_h, teacher_w, _ = make_inputs(6, 12, 50, torch.float32, seed=3)
    jsd = linear_jsd(hidden, weight, teacher_h, teacher_w, reduction="none", backend=backend)
    for loss in (kl, jsd):
        assert not torch.isfinite(loss[4]) and torch.isfinite(loss[torch.arange(6) != 4]).all(), loss


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend,two_level", PATHS, ids=PATH_IDS)
def test_non_finite_logits_row_of_the_topk_functions(monkeypatch, backend, two_level, bad):
    _force(monkeypatch, two_level)
    x, _ = _logits(5, 300, seed=24)
    x[3, 11] = bad  # not one of the row's ids
    g = torch.Generator().manual_seed(25)
    ids = torch.stack([torch.randperm(300, generator=g)[:4] for _ in range(5)])
    ids[3] = torch.tensor([0, 1, 2, 3])
    t_lp = torch.log_softmax(torch.randn(5, 4, generator=g), -1)
    ok = torch.arange(5) != 3
    xg = x.clone().requires_grad_()
    log_q = topk_log_probs_from_logits(xg, ids, temperature=0.7, backend=backend)
    kl = topk_kl_from_logits(xg, ids, t_lp, temperature=0.7, reduction="none", backend=backend)
    assert not torch.isfinite(log_q[3]).any() and not torch.isfinite(kl[3])
    (log_q.sum() + kl.sum()).backward()
    assert not torch.isfinite(xg.grad[3]).all()
    z = x.double().requires_grad_()
    ref = torch.log_softmax(z / 0.7, -1).gather(1, ids)
    ref_kl = (t_lp.double().exp() * (t_lp.double() - ref)).sum(-1) * 0.49
    (ref[ok].sum() + ref_kl[ok].sum()).backward()
    torch.testing.assert_close(log_q[ok].double(), ref[ok].detach(), **TOL)
    torch.testing.assert_close(kl[ok].double(), ref_kl[ok].detach(), **TOL)
    torch.testing.assert_close(xg.grad[ok].double(), z.grad[ok], **TOL)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_non_finite_logits_row_of_topk_kl_from_logits_gets_exactly_zero_gradient(backend, bad):
    x, labels = _logits(4, 300, seed=26)
    if bad == "all -inf":
        x[2] = float("-inf")
    else:
        x[2, 5] = bad
    g = torch.Generator().manual_seed(27)
    ids = torch.stack([torch.randperm(300, generator=g)[:3] for _ in range(4)])
    t_lp = torch.log_softmax(torch.randn(4, 3, generator=g), -1)
    mask = torch.tensor([1, 1, 0, 1])
    labels[2] = -100
    for kw in (dict(mask=mask), dict(labels=labels)):
        xg = x.clone().requires_grad_()
        loss = topk_kl_from_logits(xg, ids, t_lp, reduction="sum", backend=backend, **kw)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(xg.grad).all()
        assert torch.equal(xg.grad[2], torch.zeros(300)), xg.grad[2]
        clean = x.clone()
        clean[2] = 0.0  # a masked row's value is irrelevant to the exact result
        ref = clean.clone().requires_grad_()
        topk_kl_from_logits(ref, ids, t_lp, reduction="sum", backend="torch", **kw).backward()
        torch.testing.assert_close(loss, topk_kl_from_logits(clean, ids, t_lp, reduction="sum", backend="torch",
                                                             **kw))
        torch.testing.assert_close(xg.grad, ref.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_non_finite_row_stays_in_that_row(name, backend, bad):
    """Every head (tests/support/heads.py), every output per row (reduction 'none'): one NaN or inf in one
    row of its per-row input (hidden for the linear families, logits for the logits family; not
    the row's label or teacher-id column) makes that row of every output non-finite and its input
    gradient non-finite; the other rows' outputs and input gradients are float64's."""
    head = HEADS[name]
    args = heads.inputs(seed=30)
    hidden, weight, logits, labels = args
    row = 4  # (not heads.IGNORED_ROW)
    x = args[head.row_input]
    taken = {int(labels[row]), *heads.teacher(heads.N, heads.V)[0][row].tolist()}
    col = min(set(range(x.shape[1])) - taken)
    with torch.no_grad():
        x[row, col] = bad
    outs = head.per_row(backend)(*args)
    g = torch.Generator().manual_seed(31)
    weights = [torch.randn(o.shape, generator=g) for o in outs]
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()

    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, logits)]
    refs = head.reference(*leaves, labels, reduction="none")
    ok = torch.arange(heads.N) != row
    assert len(outs) == len(refs)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.shape[0] == heads.N, (i, o.shape)
        assert not torch.isfinite(o[row]).any(), (i, o[row])
        torch.testing.assert_close(o[ok].double(), r[ok].detach(), **TOL, msg=lambda m: f"output {i}: {m}")
    sum((r[ok] * w[ok].double()).sum() for r, w in zip(refs, weights)).backward()
    assert not torch.isfinite(x.grad[row]).all(), x.grad[row]
    torch.testing.assert_close(x.grad[ok].double(), leaves[head.row_input].grad[ok], **TOL)


# ----------------------------------------------------------------------------- 4. ignored rows

@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ignored_non_finite_row_contributes_nothing(backend, bad):
    hidden, weight, labels = make_inputs(7, 16, 60, torch.float32, seed=4, ignore_frac=0.0)
    hidden[3, 2] = bad
    labels[3] = -100
    g = torch.Generator().manual_seed(6)
    g_lp, g_ent = torch.randn(2, 7, generator=g)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, backend=backend)
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    assert out.log_probs[3] == 0 and out.entropy[3] == 0
    clean = hidden.clone()
    clean[3] = 0.0  # an ignored row's value is irrelevant to the exact result
    h64, w64 = clean.double().requires_grad_(), weight.double().requires_grad_()
    lp, ent = dense_linear_log_probs(h64, w64, labels)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    torch.testing.assert_close(wx.grad.double(), w64.grad, **TOL)
    torch.testing.assert_close(hx.grad.double(), h64.grad, **TOL)
    assert torch.equal(hx.grad[3], torch.zeros(16))


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_non_finite_row_of_the_distillation_losses_contributes_nothing(backend):
    hidden, weight, labels = make_inputs(6, 16, 50, torch.float32, seed=7, ignore_frac=0.0)
    hidden[1, 3] = float("nan")
    mask = torch.ones(6, dtype=torch.bool)
    mask[1] = False
    labels[1] = -100
    g = torch.Generator().manual_seed(8)
    ids = torch.stack([torch.randperm(50, generator=g)[:4] for _ in range(6)])
    t_lp = torch.log_softmax(torch.randn(6, 4, generator=g), -1)
    teacher_h, teacher_w, _ = make_inputs(6, 12, 50, torch.float32, seed=9)
    for fn in (lambda h, w: linear_topk_kl(h, w, ids, t_lp, mask=mask, reduction="sum", backend=backend),
               lambda h, w: linear_jsd(h, w, teacher_h, teacher_w, labels=labels, reduction="sum",
                                       backend=backend)):
        wx = weight.clone().requires_grad_()
        hx = hidden.clone().requires_grad_()
        fn(hx, wx).backward()
        assert torch.isfinite(wx.grad).all() and torch.isfinite(hx.grad).all()
        assert torch.equal(hx.grad[1], torch.zeros(16))
        clean = hidden.clone()
        clean[1] = 0.0
        w64, h64 = weight.double().requires_grad_(), clean.double().requires_grad_()
        fn(h64.float(), w64.float()).backward()  # same function on the cleaned row
        torch.testing.assert_close(wx.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- 2. in-place backward

@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_is_caught_by_autograd_or_correct(backend):
    x, labels = _logits(6, 50, seed=10)

    def grad(inplace, order):
        xl = x.clone().requires_grad_()
        y = xl * 1.0  # non-leaf logits with a second consumer that saves them
        if order == "ours_first":
            loss = log_probs_from_logits(y, labels, inplace_backward=inplace, backend=backend).sum() + (y * y).sum()
        else:
            loss = (y * y).sum() + log_probs_from_logits(y, labels, inplace_backward=inplace, backend=backend).sum()
        loss.backward()
        return xl.grad

    # autograd runs the later consumer's backward first: (y * y) then ours -> correct gradients
    torch.testing.assert_close(grad(True, "ours_first"), grad(False, "ours_first"), atol=1e-6, rtol=1e-6)
    # ours runs first and overwrites y, which y * y still needs -> torch's own error, no wrong numbers
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        grad(True, "theirs_first")
    # retain_graph and a second backward over the overwritten logits
    y = x.clone().requires_grad_() * 1.0
    lp = log_probs_from_logits(y, labels, inplace_backward=True, backend=backend).sum()
    lp.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_refuses_overlapping_logits_before_writing(backend):
    row = torch.randn(1, 40, requires_grad=True)
    labels = torch.tensor([1, 2, 3])
    expanded = row.expand(3, 40)
    before = row.detach().clone()
    with pytest.raises(ValueError, match="inplace_backward=True: logits .* share memory"):
        logits_stats(expanded, labels, inplace_backward=True, backend=backend)
    assert torch.equal(row.detach(), before)
    # the same logits without in-place backward are fine (the gradient sums over the expansion)
    logits_stats(expanded, labels, backend=backend).log_probs.sum().backward()
    assert torch.isfinite(row.grad).all()


# ----------------------------------------------------------------------------- 3. double backward

def _with_row_input(head, args, x):
    """(hidden, weight, logits, labels) with the head's per-row input replaced by ``x``."""
    args = list(args)
    args[head.row_input] = x
    return args


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(HEADS))
def test_double_backward_raises_one_clear_error(name, backend):
    """Every head (tests/support/heads.py): the first derivative w.r.t. its per-row input (hidden or
    logits), taken with create_graph=True, is the one a plain backward gives; differentiating it
    again raises, naming the function."""
    head = HEADS[name]
    args = heads.inputs(seed=11)
    f = head.call(backend)
    g = torch.Generator().manual_seed(13)
    weights = [torch.randn(o.shape, generator=g) for o in f(*args)]

    def fn(x):
        return sum((o * w).sum() for o, w in zip(f(*_with_row_input(head, args, x)), weights))

    inp = args[head.row_input].detach()
    xg = inp.clone().requires_grad_()
    (g1,) = torch.autograd.grad(fn(xg), xg, create_graph=True)
    # the first derivative is the one a plain backward gives
    xc = inp.clone().requires_grad_()
    (g_ref,) = torch.autograd.grad(fn(xc), xc)
    torch.testing.assert_close(g1.detach(), g_ref, atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match=f"double backward is not supported by rl_kernels.{name}"):
        torch.autograd.grad((g1 * torch.randn_like(g1)).sum(), xg)


# ----------------------------------------------------------------------------- 5. -inf teacher

def _topk_reference(h64, w64, ids, t_lp, kind, renormalize, temperature):
    log_q = torch.log_softmax(h64 @ w64.T / temperature, -1).gather(1, ids)
    lp = t_lp.double()
    if renormalize:
        lp = torch.log_softmax(lp, -1)
    support = lp > -math.inf
    lp0 = torch.where(support, lp, 0.0)
    terms = lp0.exp() * (lp0 - log_q) if kind == "forward" else log_q.exp() * (log_q - lp0)
    return (torch.where(support, terms, 0.0).sum(-1) * temperature ** 2).sum()


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("kind", ["forward", "reverse"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_kl_minus_inf_teacher_slots_count_zero(backend, kind, renormalize):
    hidden, weight, _ = make_inputs(5, 16, 40, torch.float32, seed=15)
    g = torch.Generator().manual_seed(16)
    ids = torch.stack([torch.randperm(40, generator=g)[:4] for _ in range(5)])
    t_lp = torch.log_softmax(torch.randn(5, 4, generator=g), -1)
    t_lp[0, 1] = t_lp[3, 0] = t_lp[3, 3] = -math.inf  # filtered slots
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_topk_kl(hx, wx, ids, t_lp, kind=kind, renormalize_teacher=renormalize,
                          temperature=0.8, reduction="sum", backend=backend)
    loss.backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = _topk_reference(h64, w64, ids, t_lp, kind, renormalize, 0.8)
    ref.backward()
    assert torch.isfinite(ref)
    torch.testing.assert_close(loss.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hx.grad.double(), h64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wx.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "+inf"])
def test_topk_kl_rejects_nan_and_plus_inf_teacher_log_probs(bad):
    hidden, weight, _ = make_inputs(3, 8, 20, torch.float32, seed=17)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    t_lp = torch.full((3, 2), -0.7)
    t_lp[2, 1] = bad
    with pytest.raises(ValueError, match=r"teacher_log_probs: 1 entries are NaN or \+inf.*position 5"):
        linear_topk_kl(hidden, weight, ids, t_lp, backend="torch")


# ----------------------------------------------------------------------------- 6. edge values

def test_edge_values_get_clear_errors():
    h0, w0 = torch.randn(3, 0), torch.randn(10, 0)
    labels = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \(\.\.\., H\) with hidden size H >= 1"):
        linear_log_probs(h0, w0, labels, backend="torch")
    with pytest.raises(ValueError, match="hidden_states: .*hidden size H >= 1"):
        linear_topk_kl(h0, w0, torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1), backend="torch")
    with pytest.raises(ValueError, match="student_hidden: .*hidden size H >= 1"):
        linear_jsd(h0, w0, h0, w0, backend="torch")
    hidden, weight, _ = make_inputs(3, 8, 10, torch.float32)
    with pytest.raises(ValueError, match=r"ignore_index: 9223372036854775808 does not fit the labels' dtype torch.int64"):
        linear_log_probs(hidden, weight, labels, ignore_index=2 ** 63, backend="torch")
    with pytest.raises(ValueError, match=r"ignore_index: -2147483649 does not fit the labels' dtype torch.int32"):
        linear_log_probs(hidden, weight, labels.int(), ignore_index=-(2 ** 31) - 1, backend="torch")
    with pytest.raises(ValueError, match="ignore_index: .* does not fit"):
        log_probs_from_logits(torch.randn(3, 10), labels.int(), ignore_index=2 ** 31, backend="torch")
    for t in (1e-40, 1e39):
        with pytest.raises(ValueError, match=r"temperature: .* outside the usable range \[2.94e-39, 8.51e\+37\]"):
            linear_log_probs(hidden, weight, labels, temperature=t, backend="torch")
        with pytest.raises(ValueError, match="temperature: .* outside the usable range"):
            logits_stats(torch.randn(3, 10), labels, temperature=t, backend="torch")
    with pytest.raises(ValueError, match="temperature: expected a positive finite number"):
        linear_log_probs(hidden, weight, labels, temperature=10 ** 400, backend="torch")
    # a 1-D hidden with a fine dtype: the message says what is wrong (the shape)
    with pytest.raises(ValueError, match=r"hidden_states: expected shape \(\.\.\., H\) with at least one token dim"):
        linear_topk_kl(torch.randn(8), weight, torch.zeros(1, dtype=torch.long), torch.zeros(1), backend="torch")


def test_temperature_and_softcap_checks_use_exactly_temperature_range():
    """The checks compare with TEMPERATURE_RANGE written as literals (a module-level float would be a
    symbolic input under torch.compile(dynamic=True)): both edges are accepted, the next float
    outside each is refused, for the temperature and for the softcap (alone and over T)."""
    from rl_kernels.core.validation import TEMPERATURE_RANGE, check_softcap, check_temperature

    lo, hi = TEMPERATURE_RANGE
    assert (lo, hi) == (1.0 / torch.finfo(torch.float32).max, 1.0 / torch.finfo(torch.float32).tiny)
    for edge, outside in ((lo, math.nextafter(lo, 0.0)), (hi, math.nextafter(hi, math.inf))):
        assert check_temperature(edge) == edge and check_softcap(edge, 1.0) == edge
        with pytest.raises(ValueError, match="temperature: .* outside the usable range"):
            check_temperature(outside)
        with pytest.raises(ValueError, match="softcap: .* outside the usable range"):
            check_softcap(outside, 1.0)
    assert check_softcap(lo * 2.0, 2.0) == lo * 2.0  # softcap / T = lo: accepted
    with pytest.raises(ValueError, match="softcap: .* outside the usable range"):
        check_softcap(lo * 2.0, math.nextafter(2.0, 3.0))


def test_positional_temperature_says_it_is_keyword_only():
    """Issue 35: ``linear_log_probs(h, W, y, 0.7)`` got Python's bare "takes 3 positional arguments
    but 4 were given"; the message now names the function and spells the keyword
    (tests/api/test_public_api.py checks every public function)."""
    hidden, weight, labels = make_inputs(3, 8, 10, torch.float32)
    with pytest.raises(TypeError, match=r"linear_log_probs\(\) takes 3 positional arguments \(hidden_states, weight, "
                                        r"labels\) but 4 were given: temperature and every other argument after the "
                                        r"tensors is keyword-only .*write linear_log_probs\(hidden_states, weight, "
                                        r"labels, temperature=0.7\)"):
        linear_log_probs(hidden, weight, labels, 0.7)
    with pytest.raises(TypeError, match=r"log_probs_from_logits\(\) takes 2 positional arguments .* write "
                                        r"log_probs_from_logits\(logits, labels, temperature=0.7\)"):
        log_probs_from_logits(hidden @ weight.T, labels, 0.7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_usable_temperatures_match_float64(backend):
    hidden, weight, labels = make_inputs(3, 8, 10, torch.float32, seed=18, ignore_frac=0.0)
    # tiny T (logits ~1e30, still inside float32): a one-hot softmax
    out = linear_log_probs(hidden, weight, labels, temperature=1e-30, backend=backend)
    ref_lp, ref_ent = dense_linear_log_probs(hidden, weight, labels, temperature=1e-30)
    # (log p ~ -1e28 is a difference of two ~1e30 float32 numbers: a few ulps of 1e30)
    torch.testing.assert_close(out.log_probs.double(), ref_lp, atol=0, rtol=1e-4)
    torch.testing.assert_close(out.entropy.double(), ref_ent, atol=1e-6, rtol=0)
    # the largest usable T: 1 / T is the smallest normal float32, the softmax is uniform
    out = linear_log_probs(hidden, weight, labels, temperature=rl_kernels.core.validation.TEMPERATURE_RANGE[1],
                           backend=backend)
    torch.testing.assert_close(out.entropy, torch.full((3,), math.log(10)), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.log_probs, torch.full((3,), -math.log(10)), atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------- found by the audit

@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "all -inf"])
@pytest.mark.parametrize("backend,two_level", PATHS, ids=PATH_IDS)
def test_from_logits_ignored_non_finite_row_gets_exactly_zero_gradient(monkeypatch, backend, two_level, bad):
    _force(monkeypatch, two_level)
    x, labels = _logits(4, 300, seed=20)
    if bad == "all -inf":
        x[2] = float("-inf")
    else:
        x[2, 5] = bad
    labels[2] = -100
    for fn in (lambda z: log_probs_from_logits(z, labels, backend=backend).sum(),
               lambda z: logits_stats(z, labels, backend=backend).entropy.sum(),
               lambda z: cross_entropy(z, labels, label_smoothing=0.1, backend=backend)):
        xg = x.clone().requires_grad_()
        fn(xg).backward()
        assert torch.equal(xg.grad[2], torch.zeros(300)), xg.grad[2]
        assert torch.isfinite(xg.grad).all()
    # an lse gradient does reach an ignored row: then its (non-finite) gradient is honest
    xg = x.clone().requires_grad_()
    logits_stats(xg, labels, backend=backend).lse.sum().backward()
    assert not torch.isfinite(xg.grad[2]).all() and torch.isfinite(xg.grad[torch.arange(4) != 2]).all()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_jsd_nan_teacher_row_gives_nan_student_gradient(backend, beta):
    sh, sw, _ = make_inputs(4, 8, 16, torch.float32, seed=21)
    th, tw, _ = make_inputs(4, 6, 16, torch.float32, seed=22)
    th[0, 2] = float("nan")
    shx = sh.clone().requires_grad_()
    loss = linear_jsd(shx, sw, th, tw, beta=beta, reduction="none", backend=backend)
    loss.sum().backward()
    assert not torch.isfinite(loss[0]) and torch.isfinite(loss[1:]).all()
    assert not torch.isfinite(shx.grad[0]).all() and torch.isfinite(shx.grad[1:]).all()


def test_more_bad_inputs_name_the_argument():
    x = torch.randn(3, 10)
    with pytest.raises(TypeError, match="labels: expected a torch.Tensor of token ids, got None"):
        log_probs_from_logits(x, None)
    with pytest.raises(TypeError, match="labels: expected a torch.Tensor of class indices, got None"):
        cross_entropy(x, None)
    with pytest.raises(ValueError, match=r"weight: expected \(vocab_size >= 1"):
        linear_topk_kl(torch.randn(0, 8), torch.randn(0, 8), torch.zeros(0, 1, dtype=torch.long),
                       torch.zeros(0, 1), backend="torch")
    with pytest.raises(ValueError, match="logits: a meta tensor holds no data"):
        logits_stats(torch.empty(3, 10, device="meta"), backend="torch")
    with pytest.raises(ValueError, match="hidden_states: a meta tensor holds no data"):
        linear_log_probs(torch.empty(3, 8, device="meta"), torch.randn(10, 8), torch.zeros(3, dtype=torch.long))
    hidden, weight, _ = make_inputs(3, 8, 10, torch.float32)
    ids, t_lp = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.full((3, 2), -0.7)
    with pytest.raises(ValueError, match="mask: expected bool or 0/1 values, got other values .* 0.5"):
        linear_topk_kl(hidden, weight, ids, t_lp, mask=torch.tensor([1.0, 0.5, 0.0]), backend="torch")
    # the top-K functions of logits: ids named as their argument, values checked before any kernel
    logits = torch.randn(3, 5)  # the ids above go up to 5
    with pytest.raises(TypeError, match="token_ids: expected a torch.Tensor, got NoneType"):
        topk_log_probs_from_logits(logits, None)
    with pytest.raises(ValueError, match=r"token_ids: values must lie in \[0, vocab_size=5\); 1 do not"):
        topk_log_probs_from_logits(logits, ids, backend="torch")
    with pytest.raises(ValueError, match=r"teacher_token_ids: values must lie in \[0, vocab_size=5\); 1 do not, "
                                         r"first at flat position 5: 5 \(min 0, max 5\)"):
        topk_kl_from_logits(logits, ids, t_lp, backend="torch")
    with pytest.raises(ValueError, match="teacher_log_probs: a meta tensor holds no data"):
        topk_kl_from_logits(logits, ids % 5, t_lp.to("meta"), backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_accepts_non_overlapping_views(backend):
    g = torch.Generator().manual_seed(23)
    big = torch.randn(4, 80, generator=g)
    labels = torch.randint(0, 40, (4,), generator=g)
    for view in (lambda t: t[:, :40], lambda t: t[:, ::2]):
        ref_in = view(big.clone()).requires_grad_()
        log_probs_from_logits(ref_in * 1.0, labels, backend=backend).sum().backward()
        leaf = big.clone().requires_grad_()
        y = leaf * 1.0
        log_probs_from_logits(view(y), labels, inplace_backward=True, backend=backend).sum().backward()
        torch.testing.assert_close(view(leaf.grad), ref_in.grad, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_raises_a_bad_label_that_an_earlier_kernel_reported(name):
    """On the GPU a kernel reports a bad label after its call returned, by writing the call's id
    into the flag word; the next rl_kernels call raises it, whichever head that is (labels or not).
    Written here as a kernel writes it; the flag is cleared by the raise, so the call after runs."""
    from rl_kernels.core.label_flag import label_flag, label_word

    hidden, weight, logits, labels = heads.inputs()
    f = HEADS[name].call("torch")
    label_flag(torch.device("cpu"))
    label_word()[0] = 987654  # the id of no registered call: reported as "an earlier call"
    with pytest.raises(ValueError, match=r"labels: a value outside \[0, vocab_size"):
        f(hidden, weight, logits, labels)
    assert label_word()[0] == 0
    outs = f(hidden, weight, logits, labels)
    assert all(torch.isfinite(o[labels != heads.IGNORE] if o.dim() else o).all() for o in outs)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_head_backward_raises_a_bad_label_reported_after_its_forward(name):
    """The backward's body too: a bad label reported between a head's forward and its backward
    (on the GPU, a kernel of that forward or of another call) is raised by the backward, which
    then computes nothing; the flag is cleared by the raise."""
    from rl_kernels.core.label_flag import label_flag, label_word

    head = HEADS[name]
    args = heads.inputs()
    x = args[head.row_input].detach().clone().requires_grad_()
    outs = head.call("torch")(*_with_row_input(head, args, x))
    label_flag(torch.device("cpu"))
    label_word()[0] = 987654  # the id of no registered call: reported as "an earlier call"
    with pytest.raises(ValueError, match=r"labels: a value outside \[0, vocab_size"):
        sum(o.sum() for o in outs).backward()
    assert label_word()[0] == 0 and x.grad is None


# ----------------------------------------------------------------------------- messages (issue 52)

def test_a_positional_argument_of_linear_topk_is_read_as_its_required_k():
    """``linear_topk(h, W, 5)`` suggested ``temperature=5``; k is the argument the call lacks, so the
    message names it first (the rule of every function with a required keyword-only argument)."""
    hidden, weight, _ = make_inputs(3, 8, 10, torch.float32)
    with pytest.raises(TypeError) as info:
        rl_kernels.linear_topk(hidden, weight, 5)
    message = str(info.value)
    assert "k is required and keyword-only" in message and "write linear_topk(hidden_states, weight, k=5)" in message
    assert "temperature=5" not in message, message
    with pytest.raises(TypeError, match=r"write linear_topk\(hidden_states, weight, k=5, temperature=0.7\)"):
        rl_kernels.linear_topk(hidden, weight, 5, 0.7)


def _topk_kl(fn, ids, t_lp, **kw):
    hidden, weight, _ = make_inputs(3, 8, 10, torch.float32, seed=24)
    if fn == "linear_topk_kl":
        return linear_topk_kl(hidden, weight, ids, t_lp, backend="torch", **kw)
    return topk_kl_from_logits((hidden @ weight.T).detach(), ids, t_lp, backend="torch", **kw)


@pytest.mark.parametrize("fn", ["linear_topk_kl", "topk_kl_from_logits"])
def test_a_teacher_of_the_wrong_dtype_is_a_type_error_listing_the_dtypes(fn):
    """float64 teacher log-probs raised a ValueError saying "expected ... float, got ... float64"
    (so did integer log-probs and float ids): a dtype is a TypeError that lists the dtypes taken."""
    ids, t_lp = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.full((3, 2), -0.7)
    for bad_ids, bad_lp, match in (
            (ids, t_lp.double(), r"teacher_log_probs: expected bfloat16, float16 or float32, got .*torch.float64"),
            (ids, t_lp.long(), r"teacher_log_probs: expected bfloat16, float16 or float32, got .*torch.int64"),
            (ids.float(), t_lp, r"teacher_token_ids: expected int64 or int32 token ids, got .*torch.float32")):
        with pytest.raises(TypeError, match=match):
            _topk_kl(fn, bad_ids, bad_lp)
    with pytest.raises(ValueError, match=r"teacher_log_probs: expected shape \(3, 2\) \(as teacher_token_ids\)"):
        _topk_kl(fn, ids, t_lp[:, :1])  # (a shape stays a ValueError)
    assert torch.isfinite(_topk_kl(fn, ids, t_lp))


def _differentiable_call(name, leaf):
    """A call of a function with a differentiable result whose input ``name`` (not differentiated)
    is ``leaf``; the other inputs random, the student's requiring grad."""
    hidden, weight, labels = make_inputs(4, 8, 10, torch.float32, seed=25)
    hidden.requires_grad_()
    ids, t_lp, mask = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]), torch.full((4, 2), -0.7), torch.ones(4)
    if name == "temperature":
        return linear_log_probs(hidden, weight, labels, temperature=leaf, backend="torch").log_probs
    if name == "temperature of logits":
        return logits_stats(hidden @ weight.T, labels, temperature=leaf, backend="torch").lse
    if name == "teacher_log_probs":
        return linear_topk_kl(hidden, weight, ids, leaf, backend="torch")
    if name == "teacher_log_probs of logits":
        return topk_kl_from_logits(hidden @ weight.T, ids, leaf, backend="torch")
    if name == "mask":
        return linear_topk_kl(hidden, weight, ids, t_lp, mask=leaf, backend="torch")
    if name == "mask of linear_jsd":
        return linear_jsd(hidden, weight, hidden.detach() * 0.5, weight, mask=leaf, backend="torch")
    if name == "teacher_hidden":
        return linear_jsd(hidden, weight, leaf, weight, backend="torch")
    assert name == "teacher_weight"
    return linear_jsd(hidden, weight, hidden.detach() * 0.5, leaf, backend="torch")


NOT_DIFFERENTIATED = {"temperature": lambda: torch.rand(4) + 0.5, "temperature of logits": lambda: torch.rand(4) + 0.5,
                      "teacher_log_probs": lambda: torch.full((4, 2), -0.7),
                      "teacher_log_probs of logits": lambda: torch.full((4, 2), -0.7),
                      "mask": lambda: torch.ones(4), "mask of linear_jsd": lambda: torch.ones(4),
                      "teacher_hidden": lambda: torch.randn(4, 8), "teacher_weight": lambda: torch.randn(10, 8)}


@pytest.mark.parametrize("name", sorted(NOT_DIFFERENTIATED))
def test_an_input_that_gets_no_gradient_is_refused_when_it_requires_grad(name):
    """One rule for every tensor a differentiable function does not differentiate: one that requires
    grad (in grad mode) is refused, naming it, rather than silently detached (teacher_log_probs was
    taken where a per-row temperature was refused); under torch.no_grad nothing asks for a gradient."""
    argument = name.split(" ")[0]
    value = NOT_DIFFERENTIATED[name]()
    with pytest.raises(ValueError, match=rf"{argument}: requires grad, but no gradient flows to it \(.*\); pass "
                                         rf"{argument}\.detach\(\)"):
        _differentiable_call(name, value.clone().requires_grad_())
    out = _differentiable_call(name, value)  # the same value, detached: fine, and differentiable
    assert torch.isfinite(out).all() and out.requires_grad
    with torch.no_grad():
        assert torch.isfinite(_differentiable_call(name, value.clone().requires_grad_())).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_linear_topk_takes_inputs_that_require_grad(backend):
    """``linear_topk`` has no differentiable output (its log-probs and ids carry no gradient): inputs
    that require grad are not refused, since no gradient can go missing unnoticed, and none reaches
    them on either backend (a per-row temperature that required grad gave the torch backend's
    log-probs a gradient)."""
    hidden, weight, _ = make_inputs(4, 8, 10, torch.float32, seed=26)
    temperature = (torch.rand(4) + 0.5).requires_grad_()
    log_probs, ids = rl_kernels.linear_topk(hidden.requires_grad_(), weight.requires_grad_(), k=3,
                                            temperature=temperature, backend=backend)
    assert not log_probs.requires_grad and not ids.requires_grad and torch.isfinite(log_probs).all()


@pytest.mark.parametrize("name", ["linear_log_probs", "log_probs_from_logits"])
def test_a_bad_label_found_by_a_cpu_kernel_is_raised_by_that_call_saying_so(name):
    """On the CPU the Triton interpreter has run the kernel before the call returns: the call raises,
    and its message says so (it said "this error comes from the next rl_kernels call"). A bad label
    reported by an earlier call's kernel (as a GPU kernel reports it) still says so; the flag is
    cleared either way."""
    from rl_kernels.core.label_flag import label_flag, label_word

    hidden, weight, labels = make_inputs(3, 8, 10, torch.float32, seed=27)
    bad = labels.clone()
    bad[1] = 10

    def call(y):
        if name == "linear_log_probs":
            return linear_log_probs(hidden, weight, y, backend="triton").log_probs
        return log_probs_from_logits(hidden @ weight.T, y, backend="triton")
    with pytest.raises(ValueError) as info:
        call(bad)
    message = str(info.value)
    assert message.startswith(f"labels: a value outside [0, vocab_size=10) that is not ignore_index=-100 was passed "
                              f"to rl_kernels.{name}"), message
    assert "during this call" in message and "next rl_kernels call" not in message, message
    assert label_word()[0] == 0 and torch.isfinite(call(labels)).all()
    label_flag(torch.device("cpu"))
    label_word()[0] = 987654  # (an earlier call, as a GPU kernel writes it)
    with pytest.raises(ValueError, match="this error comes from the next rl_kernels call or backward"):
        call(labels)
    assert label_word()[0] == 0


def test_a_fraction_of_the_wrong_type_is_a_type_error():
    """``beta`` and ``label_smoothing``, numbers in [0, 1]: a str or a bool is a TypeError (it was a
    ValueError), a number outside [0, 1] a ValueError."""
    hidden, weight, labels = make_inputs(3, 8, 10, torch.float32, seed=28)
    for bad, error in (("0.5", TypeError), (True, TypeError), (1.5, ValueError), (math.nan, ValueError)):
        with pytest.raises(error, match=r"beta: expected a Python number in \[0, 1\], got"):
            linear_jsd(hidden, weight, hidden * 0.5, weight, beta=bad, backend="torch")
        with pytest.raises(error, match=r"label_smoothing: expected a Python number in \[0, 1\], got"):
            cross_entropy(hidden @ weight.T, labels, label_smoothing=bad, backend="torch")
