"""linear_log_probs on CPU: Triton kernels in the interpreter and the torch backend, both against
a float64 reference.

Shapes: the interpreter costs ~0.3 s a launch, so shapes are small and odd. N=33 and V=257 are
one more than a multiple of every tile the interpreter config uses (block_m 32, block_n 64,
split_v 256, block_k 32), so each kernel sees a one-element tail in every dimension; (37, 72,
1007) is an odd shape (H not a multiple of block_k, 4 vocab splits, 3 row blocks).
Tolerances: values are fp32-accumulated from the same (fp32/fp16) inputs as the reference, so
max |error| <= 2e-5 nats; gradients are rounded once to the input dtype: relative Frobenius error
<= 2e-5 (fp32) and 1e-3 (fp16, unit roundoff 4.9e-4).
"""
import functools
import logging
import re

import pytest
import torch

import rl_kernels.autograd.backward_schedule as rl_autograd
from rl_kernels import linear_log_probs
from rl_kernels.core.backends import interpreting
from rl_kernels.ops.launch import quiet_interpreter
from rl_kernels.tools.reference import dense_linear_log_probs, make_inputs, reference_linear_grads, rel_err
from tolerances import assert_close_f32, head_magnitude

BACKENDS = ["triton", "torch"]
VALUE_ATOL = 2e-5
GRAD_RTOL = {torch.float32: 2e-5, torch.float16: 1e-3}
SHAPES = [(33, 65, 257, 0.7), (37, 72, 1007, 1.0)]
# the Triton tests skipped outside the interpreter; ``small_chunks`` (the backward in ~3 windows):
# both fixtures in tests/api/conftest.py
pytestmark = pytest.mark.usefixtures("_needs_interpreter")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,h,v,temperature", SHAPES)
def test_values_and_gradients_match_float64(backend, dtype, n, h, v, temperature, poison,
                                            small_chunks):
    hidden, weight, labels = make_inputs(n, h, v, dtype, seed=n + v)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)

    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp_ref, ent_ref = dense_linear_log_probs(hr, wr, labels, temperature)
    (lp_ref * g_lp.double() + ent_ref * g_ent.double()).sum().backward()

    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=temperature, backend=backend)
    assert out.log_probs.dtype == torch.float32 and out.entropy.dtype == torch.float32
    assert out.log_probs.shape == labels.shape
    assert (out.log_probs.double() - lp_ref).abs().max().item() <= VALUE_ATOL
    assert (out.entropy.double() - ent_ref).abs().max().item() <= VALUE_ATOL
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    assert hx.grad.dtype == dtype and wx.grad.dtype == dtype
    assert rel_err(hx.grad, hr.grad) <= GRAD_RTOL[dtype]
    assert rel_err(wx.grad, wr.grad) <= GRAD_RTOL[dtype]
    ignored = labels == -100
    assert ignored.any() and (out.log_probs[ignored] == 0).all() and (out.entropy[ignored] == 0).all()
    assert (hx.grad[ignored] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,h,v,dtype,schedule,spare", [
    (37, 16, 1007, torch.float32, "one recompute", 0.25),    # float32: the accumulator is dh itself
    (40, 16, 60, torch.float16, "one recompute", 0.25),      # half in dh, half in dW's last N rows (N > V/2)
    (40, 64, 2000, torch.float16, "one recompute", 0.0),     # windows placed in dW's unwritten rows
    (40, 64, 2000, torch.float16, "one recompute", 0.25),    # the same with the half in its own storage
    (40, 16, 41, torch.float16, "two passes", 0.25)],
    ids=["fp32", "fp16", "fp16-wide", "fp16-wide-spare", "fp16-fallback"])
def test_backward_schedules(backend, n, h, v, dtype, schedule, spare, poison, small_chunks, monkeypatch):
    """Both gradients: one recompute with the float32 dh accumulator in dh's own storage and (for
    16-bit dh) either its own storage (when that costs at most SPARE_ACCUMULATOR_FRACTION of the
    gradients: 2% in "fp16-wide-spare", 40% in "fp16") or dW's tail storage (those vocab rows
    recomputed afterwards), or two passes when it does not fit (N > V - 2 for 16-bit weights).
    All against float64; poison makes an unwritten dW row show as NaN. In "fp16-wide" the Triton
    backend's 16-bit windows go into the bytes of dW rows not written yet (wider than the fixed
    buffer): a window that overlapped a written dW row or the accumulator would corrupt it. The
    number of dlogits windows shows whether vocab rows were recomputed twice."""
    calls, placed, windows = [], [], []
    monkeypatch.setattr(rl_autograd, "SPARE_ACCUMULATOR_FRACTION", spare)
    one = rl_autograd._one_recompute

    def counted(dlogits, *a):
        def count(rows, cols, out):
            windows.append(cols.stop - cols.start)
            return dlogits(rows, cols, out)
        return one(count, *a)
    monkeypatch.setattr(rl_autograd, "_one_recompute", lambda *a: calls.append(counted(*a)) or calls[-1])
    mm_into = rl_autograd._mm_into

    def spy(out, a, b, *form):  # dW chunks written from a window that lies inside dW's own storage
        placed.append(a.untyped_storage().data_ptr() == out.untyped_storage().data_ptr())
        mm_into(out, a, b, *form)
    monkeypatch.setattr(rl_autograd, "_mm_into", spy)
    hidden, weight, labels = make_inputs(n, h, v, dtype, seed=n + v)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp_ref, ent_ref = dense_linear_log_probs(hr, wr, labels, 0.9)
    (lp_ref * g_lp.double() + ent_ref * g_ent.double()).sum().backward()
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=0.9, backend=backend)
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    runs = schedule == "one recompute"
    assert len(calls) == 1 and (calls[0] is not None) == runs
    if runs and dtype == torch.float16:  # recomputed columns: V with spare storage, V + ~N without
        assert (sum(windows) == v) == (spare > 0 and n / (n + v) <= spare), (sum(windows), v)
    if h == 64:  # the triton backend's windows are 16-bit like dW (the torch backend's are float32)
        assert any(placed) == (backend == "triton"), placed
    if schedule == "two passes":  # the fallback is logged (once per process)
        from rl_kernels.core import _logging
        assert any("does not fit" in m or "cannot add" in m for m in _logging._seen)
    assert rel_err(hx.grad, hr.grad) <= GRAD_RTOL[dtype]
    assert rel_err(wx.grad, wr.grad) <= GRAD_RTOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["expanded_sum", "log_probs_only", "entropy_only", "no_entropy"])
def test_gradient_modes(backend, mode, poison):
    """Upstream gradients that are expanded (stride 0), or only one output used."""
    n, h, v, t = 33, 65, 257, 1.3
    hidden, weight, labels = make_inputs(n, h, v, torch.float32, seed=7)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp_ref, ent_ref = dense_linear_log_probs(hr, wr, labels, t)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=t, backend=backend,
                           return_entropy=mode != "no_entropy")
    if mode == "expanded_sum":
        loss, loss_ref = out.log_probs.sum() + out.entropy.sum(), lp_ref.sum() + ent_ref.sum()
    elif mode == "entropy_only":
        loss, loss_ref = out.entropy.mean(), ent_ref.mean()
    else:
        loss, loss_ref = -out.log_probs.sum(), -lp_ref.sum()
    if mode == "no_entropy":
        assert out.entropy is None
    loss.backward()
    loss_ref.backward()
    assert rel_err(hx.grad, hr.grad) <= 2e-5
    assert rel_err(wx.grad, wr.grad) <= 2e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_3d_hidden_and_frozen_weight(backend, poison):
    """(B, T, H) hidden that is a non-contiguous view (verl #6913: its gradient must arrive) and a
    weight that does not require grad (only the dh pass runs)."""
    b, t, h, v = 3, 11, 40, 300
    base, weight, _ = make_inputs(b * t * 2, h, v, torch.float32, seed=3)
    hidden = base.view(b, 2 * t, h)[:, ::2].transpose(0, 1).contiguous().transpose(0, 1)
    hidden = hidden.detach().requires_grad_()
    assert not hidden.is_contiguous()
    labels = torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(0))
    out = linear_log_probs(hidden, weight, labels, backend=backend)
    lp_ref, ent_ref = dense_linear_log_probs(hidden.detach(), weight, labels)
    assert out.log_probs.shape == (b, t)
    assert (out.log_probs.double() - lp_ref).abs().max() <= VALUE_ATOL
    assert (out.entropy.double() - ent_ref).abs().max() <= VALUE_ATOL
    out.log_probs.sum().backward()
    hr = hidden.detach().double().requires_grad_()
    dense_linear_log_probs(hr, weight, labels)[0].sum().backward()
    assert hidden.grad is not None and rel_err(hidden.grad, hr.grad) <= 2e-5
    assert weight.grad is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_run_to_run_bitwise_identical(backend):
    hidden, weight, labels = make_inputs(37, 72, 1007, torch.float32, seed=11)
    results = []
    for _ in range(2):
        hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = linear_log_probs(hx, wx, labels, temperature=0.9, backend=backend)
        (out.log_probs.sum() + 0.5 * out.entropy.sum()).backward()
        results.append((out.log_probs, out.entropy, hx.grad, wx.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_batch_invariance_triton():
    """A row's outputs are the same bits alone, in a small batch, and in a larger one.

    On CPU the slices start at a multiple of the interpreter's block_m (32): numpy's matmul,
    which runs the interpreter's tl.dot, rounds a row differently at another position inside a
    block (BLAS edge kernels), which says nothing about the GPU. What is tested here is that
    neither the batch size nor the number of row blocks changes a row's reduction tree; the GPU
    test checks arbitrary offsets."""
    if not interpreting() and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter")
    hidden, weight, labels = make_inputs(70, 48, 700, torch.float32, seed=5)
    full = linear_log_probs(hidden, weight, labels, backend="triton")
    for rows in (slice(32, 33), slice(32, 39), slice(64, 70)):
        part = linear_log_probs(hidden[rows], weight, labels[rows], backend="triton")
        assert torch.equal(part.log_probs, full.log_probs[rows])
        assert torch.equal(part.entropy, full.entropy[rows])


def test_torch_backend_batch_consistency():
    """The torch backend is not bitwise batch invariant (the CPU / cuBLAS matmul chooses its
    kernel by the number of rows); it stays within fp32 rounding across batch sizes."""
    hidden, weight, labels = make_inputs(70, 48, 700, torch.float32, seed=5)
    full = linear_log_probs(hidden, weight, labels, backend="torch")
    part = linear_log_probs(hidden[40:41], weight, labels[40:41], backend="torch")
    assert (part.log_probs - full.log_probs[40:41]).abs().max() <= 1e-5
    assert (part.entropy - full.entropy[40:41]).abs().max() <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_row_does_not_corrupt_others(backend):
    hidden, weight, labels = make_inputs(33, 40, 257, torch.float32, seed=9, ignore_frac=0.0)
    clean = linear_log_probs(hidden, weight, labels, backend=backend)
    bad = hidden.clone()
    bad[4, 7] = float("nan")
    bad[20, 3] = float("inf")
    out = linear_log_probs(bad, weight, labels, backend=backend)
    others = torch.ones(33, dtype=torch.bool)
    others[[4, 20]] = False
    assert not torch.isfinite(out.log_probs[[4, 20]]).any()
    assert not torch.isfinite(out.entropy[[4, 20]]).any()
    assert torch.equal(out.log_probs[others], clean.log_probs[others])
    assert torch.equal(out.entropy[others], clean.entropy[others])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    hidden = torch.randn(0, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    out = linear_log_probs(hidden, weight, torch.zeros(0, dtype=torch.long), backend=backend)
    assert out.log_probs.shape == (0,) and out.entropy.shape == (0,)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert hidden.grad.shape == (0, 16)
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_backward_matmuls_use_full_precision_reduction_and_restore_flag(monkeypatch):
    """Reduced-precision (16-bit) split-K reduction tripled the dh error on an H100; the backward
    turns it off for its own matmuls and gives the user's setting back."""
    flags = torch.backends.cuda.matmul
    seen = []
    real_mm_into = rl_autograd._mm_into

    def spy(out, a, b, *form):
        seen.append((flags.allow_bf16_reduced_precision_reduction,
                     flags.allow_fp16_reduced_precision_reduction))
        real_mm_into(out, a, b, *form)

    monkeypatch.setattr(rl_autograd, "_mm_into", spy)
    saved = (flags.allow_bf16_reduced_precision_reduction,
             flags.allow_fp16_reduced_precision_reduction)
    try:
        flags.allow_bf16_reduced_precision_reduction = True
        flags.allow_fp16_reduced_precision_reduction = True
        hidden, weight, labels = make_inputs(9, 16, 40, torch.float32, seed=4)
        hidden.requires_grad_()
        weight.requires_grad_()
        linear_log_probs(hidden, weight, labels, backend="torch").log_probs.sum().backward()
        assert seen and all(s == (False, False) for s in seen)
        assert flags.allow_bf16_reduced_precision_reduction is True
        assert flags.allow_fp16_reduced_precision_reduction is True
    finally:
        (flags.allow_bf16_reduced_precision_reduction,
         flags.allow_fp16_reduced_precision_reduction) = saved


# ----------------------------------------------------------------------- bug catalogue, crafted


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_tail_columns_carry_no_mass(backend):
    """verl #2656/#2899: V = 257 leaves 1 real column in the last split; all real logits are very
    negative except the last row's, so any padded column that entered as 0 (not -inf) would
    dominate the sum. Log-probs must match float64 and never be positive."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 17, 64, 257
    hidden = torch.rand(n, h, generator=g) + 0.5
    weight = -(torch.rand(v, h, generator=g) + 0.5)
    weight[-1] = 0.05
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::2] = v - 1
    out = linear_log_probs(hidden, weight, labels, temperature=1.5, backend=backend)
    lp_ref, ent_ref = dense_linear_log_probs(hidden, weight, labels, 1.5)
    assert (out.log_probs <= 0).all()
    assert (out.log_probs.double() - lp_ref).abs().max() <= VALUE_ATOL
    assert (out.entropy.double() - ent_ref).abs().max() <= VALUE_ATOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_negative_logits(backend):
    """verl PR #7439: every logit <= -100 (a running max initialised at 0 underflows s to 0)."""
    g = torch.Generator().manual_seed(1)
    n, h, v = 21, 48, 600
    hidden = torch.rand(n, h, generator=g) + 1.0
    weight = -(torch.rand(v, h, generator=g) + 2.0)
    labels = torch.randint(0, v, (n,), generator=g)
    out = linear_log_probs(hidden, weight, labels, backend=backend)
    z_max = (hidden.double() @ weight.double().T).max()
    assert z_max < -100
    lp_ref, ent_ref = dense_linear_log_probs(hidden, weight, labels)
    assert torch.isfinite(out.log_probs).all() and torch.isfinite(out.entropy).all()
    # |z| ~ 150 in fp32: one ulp is 1.5e-5
    assert (out.log_probs.double() - lp_ref).abs().max() <= 1e-4
    assert (out.entropy.double() - ent_ref).abs().max() <= 1e-4


def test_reference_grads_helper_matches_autograd():
    """The chunked float64 gradient oracle used by the GPU tests equals autograd float64."""
    hidden, weight, labels = make_inputs(30, 24, 200, torch.float64, seed=2)
    g_lp, g_ent = torch.randn(30, dtype=torch.float64), torch.randn(30, dtype=torch.float64)
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = dense_linear_log_probs(hr, wr, labels, 0.8)
    (lp * g_lp + ent * g_ent).sum().backward()
    dh, dw = reference_linear_grads(hidden, weight, labels, g_lp, g_ent, 0.8, chunk=7)
    assert rel_err(dh, hr.grad) <= 1e-12 and rel_err(dw, wr.grad) <= 1e-12


# ----------------------------------------------------------------------------- bad input


def _args():
    hidden, weight, labels = make_inputs(5, 8, 20, torch.float32, seed=0)
    return hidden, weight, labels


@pytest.mark.parametrize("change,exc,words", [
    (lambda h, w, l: (h, w[:, :7], l), ValueError, "weight: expected shape (vocab_size, H)"),
    (lambda h, w, l: (h, w.double(), l), TypeError, "weight: dtype torch.float64 differs"),
    (lambda h, w, l: (h.double(), w.double(), l), TypeError, "hidden_states: expected bfloat16"),
    (lambda h, w, l: (h, w, l[:4]), ValueError, "labels: expected shape (5,)"),
    (lambda h, w, l: (h, w, l.float()), TypeError, "labels: expected int64 or int32"),
    (lambda h, w, l: (h, w, torch.tensor([0, 1, 20, 3, -100])), ValueError,
     "labels: 1 entries lie outside [0, vocab_size=20)"),
    (lambda h, w, l: (h, w, torch.tensor([0, -1, 2, 3, 4])), ValueError, "first at flat position 1: -1"),
    (lambda h, w, l: (h, w[:0], l), ValueError, "vocab_size must be >= 1"),
    (lambda h, w, l: (h, w, l.to("meta")), ValueError, "labels: a meta tensor holds no data"),
    (lambda h, w, l: (h.numpy(), w, l), TypeError, "hidden_states: expected a torch.Tensor"),
])
def test_bad_tensors_raise_clear_errors(change, exc, words):
    with pytest.raises(exc) as info:
        linear_log_probs(*change(*_args()), backend="torch")
    assert words in str(info.value)


@pytest.mark.parametrize("temperature,exc", [(0.0, ValueError), (-1.0, ValueError),
                                              (float("inf"), ValueError), (float("nan"), ValueError),
                                              (torch.tensor(1.0), TypeError), (True, TypeError),
                                              ("1", TypeError)])
def test_bad_temperature(temperature, exc):
    with pytest.raises(exc, match="temperature"):
        linear_log_probs(*_args(), temperature=temperature, backend="torch")


def test_integer_temperature_accepted():
    a = linear_log_probs(*_args(), temperature=2, backend="torch")
    b = linear_log_probs(*_args(), temperature=2.0, backend="torch")
    assert torch.equal(a.log_probs, b.log_probs)


def test_bad_ignore_index_and_backend():
    with pytest.raises(TypeError, match="ignore_index"):
        linear_log_probs(*_args(), ignore_index=-100.0, backend="torch")
    with pytest.raises(ValueError, match="backend"):
        linear_log_probs(*_args(), backend="cuda")


def test_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        linear_log_probs(*_args(), backend="triton")


def test_auto_backend_logs_choice_once(caplog):
    import rl_kernels.core._logging as rl_logging

    rl_logging._seen.clear()
    with caplog.at_level(logging.INFO, logger="rl_kernels"):
        linear_log_probs(*_args())
        linear_log_probs(*_args())
    msgs = [r.getMessage() for r in caplog.records if "backend='auto'" in r.getMessage()]
    assert msgs == ["rl_kernels: backend='auto' runs 'torch' for cpu tensors"]


# ----------------------------------------------------------------------------- soft-capping
# Gemma 2's final-logit soft-capping, z = c tanh(h.w / c) / T. The weights are scaled so that the
# raw logits h.w have a std of ~3 c: most of them are past the cap, where an uncapped head is off
# by many nats and the backward's 1 - tanh^2 factor is far from 1.

def _capped_inputs(n, h, v, dtype, cap, seed):
    hidden, weight, labels = make_inputs(n, h, v, dtype, seed=seed, w_scale=3.0 * cap / h ** 0.5)
    return hidden, weight, labels


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,n,h,v,cap,temperature", [
    (torch.float32, 33, 65, 257, 5.0, 0.7),
    (torch.float16, 37, 72, 1007, 30.0, 1.0)])
def test_softcap_values_and_gradients_match_float64(backend, dtype, n, h, v, cap, temperature, poison,
                                                    small_chunks):
    hidden, weight, labels = _capped_inputs(n, h, v, dtype, cap, seed=n + v)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    assert ((hr @ wr.T).abs() > cap).double().mean() > 0.3  # the cap is active
    lp_ref, ent_ref = dense_linear_log_probs(hr, wr, labels, temperature, softcap=cap)
    (lp_ref * g_lp.double() + ent_ref * g_ent.double()).sum().backward()
    lp_plain, _ = dense_linear_log_probs(hidden.double(), weight.double(), labels, temperature)
    assert (lp_plain - lp_ref).abs().max() > 1.0  # skipping the cap would fail this test

    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=temperature, softcap=cap, backend=backend)
    assert (out.log_probs.double() - lp_ref).abs().max().item() <= VALUE_ATOL
    assert (out.entropy.double() - ent_ref).abs().max().item() <= VALUE_ATOL
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    assert rel_err(hx.grad, hr.grad) <= GRAD_RTOL[dtype]
    assert rel_err(wx.grad, wr.grad) <= GRAD_RTOL[dtype]
    ignored = labels == -100
    assert ignored.any() and (out.log_probs[ignored] == 0).all() and (hx.grad[ignored] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_softcap_sum_pi_squared_and_non_finite_rows(backend, poison):
    """Under the cap: sum p^2 and its gradient against float64; a row whose hidden state holds
    +inf gets NaN, not the finite cap (the promise: non-finite input, non-finite output), and the
    other rows keep their values."""
    n, h, v, cap = 9, 24, 70, 2.0
    hidden, weight, labels = _capped_inputs(n, h, v, torch.float32, cap, seed=5)
    labels[:] = labels.clamp_min(0)
    g_sq = torch.randn(n, generator=torch.Generator().manual_seed(3))
    hr, wr = hidden.double().requires_grad_(), weight.double().requires_grad_()
    p = torch.softmax(cap * torch.tanh(hr @ wr.T / cap) / 0.9, -1)
    ref = (p * p).sum(-1)
    (ref * g_sq.double()).sum().backward()
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=0.9, softcap=cap, return_entropy=False,
                           return_sum_pi_squared=True, backend=backend)
    assert (out.sum_pi_squared.double() - ref).abs().max() <= VALUE_ATOL
    (out.sum_pi_squared * g_sq).sum().backward()
    assert rel_err(hx.grad, hr.grad) <= 2e-5 and rel_err(wx.grad, wr.grad) <= 2e-5

    bad = hidden.clone()
    bad[3] = float("inf")
    with quiet_interpreter():  # the interpreter's numpy reduces the inf row too (the GPU is silent)
        out = linear_log_probs(bad, weight, labels, softcap=cap, backend=backend)
    ref_lp, _ = dense_linear_log_probs(hidden.double(), weight.double(), labels, softcap=cap)
    assert not torch.isfinite(out.log_probs[3]) and not torch.isfinite(out.entropy[3])
    ok = torch.arange(n) != 3
    assert (out.log_probs[ok].double() - ref_lp[ok]).abs().max() <= VALUE_ATOL


@pytest.mark.parametrize("softcap,exc,words", [
    (0.0, ValueError, "softcap: expected None or a positive finite number"),
    (-30.0, ValueError, "softcap: expected None or a positive finite number"),
    (float("nan"), ValueError, "softcap: expected None or a positive finite number"),
    (float("inf"), ValueError, "softcap: expected None or a positive finite number"),
    (1e-45, ValueError, "softcap: 1e-45 with temperature 1.0 is outside the usable range"),
    (True, TypeError, "softcap: expected None or a positive finite Python number"),
    ("30", TypeError, "softcap: expected None or a positive finite Python number (float or int), got str"),
    (torch.tensor(30.0), TypeError, "pass float(softcap)")])
def test_bad_softcap(softcap, exc, words):
    hidden, weight, labels = make_inputs(3, 8, 11, torch.float32)
    with pytest.raises(exc, match=re.escape(words)):
        linear_log_probs(hidden, weight, labels, softcap=softcap, backend="torch")


def test_linear_head_returns_each_asked_output_in_its_field():
    """``autograd.linear.linear_head`` puts the Function's outputs into ``HeadOutputs``' fields: a
    field holds a tensor exactly when the call asks for it, for every combination of the optional
    outputs, and each holds its own statistic (the entropy is not the lse's, the tail not the
    gathered logits')."""
    import itertools

    import rl_kernels.autograd.linear as linear_autograd
    from rl_kernels.core.backends import get_backend

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g)
    labels, ids = torch.tensor([3, -100, 0, 10, 7]), torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 0]])
    z = h.double() @ w.double().T
    lse, valid = torch.logsumexp(z, -1), labels != -100
    close = functools.partial(assert_close_f32, depth=h.shape[1] + w.shape[0], logits=head_magnitude(h, w))
    for entropy, spp, gather, tail in itertools.product((False, True), repeat=4):
        if tail and not gather:
            continue
        params = linear_autograd.HeadParams(get_backend("torch", h.device), 1.0, -100, entropy,
                                            return_sum_pi_squared=spp, return_tail=tail)
        out = linear_autograd.linear_head(h, w, labels, params, ids if gather else None)
        assert [o is not None for o in out] == [True, entropy, True, spp, gather, tail, False, False]
        close(out.lse, lse)
        if entropy:  # (an ignored row's entropy is 0)
            close(out.entropy[valid], (lse - (torch.softmax(z, -1) * z).sum(-1))[valid])
        if spp:
            close(out.sum_pi_squared[valid], (torch.softmax(z, -1) ** 2).sum(-1)[valid])
        if gather:
            close(out.gathered_logits, z.gather(1, ids))
        if tail:
            close(out.tail_lse, torch.logsumexp(z.scatter(1, ids, float("-inf")), -1))
