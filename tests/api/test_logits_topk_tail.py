"""The tail of the from-logits top-K (issue 45): ``topk_log_probs_from_logits(return_tail=True)``
and ``topk_kl_from_logits(tail=True)`` (verl RFC #7856's tail-aware top-K KL) on both backends
against float64 references written here from the definitions:

    log q_tail = logsumexp(z over the columns not among the row's ids) - logsumexp(z),  z = logits / T
    forward:  sum_k p_k log(p_k / q_k) + p_tail log(p_tail / q_tail)
    reverse:  sum_k q_k log(q_k / p_k) + q_tail log(q_tail / p_tail)
    p_tail = max(0, 1 - sum_k p_k) (float64), a probability floored at 2^-126 inside a logarithm,
    0 log 0 = 0 (forward), times T^2.

Values and gradients within 1e-5 (float32 logits) where the tail mass is >= 1e-6; the
ill-conditioned cases (teacher mass 1, q_tail ~ 1e-6 and ~ 1e-30, K = V) against the same
references, with the naive log(1 - sum_k q_k) shown to fail there. Ignored rows get exactly zero
gradient (even NaN ones), bad inputs name their argument, torch.compile traces without graph
breaks and its custom ops pass opcheck. The vocab-parallel top-K (tail or not) is checked in
tests/api/tp_worker.py (a gloo group of 2). Shapes are small and odd (V = 203 / 101 / 37: partial
64-column splits of the interpreter's tiles; N = 3 takes the two-level split there).
"""
import math

import pytest
import torch
import torch._dynamo.testing
from heads import reference_tail_kl

import rl_kernels.torch_ops.logits as torch_logits
from rl_kernels import topk_kl_from_logits, topk_log_probs_from_logits
from rl_kernels.autograd.logits import OP_ARGS, LogitsParams
from rl_kernels.core.backends import get_backend
from compiled import assert_compiled_equals_eager
from tolerances import assert_close_f32, logits_magnitude

BACKENDS = ["torch", "triton"]


def _fwd(v):
    """float32 rounding bounds from materialized logits (tests/support/tolerances.py): 1/T rounded and the product
    by it (2), the row's sums over its v columns (lse, the tail's logsumexp); a gradient combines those over the v
    columns once more (+ v); the tail KL adds its sum over the K ids, the tail term's log1p / exp (2) and T^2's two
    roundings (2)."""
    return v + 2


def _kl(v, k):
    return _fwd(v) + k + 4


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(torch_logits, "CHUNK_ELEMENTS", 2 * 203)  # the torch backend crosses row chunks


def _ids(n, v, k, g):
    """(n, k) distinct ids per row (a random permutation's first k)."""
    return torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])


def _reference(x64, ids, temperature):
    """float64 (log q at the ids (N, K), log q_tail (N,)): the tail's logsumexp over the columns
    outside the ids, from the definition (-inf when the ids cover the vocabulary)."""
    z = x64 / temperature
    lse = torch.logsumexp(z, -1)
    outside = torch.ones_like(z, dtype=torch.bool).scatter(1, ids, False)
    return z.gather(1, ids) - lse[:, None], torch.logsumexp(z.masked_fill(~outside, -math.inf), -1) - lse


# ----------------------------------------------------------------------------- log q at the ids and the tail

CASES = {  # name: (lead shape, V, K, temperature)
    "one level": ((7,), 203, 5, 0.8),
    "two levels": ((3,), 203, 4, 1.3),  # (N = 3 < 4 rows per "multiprocessor": the split kernels)
    "3-D": ((2, 3), 101, 6, 1.0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_tail_values_and_gradients(poison, backend, case):
    lead, v, k, temperature = CASES[case]
    n = math.prod(lead)
    g = torch.Generator().manual_seed(len(case) + 10 * k)
    base = 2 * torch.randn(n, v, generator=g)
    ids = _ids(n, v, k, g)
    base[0].scatter_(0, ids[0], 4.0 + torch.rand(k, generator=g))  # one row with most mass on its ids
    up, up_tail = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = base.reshape(*lead, v).clone().requires_grad_()
    log_q, tail = topk_log_probs_from_logits(x, ids.reshape(*lead, k), temperature=temperature, backend=backend,
                                             return_tail=True)
    assert log_q.shape == (*lead, k) and tail.shape == lead and tail.dtype == torch.float32
    ((log_q.reshape(n, k) * up).sum() + (tail.reshape(n) * up_tail).sum()).backward()
    x64 = base.double().requires_grad_()
    ref_q, ref_tail = _reference(x64, ids, temperature)
    ((ref_q * up.double()).sum() + (ref_tail * up_tail.double()).sum()).backward()
    assert bool((ref_tail.exp() >= 1e-6).all())  # (the tolerance's domain)
    m = logits_magnitude(base, temperature)
    assert_close_f32(log_q.reshape(n, k), ref_q, depth=_fwd(v), logits=m, msg="log q at the ids")
    assert_close_f32(tail.reshape(n), ref_tail, depth=_fwd(v), logits=m, msg="log q_tail")
    assert_close_f32(x.grad.reshape(n, v), x64.grad, depth=_fwd(v) + v, logits=m, floor=0, msg="dx")
    with torch.no_grad():  # the forward alone: the same bits; the log-probs those of the call without tail
        again = topk_log_probs_from_logits(x, ids.reshape(*lead, k), temperature=temperature, backend=backend,
                                           return_tail=True)
        plain = topk_log_probs_from_logits(x, ids.reshape(*lead, k), temperature=temperature, backend=backend)
    assert torch.equal(again[0], log_q.detach()) and torch.equal(again[1], tail.detach())
    assert torch.equal(plain, log_q.detach())


def test_the_kernels_launch_shapes_give_the_same_tail_bits(poison):
    """The TAIL forward's three launch shapes (one level; two levels with the last split merging
    or a combine launch) agree, and K = V gives -inf, never NaN. The two two-level shapes give the
    same bits; one level vs two levels only within an ulp here: the interpreter's one-level log_sum
    can differ from the two-level one by an ulp (also without the tail, on main: the partials that
    the two-level path stores as float32 are not rounded alike in registers by the interpreter)."""
    from rl_kernels import ops
    from rl_kernels.autograd.head_family import sorted_tail_ids

    g = torch.Generator().manual_seed(4)
    n, v, k = 3, 203, 7
    x = 2 * torch.randn(n, v, generator=g)
    ids = _ids(n, v, k, g)
    ids[2] = torch.arange(v - k, v)  # the last split's columns among the ids
    params = LogitsParams(get_backend("triton", x.device), 1 / 0.9, -100, False, "test")
    cfg = ops.logits_config(x.device)
    runs = [ops.logits_forward(x, None, params, cfg, two_level=two, last_combines=last, tail_ids=sorted_tail_ids(ids))
            for two, last in ((False, None), (True, True), (True, False))]
    m = logits_magnitude(x, 0.9)
    for key in ("lse", "tail_lse", "tail_log_probs"):
        assert torch.equal(runs[1][key], runs[2][key]), key
        # two float32 results: twice one's bound against the exact value
        assert_close_f32(runs[0][key], runs[1][key], depth=2 * _fwd(v), logits=m, msg=key)
    ref_q, ref_tail = _reference(x.double(), ids, 0.9)
    assert_close_f32(runs[0]["tail_log_probs"], ref_tail, depth=_fwd(v), logits=m, msg="log q_tail")
    everything = torch.arange(v).expand(1, v).contiguous()
    whole = ops.logits_forward(x[:1], None, params, cfg, two_level=True, tail_ids=sorted_tail_ids(everything))
    assert whole["tail_lse"].item() == -math.inf and whole["tail_log_probs"].item() == -math.inf


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_tail_alone_gets_the_k_columns_right(backend):
    """A loss of the tail only (no gradient reaches the K log-probs): the K columns hold
    p g_lse / T with g_lse = -g_t and no tail term (they are not in the tail)."""
    g = torch.Generator().manual_seed(3)
    n, v, k = 5, 101, 7
    base = 2 * torch.randn(n, v, generator=g)
    ids = _ids(n, v, k, g)
    up = torch.randn(n, generator=g)
    x = base.clone().requires_grad_()
    (topk_log_probs_from_logits(x, ids, temperature=0.6, backend=backend, return_tail=True)[1] * up).sum().backward()
    x64 = base.double().requires_grad_()
    (_reference(x64, ids, 0.6)[1] * up.double()).sum().backward()
    m = logits_magnitude(base, 0.6)
    assert_close_f32(x.grad, x64.grad, depth=_fwd(v) + v, logits=m, floor=0, msg="dx")
    assert_close_f32(x.grad.gather(1, ids), x64.grad.gather(1, ids), depth=_fwd(v) + v, logits=m, floor=0,
                     msg="dx at the K ids")


@pytest.mark.parametrize("backend", BACKENDS)
def test_tail_accuracy_does_not_grow_with_the_logits_offset(backend):
    """log q_tail is formed relative to the row max ((mt - m) + log st - log s), not as tail_lse -
    lse: at logits around 60 (lse ~ 65, float32 ulp 7.6e-6) it stays within 1e-6 of float64, where
    the difference of the two rounded lse's is off by several ulp (checked here from float32 sums)."""
    g = torch.Generator().manual_seed(60)
    n, v, k = 24, 203, 5
    base = 60.0 + 2 * torch.randn(n, v, generator=g)
    ids = _ids(n, v, k, g)
    with torch.no_grad():
        _, tail = topk_log_probs_from_logits(base, ids, backend=backend, return_tail=True)
    ref = _reference(base.double(), ids, 1.0)[1]
    torch.testing.assert_close(tail.double(), ref, atol=1e-6, rtol=0)
    outside = torch.ones_like(base, dtype=torch.bool).scatter(1, ids, False)
    difference = torch.logsumexp(base.masked_fill(~outside, -math.inf), -1) - torch.logsumexp(base, -1)
    assert (difference.double() - ref).abs().max() > 2e-6  # (the rounding this formula avoids)


# ----------------------------------------------------------------------------- the tail-aware KL

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_tail_kl_values_and_gradients(poison, backend, kind):
    """Teacher mass P < 1 (a slot at -inf in one row, P = 1 - 1e-9 in another), ignored rows by
    labels and mask (one of them NaN: exactly zero gradient), 'none' reduction x a random weight."""
    lead, v, k, temperature = (2, 4), 101, 5, 0.9
    n = math.prod(lead)
    g = torch.Generator().manual_seed(11 + len(kind))
    base = 2 * torch.randn(n, v, generator=g)
    ids = _ids(n, v, k, g)
    t_lp = torch.log_softmax(2 * torch.randn(n, k, generator=g), -1) - torch.rand(n, 1, generator=g)
    t_lp[1, 3] = -math.inf
    t_lp[2] = torch.log_softmax(t_lp[2], -1) + math.log1p(-1e-9)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[5] = -100
    mask = torch.ones(n, dtype=torch.bool)
    mask[6] = False
    base[5, 7] = math.nan  # an ignored row: no NaN may leave it
    valid = (labels != -100) & mask
    x = base.reshape(*lead, v).clone().requires_grad_()
    got = topk_kl_from_logits(x, ids.reshape(*lead, k), t_lp.reshape(*lead, k), temperature=temperature,
                              labels=labels.reshape(lead), mask=mask.reshape(lead), kind=kind, tail=True,
                              reduction="none", backend=backend)
    up = torch.randn(lead, generator=g)
    (got * up).sum().backward()
    x64 = base.double().requires_grad_()
    log_q, log_q_tail = _reference(x64, ids, temperature)
    ref = torch.where(valid, reference_tail_kl(log_q, log_q_tail, t_lp, kind) * temperature ** 2, 0.0)
    (ref * up.reshape(n).double()).sum().backward()
    assert got.shape == lead and got.dtype == torch.float32
    m = max(logits_magnitude(base[valid], temperature), logits_magnitude(t_lp))
    assert_close_f32(got.reshape(n), ref, depth=_kl(v, k), logits=m, msg="loss")
    grad = x.grad.reshape(n, v)
    assert_close_f32(grad[valid], x64.grad[valid], depth=_kl(v, k) + v, logits=m, floor=0, msg="dx")
    assert torch.equal(grad[~valid], torch.zeros_like(grad[~valid]))  # exactly, the NaN row included
    # the tail's terms matter here: where the teacher leaves a tail (P < 0.99) the loss without them differs
    far = valid & (t_lp.double().exp().sum(-1) < 0.99)
    plain = topk_kl_from_logits(base.reshape(*lead, v), ids.reshape(*lead, k), t_lp.reshape(*lead, k),
                                temperature=temperature, labels=labels.reshape(lead), mask=mask.reshape(lead),
                                kind=kind, reduction="none", backend=backend)
    assert far.sum() >= 4 and (plain.reshape(n) - got.detach().reshape(n))[far].abs().min() > 1e-3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_non_finite_row_stays_in_its_row(backend):
    g = torch.Generator().manual_seed(5)
    n, v, k = 4, 37, 3
    base = 2 * torch.randn(n, v, generator=g)
    ids = _ids(n, v, k, g)
    t_lp = torch.log_softmax(torch.randn(n, k, generator=g), -1) - 0.3
    base[1, 4] = math.nan
    x = base.clone().requires_grad_()
    got = topk_kl_from_logits(x, ids, t_lp, kind="reverse", tail=True, reduction="none", backend=backend)
    got.sum().backward()
    ok = torch.arange(n) != 1
    assert not torch.isfinite(got[1]) and bool(torch.isfinite(got[ok]).all())
    assert bool(torch.isfinite(x.grad[ok]).all()) and not bool(torch.isfinite(x.grad[1]).all())
    log_q, log_q_tail = _reference(base[ok].double(), ids[ok], 1.0)
    m = max(logits_magnitude(base[ok]), logits_magnitude(t_lp))
    assert_close_f32(got[ok], reference_tail_kl(log_q, log_q_tail, t_lp[ok], "reverse"), depth=_kl(v, k), logits=m)


# ----------------------------------------------------------------------------- ill-conditioned

def _hard_row_logits(n, v, k, q_tail, g):
    """(logits (n, v), ids (n, k)): the K ids hold all but ~``q_tail`` of each row's mass (the
    tail's logits sit at log(q_tail / (V - K)) below the ids' logsumexp, +- 0.1)."""
    ids = _ids(n, v, k, g)
    top = torch.randn(n, k, generator=g)
    level = torch.logsumexp(top.double(), -1) + math.log(q_tail / (v - k))
    x = (level[:, None] + 0.1 * torch.rand(n, v, generator=g, dtype=torch.float64)).float()
    return x.scatter(1, ids, top), ids


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_tail", [1e-6, 1e-30])
def test_ill_conditioned_tail_mass(backend, q_tail):
    """Teacher top-K mass 1 (its log-softmax over K), student q_tail ~ 1e-6 or ~ 1e-30: the tail's
    log-probability and both kinds' losses and gradients match float64, where log(1 - sum_k q_k)
    from the same float32 log-probs (the cancellation this design avoids) is far off."""
    g = torch.Generator().manual_seed(int(-math.log10(q_tail)))
    n, v, k = 4, 101, 6
    base, ids = _hard_row_logits(n, v, k, q_tail, g)
    t_lp = torch.log_softmax(torch.randn(n, k, generator=g), -1)
    x64 = base.double().requires_grad_()
    ref_q, ref_tail = _reference(x64, ids, 1.0)
    assert bool(((ref_tail.detach() - math.log(q_tail)).abs() < 0.2).all())
    with torch.no_grad():
        log_q, tail = topk_log_probs_from_logits(base, ids, backend=backend, return_tail=True)
    m = max(logits_magnitude(base), logits_magnitude(t_lp))
    assert_close_f32(tail, ref_tail, depth=_fwd(v), logits=m, msg="log q_tail")
    naive = torch.log(1.0 - log_q.exp().sum(-1))  # float32, as a caller without the tail would form it
    naive_err = (naive.double() - ref_tail.detach()).abs()
    assert bool((naive_err > 1e-2).all() if q_tail > 1e-20 else (naive_err > 10).all()), naive_err
    for kind in ("forward", "reverse"):
        x = base.clone().requires_grad_()
        up = torch.randn(n, generator=g)
        got = topk_kl_from_logits(x, ids, t_lp, kind=kind, tail=True, reduction="none", backend=backend)
        (got * up).sum().backward()
        x64.grad = None
        ref = reference_tail_kl(*_reference(x64, ids, 1.0), t_lp, kind)
        (ref * up.double()).sum().backward()
        assert_close_f32(got, ref, depth=_kl(v, k), logits=m, msg=f"{kind} loss")
        assert_close_f32(x.grad, x64.grad, depth=_kl(v, k) + v, logits=m, floor=0, msg=f"{kind} dx")


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_equal_to_v_has_no_tail_and_a_finite_loss(backend):
    """K = V: log q_tail = -inf exactly (never NaN), the loss and its gradient finite (the floor
    at 2^-126 inside the logarithm), equal to float64's; the two-level split included (N = 3)."""
    g = torch.Generator().manual_seed(8)
    n, v = 3, 37
    base = 2 * torch.randn(n, v, generator=g)
    ids = _ids(n, v, v, g)
    t_lp = torch.log_softmax(torch.randn(n, v, generator=g), -1)
    with torch.no_grad():
        _, tail = topk_log_probs_from_logits(base, ids, backend=backend, return_tail=True)
    assert bool((tail == -math.inf).all())
    for kind in ("forward", "reverse"):
        x = base.clone().requires_grad_()
        got = topk_kl_from_logits(x, ids, t_lp, kind=kind, tail=True, reduction="sum", backend=backend)
        got.backward()
        x64 = base.double().requires_grad_()
        ref = reference_tail_kl(*_reference(x64, ids, 1.0), t_lp, kind).sum()
        ref.backward()
        assert bool(torch.isfinite(got)) and bool(torch.isfinite(x.grad).all())
        m = max(logits_magnitude(base), logits_magnitude(t_lp)) * n  # reduction "sum" over the n rows
        depth = _kl(v, v) + n + 1
        assert_close_f32(got, ref, depth=depth, logits=m, msg=f"{kind} loss")
        assert_close_f32(x.grad, x64.grad, depth=depth + v, logits=m, floor=0, msg=f"{kind} dx")


# ----------------------------------------------------------------------------- bad inputs

def test_bad_inputs_name_the_argument():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 50, generator=g)
    ids = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]])
    t_lp = torch.full((4, 3), math.log(0.3))
    twice = ids.clone()
    twice[2, 2] = 6
    with pytest.raises(ValueError, match=r"token_ids: the tail .* needs distinct ids per counted position; 1 "
                                         r"positions repeat an id, first at flat position 2: \[6, 7, 6\]"):
        topk_log_probs_from_logits(x, twice, return_tail=True, backend="torch")
    topk_log_probs_from_logits(x, twice, backend="torch")  # (without the tail, duplicates are allowed)
    with pytest.raises(ValueError, match=r"teacher_token_ids: the tail .* first at flat position 2: \[6, 7, 6\]"):
        topk_kl_from_logits(x, twice, t_lp, tail=True, backend="torch")
    labels = torch.tensor([1, 2, -100, 3])  # the repeating row does not count: no error
    topk_kl_from_logits(x, twice, t_lp, tail=True, labels=labels, backend="torch")
    heavy = t_lp.clone()
    heavy[1] = math.log(0.34)  # sum 1.02
    with pytest.raises(ValueError, match=r"teacher_log_probs: the tail-aware KL .* <= 1 \+ 0.01 .* first at flat "
                                         r"position 1: 1.02"):
        topk_kl_from_logits(x, ids, heavy, tail=True, backend="torch")
    topk_kl_from_logits(x, ids, heavy, tail=True, mask=torch.tensor([1, 0, 1, 1]), backend="torch")  # not counted
    topk_kl_from_logits(x, ids, heavy, backend="torch")  # (without the tail no mass is asked for)
    with pytest.raises(ValueError, match="renormalize_teacher: True with tail=True"):
        topk_kl_from_logits(x, ids, t_lp, tail=True, renormalize_teacher=True, backend="torch")
    with pytest.raises((TypeError, ValueError), match="return_tail"):
        topk_log_probs_from_logits(x, ids, return_tail=1, backend="torch")
    with pytest.raises((TypeError, ValueError), match="tail"):
        topk_kl_from_logits(x, ids, t_lp, tail="yes", backend="torch")
    with pytest.raises(ValueError, match="vocab_start_index"):
        topk_log_probs_from_logits(x, ids, vocab_start_index=3, backend="torch")  # (without a group)
    with pytest.raises(ValueError, match="vocab_start_index"):
        topk_kl_from_logits(x, ids, t_lp, vocab_start_index=3, backend="torch")


# ----------------------------------------------------------------------------- torch.compile

def _compiled_cases(backend):
    def log_probs(x, ids, t_lp, mask):
        log_q, tail = topk_log_probs_from_logits(x, ids, temperature=0.7, backend=backend, return_tail=True)
        return torch.cat([log_q, tail[:, None]], 1)

    def kl(x, ids, t_lp, mask):
        return topk_kl_from_logits(x, ids, t_lp, temperature=0.7, mask=mask, kind="reverse", tail=True,
                                   reduction="none", backend=backend)
    return {"topk_log_probs_from_logits": log_probs, "topk_kl_from_logits": kl}


def _compile_inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(n, 37, generator=g)).requires_grad_()
    ids = _ids(n, 37, 3, g)
    t_lp = torch.log_softmax(torch.randn(n, 3, generator=g), -1) - 0.2
    return x, ids, t_lp, torch.rand(n, generator=g) > 0.2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["topk_log_probs_from_logits", "topk_kl_from_logits"])
def test_fullgraph_compile_matches_eager(name, backend):
    """No graph break; compiled equals eager (values and gradients, bitwise: the same ops' bodies);
    another batch size without recompiling; a repeated id raises under compile too."""
    compiled = assert_compiled_equals_eager(_compiled_cases(backend)[name], _compile_inputs)
    x, ids, t_lp, mask = _compile_inputs(9, 8)
    ids[4, 1] = ids[4, 0]
    mask[4] = True
    which = "token_ids" if name == "topk_log_probs_from_logits" else "teacher_token_ids"
    with pytest.raises(ValueError, match=f"{which}: the tail"):
        compiled(x, ids, t_lp, mask)


def test_compiled_teacher_mass_check_raises():
    f = _compiled_cases("torch")["topk_kl_from_logits"]
    x, ids, t_lp, mask = _compile_inputs(9, 8)
    t_lp[3] = math.log(0.5)
    mask[3] = True
    with pytest.raises(ValueError, match="teacher_log_probs: the tail-aware KL needs a top-K mass"):
        torch.compile(f, backend="aot_eager", fullgraph=True)(x, ids, t_lp, mask)


@pytest.mark.parametrize("op", ["logits_forward", "logits_forward-labels", "logits_backward",
                                "logits_backward-tail_only", "counted_positions"])
def test_custom_ops_pass_opcheck(op):
    """torch.library.opcheck (schema, fake implementation, AOT dispatch) of the ops that carry the
    tail: the forward with ``return_tail`` (tail_log_probs, tail_lse), the backward with tail_lse and
    its gradient, and the positions op with ``tail`` (the teacher's mass check)."""
    x, ids, t_lp, mask = _compile_inputs(5, 10)
    x = x.detach()
    record = LogitsParams(get_backend("torch", x.device), 1 / 0.7, -100, False, "topk_kl_from_logits",
                          return_tail=True, ids_name="teacher_token_ids")
    params = OP_ARGS.pack(record, None)
    rows = torch.where(mask, ids[:, 0], -100)
    n, k = ids.shape
    row_max, log_sum, lse = (torch.randn(n) for _ in range(3))  # (their values do not matter here)
    tail_lse = lse - torch.rand(n)
    grad_topk = None if op.endswith("tail_only") else torch.randn(n, k)
    # the backward's saved slots (entropy, lse, sum_pi_squared, row_max, log_sum, shard_labels, tail_lse,
    # shard_ids), then one gradient per output (log_probs, entropy, lse, mean_log_p, sum_pi_squared,
    # topk_log_probs, tail_log_probs)
    saved = (None, lse, None, row_max, log_sum, None, tail_lse, None)
    args = {"logits_forward": (x, None, ids, *params),
            "logits_forward-labels": (x, rows, ids, *params),
            "logits_backward": (x, rows, ids, *saved, None, None, torch.randn(n), None, None, grad_topk, torch.randn(n),
                                *params),
            "counted_positions": (x, None, mask, ids, t_lp, 37, -100, "logits", None, None, True)}
    args["logits_backward-tail_only"] = args["logits_backward"]
    torch.library.opcheck(getattr(torch.ops.rl_kernels, op.split("-")[0]).default, args[op])
    if op.startswith("logits"):
        assert OP_ARGS.unpack(params)[0] == record
