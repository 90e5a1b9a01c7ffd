"""The tail-aware top-K KL on the fused head (issue 45; verl RFC #7856): ``linear_topk_kl(tail=True)``
and ``linear_log_probs_at_ids(return_tail=True)`` against a float64 reference written here (logits in
float64, the tail's logsumexp with the K ids masked, the (K+1)-category KL), values and gradients,
both kinds and both backends (Triton in the CPU interpreter, 64-column splits and small backward
windows, so a row's ids fall in several tiles); then the ill-conditioned rows (teacher mass 1
exactly, a student tail of 1e-6 and 1e-30, K = V), a row where 1 - sum_k q_k would be wrong, the
errors, and the compiled route (no graph break, the changed ops under opcheck). The vocab-parallel
case is in tests/api/tp_worker.py."""
import math

import pytest
import torch
import torch._dynamo.testing
from heads import reference_tail_kl
from tolerances import assert_close_f32, head_magnitude
import triton
import triton.language as tl

import rl_kernels.autograd.backward_schedule as rl_autograd
import rl_kernels.autograd.linear as linear_autograd
from rl_kernels import linear_topk_kl
from rl_kernels.core.backends import get_backend
from rl_kernels.distill import linear_log_probs_at_ids
from rl_kernels.autograd.head_family import sorted_tail_ids
from rl_kernels.ops.building_blocks import among_ids

N, H, V, K = 11, 20, 203, 5
# float32 rounding bounds (tests/support/tolerances.py): a loss or log-prob passes through a logit's dot
# product (H) and its row's sums (V); a gradient then through dh's sum over the V columns or dW's over the N rows
FWD, GRAD = H + V, H + V + max(V, N)


@pytest.fixture(autouse=True)
def small_windows(monkeypatch):
    """Backward dlogits windows of ~64 columns: the masked tail gradient spans several windows."""
    monkeypatch.setattr(rl_autograd, "MIN_CHUNK_ELEMENTS", 64 * N)


def _inputs(seed, k=K):
    """Random student head, distinct ids per row, a teacher whose top-K mass is below 1 (a softmax
    over K + 1 categories, the last dropped), one slot at -inf, and a mask with excluded rows."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = 0.4 * torch.randn(V, H, generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])
    t_lp = torch.log_softmax(2 * torch.randn(N, k + 1, generator=g), -1)[:, :k].contiguous()
    t_lp[3, -1] = float("-inf")
    mask = torch.rand(N, generator=g) > 0.3
    mask[0] = True
    return h, w, ids, t_lp, mask


def _tail_mask(ids, v=V):
    return torch.zeros(ids.shape[0], v, dtype=torch.bool).scatter_(1, ids, True)


def _log_q(h64, w64, ids, temperature):
    """float64 (log q at the ids, log q_tail), the tail with the ids masked (no cancellation)."""
    z = h64 @ w64.T / temperature
    lse = torch.logsumexp(z, -1)
    tail = torch.logsumexp(z.masked_fill(_tail_mask(ids, z.shape[1]), float("-inf")), -1)
    return z.gather(1, ids) - lse[:, None], tail - lse


def _reference(h, w, ids, t_lp, mask, temperature, kind, reduction):
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    log_q, log_q_tail = _log_q(h64, w64, ids, temperature)
    per = torch.where(mask, reference_tail_kl(log_q, log_q_tail, t_lp, kind) * temperature ** 2, 0.0)
    out = {"none": per, "sum": per.sum(), "mean": per.sum() / mask.sum(), "batchmean": per.sum() / N}[reduction]
    return out, h64, w64


def _check(h, w, ids, t_lp, mask, temperature, kind, reduction, backend):
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = linear_topk_kl(hx, wx, ids, t_lp, mask=mask, temperature=temperature, kind=kind, tail=True,
                         reduction=reduction, backend=backend)
    ref, h64, w64 = _reference(h, w, ids, t_lp, mask, temperature, kind, reduction)
    up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9)).double()
    (up * ref).sum().backward()
    (up.float() * got).sum().backward()
    assert got.dtype == torch.float32 and got.shape == ref.shape
    m = head_magnitude(h, w, temperature) * (N if reduction == "sum" else 1)
    assert_close_f32(got, ref, depth=FWD, logits=m, msg="loss")
    assert_close_f32(hx.grad, h64.grad, depth=GRAD, logits=m, floor=0, msg="dh")
    assert_close_f32(wx.grad, w64.grad, depth=GRAD, logits=m, floor=0, msg="dw")
    assert torch.all(hx.grad[~mask] == 0)  # excluded rows: exactly no gradient
    return got, ref


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind,reduction,temperature,k", [
    ("forward", "mean", 1.0, K),
    ("reverse", "none", 0.7, K),
    ("forward", "sum", 1.3, 1),
    ("reverse", "batchmean", 1.0, 9),
])
def test_tail_kl_values_and_gradients(poison, backend, kind, reduction, temperature, k):
    h, w, ids, t_lp, mask = _inputs(seed=k + 3 * (kind == "reverse"), k=k)
    _check(h, w, ids, t_lp, mask, temperature, kind, reduction, backend)
    # the tail changes the loss: the plain top-K KL differs (a test that could not tell them apart would pass)
    plain = linear_topk_kl(h, w, ids, t_lp, mask=mask, temperature=temperature, kind=kind, reduction="sum",
                           backend=backend)
    tailed = linear_topk_kl(h, w, ids, t_lp, mask=mask, temperature=temperature, kind=kind, reduction="sum",
                            backend=backend, tail=True)
    assert abs(float(plain - tailed)) > 1e-3


def _ill_conditioned(log_q_tail_target, seed=1):
    """Inputs whose student tail mass is about exp(log_q_tail_target) on rows 1.. (the ids get a large
    logit along one hidden dimension), with row 0 a teacher of top-K mass exactly 1 (p_tail = 0)."""
    h, w, ids, t_lp, mask = _inputs(seed)
    ids[1:] = torch.arange(K)  # the same ids on the hard rows: one weight column lifts them
    h[:, 1:] *= 0.05
    w[:, 0] = 0.0
    w[:K, 0] = 1.0
    lift = math.log((V - K) / K) - log_q_tail_target
    h[:, 0] = lift
    h[0, 0] = 0.0
    t_lp[0] = torch.log_softmax(torch.randn(K, generator=torch.Generator().manual_seed(seed)), -1)  # P = 1
    t_lp[3, -1] = float("-inf")
    mask[:] = True
    return h, w, ids, t_lp, mask


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_tiny_student_tail_1e6_within_tolerance_where_one_minus_q_fails(backend, kind):
    """q_tail ~ 1e-6: the kernels' masked logsumexp keeps the tolerance; log(1 - sum_k q_k) in float32
    (the naive formula) is off by far more, so the case is hard. Row 0: teacher mass 1 (p_tail = 0)."""
    h, w, ids, t_lp, mask = _ill_conditioned(math.log(1e-6))
    _, log_q_tail = _log_q(h.double(), w.double(), ids, 1.0)
    assert torch.all((log_q_tail[1:] - math.log(1e-6)).abs() < 0.5)
    assert float(t_lp[0].double().exp().sum()) == pytest.approx(1.0, abs=1e-6)
    got, ref = _check(h, w, ids, t_lp, mask, 1.0, kind, "none", backend)
    # the naive tail from the float32 log-probs at the ids: 1 - Q cancels
    _, _, log_q32, tail32 = linear_log_probs_at_ids(h, w, ids[:, 0], ids, return_tail=True, backend=backend)
    naive = torch.log1p(-log_q32.exp().sum(-1)).double()  # (NaN where sum_k q_k rounds above 1)
    error = (naive[1:] - log_q_tail[1:]).abs().nan_to_num(float("inf"))
    assert error.max() > 0.1, error  # the cancellation's error in log q_tail
    assert_close_f32(tail32[1:], log_q_tail[1:], depth=FWD, logits=head_magnitude(h, w))
    if kind == "forward":  # p_tail log q_tail: the naive formula's loss is wrong (the reverse weighs it by q_tail)
        naive_loss = reference_tail_kl(log_q32.double(), naive.clamp_max(0), t_lp, kind)
        assert (naive_loss - ref.detach()).abs().nan_to_num(float("inf")).max() > 1e-2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_student_tail_1e30_and_k_equals_v_are_finite(backend):
    """q_tail ~ 1e-30 (1 - sum q_k is exactly 0 in float32): finite loss and gradients, close to the
    reference; K = V (no tail at all, tail_lse = -inf): finite, the floored reference."""
    h, w, ids, t_lp, mask = _ill_conditioned(math.log(1e-30))
    for kind in ("forward", "reverse"):
        hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
        got = linear_topk_kl(hx, wx, ids, t_lp, kind=kind, tail=True, reduction="none", backend=backend)
        got.sum().backward()
        assert torch.isfinite(got).all() and torch.isfinite(hx.grad).all() and torch.isfinite(wx.grad).all()
        ref, _, _ = _reference(h, w, ids, t_lp, mask, 1.0, kind, "none")
        assert_close_f32(got, ref, depth=FWD, logits=head_magnitude(h, w), msg=kind)
    g = torch.Generator().manual_seed(2)
    hs, ws = torch.randn(3, H, generator=g), 0.4 * torch.randn(V, H, generator=g)
    ids = torch.stack([torch.randperm(V, generator=g) for _ in range(3)])
    t_lp = torch.log_softmax(torch.randn(3, V, generator=g), -1)
    for kind in ("forward", "reverse"):
        hx, wx = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        got = linear_topk_kl(hx, wx, ids, t_lp, kind=kind, tail=True, reduction="sum", backend=backend)
        got.backward()
        assert torch.isfinite(got) and torch.isfinite(hx.grad).all() and torch.isfinite(wx.grad).all()
        ref, h64, w64 = _reference(hs, ws, ids, t_lp, torch.ones(3, dtype=torch.bool), 1.0, kind, "sum")
        ref.backward()
        m = head_magnitude(hs, ws) * 3  # reduction "sum" over 3 rows
        assert_close_f32(got, ref, depth=FWD, logits=m, msg=f"{kind} loss, K = V")
        assert_close_f32(hx.grad, h64.grad, depth=GRAD, logits=m, floor=0, msg=f"{kind} dh, K = V")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_log_probs_at_ids_return_tail(poison, backend):
    """The 4th output: log q_tail (labels' shape, float32), differentiable, with a per-row temperature;
    a -100 position gets no gradient; the first three outputs are those of return_tail=False."""
    h, w, ids, _, _ = _inputs(5)
    labels = ids[:, 2].clone()
    labels[4] = -100
    temperature = torch.rand(N, generator=torch.Generator().manual_seed(1)) + 0.5
    hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp, ent, lq, tail = linear_log_probs_at_ids(hx.view(1, N, H), wx, labels.view(1, N), ids.view(1, N, K),
                                                temperature=temperature.view(1, N), backend=backend,
                                                return_tail=True)
    assert ent is None and tail.shape == (1, N) and tail.dtype == torch.float32
    g = torch.Generator().manual_seed(3)
    g_lp, g_tail, g_q = torch.randn(N, generator=g), torch.randn(N, generator=g), torch.randn(N, K, generator=g)
    (lp[0] * g_lp + tail[0] * g_tail + (lq[0] * g_q).sum(-1)).sum().backward()
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    log_q, log_q_tail = _log_q(h64, w64, ids, temperature.double()[:, None])
    log_p = torch.log_softmax(h64 @ w64.T / temperature.double()[:, None], -1).gather(1, labels.clamp_min(0)[:, None])
    valid = labels != -100
    ref_lp = torch.where(valid, log_p[:, 0], 0.0)
    m = head_magnitude(h, w, temperature)
    assert_close_f32(tail[0], log_q_tail, depth=FWD, logits=m, msg="log q_tail")
    assert_close_f32(lq[0], log_q, depth=FWD, logits=m, msg="log q at the ids")
    (torch.where(valid, ref_lp * g_lp + log_q_tail * g_tail + (log_q * g_q).sum(-1), 0.0)).sum().backward()
    assert_close_f32(hx.grad, h64.grad, depth=GRAD, logits=m, floor=0, msg="dh")
    assert_close_f32(wx.grad, w64.grad, depth=GRAD, logits=m, floor=0, msg="dw")
    assert torch.all(hx.grad[4] == 0)
    plain = linear_log_probs_at_ids(h, w, labels, ids, temperature=temperature, backend=backend)
    assert len(plain) == 3 and torch.equal(plain[2], lq[0].detach()) and torch.equal(plain[0], lp[0].detach())


def test_errors_name_the_argument():
    h, w, ids, t_lp, mask = _inputs(0)
    with pytest.raises(ValueError, match="renormalize_teacher"):
        linear_topk_kl(h, w, ids, t_lp, tail=True, renormalize_teacher=True, backend="torch")
    with pytest.raises(TypeError, match="tail"):
        linear_topk_kl(h, w, ids, t_lp, tail=1, backend="torch")
    dup = ids.clone()
    dup[2, 3] = dup[2, 1]
    with pytest.raises(ValueError, match=r"teacher_token_ids: .*distinct.*flat position 2"):
        linear_topk_kl(h, w, dup, t_lp, tail=True, backend="torch")
    mask2 = mask.clone()
    mask2[2] = False  # a repeated id in a row that does not count is fine
    linear_topk_kl(h, w, dup, t_lp, mask=mask2, tail=True, backend="torch")
    linear_topk_kl(h, w, dup, t_lp, backend="torch")  # and without the tail
    heavy = t_lp.clone()
    heavy[0] = math.log(1.05 / K)  # top-K mass 1.05 (position 0 counts)
    with pytest.raises(ValueError, match=r"teacher_log_probs: .*1 \+ 0.01.*flat position 0"):
        linear_topk_kl(h, w, ids, heavy, mask=mask, tail=True, backend="torch")
    heavy[0] = math.log(1.005 / K)  # rounding-sized excess: clamped (p_tail = 0), the reference's value
    got = linear_topk_kl(h, w, ids, heavy, mask=mask, tail=True, reduction="none", backend="torch")
    ref, _, _ = _reference(h, w, ids, heavy, mask, 1.0, "forward", "none")
    assert_close_f32(got, ref, depth=FWD, logits=head_magnitude(h, w))
    labels = ids[:, 0].clone()
    with pytest.raises(ValueError, match="token_ids: .*distinct"):
        linear_log_probs_at_ids(h, w, labels, dup, return_tail=True, backend="torch")
    labels[2] = -100
    linear_log_probs_at_ids(h, w, labels, dup, return_tail=True, backend="torch")  # (ignored position)
    with pytest.raises(ValueError, match="return_tail"):
        linear_autograd.linear_head(h, w, labels, linear_autograd.HeadParams(
            get_backend("torch", h.device), 1.0, -100, False, return_tail=True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_tail_kl_equals_eager_without_graph_breaks(backend):
    h, w, ids, t_lp, mask = _inputs(7)

    def f(hh, ww):
        return linear_topk_kl(hh, ww, ids, t_lp, mask=mask, temperature=0.9, kind="reverse", tail=True,
                              reduction="sum", backend=backend)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    grads = []
    for fn in (f, torch.compile(f, backend=counter, fullgraph=True)):
        hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hx, wx)
        loss.backward()
        grads.append((loss.detach(), hx.grad, wx.grad))
    assert counter.frame_count == 1
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    bad = ids.clone()
    bad[0, 1] = bad[0, 0]
    with pytest.raises(Exception, match="teacher_token_ids"):  # the check runs inside the compiled op too
        torch.compile(lambda hh, ww: linear_topk_kl(hh, ww, bad, t_lp, tail=True, backend=backend),
                      backend="aot_eager", fullgraph=True)(h, w)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_compiled_log_probs_at_ids_with_tail_equals_eager_and_still_checks_the_ids(backend):
    """``linear_log_probs_at_ids`` (the fused distillation's student call) traced whole by
    torch.compile(fullgraph=True): one graph, no break (its id checks, a value range and the tail's
    distinct ids, run inside the ``rl_kernels::checked_token_ids`` op), the log-probs at the labels
    and at the ids, the tail and both gradients bitwise eager's; an id out of range and a repeated id
    at a counted position still raise, naming ``token_ids``, from the compiled function."""
    h, w, ids, _, mask = _inputs(9)
    labels = torch.where(mask, ids[:, 0], -100)

    def f(hh, ww, i):
        lp, _, at_ids, tail = linear_log_probs_at_ids(hh, ww, labels, i, temperature=0.8, return_tail=True,
                                                      backend=backend)
        return lp, at_ids, tail

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    up = torch.randn(N, K + 2, generator=torch.Generator().manual_seed(3))
    runs = []
    for fn in (f, torch.compile(f, backend=counter, fullgraph=True)):
        hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, at_ids, tail = fn(hx, wx, ids)
        (torch.cat([lp[:, None], at_ids, tail[:, None]], 1) * up).sum().backward()
        runs.append((lp.detach(), at_ids.detach(), tail.detach(), hx.grad, wx.grad))
    assert counter.frame_count == 1
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    out_of_range, repeated = ids.clone(), ids.clone()
    out_of_range[1, 2] = V
    repeated[0, 1] = repeated[0, 0]  # (position 0 counts: mask[0] is True)
    for bad, message in ((out_of_range, "token_ids: values must lie in"), (repeated, "token_ids: .*distinct")):
        with pytest.raises(Exception, match=message):
            compiled(h, w, bad)


def test_changed_ops_pass_opcheck():
    """opcheck of the ops the tail changed: the head's forward with ``return_tail`` (its 6th output),
    its backward (tail_lse and its gradient in), and counted_positions with ``tail``."""
    h, w, ids, t_lp, mask = _inputs(8)
    labels = torch.where(mask, ids[:, 0], -100)
    torch_backend = get_backend("torch", h.device)
    params = linear_autograd.HeadParams(torch_backend, 1 / 0.8, -100, False, "linear_topk_kl", return_tail=True)
    args = linear_autograd.OP_ARGS.pack(params, None)
    torch.library.opcheck(torch.ops.rl_kernels.linear_forward.default, (h, w, labels, ids, *args))
    out = torch.ops.rl_kernels.linear_forward(h, w, labels, ids, *args)
    assert out[5].shape == (N,) and torch.isfinite(out[5]).all()
    lse, tail = out[2], out[5]
    g = torch.Generator().manual_seed(1)
    grads = (None, None, torch.randn(N, generator=g), None, torch.randn(N, K, generator=g), torch.randn(N, generator=g))
    torch.library.opcheck(torch.ops.rl_kernels.linear_backward.default,
                          (h, w, labels, ids, None, lse, None, out[4], tail, None, None, *grads, True, True,
                           *linear_autograd.BACKWARD_OP_ARGS.pack(params, None)))
    torch.library.opcheck(torch.ops.rl_kernels.counted_positions.default,
                          (h, None, mask, ids, t_lp, V, -100, "hidden_states", None, None, True))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_non_finite_row_stays_in_its_row(backend):
    """A counted row with an infinite hidden state: NaN loss in that row only; the same row excluded
    by the mask: the other rows' loss and gradients are the clean ones (no NaN leaks through dW)."""
    h, w, ids, t_lp, mask = _inputs(11)
    mask[:] = True
    h[4, 2] = float("inf")
    got = linear_topk_kl(h, w, ids, t_lp, tail=True, reduction="none", backend=backend)
    assert torch.isnan(got[4]) and torch.isfinite(got[torch.arange(N) != 4]).all()
    mask[4] = False
    wx = w.clone().requires_grad_()
    loss = linear_topk_kl(h, wx, ids, t_lp, mask=mask, tail=True, reduction="sum", backend=backend)
    loss.backward()
    h_clean = h.clone()
    h_clean[4] = 0.0
    ref, _, w64 = _reference(h_clean, w, ids, t_lp, mask, 1.0, "forward", "sum")
    ref.backward()
    m = head_magnitude(h_clean, w) * N  # reduction "sum"
    assert_close_f32(loss, ref, depth=FWD, logits=m, msg="loss")
    assert_close_f32(wx.grad, w64.grad, depth=GRAD, logits=m, floor=0, msg="dw")


@triton.jit
def _mask_kernel(ids_ptr, out_ptr, n_rows, n_cols, n_ids, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_IDS: tl.constexpr):
    """among_ids' (rows x cols) tiles written out as int8."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col0 = tl.program_id(1) * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    hit = among_ids(ids_ptr, n_ids, rows.to(tl.int64), row_mask, cols, col0, BLOCK_N, n_ids, BLOCK_IDS)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], hit.to(tl.int8),
             mask=row_mask[:, None] & (cols < n_cols)[None, :])


def test_among_ids_is_the_scatter_mask():
    """``ops.building_blocks.among_ids`` (the kernels' exclusion mask) on (rows x cols) tiles of a vocabulary
    shard equals the scattered mask of ``sorted_tail_ids``' local ids (ids of other shards, repeated
    ids and a row with all of its ids in one tile included)."""
    g = torch.Generator().manual_seed(0)
    start, width, k = 40, 90, 7
    ids = torch.randint(0, 150, (9, k), generator=g)
    ids[0] = torch.arange(50, 50 + k)  # all in one tile
    ids[1, 1] = ids[1, 0]  # a repeated id
    local = sorted_tail_ids(ids, start, width)
    out = torch.full((9, width), -1, dtype=torch.int8)
    _mask_kernel[(triton.cdiv(9, 4), triton.cdiv(width, 16))](local, out, 9, width, k, BLOCK_M=4, BLOCK_N=16,
                                                              BLOCK_IDS=8)
    inside = (ids >= start) & (ids < start + width)
    ref = torch.zeros(9, width + 1, dtype=torch.bool).scatter_(1, torch.where(inside, ids - start, width), True)
    assert torch.equal(out.bool(), ref[:, :width]) and out.min() >= 0
