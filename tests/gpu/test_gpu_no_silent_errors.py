"""CUDA checks that nothing comes out silently wrong (``pytest -m gpu``): on the GPU a Triton max
ignores NaN and the fast exp/log differ from the interpreter, so the non-finite, ignored-row and
in-place classes of ``test_no_silent_errors.py`` are re-run here in bf16 at vocabulary sizes that
take both launch shapes of the from-logits kernels and several vocab splits of the linear head.
"""
import pytest
import torch

from rl_kernels import linear_log_probs, log_probs_from_logits, logits_stats
from rl_kernels.tools.reference import make_inputs, reference_linear_grads, reference_linear_log_probs, rel_err


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n,v", [(4096, 32000), (64, 152064)])  # one level; two-level (few rows)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_logits_row_on_the_gpu(n, v, bad):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(n, v, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    x[5, 1000] = bad
    labels[5] = 17
    xg = x.clone().requires_grad_()
    s = logits_stats(xg, labels, temperature=0.7, backend="triton")
    z = x.double() / 0.7
    log_p = torch.log_softmax(z, -1)
    ref = (log_p.gather(1, labels[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1), torch.logsumexp(z, -1))
    ok = torch.arange(n, device="cuda") != 5
    for got, want in zip((s.log_probs, s.entropy, s.lse), ref):
        assert not torch.isfinite(got[5]), got[5]
        assert (got[ok].double() - want[ok]).abs().max() < 5e-5
    (s.log_probs.sum() + s.entropy.sum()).backward()
    assert not torch.isfinite(xg.grad[5].float()).all()
    assert torch.isfinite(xg.grad[ok].float()).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_hidden_rows_on_the_gpu(bad):
    n, h, v = 512, 1024, 50257
    hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, seed=1, device="cuda", w_scale=0.02)
    labels[labels == -100] = 3
    hidden[7, 9] = bad          # labelled: non-finite outputs for row 7 only
    hidden[11, 2] = bad         # ignored: contributes nothing anywhere
    labels[11] = -100
    out = linear_log_probs(hidden, weight, labels, backend="triton")
    ok = (torch.arange(n, device="cuda") != 7)
    assert not torch.isfinite(out.log_probs[7]) and not torch.isfinite(out.entropy[7])
    assert out.log_probs[11] == 0 and out.entropy[11] == 0
    clean = hidden.clone()
    clean[7] = clean[11] = 0
    ref = reference_linear_log_probs(clean, weight, labels)
    assert (out.log_probs[ok].double() - ref.log_probs[ok]).abs().max() < 5e-5
    assert (out.entropy[ok].double() - ref.entropy[ok]).abs().max() < 5e-5
    # backward with row 7 ignored too: dW and dh finite and right
    labels[7] = -100
    g = torch.Generator(device="cuda").manual_seed(2)
    g_lp, g_ent = torch.randn(2, n, device="cuda", generator=g)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, backend="triton")
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    ref_dh, ref_dw = reference_linear_grads(clean, weight, labels, g_lp, g_ent)
    assert torch.isfinite(wx.grad).all() and torch.isfinite(hx.grad).all()
    assert torch.equal(hx.grad[7], torch.zeros_like(hx.grad[7]))
    assert rel_err(hx.grad, ref_dh) < 2.5e-3 and rel_err(wx.grad, ref_dw) < 2.5e-3


def test_inplace_backward_on_the_gpu():
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(256, 32000, device="cuda", generator=g).bfloat16()
    labels = torch.randint(0, 32000, (256,), device="cuda", generator=g)
    y = x.clone().requires_grad_() * 1.0
    loss = (y * y).float().sum() + log_probs_from_logits(y, labels, inplace_backward=True, backend="triton").sum()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with pytest.raises(ValueError, match="share memory"):
        log_probs_from_logits(x[:1].expand(4, 32000).requires_grad_(), labels[:4], inplace_backward=True)
    # alone, the in-place gradient equals the out-of-place one bit for bit
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    log_probs_from_logits(a * 1.0, labels, inplace_backward=True).sum().backward()
    log_probs_from_logits(b * 1.0, labels).sum().backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("fn", ["logits_stats", "log_probs_from_logits", "linear_log_probs"])
@pytest.mark.parametrize("n,v", [(4096, 32000), (64, 152064)])  # from-logits: one level; two levels
def test_bad_label_is_reported_without_a_host_sync(fn, n, v):
    """On CUDA the label range is checked inside the kernels: the call returns without a host sync,
    the bad row's log-prob and gradient are NaN (never finite and wrong), the other rows are right,
    and the ValueError naming ``labels`` and the call comes from the next rl_kernels call (here the
    backward). With RL_KERNELS_SYNC_LABEL_CHECK=1 the call itself raises."""
    import os

    from rl_kernels.core.label_check import SYNC_LABEL_CHECK_ENV

    g = torch.Generator(device="cuda").manual_seed(3)
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[9] = v + 5
    labels[10] = -100
    if fn == "linear_log_probs":
        hidden, weight, _ = make_inputs(n, 256, v, torch.bfloat16, seed=4, device="cuda", w_scale=0.05)
        inputs = (hidden.requires_grad_(), weight.requires_grad_())
        call = lambda lab: linear_log_probs(*inputs, lab, backend="triton").log_probs  # noqa: E731
        good = lambda: reference_linear_log_probs(hidden.detach(), weight.detach(), ok_labels).log_probs  # noqa: E731
    else:
        x = (3 * torch.randn(n, v, device="cuda", generator=g)).bfloat16()
        inputs = (x.clone().requires_grad_(),)
        fun = logits_stats if fn == "logits_stats" else log_probs_from_logits
        call = lambda lab: (lambda o: o.log_probs if fn == "logits_stats" else o)(fun(*inputs, lab, backend="triton"))  # noqa: E731
        good = lambda: torch.log_softmax(x.double(), -1).gather(1, ok_labels.clamp_min(0)[:, None])[:, 0]  # noqa: E731
    ok_labels = labels.clone()
    ok_labels[9] = 0
    log_probs = call(labels)
    torch.cuda.synchronize()
    assert torch.isnan(log_probs[9]) and log_probs[10] == 0
    rows = (torch.arange(n, device="cuda") != 9) & (torch.arange(n, device="cuda") != 10)
    assert (log_probs[rows].double() - good()[rows]).abs().max() < 5e-5
    with pytest.raises(ValueError, match=rf"labels: .*vocab_size={v}.*rl_kernels\.{fn}"):
        log_probs.sum().backward()
    # reported once; the gradient of that row, computed anyway, is NaN
    for t in inputs:
        t.grad = None
    log_probs = call(labels)
    torch.cuda.synchronize()
    from rl_kernels.core.label_check import raise_label_errors
    with pytest.raises(ValueError, match="labels"):
        raise_label_errors()
    log_probs.sum().backward()
    grad = inputs[0].grad
    assert torch.isnan(grad[9].float()).all()
    assert torch.isfinite(grad[rows].float()).all()
    raise_label_errors()  # nothing pending any more
    os.environ[SYNC_LABEL_CHECK_ENV] = "1"
    try:
        with pytest.raises(ValueError, match="labels"):
            call(labels)
    finally:
        del os.environ[SYNC_LABEL_CHECK_ENV]
