"""Sum of squared probabilities (sum_j p_j^2) from the fused head and from logits, both backends
and both from-logits launch shapes, against float64: values and gradients, temperature, ignored
rows (0 and no gradient), and the 1-level / 2-level paths bitwise equal."""
import pytest
import torch

from rl_kernels import linear_log_probs, logits_stats, sum_pi_squared_from_logits
from rl_kernels.ops import logits as kernels

from rl_kernels.tools.reference import make_inputs
from tolerances import assert_close_f32, head_magnitude, logits_magnitude

PATHS = [("torch", None), ("triton", False), ("triton", True)]
PATH_IDS = ["torch", "triton-1level", "triton-2level"]
# float32 rounding bounds (tests/support/tolerances.py): 1/T rounded to float32 and the product by it (2), a
# logit's dot product over H (from a head), the row's sums over its V columns; a gradient is then combined from
# p and the row statistics over the V columns once more (dh), or summed over the N rows (dW)


def fwd(v, h=0):
    """sum_j p_j^2 is a sum of positive terms: its error is relative (floor 0), each p_j's twice over (the
    square), plus the sum's own over the V columns."""
    return 2 * (h + v + 2) + v


def grad(v, h=0, n=0):
    return h + v + max(v, n) + 2


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
    m, v = logits_magnitude(x, 0.7), x.shape[1]
    assert_close_f32(s.sum_pi_squared, ref, depth=fwd(v), logits=m, floor=0, msg="sum p^2")
    assert s.sum_pi_squared[3] == 0 and torch.equal(xg.grad[3], torch.zeros(2100))
    assert_close_f32(xg.grad, z.grad, depth=grad(v), logits=m, floor=0, msg="dx")
    # the single-purpose function: every row (no labels)
    xg2 = x.clone().requires_grad_()
    sq = sum_pi_squared_from_logits(xg2, temperature=0.7, backend=backend)
    (sq * up).sum().backward()
    z2 = x.double().requires_grad_()
    ref2 = _reference(z2, None, 0.7)
    (ref2 * up.double()).sum().backward()
    assert_close_f32(sq, ref2, depth=fwd(v), logits=m, floor=0, msg="sum p^2, no labels")
    assert_close_f32(xg2.grad, z2.grad, depth=grad(v), logits=m, floor=0, msg="dx, no labels")


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
    (n, h), v = hidden.shape, weight.shape[0]
    m = head_magnitude(hidden, weight, 0.8)
    assert_close_f32(out.sum_pi_squared, ref, depth=fwd(v, h), logits=m, floor=0, msg="sum p^2")
    assert_close_f32(hx.grad, h64.grad, depth=grad(v, h), logits=m, floor=0, msg="dh")
    assert_close_f32(wx.grad, w64.grad, depth=grad(v, h, n), logits=m, floor=0, msg="dw")
    # not asked: None, and the other outputs are unchanged bit for bit
    plain = linear_log_probs(hidden, weight, labels, temperature=0.8, backend=backend)
    assert plain.sum_pi_squared is None
    assert torch.equal(plain.log_probs, out.log_probs.detach())
    assert torch.equal(plain.entropy, out.entropy.detach())
