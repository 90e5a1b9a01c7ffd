"""rl_kernels.log_probs_from_logits / entropy_from_logits (torch, chunked) vs float64.

Shapes: V = 301 (odd), 3 x 7 rows; CHUNK_ELEMENTS is patched to 4 rows' worth so that every
call crosses chunk boundaries, including a last partial chunk (21 = 5 * 4 + 1).
"""
import pytest
import torch

import rl_kernels.logits as logits_mod
from rl_kernels import entropy_from_logits, log_probs_from_logits

V = 301


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(logits_mod, "CHUNK_ELEMENTS", 4 * V)


def _reference(x, labels, temperature, ignore_index=-100):
    log_p = (x.double() / temperature).log_softmax(-1)
    valid = labels != ignore_index
    lp = log_p.gather(-1, torch.where(valid, labels, 0)[..., None])[..., 0]
    return torch.where(valid, lp, 0.0), -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_values_and_gradients(poison, dtype, atol):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 7, 2 * V, generator=g) * 4
    labels = torch.randint(0, V, (3, 7), generator=g)
    labels[0, 1] = labels[2, 6] = -100
    x = base[..., ::2].to(dtype).requires_grad_()  # strided rows: every other column
    g_lp, g_ent = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)

    lp = log_probs_from_logits(x, labels, temperature=0.7)
    ent = entropy_from_logits(x, temperature=0.7)
    (g_lp * lp + g_ent * ent).sum().backward()

    x64 = x.detach().double().requires_grad_()
    ref_lp, ref_ent = _reference(x64, labels, 0.7)
    (g_lp * ref_lp + g_ent * ref_ent).sum().backward()
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == labels.shape
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    assert torch.all(lp[labels == -100] == 0)
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=atol, rtol=0)


def test_extreme_logits_stay_finite():
    x = torch.full((2, V), -1e4)
    x[0, 5] = 50.0
    labels = torch.tensor([5, 7])
    lp = log_probs_from_logits(x, labels)
    ent = entropy_from_logits(x)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    assert lp[0].item() == pytest.approx(0.0, abs=1e-6) and lp[1].item() == pytest.approx(-5.7071, abs=1e-3)
    assert ent[1].item() == pytest.approx(torch.log(torch.tensor(float(V))).item(), abs=1e-4)


def test_bad_inputs_name_the_argument():
    x = torch.randn(4, V)
    with pytest.raises(TypeError, match="logits: expected bfloat16, float16 or float32"):
        log_probs_from_logits(x.double(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels: expected shape \(4,\)"):
        log_probs_from_logits(x, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="labels: 1 entries lie outside"):
        log_probs_from_logits(x, torch.tensor([0, 1, V, -100]))
    with pytest.raises(TypeError, match="labels: expected int64 or int32"):
        log_probs_from_logits(x, torch.zeros(4))
    with pytest.raises(ValueError, match="temperature: expected a positive finite number"):
        entropy_from_logits(x, temperature=0.0)
    with pytest.raises(ValueError, match="logits: expected shape"):
        entropy_from_logits(torch.randn(4, 0))
