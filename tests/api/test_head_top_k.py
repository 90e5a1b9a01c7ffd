"""The student's top K from the head's own forward pass (issue 54 item 2): ``linear_log_probs_at_ids``
with ``top_k`` on both backends (Triton in the CPU interpreter), against a float64 reference (the
logits' stable descending sort, ties to the smaller id) and against ``linear_topk``.

The Triton cases run with small tiles (``SMALL_TOPK`` of tests/api/conftest.py: 16-row blocks, 32-column tiles, head splits of 64
columns), so V = 203 is 7 tiles in 4 splits, walked by 1 to 4 top-K runs (``topk_splits`` patched:
a run covers whole splits and stores each split's partials as a program per split would). Checked:
the ids equal float64's and linear_topk's, the log-probs within float32 rounding, every other
output and both gradients bitwise those of the call without ``top_k`` (the selection changes no bit
of the head), the tail variant beside it, exact ties from small-integer inputs, a NaN row (its
slots empty, other rows untouched), the poison fixture, empty inputs, and bad ``top_k`` values.
"""
import pytest
import torch

import rl_kernels.ops.linear as linear_ops
from rl_kernels import linear_topk
from rl_kernels.distill import linear_log_probs_at_ids
from rl_kernels.ops.config import forced_config
from tolerances import assert_close_f32, head_magnitude

BACKENDS = ["torch", "triton"]
pytestmark = pytest.mark.usefixtures("small_topk_tiles")  # (tests/api/conftest.py)


def _runs(monkeypatch, n):
    monkeypatch.setattr(linear_ops, "topk_splits", lambda row_blocks, n_chunks, device: n)


def _inputs(n, h, v, seed=0, integers=False):
    g = torch.Generator().manual_seed(seed)
    if integers:  # exact float32 logits with many ties
        hidden = torch.randint(-2, 3, (n, h), generator=g).float()
        weight = torch.randint(-1, 2, (v, h), generator=g).float()
    else:
        hidden = torch.randn(n, h, generator=g)
        weight = torch.randn(v, h, generator=g) * 2 / h ** 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1] = -100
    ids = torch.stack([torch.randperm(v, generator=g)[:3] for _ in range(n)])
    return hidden, weight, labels, ids


def _reference(hidden, weight, k, temperature):
    z = hidden.double() @ weight.double().T
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.double()[:, None]
    z = z / temperature
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.log_softmax(z, -1).gather(-1, order), order


def _grads(hidden, weight, labels, ids, backend, temperature, **kw):
    """The outputs and (dh, dW) of a loss over log-probs, entropy and the log-probs at ``ids``."""
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs_at_ids(hx, wx, labels, ids, temperature=temperature, return_entropy=True,
                                  backend=backend, **kw)
    g = torch.Generator().manual_seed(9)
    (out[0] * torch.randn(out[0].shape, generator=g) + out[1] * torch.randn(out[1].shape, generator=g)
     + (out[2] * torch.randn(out[2].shape, generator=g)).sum(-1)).sum().backward()
    return out, hx.grad, wx.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("runs", [1, 3])
@pytest.mark.parametrize("k,temperature", [(1, 1.0), (5, 0.7), (9, "per row")])
def test_top_k_ids_and_log_probs_change_no_bit_of_the_head(backend, runs, k, temperature, monkeypatch, poison):
    _runs(monkeypatch, runs)
    hidden, weight, labels, ids = _inputs(37, 24, 203, seed=k)
    if temperature == "per row":
        temperature = torch.rand(37, generator=torch.Generator().manual_seed(1)) * 1.5 + 0.4
    plain, dh, dw = _grads(hidden, weight, labels, ids, backend, temperature)
    out, dh_k, dw_k = _grads(hidden, weight, labels, ids, backend, temperature, top_k=k)
    for a, b in zip(plain, out[:3]):
        assert torch.equal(a, b)
    assert torch.equal(dh, dh_k) and torch.equal(dw, dw_k)
    top_lp, top_ids = out[3:]
    assert top_lp.shape == top_ids.shape == (37, k) and top_ids.dtype == torch.int64
    assert not top_lp.requires_grad and not top_ids.requires_grad
    ref_lp, ref_ids = _reference(hidden, weight, k, temperature)
    assert torch.equal(top_ids, ref_ids), (top_ids != ref_ids).nonzero()[:5]
    assert torch.equal(top_ids, linear_topk(hidden, weight, k=k, temperature=temperature, backend=backend)[1])
    # a logit's dot over H, 1 / T and its product, the base-2 scale and back (Triton), the row's sum over V
    assert_close_f32(top_lp, ref_lp, depth=24 + 203 + 4, logits=head_magnitude(hidden, weight, temperature))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_go_to_the_smaller_id(backend, monkeypatch):
    _runs(monkeypatch, 2)
    hidden, weight, labels, ids = _inputs(11, 16, 203, seed=3, integers=True)
    z = hidden @ weight.T
    kth = z.sort(-1, descending=True).values[:, 6:8]
    assert (kth[:, 0] == kth[:, 1]).any()  # (a tie at the 7th place in some row)
    *_, top_ids = linear_log_probs_at_ids(hidden, weight, labels, ids, backend=backend, top_k=7)
    assert torch.equal(top_ids, _reference(hidden, weight, 7, 1.0)[1])


def test_with_the_tail_on_the_triton_kernels(monkeypatch):
    """The TAIL and TOPK variants together: the tail's bits those of the call without top_k."""
    _runs(monkeypatch, 2)
    hidden, weight, labels, ids = _inputs(21, 24, 203, seed=5)
    plain = linear_log_probs_at_ids(hidden, weight, labels, ids, temperature=0.9, backend="triton", return_tail=True)
    out = linear_log_probs_at_ids(hidden, weight, labels, ids, temperature=0.9, backend="triton", return_tail=True,
                                  top_k=4)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(plain, out[:4]))
    assert torch.equal(out[-1], _reference(hidden, weight, 4, 0.9)[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_row_only_that_row_and_empty_input(backend, poison):
    hidden, weight, labels, ids = _inputs(9, 16, 203, seed=6)
    hidden[4, 3] = float("nan")
    *_, top_lp, top_ids = linear_log_probs_at_ids(hidden, weight, labels, ids, backend=backend, top_k=3)
    assert torch.all(top_ids[4] == -1) and torch.isnan(top_lp[4]).all()
    keep = torch.arange(9) != 4
    assert torch.equal(top_ids[keep], _reference(hidden[keep], weight, 3, 1.0)[1])
    assert torch.isfinite(top_lp[keep]).all()
    *_, top_lp, top_ids = linear_log_probs_at_ids(hidden[:0], weight, labels[:0], ids[:0], backend=backend, top_k=3)
    assert top_lp.shape == top_ids.shape == (0, 3)


@pytest.mark.parametrize("bad,error,text", [(-1, ValueError, "got -1"), (129, ValueError, "got 129"),
                                            (1.5, TypeError, "got float"), (True, TypeError, "got bool")])
def test_bad_top_k_names_it(bad, error, text):
    hidden, weight, labels, ids = _inputs(3, 8, 203)
    with pytest.raises(error, match=rf"top_k: expected an int in \[0, min\(128, vocab_size\)\].*{text}"):
        linear_log_probs_at_ids(hidden, weight, labels, ids, backend="torch", top_k=bad)
    with pytest.raises(ValueError, match=r"top_k: .*= \[0, 7\], got 8"):
        linear_log_probs_at_ids(hidden, weight[:7], labels.clamp(max=6), ids.clamp(max=6), backend="torch", top_k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_head_top_k_is_linear_topks_and_changes_no_bit(dtype):
    """CUDA, default tiles: an odd shape (several runs of splits, a partial last tile), K = 64 and 128
    (the tail beside K = 64): every other output and both gradients bitwise those of the call without
    top_k; the ids those of linear_topk except at near-ties (two logits closer than the float32 rounding
    of their sums: both orders are right, checked by value against float64); the log-probs within float32
    rounding of linear_topk's (the head's lse and the base-2 scale: a few units of 1e-6)."""
    with forced_config(None):
        n, h, v = 1031, 512, 50257
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(n, h, generator=g).to("cuda", dtype)
        weight = (torch.randn(v, h, generator=g) * 2 / h ** 0.5).to("cuda", dtype)
        labels = torch.randint(0, v, (n,), generator=g).cuda()
        ids = torch.stack([torch.randperm(v, generator=g)[:8] for _ in range(n)]).cuda()
        for k, temperature, tail in ((64, 1.0, True), (128, 0.7, False)):
            def call(**kw):
                hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
                out = linear_log_probs_at_ids(hx, wx, labels, ids, temperature=temperature, backend="triton",
                                              return_tail=tail, **kw)
                (out[0].sum() + out[2].sum() + (out[3].sum() if tail else 0)).backward()
                return out, hx.grad, wx.grad
            plain, dh, dw = call()
            out, dh_k, dw_k = call(top_k=k)
            assert all(a is b is None or torch.equal(a, b) for a, b in zip(plain, out[:-2]))
            assert torch.equal(dh, dh_k) and torch.equal(dw, dw_k)
            top_lp, top_ids = out[-2:]
            lp, topk_ids = linear_topk(hidden, weight, k=k, temperature=temperature, backend="triton")
            assert (top_ids != topk_ids).float().mean() < 1e-3
            z = (hidden.double() @ weight.double().T) / temperature
            torch.testing.assert_close(z.gather(1, top_ids), z.gather(1, topk_ids), atol=2e-5, rtol=0)
            torch.testing.assert_close(top_lp, lp, atol=2e-5, rtol=0)
