"""Sum of squared probabilities (sum_j p_j^2) from the fused head and from logits, both backends
and both from-logits launch shapes, against float64: values and gradients, temperature, ignored
rows (0 and no gradient), and the 1-level / 2-level paths bitwise equal."""
import pytest
import torch

from rl_kernels import linear_log_probs, logits_stats, sum_pi_squared_from_logits
from rl_kernels.ops import logits as kernels

from rl_kernels.reference import make_inputs

PATHS = [("torch", None), ("triton", False), ("triton", True)]
PATH_IDS = ["torch", "triton-1level", "triton-2level"]
TOL = dict(atol=2e-6, rtol=1e-5)


def _force(monkeypatch, two_level):
    if two_level is not None:
        monkeypatch.setattr(kernels, "use_two_level", lambda *a: two_level)


def _reference(z64, labels, temperature):
    p = torch.softmax(z64 / temperature, -1)
    sq = (p * p).sum(-1)
    return sq if labels is None else torch.where(labels != -100, sq, 0.0)


@pytest.mark.parametrize("backend,two_level", PATHS, ids=PATH_IDS)
def test_from_logits_values_and_gradients(poison, monkeypatch, backend, two_level):
    _force(monkeypatch, two_level)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 2100, generator=g) * 3  # > one split of the 2-level path
    x[1, 5] = 25.0  # a peaked row (sum p^2 near 1)
    labels = torch.randint(0, 2100, (6,), generator=g)
    labels[3] = -100
    up = torch.randn(6, generator=g)
    xg = x.clone().requires_grad_()
    s = logits_stats(xg, labels, temperature=0.7, return_sum_pi_squared=True, backend=backend)
    (s.sum_pi_squared * up).sum().backward()
    z = x.double().requires_grad_()
    ref = _reference(z, labels, 0.7)
    (ref * up.double()).sum().backward()
    torch.testing.assert_close(s.sum_pi_squared.double(), ref.detach(), **TOL)
    assert s.sum_pi_squared[3] == 0 and torch.equal(xg.grad[3], torch.zeros(2100))
    torch.testing.assert_close(xg.grad.double(), z.grad, **TOL)
    # the single-purpose function: every row (no labels)
    xg2 = x.clone().requires_grad_()
    sq = sum_pi_squared_from_logits(xg2, temperature=0.7, backend=backend)
    (sq * up).sum().backward()
    z2 = x.double().requires_grad_()
    ref2 = _reference(z2, None, 0.7)
    (ref2 * up.double()).sum().backward()
    torch.testing.assert_close(sq.double(), ref2.detach(), **TOL)
    torch.testing.assert_close(xg2.grad.double(), z2.grad, **TOL)


def test_from_logits_launch_shapes_bitwise_equal(monkeypatch):
    x = torch.randn(3, 5000) * 2
    outs = []
    for two_level in (False, True):
        _force(monkeypatch, two_level)
        outs.append(sum_pi_squared_from_logits(x, backend="triton"))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_linear_head_values_and_gradients(poison, backend):
    hidden, weight, labels = make_inputs(7, 16, 1100, torch.float32, seed=3, w_scale=0.6)
    g = torch.Generator().manual_seed(4)
    up_sq, up_ent = torch.randn(2, 7, generator=g)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=0.8, return_sum_pi_squared=True, backend=backend)
    (out.sum_pi_squared * up_sq + out.entropy * up_ent).sum().backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = h64 @ w64.T
    ref = _reference(z, labels, 0.8)
    log_p = torch.log_softmax(z / 0.8, -1)
    ent = torch.where(labels != -100, -(log_p.exp() * log_p).sum(-1), 0.0)
    (ref * up_sq.double() + ent * up_ent.double()).sum().backward()
    torch.testing.assert_close(out.sum_pi_squared.double(), ref.detach(), **TOL)
    torch.testing.assert_close(hx.grad.double(), h64.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wx.grad.double(), w64.grad, atol=1e-5, rtol=1e-5)
    # not asked: None, and the other outputs are unchanged bit for bit
    plain = linear_log_probs(hidden, weight, labels, temperature=0.8, backend=backend)
    assert plain.sum_pi_squared is None
    assert torch.equal(plain.log_probs, out.log_probs.detach())
    assert torch.equal(plain.entropy, out.entropy.detach())
