"""ops/fp32_matmul.py: ``acc += a @ b`` as three TF32 products from operands split once (the
float32 head's backward matmuls, issue 54 item 1), against float64 on fresh random operands."""
import pytest
import torch

from rl_kernels.ops.fp32_matmul import addmm_tf32x3

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
