"""linear_jsd vs a float64 reference built from materialized logits (values and gradients).

Small odd shapes (13 tokens, student H 24, teacher H 40, V 203): the Triton backend runs in the
CPU interpreter with 256-column splits of 64-column tiles and backward windows of ~64 columns, so
V ends in a partial tile and several windows (and the recomputed tail) are exercised.
"""
import pytest
import torch

import rl_kernels.autograd.backward_schedule as rl_autograd
from rl_kernels import linear_jsd

from rl_kernels.tools.reference import reference_jsd
from tolerances import assert_close_f32, head_magnitude

N, HS, HT, V = 13, 24, 40, 203


def _bounds(hs, ws, ht, wt, temperature=1.0, reduction="none"):
    """float32 rounding bounds (tests/support/tolerances.py): a logit's dot product over the larger hidden size,
    1/T rounded and the product by it (2), each head's log-softmax row sum over V, the JSD's sum over V of the
    mixture's terms, T^2 rounded and the product by it (2), a reduction's sum over the N rows (+ 1 for its
    division); a student gradient then sums over the V columns (dh) or the N rows (dW) once more. The magnitude
    is the larger of the two heads' (times N for "sum")."""
    fwd = max(HS, HT) + 2 * V + 4 + (N + 1 if reduction != "none" else 0)
    m = max(head_magnitude(hs, ws, temperature), head_magnitude(ht, wt, temperature))
    return fwd, fwd + max(V, N), m * (N if reduction == "sum" else 1)


@pytest.fixture(autouse=True)
def small_windows(monkeypatch):
    monkeypatch.setattr(rl_autograd, "MIN_CHUNK_ELEMENTS", 64 * N)


def _inputs(seed=0, dtype=torch.float32, lead=(N,)):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(*lead, HS, generator=g).to(dtype)
    ws = (0.4 * torch.randn(V, HS, generator=g)).to(dtype)
    ht = torch.randn(*lead, HT, generator=g).to(dtype)
    wt = (0.4 * torch.randn(V, HT, generator=g)).to(dtype)
    labels = torch.randint(0, V, lead, generator=g)
    labels[torch.rand(lead, generator=g) < 0.3] = -100
    return hs, ws, ht, wt, labels


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("beta,temperature,reduction", [
    (0.5, 1.0, "mean"),
    (0.0, 0.7, "none"),     # forward KL
    (1.0, 1.3, "sum"),      # reverse KL
    (0.1, 2.0, "batchmean"),
    (0.9, 1.0, "none"),
])
def test_jsd_values_and_student_gradients(poison, backend, beta, temperature, reduction):
    hs, ws, ht, wt, labels = _inputs(seed=int(beta * 10))
    hsx, wsx = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    got = linear_jsd(hsx, wsx, ht, wt, beta=beta, temperature=temperature, labels=labels,
                     reduction=reduction, backend=backend)
    hs64, ws64 = hs.double().requires_grad_(), ws.double().requires_grad_()
    ref = reference_jsd(hs64, ws64, ht.double(), wt.double(), labels, beta, temperature, reduction)
    up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5)).double()
    (up * ref).sum().backward()
    (up.float() * got).sum().backward()
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert float(ref.detach().abs().max()) > 1e-3  # the heads differ: a zero loss would not test anything
    fwd, grad, m = _bounds(hs, ws, ht, wt, temperature, reduction)
    assert_close_f32(got, ref, depth=fwd, logits=m, msg="loss")
    assert_close_f32(hsx.grad, hs64.grad, depth=grad, logits=m, floor=0, msg="dh")
    assert_close_f32(wsx.grad, ws64.grad, depth=grad, logits=m, floor=0, msg="dw")
    assert torch.all(hsx.grad[labels == -100] == 0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_jsd_of_identical_heads_is_zero(backend):
    """p = q gives 0 for every beta, with zero student gradients (and a nonzero loss as soon as
    the teacher differs, so the check can fail)."""
    hs, ws, _, _, _ = _inputs(seed=3)
    for beta in (0.0, 0.3, 1.0):
        hsx = hs.clone().requires_grad_()
        got = linear_jsd(hsx, ws, hs, ws, beta=beta, reduction="none", backend=backend)
        got.sum().backward()
        assert got.abs().max() < 1e-6 and hsx.grad.abs().max() < 1e-6
        assert linear_jsd(hs, ws, hs, 1.1 * ws, beta=beta, reduction="none", backend=backend).min() > 1e-5


def test_jsd_3d_leading_shape_and_bf16_triton():
    hs, ws, ht, wt, labels = _inputs(seed=7, dtype=torch.bfloat16, lead=(3, 5))
    got = linear_jsd(hs, ws, ht, wt, beta=0.5, labels=labels, reduction="none", backend="triton")
    ref = reference_jsd(hs.double(), ws.double(), ht.double(), wt.double(), labels, 0.5, 1.0, "none")
    assert got.shape == (3, 5)
    fwd, _, m = _bounds(hs, ws, ht, wt)  # bfloat16 inputs, exact in the float64 reference; a float32 loss
    assert_close_f32(got, ref, depth=fwd, logits=m)


def test_jsd_bad_inputs_name_the_argument():
    hs, ws, ht, wt, labels = _inputs()
    with pytest.raises(ValueError, match="beta: expected"):
        linear_jsd(hs, ws, ht, wt, beta=1.5)
    with pytest.raises(ValueError, match="reduction: expected"):
        linear_jsd(hs, ws, ht, wt, reduction="avg")
    with pytest.raises(ValueError, match="teacher_weight: vocab_size"):
        linear_jsd(hs, ws, ht, wt[:-1])
    with pytest.raises(ValueError, match="teacher_hidden: expected leading shape"):
        linear_jsd(hs, ws, ht[:-1], wt)
    with pytest.raises(TypeError, match="teacher_hidden: dtype"):
        linear_jsd(hs, ws, ht.half(), wt.half())
    with pytest.raises(ValueError, match="student_weight: expected"):
        linear_jsd(hs, ws[:, :-1], ht, wt)
    with pytest.raises(ValueError, match="labels"):
        linear_jsd(hs, ws, ht, wt, labels=labels[:-1])
    with pytest.raises(RuntimeError, match="process_group: torch.distributed is not initialized"):
        linear_jsd(hs, ws, ht, wt, process_group=object())
    with pytest.raises(ValueError, match="vocab_start_index"):
        linear_jsd(hs, ws, ht, wt, reduce_hidden_grad=True)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_jsd_fused_k_loop_is_bitwise_equal_to_two_loops(monkeypatch, beta):
    """Equal hidden sizes: the one-K-loop variant (jsd_fused_k) gives the same bits as two
    logits_tile loops, forward and backward, and both match float64."""
    import dataclasses

    import rl_kernels.ops as ops

    g = torch.Generator().manual_seed(2)
    hs, ht = torch.randn(2, N, HS, generator=g)
    ws, wt = 0.4 * torch.randn(2, V, HS, generator=g)
    base = ops.default_config(hs.device)
    results = []
    for fused in (False, True):
        monkeypatch.setattr(ops, "default_config", lambda d, dtype=None, f=fused: dataclasses.replace(base, jsd_fused_k=f))
        hsx = hs.clone().requires_grad_()
        loss = linear_jsd(hsx, ws, ht, wt, beta=beta, reduction="none", backend="triton")
        loss.sum().backward()
        results.append((loss, hsx.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    ref = reference_jsd(hs.double(), ws.double(), ht.double(), wt.double(), torch.zeros(N, dtype=torch.long),
                     beta, 1.0, "none")
    fwd, _, m = _bounds(hs, ws, ht, wt)
    assert_close_f32(results[1][0], ref, depth=fwd, logits=m)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mask_selects_positions_like_labels(backend):
    """linear_jsd's mask excludes exactly what ignore_index labels exclude; with both, a position
    counts when both say so (values and student gradients vs float64)."""
    hs, ws, ht, wt, labels = _inputs(seed=21)
    g = torch.Generator().manual_seed(22)
    mask = torch.rand(N, generator=g) > 0.3
    both = (labels != -100) & mask
    by_labels = linear_jsd(hs, ws, ht, wt, labels=labels, reduction="none", backend=backend)
    by_mask = linear_jsd(hs, ws, ht, wt, mask=labels != -100, reduction="none", backend=backend)
    assert torch.equal(by_labels, by_mask)
    h64, w64 = hs.double().requires_grad_(), ws.double().requires_grad_()
    ref = reference_jsd(h64, w64, ht.double(), wt.double(), torch.where(both, labels, -100), 0.5, 1.0, "mean")
    ref.backward()
    hx, wx = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    got = linear_jsd(hx, wx, ht, wt, labels=labels, mask=mask, backend=backend)
    got.backward()
    fwd, grad, m = _bounds(hs, ws, ht, wt, 1.0, "mean")
    assert_close_f32(got, ref, depth=fwd, logits=m, msg="loss")
    assert_close_f32(hx.grad, h64.grad, depth=grad, logits=m, floor=0, msg="dh")
    assert_close_f32(wx.grad, w64.grad, depth=grad, logits=m, floor=0, msg="dw")
    assert torch.all(hx.grad[~both] == 0)
    with pytest.raises(ValueError, match="mask: expected a bool/0-1 tensor of shape"):
        linear_jsd(hs, ws, ht, wt, mask=mask[:3], backend=backend)
