"""The tail-aware top-K KL (issue 45) on CUDA with the shipped kernel configurations (Triton on the
GPU, not the interpreter): fused and from logits, both kinds, against a float64 reference (values,
and gradients w.r.t. hidden states and weight, or logits)."""
import pytest
import torch

import rl_kernels

pytestmark = pytest.mark.gpu


def _reference(h, w, ids, t_lp, kind):
    """float64 per-token (K+1)-category KL; the tail's lse over the columns outside the ids."""
    z = h @ w.T
    lse = torch.logsumexp(z, -1)
    log_q = z.gather(1, ids) - lse[:, None]
    log_q_tail = torch.logsumexp(z.scatter(1, ids, float("-inf")), -1) - lse
    log_p = t_lp.double()
    p_tail = (1 - log_p.exp().sum(-1)).clamp(0, 1)
    if kind == "forward":
        return (log_p.exp() * (log_p - log_q)).sum(-1) + p_tail * (p_tail.log() - log_q_tail)
    return (log_q.exp() * (log_q - log_p)).sum(-1) + log_q_tail.exp() * (log_q_tail - p_tail.log())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["forward", "reverse"])
@pytest.mark.parametrize("path", ["fused", "from_logits"])
def test_tail_kl_on_cuda_against_float64(kind, path):
    g = torch.Generator().manual_seed(0)
    n, hdim, v, k = 257, 512, 50257, 64
    hidden = torch.randn(n, hdim, generator=g).cuda()
    weight = (torch.randn(v, hdim, generator=g) * 0.08).cuda()
    with torch.no_grad():  # a teacher near the student: its top K of noisy logits, log-softmaxed
        z = (hidden @ weight.T) + torch.randn(n, v, generator=g).cuda()
        top, ids = z.topk(k, -1)
        t_lp = top - torch.logsumexp(z, -1, keepdim=True)
    h64 = hidden.double().requires_grad_()
    w64 = weight.double().requires_grad_()
    ref = _reference(h64, w64, ids, t_lp, kind)
    ref.sum().backward()
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    if path == "fused":
        loss = rl_kernels.linear_topk_kl(hx, wx, ids, t_lp, kind=kind, tail=True, reduction="none")
    else:
        loss = rl_kernels.topk_kl_from_logits(hx @ wx.T, ids, t_lp, kind=kind, tail=True, reduction="none")
    loss.sum().backward()
    torch.testing.assert_close(loss.double(), ref.detach(), atol=2e-5, rtol=0)
    for got, want in ((hx.grad, h64.grad), (wx.grad, w64.grad)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 1e-4, err
