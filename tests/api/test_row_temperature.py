"""A per-row temperature (a float tensor shaped like the labels, verl's per-sample temperature) in
the fused head and its from-logits twins: values and gradients against float64 on fresh random
inputs, both backends, eager and compiled; a constant per-row temperature gives the scalar
temperature's bits; bad temperatures raise one-line errors naming ``temperature``.

Shapes: (37, 72, 1007) is odd in every dimension against the interpreter's tiles (3 row blocks, 4
vocab splits, H not a multiple of block_k); the temperatures span [0.3, 2.3) so that rows of one
tile differ by up to 8x. Tolerances: float32 inputs with float32 accumulation, as in
test_linear_log_probs (values |error| <= 2e-5 nats, gradients relative Frobenius <= 2e-5).
"""
import pytest
import torch

from rl_kernels import entropy_from_logits, linear_log_probs, log_probs_from_logits, logits_stats
from rl_kernels.tools.reference import (make_inputs, reference_linear_grads, reference_linear_log_probs,
                                        reference_logits_stats, rel_err)

BACKENDS = ["triton", "torch"]
# the interpreter skip, and the backward forced into several windows (``small_chunks``, so that a
# window's rows read their own temperatures): the fixtures of tests/api/conftest.py
pytestmark = pytest.mark.usefixtures("_needs_interpreter")
VALUE_ATOL = 2e-5
GRAD_RTOL = 2e-5
N, H, V = 37, 72, 1007


def _temperatures(n: int, seed: int) -> torch.Tensor:
    return torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 2.0 + 0.3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_head_per_row_temperature_matches_float64(backend, softcap, poison, small_chunks):
    hidden, weight, labels = make_inputs(N, H, V, torch.float32, seed=11)
    labels[5] = -100
    temperature = _temperatures(N, 3)
    g = torch.Generator().manual_seed(4)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)

    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=temperature, softcap=softcap, return_sum_pi_squared=True,
                           backend=backend)
    ref = reference_linear_log_probs(hidden, weight, labels, temperature=temperature, softcap=softcap)
    assert (out.log_probs.double() - ref.log_probs).abs().max() <= VALUE_ATOL
    assert (out.entropy.double() - ref.entropy).abs().max() <= VALUE_ATOL
    assert (out.sum_pi_squared.double() - ref.sum_pi_squared).abs().max() <= VALUE_ATOL
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    dh, dw = reference_linear_grads(hidden, weight, labels, g_lp, g_ent, temperature=temperature, softcap=softcap)
    assert rel_err(hx.grad, dh) <= GRAD_RTOL and rel_err(wx.grad, dw) <= GRAD_RTOL
    # the temperature is per row: the scalar temperature of any one row gives other values
    scalar = linear_log_probs(hidden, weight, labels, temperature=float(temperature[0]), backend=backend)
    assert (scalar.log_probs - out.log_probs).abs().max() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_constant_rows_equal_the_scalar_temperature_bitwise(backend):
    hidden, weight, labels = make_inputs(33, 65, 257, torch.float32, seed=5)
    a = linear_log_probs(hidden, weight, labels, temperature=torch.full((33,), 0.7), backend=backend)
    b = linear_log_probs(hidden, weight, labels, temperature=0.7, backend=backend)
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.entropy, b.entropy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_logits_per_row_temperature_matches_float64(backend, poison):
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(2, 19, V, generator=g) * 3).requires_grad_()
    labels = torch.randint(0, V, (2, 19), generator=g)
    labels[1, 4] = -100
    temperature = _temperatures(38, 8).view(2, 19)
    stats = logits_stats(logits, labels, temperature=temperature, return_sum_pi_squared=True, backend=backend)
    ref = reference_logits_stats(logits.detach(), labels, temperature=temperature)
    for got, want in ((stats.log_probs, ref.log_probs), (stats.entropy, ref.entropy), (stats.lse, ref.lse),
                      (stats.sum_pi_squared, ref.sum_pi_squared)):
        assert got.shape == labels.shape and (got.double() - want).abs().max() <= VALUE_ATOL
    g_lp, g_ent = torch.randn(2, 19, generator=g), torch.randn(2, 19, generator=g)
    (stats.log_probs * g_lp + stats.entropy * g_ent).sum().backward()
    x64 = logits.detach().double().requires_grad_()
    log_p = torch.log_softmax(x64 / temperature.double()[..., None], -1)
    valid = labels != -100
    lp = torch.where(valid, log_p.gather(-1, labels.clamp_min(0)[..., None])[..., 0], 0.0)
    ent = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    assert rel_err(logits.grad, x64.grad) <= GRAD_RTOL
    # the one-output twins take it too
    lp2 = log_probs_from_logits(logits.detach(), labels, temperature=temperature, backend=backend)
    ent2 = entropy_from_logits(logits.detach(), temperature=temperature, backend=backend)
    assert (lp2.double() - ref.log_probs).abs().max() <= VALUE_ATOL
    assert (ent2.double() - reference_logits_stats(logits.detach(), temperature=temperature).entropy).abs().max() \
        <= VALUE_ATOL


def test_compiled_per_row_temperature_one_graph_same_bits():
    """Under torch.compile(fullgraph=True) a new per-row temperature is a new input of the same
    graph (no recompilation), and the compiled results are the eager ones, bit for bit."""
    from torch._dynamo.testing import CompileCounterWithBackend

    hidden, weight, labels = make_inputs(17, 32, 100, torch.float32, seed=9)
    h, w = hidden.requires_grad_(), weight.requires_grad_()

    def f(h, w, labels, temperature):
        out = linear_log_probs(h, w, labels, temperature=temperature, backend="torch")
        return out.log_probs.sum() + out.entropy.sum()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    for seed in range(3):
        temperature = _temperatures(17, seed)
        a = compiled(h, w, labels, temperature)
        b = f(h, w, labels, temperature)
        assert torch.equal(a, b)
        for ga, gb in zip(torch.autograd.grad(a, (h, w)), torch.autograd.grad(b, (h, w))):
            assert torch.equal(ga, gb)
    assert counter.frame_count == 1


@pytest.mark.parametrize("change,error,match", [
    (dict(temperature=torch.ones(18)), ValueError,
     r"temperature: a per-row temperature must have the shape of (labels|logits.shape\[:-1\]), \(17,\)"),
    (dict(temperature=torch.ones(17, dtype=torch.int64)), TypeError,
     r"temperature: expected float32, float64, bfloat16 or float16 \(a per-row temperature\), got .*int64"),
    (dict(temperature=torch.full((17,), float("nan"))), ValueError, "temperature: row 0 is nan"),
    (dict(temperature=torch.cat([torch.ones(16), -torch.ones(1)])), ValueError, "temperature: row 16 is -1.0"),
    (dict(temperature=torch.ones(17).requires_grad_()), ValueError, "temperature: .*requires grad"),
    (dict(temperature=torch.tensor(0.7)), TypeError, "temperature: .*pass float"),
])
def test_bad_per_row_temperature_raises(change, error, match):
    hidden, weight, labels = make_inputs(17, 32, 100, torch.float32, seed=2)
    with pytest.raises(error, match=match):
        linear_log_probs(hidden, weight, labels, **{"backend": "torch", **change})
    with pytest.raises(error, match=match):
        log_probs_from_logits(hidden @ weight.T, labels, **{"backend": "torch", **change})


@pytest.mark.gpu
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_gpu_bf16_per_row_temperature_matches_float64(softcap):
    """On CUDA (Triton, bf16 inputs, every head kernel's ROW_TEMPERATURE variant and the from-logits
    ones): values within 5e-5 nats of float64 from the same bf16 values, gradients within 1e-2
    relative (one bf16 rounding of dh / dW / dlogits); constant rows give the scalar's bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    n, h, v = 257, 256, 4099
    g = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (0.3 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    labels[7] = -100
    temperature = torch.rand(n, device="cuda", generator=g) * 2 + 0.3
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=temperature, softcap=softcap, backend="triton")
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    ref = reference_linear_log_probs(hidden, weight, labels, temperature=temperature, softcap=softcap)
    dh, dw = reference_linear_grads(hidden, weight, labels, g_lp, g_ent, temperature=temperature, softcap=softcap)
    assert (out.log_probs.double() - ref.log_probs).abs().max() <= 5e-5
    assert (out.entropy.double() - ref.entropy).abs().max() <= 5e-5
    assert rel_err(hx.grad, dh) <= 1e-2 and rel_err(wx.grad, dw) <= 1e-2
    logits = (hidden @ weight.T).requires_grad_()
    stats = logits_stats(logits, labels, temperature=temperature, backend="triton")
    (stats.log_probs * g_lp + stats.entropy * g_ent).sum().backward()
    ref = reference_logits_stats(logits.detach(), labels, temperature=temperature)
    assert (stats.log_probs.double() - ref.log_probs).abs().max() <= 5e-5
    assert (stats.entropy.double() - ref.entropy).abs().max() <= 5e-5
    x64 = logits.detach().double().requires_grad_()
    log_p = torch.log_softmax(x64 / temperature.double()[:, None], -1)
    valid = labels != -100
    lp = torch.where(valid, log_p.gather(-1, labels.clamp_min(0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    assert rel_err(logits.grad, x64.grad) <= 1e-2
    a = linear_log_probs(hidden, weight, labels, temperature=torch.full((n,), 0.7, device="cuda"), backend="triton")
    b = linear_log_probs(hidden, weight, labels, temperature=0.7, backend="triton")
    assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.entropy, b.entropy)
