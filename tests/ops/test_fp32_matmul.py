"""ops/fp32_matmul.py: ``acc += a @ b`` as three TF32 products from operands split once (the
float32 head's backward matmuls, issue 54 item 1), against float64 on fresh random operands."""
import pytest
import torch

from rl_kernels.ops.fp32_matmul import _high_part, addmm_tf32x3

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _bound(a, b, acc0, k):
    """Elementwise bound on |acc + a @ b - exact|: the dropped a_lo b_lo term and the low parts'
    TF32 rounding (2^-20 |a||b| together), and the float32 sums of k products plus the final add,
    each addition's error at most 2^-23 of the running magnitude (the tensor cores cut, not round)."""
    mag = a.double().abs() @ b.double().abs()
    return 2.0 ** -20 * mag + (k + 2) * 2.0 ** -23 * (mag + acc0.double().abs())


@pytest.mark.parametrize("m,k,n", [(70, 150, 45), (129, 33, 130), (5, 301, 7)])
def test_addmm_tf32x3_within_float32_rounding_of_float64(m, k, n):
    """Odd shapes, ``a`` a column slice of a wider tensor (not aligned for the copy engine: copied),
    ``b`` a row-major (K, N) tensor (copied K-major), ``acc`` a view inside a NaN-poisoned buffer:
    acc + a @ b within ``_bound`` of float64, the poison outside ``acc`` untouched, and a second run
    gives the same bits."""
    g = torch.Generator(device=DEVICE).manual_seed(m * k + n)
    wide = torch.randn(m, k + 3, device=DEVICE, generator=g)
    a = wide[:, 1:k + 1]
    b = torch.randn(k, n, device=DEVICE, generator=g) * torch.exp2(torch.randint(-4, 4, (k, n), device=DEVICE,
                                                                                 generator=g).float())
    buf = torch.full((m + 2, n + 5), float("nan"), device=DEVICE)
    acc = buf[1:m + 1, 2:n + 2]
    acc0 = torch.randn(m, n, device=DEVICE, generator=g)
    acc.copy_(acc0)
    addmm_tf32x3(acc, a, b)
    exact = acc0.double() + a.double() @ b.double()
    err = (acc.double() - exact).abs()
    assert torch.all(err <= _bound(a, b, acc0, k)), float((err / _bound(a, b, acc0, k)).max())
    poison = torch.ones_like(buf, dtype=torch.bool)
    poison[1:m + 1, 2:n + 2] = False
    assert buf[poison].isnan().all()
    again = acc0.clone()
    addmm_tf32x3(again, a, b)
    assert torch.equal(again, acc)


def test_addmm_tf32x3_non_finite_operand_spoils_its_row_only():
    """An infinity in row 3 of ``a`` makes row 3 of the result non-finite; every other row is finite
    and equal to the run without it."""
    g = torch.Generator(device=DEVICE).manual_seed(3)
    a = torch.randn(40, 64, device=DEVICE, generator=g)
    b = torch.randn(64, 24, device=DEVICE, generator=g)
    clean = torch.zeros(40, 24, device=DEVICE)
    addmm_tf32x3(clean, a, b)
    a[3, 10] = float("inf")
    out = torch.zeros(40, 24, device=DEVICE)
    addmm_tf32x3(out, a, b)
    assert not out[3].isfinite().any()
    rest = torch.arange(40, device=DEVICE) != 3
    assert torch.equal(out[rest], clean[rest])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m,k,n", [(1024, 3584, 8192), (1024, 32771, 3584)])
def test_addmm_tf32x3_at_least_as_accurate_as_sgemm_on_the_gpu(m, k, n):
    """On the tensor cores, at the head's shapes (K = H = 3584 as dW's, a long odd K as dh's), logits
    std 2: mean |error| vs float64 within 1.3x of cuBLAS SGEMM's on the same operands and max below
    it (H100, 2026-12-08, plain kernel: 1.2x / 0.4x at K = 3584, 0.4x / 0.2x at K = 32768)."""
    g = torch.Generator(device="cuda").manual_seed(k)
    a = torch.randn(m, k, device="cuda", generator=g)
    b = torch.randn(k, n, device="cuda", generator=g) * (2 / k ** 0.5)
    exact = a.double() @ b.double()
    assert not torch.backends.cuda.matmul.allow_tf32
    sgemm = (a @ b).double() - exact
    acc = torch.zeros(m, n, device="cuda")
    addmm_tf32x3(acc, a, b)
    ours = acc.double() - exact
    assert ours.abs().mean() <= 1.3 * sgemm.abs().mean(), (float(ours.abs().mean()), float(sgemm.abs().mean()))
    assert ours.abs().max() <= sgemm.abs().max(), (float(ours.abs().max()), float(sgemm.abs().max()))


def test_addmm_tf32x3_in_pieces_of_k_and_blocks_of_rows_equals_float64_within_rounding(monkeypatch):
    """With the copies' bound forcing three pieces of K and three blocks of 128 rows
    (``PIECE_ELEMENTS``), each launch's sum added into its rows of ``acc``: still within ``_bound``
    of float64 (a piece or block dropped or counted twice is off by a whole piece's products), and
    ``a`` transposed (copied K-major block by block)."""
    import rl_kernels.ops.fp32_matmul as fm

    monkeypatch.setattr(fm, "PIECE_ELEMENTS", 2 * 20 * 128)  # pieces of 128 for N = 20, blocks of 128 rows
    g = torch.Generator(device=DEVICE).manual_seed(11)
    a = torch.randn(300, 330, device=DEVICE, generator=g).T
    b = torch.randn(300, 20, device=DEVICE, generator=g)
    acc0 = torch.randn(330, 20, device=DEVICE, generator=g)
    acc = acc0.clone()
    fm.addmm_tf32x3(acc, a, b)
    err = (acc.double() - (acc0.double() + a.double() @ b.double())).abs()
    assert torch.all(err <= _bound(a, b, acc0, 300)), float((err / _bound(a, b, acc0, 300)).max())


def test_float32_head_backward_through_the_split_form(monkeypatch):
    """The float32 head's backward with ``fp32_backward="tf32x3"`` (the Hopper class's; forced here,
    the interpreter runs it): its dh and dW matmuls go through ``addmm_tf32x3`` (counted: the test
    cannot pass on SGEMM), over several dlogits windows (dW from the windows' transposes, dh
    accumulated window by window), and both gradients are within the float32 rounding of float64 as
    the SGEMM form's are (``GRAD_RTOL`` of tests/api/test_linear_log_probs.py)."""
    import dataclasses

    import rl_kernels.autograd.backward_schedule as schedule
    import rl_kernels.ops.fp32_matmul as fm
    from rl_kernels import linear_log_probs
    from rl_kernels.ops import INTERPRETER_CONFIG, forced_config
    from rl_kernels.tools.reference import make_inputs, reference_linear_grads, rel_err

    if DEVICE == "cuda":
        pytest.skip("the GPU suite runs the split form on the Hopper class itself")
    calls = []
    real = fm.addmm_tf32x3
    monkeypatch.setattr(fm, "addmm_tf32x3", lambda *a: calls.append(a[1].shape) or real(*a))
    monkeypatch.setattr(schedule, "MIN_CHUNK_ELEMENTS", 15000)  # about three windows
    monkeypatch.setattr(schedule, "CHUNK_FRACTION", 0.0)
    n, h, v = 37, 48, 1007
    hidden, weight, labels = make_inputs(n, h, v, torch.float32, seed=5)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    dh, dw = reference_linear_grads(hidden, weight, labels, g_lp, g_ent, 0.9)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with forced_config(dataclasses.replace(INTERPRETER_CONFIG, fp32_backward="tf32x3")):
        out = linear_log_probs(hx, wx, labels, temperature=0.9, backend="triton")
        (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    assert len(calls) >= 4, calls  # dh and dW, window by window
    assert rel_err(hx.grad, dh) <= 2e-5 and rel_err(wx.grad, dw) <= 2e-5, (rel_err(hx.grad, dh), rel_err(wx.grad, dw))


def test_tf32_split_is_exact_and_its_three_products_reach_float32_accuracy():
    """The split of ``addmm_tf32x3`` (``_high_part``): a = hi + lo with hi exact in TF32 (its 13 low
    mantissa bits 0) and hi + lo == a bit for bit, for random magnitudes, subnormals and zeros (an
    infinity keeps hi = a and gets lo = NaN: the products stay non-finite); the three products
    a_lo b_hi + a_hi b_lo + a_hi b_hi, each operand truncated to TF32 (10 mantissa bits, as the
    H100's tensor cores read a float32 operand: scripts/diag/fp32_split_gemm.py) and summed in
    float64, are within 3 x 2^-20 |a||b| of the exact product (each low part's truncation and the
    dropped a_lo b_lo, 2^-20 each), where one TF32 product is 2^-11 off. CPU: the split itself."""
    g = torch.Generator().manual_seed(7)
    a = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-60, 60, (64, 96), generator=g).float())
    a[0, :4] = torch.tensor([0.0, -0.0, float("inf"), 1e-40])
    hi = _high_part(a)
    assert torch.all((hi.view(torch.int32) & 8191) == 0)
    finite = a.isfinite()
    assert torch.equal((hi + (a - hi))[finite], a[finite])
    assert hi[0, 2] == float("inf") and (a - hi)[0, 2].isnan()
    x, y = torch.randn(48, 200, generator=g), torch.randn(200, 40, generator=g)
    x_hi, y_hi = _high_part(x), _high_part(y)
    parts = [(x - x_hi, y_hi), (x_hi, y - y_hi), (x_hi, y_hi)]
    three = sum(_high_part(p).double() @ _high_part(q).double() for p, q in parts)
    exact = x.double() @ y.double()
    scale = x.double().abs() @ y.double().abs()
    assert ((three - exact).abs() / scale).max() < 3 * 2.0 ** -20
    assert ((x_hi.double() @ y_hi.double() - exact).abs() / scale).max() > 2.0 ** -14
