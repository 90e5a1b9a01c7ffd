"""From-logits functions (logits_stats, log_probs_from_logits, entropy_from_logits, logsumexp,
cross_entropy) on both backends vs a float64 reference.

Shapes: V = 301 (odd), 3 x 7 rows with every other column (strided rows). The torch backend's
CHUNK_ELEMENTS is patched to 4 rows' worth so that every call crosses chunk boundaries (21 =
5 * 4 + 1). The Triton backend runs in the CPU interpreter with 64-column splits read in 32-column
chunks, so V = 301 ends in a partial split and a partial chunk; both launch shapes (one level,
two-level split) are forced in turn.
"""
import pytest
import torch
import torch.nn.functional as F

import rl_kernels.torch_ops.logits as logits_mod
from rl_kernels import (cross_entropy, entropy_from_logits, log_probs_from_logits, logits_stats,
                        logsumexp)
from tolerances import assert_close_f32, logits_magnitude

V = 301
PATHS = [("torch", None), ("triton", False), ("triton", True)]  # (backend, two_level)
PATH_IDS = ["torch", "triton-1level", "triton-2level"]
# float32 rounding bounds (tests/support/tolerances.py), from materialized logits: 1/T rounded to float32 and the
# product by it (2), then a row's sums over its V columns (log p, entropy, lse); a gradient is then combined from
# those row statistics and p over the V columns once more
FWD, GRAD = V + 2, 2 * V + 2


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(logits_mod, "CHUNK_ELEMENTS", 4 * V)


def _force(monkeypatch, two_level):
    if two_level is not None:
        from rl_kernels.ops import logits as kernels

        monkeypatch.setattr(kernels, "use_two_level", lambda *a: two_level)


def _reference(x, labels, temperature, ignore_index=-100):
    """float64 (log_probs, entropy, lse); log-prob and entropy 0 on ignored rows."""
    z = x.double() / temperature
    log_p = z.log_softmax(-1)
    valid = labels != ignore_index
    lp = log_p.gather(-1, torch.where(valid, labels, 0)[..., None])[..., 0]
    p = log_p.exp()
    ent = -(p * torch.where(p > 0, log_p, 0.0)).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0), torch.logsumexp(z, -1)


@pytest.mark.parametrize("backend,two_level", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_values_and_gradients(poison, monkeypatch, backend, two_level, dtype):
    _force(monkeypatch, two_level)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 7, 2 * V, generator=g) * 4
    labels = torch.randint(0, V, (3, 7), generator=g)
    labels[0, 1] = labels[2, 6] = -100
    x = base[..., ::2].to(dtype).requires_grad_()  # strided rows: every other column
    g_lp, g_ent, g_lse = (torch.randn(3, 7, generator=g) for _ in range(3))

    out = logits_stats(x, labels, temperature=0.7, backend=backend)
    (g_lp * out.log_probs + g_ent * out.entropy + g_lse * out.lse).sum().backward()

    x64 = x.detach().double().requires_grad_()
    ref_lp, ref_ent, ref_lse = _reference(x64, labels, 0.7)
    (g_lp * ref_lp + g_ent * ref_ent + g_lse * ref_lse).sum().backward()
    m = logits_magnitude(x, 0.7)
    for name, got, ref in (("log p", out.log_probs, ref_lp), ("entropy", out.entropy, ref_ent), ("lse", out.lse, ref_lse)):
        assert got.dtype == torch.float32 and got.shape == labels.shape
        assert_close_f32(got, ref, depth=FWD, logits=m, msg=name)
    assert torch.all(out.log_probs[labels == -100] == 0) and torch.all(out.entropy[labels == -100] == 0)
    assert x.grad.dtype == dtype
    # (a 16-bit gradient: assert_close_f32 adds its rounding, half an ulp)
    assert_close_f32(x.grad, x64.grad, depth=GRAD, logits=m, floor=0, msg="dx")


@pytest.mark.parametrize("backend,two_level", PATHS, ids=PATH_IDS)
def test_single_functions_match_logits_stats(monkeypatch, backend, two_level):
    """log_probs_from_logits / entropy_from_logits / logsumexp: values and gradients vs float64."""
    _force(monkeypatch, two_level)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, V, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, V, (5,), generator=g)
    x64 = x.detach().double().requires_grad_()

    def ref_entropy(t):  # no labels: no row is ignored
        p = (t / 1.3).softmax(-1)
        return -(p * p.log()).sum(-1)

    m = logits_magnitude(x, 1.3)
    for fn, ref_fn in ((lambda t: log_probs_from_logits(t, labels, temperature=1.3, backend=backend),
                        lambda t: _reference(t, labels, 1.3)[0]),
                       (lambda t: entropy_from_logits(t, temperature=1.3, backend=backend), ref_entropy),
                       (lambda t: logsumexp(t, temperature=1.3, backend=backend),
                        lambda t: _reference(t, labels, 1.3)[2])):
        x.grad = x64.grad = None
        w = torch.randn(5, generator=g)
        got, ref = fn(x), ref_fn(x64)
        (w * got).sum().backward()
        (w * ref).sum().backward()
        assert_close_f32(got, ref, depth=FWD, logits=m)
        assert_close_f32(x.grad, x64.grad, depth=GRAD, logits=m, floor=0, msg="dx")


def test_two_level_and_one_level_are_bitwise_equal_and_batch_invariant(monkeypatch):
    """Both launch shapes run the same per-split arithmetic in the same merge order, so they agree
    bitwise; a row's result does not depend on which other rows are in the batch."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 997, generator=g) * 5  # 997: prime, 16 splits of 64 with a partial last
    labels = torch.randint(0, 997, (9,), generator=g)
    results = []
    for two_level in (False, True):
        _force(monkeypatch, two_level)
        results.append(logits_stats(x, labels, return_sum_pi_squared=True, backend="triton"))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    _force(monkeypatch, False)
    alone = logits_stats(x[4:5], labels[4:5], return_sum_pi_squared=True, backend="triton")
    for a, b in zip(alone, results[0]):
        assert torch.equal(a[0], b[4])


@pytest.mark.parametrize("n,v", [(5, 997), (1, 70), (3, 64)])  # several splits; one row; one split
def test_two_level_combine_in_one_launch_or_two(n, v):
    """The two-level forward merges each row either in its last split's program (one launch, with
    per-row counters) or in a combine launch: the same bits, the float64 values, all five
    statistics, with a label on an ignored row (placeholder outputs poisoned first)."""
    from rl_kernels.autograd.logits import LogitsParams
    from rl_kernels.core.backends import get_backend
    from rl_kernels.ops import logits_config, logits_forward

    g = torch.Generator().manual_seed(n * v)
    x = torch.randn(n, v, generator=g) * 4
    labels = torch.randint(0, v, (n,), generator=g)
    labels[-1] = -100
    params = LogitsParams(backend=get_backend("triton", x.device), inv_temperature=1 / 0.7, ignore_index=-100,
                          return_entropy=True, name="test", return_mean_log_p=True, return_sum_pi_squared=True)
    cfg = logits_config(x.device)
    paths = []
    for last in (True, False):
        with torch.no_grad():
            paths.append(logits_forward(x, labels, params, cfg, two_level=True, last_combines=last))
    lp, ent, lse = _reference(x, labels, 0.7)
    log_p = (x.double() / 0.7).log_softmax(-1)
    p = log_p.exp()
    valid = labels != -100
    want = {"log_probs": lp, "entropy": ent, "lse": lse, "mean_log_p": log_p.mean(-1),
            "sum_pi_squared": torch.where(valid, (p * p).sum(-1), 0.0)}
    m = logits_magnitude(x, 0.7)
    for key, ref in want.items():
        assert torch.equal(paths[0][key], paths[1][key]), key
        # 1/T's two roundings and the row's sums over v columns; mean_log_p sums log p over the v columns once more
        assert_close_f32(paths[0][key], ref, depth=(2 * v if key == "mean_log_p" else v) + 2, logits=m, msg=key)


@pytest.mark.parametrize("two_level", [False, True])
def test_prefetch_and_blocks_per_program_keep_the_bits(two_level):
    """The bandwidth variants of the from-logits kernels (forward: the next block loaded before
    this block's math; backward: several column blocks per program, the next one prefetched) give
    the shipped variant's bits, forward and backward, with a partial last block and a partial last
    program; and the float64 gradient (outputs poisoned first)."""
    import dataclasses

    from rl_kernels.autograd.logits import LogitsParams
    from rl_kernels.core.backends import get_backend
    from rl_kernels.ops import logits_backward, logits_config, logits_forward

    g = torch.Generator().manual_seed(11)
    n, v = 3, 997  # 16 splits of 64 (blocks of 32; last split 37 columns); 32 backward blocks of 64
    x = torch.randn(n, v, generator=g) * 4
    labels = torch.randint(0, v, (n,), generator=g)
    labels[1] = -100
    grads = {"log_probs": torch.randn(n, generator=g), "entropy": torch.randn(n, generator=g)}
    params = LogitsParams(backend=get_backend("triton", x.device), inv_temperature=1 / 0.7, ignore_index=-100,
                          return_entropy=True, name="test")
    base = logits_config(x.device)
    results = []
    for fields in (dict(bwd_blocks_per_program=1, prefetch=False), {}, dict(prefetch=True),
                   dict(bwd_blocks_per_program=3), dict(prefetch=True, bwd_blocks_per_program=5)):
        cfg = dataclasses.replace(base, **fields)
        with torch.no_grad():
            stats = logits_forward(x, labels, params, cfg, two_level=two_level)
            grad = logits_backward(x, torch.full_like(x, float("nan")), labels, stats, grads, params, cfg)
        results.append((stats["log_probs"], stats["entropy"], stats["lse"], grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    x64 = x.double().requires_grad_()
    lp, ent, _ = _reference(x64, labels, 0.7)
    (lp * grads["log_probs"].double() + ent * grads["entropy"].double()).sum().backward()
    assert_close_f32(results[0][3], x64.grad, depth=2 * v + 2, logits=logits_magnitude(x, 0.7), floor=0, msg="dx")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_inplace_backward_writes_the_logits_storage(backend):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, V, generator=g)
    labels = torch.randint(0, V, (6,), generator=g)
    w = torch.randn(6, generator=g)
    a = x.clone().requires_grad_()
    (w * log_probs_from_logits(a, labels, backend=backend)).sum().backward()
    leaf = x.clone().requires_grad_()
    b = leaf * 1.0  # a non-leaf, as the logits coming out of a model's head
    (w * log_probs_from_logits(b, labels, inplace_backward=True, backend=backend)).sum().backward()
    torch.testing.assert_close(b.detach(), a.grad, atol=0, rtol=0)  # b's storage now holds the grad
    torch.testing.assert_close(leaf.grad, a.grad, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
def test_cross_entropy_matches_torch(poison, backend, reduction, label_smoothing):
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(11, V, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, V, (11,), generator=g)
    labels[3] = labels[7] = -100
    x64 = x.detach().double().requires_grad_()
    got = cross_entropy(x, labels, reduction=reduction, label_smoothing=label_smoothing, backend=backend)
    ref = F.cross_entropy(x64, labels, reduction=reduction, label_smoothing=label_smoothing)
    w = torch.randn(ref.shape, generator=g)
    (w * got).sum().backward()
    (w * ref).sum().backward()
    assert got.dtype == x.dtype and got.shape == ref.shape
    # label smoothing sums log p over the V columns once more; "sum" / "mean" add the sum over the 11 rows (and
    # "sum" the rows' errors: the magnitude times 11)
    n = x.shape[0]
    depth = FWD + (V if label_smoothing else 0) + (n + 1 if reduction != "none" else 0)
    m = logits_magnitude(x) * (n if reduction == "sum" else 1)
    assert_close_f32(got, ref, depth=depth, logits=m, msg="loss")
    assert_close_f32(x.grad, x64.grad, depth=GRAD + (V if label_smoothing else 0) + 1, logits=m, floor=0, msg="dx")


@pytest.mark.parametrize("backend,two_level", PATHS, ids=PATH_IDS)
def test_extreme_logits_stay_finite(monkeypatch, backend, two_level):
    _force(monkeypatch, two_level)
    x = torch.full((3, V), -1e4)
    x[0, 5] = 50.0
    x[2, :200] = float("-inf")  # masked-out vocabulary entries
    labels = torch.tensor([5, 7, 250])
    x = x.requires_grad_()
    out = logits_stats(x, labels, return_sum_pi_squared=True, backend=backend)
    assert all(torch.isfinite(t).all() for t in out)
    assert out.log_probs[0].item() == pytest.approx(0.0, abs=1e-6)
    assert out.sum_pi_squared[0].item() == pytest.approx(1.0, abs=1e-6)  # one-hot
    assert out.sum_pi_squared[1].item() == pytest.approx(1.0 / V, rel=1e-5)  # uniform
    assert out.log_probs[1].item() == pytest.approx(-5.7071, abs=1e-3)
    assert out.entropy[1].item() == pytest.approx(torch.log(torch.tensor(float(V))).item(), abs=1e-4)
    assert out.entropy[2].item() == pytest.approx(torch.log(torch.tensor(101.0)).item(), abs=1e-4)
    (out.log_probs + out.entropy).sum().backward()
    assert torch.isfinite(x.grad).all() and torch.all(x.grad[2, :200] == 0)


def test_bad_inputs_name_the_argument():
    x = torch.randn(4, V)
    with pytest.raises(TypeError, match="logits: expected bfloat16, float16 or float32"):
        log_probs_from_logits(x.double(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels: expected shape \(4,\)"):
        log_probs_from_logits(x, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="labels: 1 entries lie outside"):
        logits_stats(x, torch.tensor([0, 1, V, -100]))
    with pytest.raises(TypeError, match="labels: expected int64 or int32"):
        log_probs_from_logits(x, torch.zeros(4))
    with pytest.raises(ValueError, match="temperature: expected a positive finite number"):
        entropy_from_logits(x, temperature=0.0)
    with pytest.raises(ValueError, match="logits: expected shape"):
        logsumexp(torch.randn(4, 0))
    with pytest.raises(ValueError, match="backend: expected one of"):
        logsumexp(x, backend="cuda")
    with pytest.raises(TypeError, match="inplace_backward: expected a bool"):
        log_probs_from_logits(x, torch.zeros(4, dtype=torch.long), inplace_backward=1)
    with pytest.raises(ValueError, match="inplace_backward=True: logits"):
        log_probs_from_logits(torch.randn(2, V, 4).transpose(1, 2),  # (2, 4, V): not viewable as 2-D
                              torch.zeros(2, 4, dtype=torch.long), inplace_backward=True)
    labels = torch.zeros(4, dtype=torch.long)
    # no class-weight argument (every `weight` of rl_kernels is an lm_head weight): torch's
    # positional weight is refused, not ignored
    with pytest.raises(TypeError, match="positional argument"):
        cross_entropy(x, labels, torch.ones(V))
    with pytest.raises(TypeError, match="weight"):
        cross_entropy(x, labels, weight=torch.ones(V))
    with pytest.raises(ValueError, match="reduction: expected one of"):
        cross_entropy(x, labels, reduction="batchmean")
    with pytest.raises(ValueError, match=r"label_smoothing: expected a Python number in \[0, 1\], got 1.5"):
        cross_entropy(x, labels, label_smoothing=1.5)
    with pytest.raises(ValueError, match="logits: expected 2-D"):
        cross_entropy(x[None], labels[None])


