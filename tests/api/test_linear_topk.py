"""linear_topk (issue 45, item 4): the k largest logits of hidden_states @ weight.T / T per row and
their log-probs, on both backends (Triton in the CPU interpreter), against a float64 reference
written here: the logits' stable descending sort (ties to the smaller id) and
log_softmax(z)[ids].

The Triton cases run with small tiles (``SMALL_TOPK`` of tests/api/conftest.py: 16-row blocks, 32-column tiles, lse chunks of 64
columns), so V = 203 is 7 tiles, the last one partial, in 4 chunks, and with 1 to 4 vocab splits
(``topk_splits`` patched): the outputs are bitwise the same for every split count. Exact ties come
from small-integer inputs (every product and sum exact in float32). Also: K = 1, K not a power of
two, K = 128 with V = 150 and K = V, temperature (a number and one per row), softcap, a NaN row,
3-D and empty inputs, the poison fixture, no (N x V) tensor, bad inputs naming the argument,
torch.compile (fullgraph, no graph break, the bits of eager, one graph for several temperatures
and batch sizes), vocab-parallel over 2 gloo ranks (``tests/api/tp_worker.py``, ``run_topk``), and a
GPU check (``gpu`` marker).
"""
import pytest
import torch
import torch._dynamo.testing
from torch.utils._python_dispatch import TorchDispatchMode

import rl_kernels
import rl_kernels.ops.linear_topk as topk_ops
from rl_kernels import linear_topk
from rl_kernels.ops.config import forced_config
from tolerances import assert_close_f32, head_magnitude

BACKENDS = ["torch", "triton"]
pytestmark = pytest.mark.usefixtures("small_topk_tiles")  # (tests/api/conftest.py)


def _splits(monkeypatch, n):
    monkeypatch.setattr(topk_ops, "topk_splits", lambda row_blocks, n_chunks, device: n)


def reference(hidden, weight, k, temperature=1.0, softcap=None):
    """float64 (log_probs, ids) (..., k): the stable descending sort of z (ties: smaller id first)."""
    z = hidden.double() @ weight.double().T
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.double()[..., None]
    z = z / temperature
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices[..., :k]
    return torch.log_softmax(z, -1).gather(-1, order), order


def _inputs(n, h, v, seed=0, dtype=torch.float32, integers=False):
    g = torch.Generator().manual_seed(seed)
    if integers:  # values in {-2..2} / {-1, 0, 1}: exact float32 logits with many ties
        hidden = torch.randint(-2, 3, (n, h), generator=g).float()
        weight = torch.randint(-1, 2, (v, h), generator=g).float()
    else:
        hidden = torch.randn(n, h, generator=g)
        weight = torch.randn(v, h, generator=g) * 2 / h ** 0.5
    return hidden.to(dtype), weight.to(dtype)


def _check(out, ref, hidden, weight, temperature=1.0, softcap=None):
    """The ids equal float64's; the log-probs within float32 rounding (tests/support/tolerances.py): a logit's
    dot product over H, the softcap's division, tanh and product (3), 1/T rounded and the product by it (2),
    the row's sum over V (its lse); the magnitude the head's (a softcap only shrinks the logits)."""
    (lp, ids), (ref_lp, ref_ids) = out, ref
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64
    assert not lp.requires_grad and not ids.requires_grad
    assert torch.equal(ids, ref_ids), (ids != ref_ids).nonzero()[:5]
    h, v = weight.shape[1], weight.shape[0]
    assert_close_f32(lp, ref_lp, depth=h + v + 2 + (3 if softcap is not None else 0),
                     logits=head_magnitude(hidden, weight, temperature), msg="log p of the top k")
    assert (lp[..., 1:] <= lp[..., :-1]).all()


CASES = {  # name: (N, H, V, k, temperature, softcap, integers)
    "K=5": (13, 24, 203, 5, 1.0, None, False),
    "K=1 T=0.7": (13, 24, 203, 1, 0.7, None, False),
    "K=7 ties": (11, 16, 203, 7, 1.0, None, True),
    "K=128 V=150 ties": (5, 8, 150, 128, 1.3, None, True),
    "K=V softcap": (6, 16, 37, 37, 0.8, 2.5, False),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_float64_topk(name, backend, poison):
    n, h, v, k, temperature, softcap, integers = CASES[name]
    hidden, weight = _inputs(n, h, v, integers=integers)
    if integers:  # (the ties are real: a tie at the k-th place in some row)
        z = hidden @ weight.T
        kth = z.sort(-1, descending=True).values[:, k - 1:k + 1]
        assert (kth[:, 0] == kth[:, 1]).any() if k < v else True
    out = linear_topk(hidden, weight, k=k, temperature=temperature, softcap=softcap, backend=backend)
    _check(out, reference(hidden, weight, k, temperature, softcap), hidden, weight, temperature, softcap)


def test_split_count_changes_no_bit(monkeypatch):
    """1 to 4 vocab splits of V = 203 (4 lse chunks): the same bits, and equal to float64; and a row
    gives the same bits in a batch of 13 and alone (batch invariance)."""
    hidden, weight = _inputs(13, 24, 203, seed=3)
    ref = reference(hidden, weight, 9, 0.9)
    outs = []
    for splits in (1, 2, 4):
        _splits(monkeypatch, splits)
        outs.append(linear_topk(hidden, weight, k=9, temperature=0.9, backend="triton"))
        _check(outs[-1], ref, hidden, weight, 0.9)
    for lp, ids in outs[1:]:
        assert torch.equal(lp, outs[0][0]) and torch.equal(ids, outs[0][1])
    lp1, ids1 = linear_topk(hidden[5:6], weight, k=9, temperature=0.9, backend="triton")
    assert torch.equal(lp1, outs[-1][0][5:6]) and torch.equal(ids1, outs[-1][1][5:6])


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_row_temperature_3d_and_empty(backend, monkeypatch):
    _splits(monkeypatch, 2)
    hidden, weight = _inputs(12, 16, 101, seed=4)
    temperature = torch.rand(12, generator=torch.Generator().manual_seed(1)) * 1.5 + 0.4
    out = linear_topk(hidden.view(3, 4, 16), weight, k=6, temperature=temperature.view(3, 4), backend=backend)
    assert out[0].shape == out[1].shape == (3, 4, 6)
    _check(out, reference(hidden.view(3, 4, 16), weight, 6, temperature.view(3, 4)), hidden, weight, temperature)
    lp, ids = linear_topk(hidden[:0], weight, k=6, backend=backend)
    assert lp.shape == ids.shape == (0, 6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16(backend):
    hidden, weight = _inputs(9, 32, 203, seed=5, dtype=torch.bfloat16)
    _check(linear_topk(hidden, weight, k=4, backend=backend), reference(hidden, weight, 4), hidden, weight)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_row_only_that_row(backend, poison):
    """A NaN hidden row: NaN log-probs and ids -1 (no logit of the row can be selected); a row with
    one NaN column of weight ... every row then has NaN logits there: NaN log-probs in every row
    (the lse is NaN), ids the top-k of the other logits. The other rows of the first case equal
    float64."""
    hidden, weight = _inputs(9, 16, 101, seed=6)
    bad = hidden.clone()
    bad[4, 3] = float("nan")
    lp, ids = linear_topk(bad, weight, k=5, backend=backend)
    assert lp[4].isnan().all() and (ids[4] == -1).all()
    keep = torch.arange(9) != 4
    _check((lp[keep], ids[keep]), tuple(r[keep] for r in reference(hidden, weight, 5)), hidden[keep], weight)

    bad_w = weight.clone()
    bad_w[7, 0] = float("nan")
    lp, ids = linear_topk(hidden, bad_w, k=5, backend=backend)
    assert lp.isnan().all()
    z = hidden.double() @ weight.double().T
    z[:, 7] = float("-inf")  # (never selected: what the kernels do with the NaN column)
    ref_ids = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :5]
    assert torch.equal(ids, ref_ids)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_logits_sized_tensor(backend):
    """No new logits-shaped tensor (last dim V) of N x V / 2 elements or more is made by the call
    (torch: chunks of 3 rows)."""
    n, v = 13, 203
    hidden, weight = _inputs(n, 24, v)
    sizes = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == v  # (not a view of weight)
                        and t.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()):
                    sizes.append(t.numel())
            return out
    with Sizes():
        linear_topk(hidden, weight, k=5, backend=backend)
    assert max(sizes, default=0) < n * v / 2, max(sizes)
    assert bool(sizes) == (backend == "torch")  # (the hook sees the torch twin's logits chunks)


def test_bad_inputs():
    hidden, weight = _inputs(4, 8, 20)
    for k, err, match in ((0, ValueError, r"k: expected an int in \[1, min\(128, vocab_size\)\] = \[1, 20\], got 0"),
                          (21, ValueError, "got 21"), (129, ValueError, "got 129"),
                          (2.0, TypeError, "got float"), (True, TypeError, "got bool"),
                          (None, TypeError, "k is required")):
        with pytest.raises(err, match=match):
            linear_topk(hidden, weight, k=k, backend="torch")
    with pytest.raises(TypeError, match="hidden_states: expected bfloat16"):
        linear_topk(hidden.long(), weight, k=2)
    with pytest.raises(ValueError, match="weight: expected shape"):
        linear_topk(hidden, weight[:, :5], k=2)
    with pytest.raises(TypeError, match="weight: dtype"):
        linear_topk(hidden, weight.double(), k=2)
    with pytest.raises(ValueError, match="temperature"):
        linear_topk(hidden, weight, k=2, temperature=0.0)
    with pytest.raises(ValueError, match="temperature: a per-row temperature must have the shape"):
        linear_topk(hidden, weight, k=2, temperature=torch.ones(5))
    with pytest.raises(ValueError, match="softcap"):
        linear_topk(hidden, weight, k=2, softcap=-1.0)
    with pytest.raises(ValueError, match="backend"):
        linear_topk(hidden, weight, k=2, backend="cuda")
    with pytest.raises(ValueError, match="vocab_start_index"):
        linear_topk(hidden, weight, k=2, vocab_start_index=3)
    # k is the required keyword: a positional argument is read as k (issue 52: it said temperature=0.7)
    with pytest.raises(TypeError, match=r"k is required and keyword-only.*write linear_topk\(hidden_states, weight, "
                                        r"k=0.7\)"):
        linear_topk(hidden, weight, 0.7)


# ----------------------------------------------------------------------------- torch.compile

@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_compile_equals_eager(backend):
    """Through the ``rl_kernels::linear_topk`` custom op: no graph break, the bits of eager, one
    graph for two batch sizes and three temperatures (a runtime value of the graph)."""
    def f(hidden, weight, temperature):
        lp, ids = linear_topk(hidden, weight, k=4, temperature=temperature, backend=backend)
        return lp * 2, ids + 1

    hidden, weight = _inputs(13, 24, 203, seed=7)
    explained = torch._dynamo.explain(f)(hidden, weight, 0.7)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    for n, temperature in ((13, 0.7), (9, 1.3), (13, 2.0)):
        h = hidden[:n].clone()  # (not a view: Dynamo would guard on its base's size)
        for e, c in zip(f(h, weight, temperature), compiled(h, weight, temperature)):
            assert torch.equal(e, c)
        lp, ids = compiled(h, weight, temperature)
        _check((lp / 2, ids - 1), reference(h, weight, 4, temperature), h, weight, temperature)
    assert counter.frame_count == 1, counter.frame_count


# ----------------------------------------------------------------------------- vocab parallel

@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_two_ranks(tmp_path, backend):
    import torch.multiprocessing as mp

    import tp_worker

    mp.spawn(tp_worker.run_topk, args=(2, str(tmp_path / "init"), backend), nprocs=2, join=True)


# ----------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_against_float64(dtype):
    """CUDA, default tiles: an odd shape (several splits, a partial last tile), k = 64 and 128.
    The ids equal float64's except where two logits of the row are closer than the float32
    rounding of their sums (a near-tie): there both orders are right; checked by value."""
    with forced_config(None):
        n, h, v = 1031, 512, 50257
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(n, h, generator=g).to("cuda", dtype)
        weight = (torch.randn(v, h, generator=g) * 2 / h ** 0.5).to("cuda", dtype)
        for k, temperature in ((64, 1.0), (128, 0.7)):
            lp, ids = linear_topk(hidden, weight, k=k, temperature=temperature, backend="triton")
            ref_lp, ref_ids = reference(hidden, weight, k, temperature)
            torch.testing.assert_close(lp.double(), ref_lp, atol=5e-5, rtol=0)
            z = (hidden.double() @ weight.double().T) / temperature
            got = z.gather(1, ids)  # the float64 logits at the returned ids: the k largest, in order
            torch.testing.assert_close(got, z.gather(1, ref_ids), atol=2e-5, rtol=0)
            assert (ids != ref_ids).float().mean() < 1e-3
            lp_t, ids_t = linear_topk(hidden, weight, k=k, temperature=temperature, backend="torch")
            torch.testing.assert_close(lp, lp_t, atol=2e-5, rtol=0)
