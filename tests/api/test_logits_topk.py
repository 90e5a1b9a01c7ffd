"""topk_log_probs_from_logits and topk_kl_from_logits (issue 34) on both backends vs float64
references written from the formulas: log q_k = log softmax(logits / T)[ids_k], and the top-K
KL of ``linear_topk_kl`` on materialized logits.

Shapes are small and odd (V = 203 / 101 / 37; the Triton backend runs in the CPU interpreter with
64-column splits, so V ends in a partial split); the torch backend's CHUNK_ELEMENTS is patched to
3 rows' worth so its calls cross chunk boundaries. Also: K = 1, K = V, duplicate ids (their
gradients add up), 3-D and strided logits, the poison fixture (outputs NaN-filled before the
kernels write them), no N x V tensor in forward and exactly one (the gradient) in backward,
torch.compile (fullgraph, no graph break), and bad inputs naming the argument.
"""
import math

import pytest
import torch
import torch._dynamo.testing
from torch.utils._python_dispatch import TorchDispatchMode

import rl_kernels
import rl_kernels.torch_ops.logits as torch_logits
from rl_kernels.autograd.logits import OP_ARGS, LogitsParams, LogitsStatsFunction
from rl_kernels.core.backends import get_backend
from rl_kernels import linear_topk_kl, topk_kl_from_logits, topk_log_probs_from_logits
from compiled import assert_compiled_equals_eager
from tolerances import assert_close_f32, head_magnitude, logits_magnitude

BACKENDS = ["torch", "triton"]


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(torch_logits, "CHUNK_ELEMENTS", 3 * 203)


def _ids(lead, v, k, g, duplicates=False):
    """(*lead, k) ids: distinct per row (a random permutation's first k), or with duplicates
    (a pair and, for k >= 4, a triple of equal ids in some rows)."""
    n = math.prod(lead)
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(n)])
    if duplicates:
        ids[0, 1] = ids[0, 0]
        if k >= 4:
            ids[n - 1, 1] = ids[n - 1, 3] = ids[n - 1, 2]
    return ids.reshape(*lead, k)


def _depths(v):
    """float32 rounding bounds from materialized logits (tests/support/tolerances.py): 1/T rounded and the
    product by it (2), the row's sum over its v columns (the lse); a gradient is then combined over the v
    columns once more (p times the sum of the K upstream weights, the entropy's terms)."""
    return v + 2, 2 * v + 2


def _reference_log_probs(logits, ids, temperature):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, ids)


# ----------------------------------------------------------------------------- values and gradients

CASES = {  # name: (lead shape, V, K, temperature, duplicates, dtype)
    "K=5": ((7,), 203, 5, 1.0, False, torch.float32),
    "K=1": ((7,), 203, 1, 0.6, False, torch.float32),
    "K=V": ((5,), 37, 37, 1.7, False, torch.float32),
    "3-D duplicates": ((2, 3), 101, 6, 0.9, True, torch.float32),
    "bf16": ((7,), 203, 4, 1.3, True, torch.bfloat16),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_values_and_gradients(poison, backend, case):
    lead, v, k, temperature, duplicates, dtype = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    base = (2 * torch.randn(*lead, v, generator=g)).to(dtype)
    ids = _ids(lead, v, k, g, duplicates)
    up = torch.randn(*lead, k, generator=g)  # the upstream gradient, a random weighting
    x = base.clone().requires_grad_()
    got = topk_log_probs_from_logits(x, ids, temperature=temperature, backend=backend)
    (got * up).sum().backward()
    x64 = base.double().requires_grad_()
    ref = _reference_log_probs(x64, ids, temperature)
    (ref * up.double()).sum().backward()
    assert got.dtype == torch.float32 and got.shape == ids.shape
    assert x.grad.dtype == dtype and x.grad.shape == base.shape
    fwd, grad = _depths(v)
    m = logits_magnitude(base, temperature)
    assert_close_f32(got, ref, depth=fwd, logits=m, msg="top-K log p")
    if dtype == torch.float32:
        assert_close_f32(x.grad, x64.grad, depth=grad, logits=m, floor=0, msg="dx")
    else:  # each element rounded once to bfloat16 (8 significant bits): within one ulp, 2^-7
        err = (x.grad.double() - x64.grad).abs()  # relative (the interpreter's conversion truncates)
        assert bool((err <= x64.grad.abs() * 2.0 ** -7 + 1e-7).all()), err.max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("others", ["lse", "entropy", "entropy+lse"])
def test_token_ids_with_other_statistics_in_one_function(poison, backend, others):
    """The family's one Function with token ids and other statistics asked: gradients of the
    top-K log-probs with those of the lse and / or the entropy, duplicate ids and ignored rows (their
    labels mark them: the top-K terms leave them), against float64. The lse's gradient alone
    keeps the K columns rounded once; with the entropy's the sparse term is added to the family's
    float32 dense gradient (rounded twice)."""
    from rl_kernels.autograd.logits import asked_outputs

    g = torch.Generator().manual_seed(len(others) + len(backend))
    n, v, k, temperature = 7, 203, 5, 0.8
    base = 2 * torch.randn(n, v, generator=g)
    ids = _ids((n,), v, k, g, duplicates=True)
    rows = torch.where(torch.arange(n) % 3 == 1, -100, ids[:, 0])  # rows 1 and 4: ignored
    weights = {name: torch.randn(n, generator=g) for name in ("entropy", "lse")}
    keep = rows != -100
    up = torch.randn(n, k, generator=g) * keep[:, None]  # (ignored rows: no top-K gradient reaches them)
    params = LogitsParams(get_backend(backend, base.device), 1 / temperature, -100, "entropy" in others,
                          "topk_log_probs_from_logits")
    x = base.clone().requires_grad_()
    outs = dict(zip(asked_outputs(params, True, True),
                    LogitsStatsFunction.apply(x, rows, ids, params, None, None)))
    assert list(outs) == (["entropy"] if "entropy" in others else []) + ["lse", "topk_log_probs"]
    loss = (outs["topk_log_probs"] * up).sum()
    for name in others.split("+"):
        loss = loss + (outs[name] * weights[name]).sum()
    loss.backward()
    x64 = base.double().requires_grad_()
    z = x64 / temperature
    log_p = torch.log_softmax(z, -1)
    want = {"lse": torch.logsumexp(z, -1), "entropy": -(log_p.exp() * log_p).sum(-1),
            "topk_log_probs": log_p.gather(1, ids)}
    ref = (want["topk_log_probs"] * up.double()).sum()
    for name in others.split("+"):  # (the family's rule: ignored rows take the lse's gradient only)
        ref = ref + (want[name] * weights[name].double() * (keep if name == "entropy" else 1)).sum()
    ref.backward()
    fwd, grad = _depths(v)
    m = logits_magnitude(base, temperature)
    for name, out in outs.items():
        assert_close_f32(out[keep], want[name][keep], depth=fwd, logits=m, msg=name)
    assert_close_f32(x.grad, x64.grad, depth=grad, logits=m, floor=0, msg="dx")


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_ids_strided_logits_and_no_gradient(backend):
    g = torch.Generator().manual_seed(3)
    big = 2 * torch.randn(5, 2 * 101, generator=g)
    ids = _ids((5,), 101, 3, g).int()
    leaf = big.clone().requires_grad_()
    got = topk_log_probs_from_logits(leaf[:, ::2], ids, temperature=0.8, backend=backend)  # column stride 2
    got.sum().backward()
    x64 = big[:, ::2].double().requires_grad_()
    ref = _reference_log_probs(x64, ids.long(), 0.8)
    ref.sum().backward()
    fwd, grad = _depths(101)
    m = logits_magnitude(big[:, ::2], 0.8)
    assert_close_f32(got, ref, depth=fwd, logits=m, msg="top-K log p")
    assert_close_f32(leaf.grad[:, ::2], x64.grad, depth=grad, logits=m, floor=0, msg="dx")
    assert torch.all(leaf.grad[:, 1::2] == 0)
    with torch.no_grad():  # the forward alone (no autograd node): the same bits
        assert torch.equal(topk_log_probs_from_logits(leaf[:, ::2], ids, temperature=0.8, backend=backend),
                           got.detach())


def test_reruns_are_bitwise_identical_and_duplicates_write_one_value():
    """Duplicate ids are summed before the K columns are written (no atomics): the same bits
    every run, and a row whose ids repeat gets the gradient of the row with the repeats merged."""
    g = torch.Generator().manual_seed(4)
    base = 2 * torch.randn(3, 101, generator=g)
    ids = torch.tensor([[5, 9, 5, 5], [7, 1, 2, 3], [0, 0, 100, 100]])
    up = torch.randn(3, 4, generator=g)

    def grad():
        x = base.clone().requires_grad_()
        (topk_log_probs_from_logits(x, ids, backend="triton") * up).sum().backward()
        return x.grad

    first = grad()
    assert torch.equal(first, grad())
    merged_ids = torch.tensor([[5, 9], [7, 1], [0, 100]])
    merged_up = torch.stack([up[0, [0, 2, 3]].sum(), up[0, 1], up[1, 0], up[1, 1], up[2, :2].sum(),
                             up[2, 2:].sum()]).reshape(3, 2)
    x = base.clone().requires_grad_()
    (topk_log_probs_from_logits(x, merged_ids, backend="triton") * merged_up).sum().backward()
    # two float32 gradients of the same value: twice the bound of one against the exact value
    assert_close_f32(first[[0, 2]], x.grad[[0, 2]], depth=2 * _depths(101)[1], logits=logits_magnitude(base),
                     floor=0, msg="merged vs repeated ids")


# ----------------------------------------------------------------------------- memory: N x V tensors

class _Sizes(TorchDispatchMode):
    """Records (op, element count) of every new tensor a torch op returns (views of an input's
    storage, as the Triton interpreter makes of the kernels' arguments, are not new tensors)."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.sizes.append((str(func), t.numel()))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_n_by_v_tensor_in_forward_and_one_in_backward(dtype):
    """Triton backend (the CUDA path): the forward makes no tensor of N x V elements or more; the
    backward makes exactly one, the gradient."""
    n, v, k = 6, 203, 5
    g = torch.Generator().manual_seed(5)
    x = (2 * torch.randn(n, v, generator=g)).to(dtype).requires_grad_()
    ids = _ids((n,), v, k, g, duplicates=True)
    with _Sizes() as fwd:
        out = topk_log_probs_from_logits(x, ids, temperature=0.9, backend="triton")
    loss = (out * torch.randn(n, k, generator=g)).sum()
    with _Sizes() as bwd:
        loss.backward()
    assert [s for s in fwd.sizes if s[1] >= n * v] == []
    big = [s for s in bwd.sizes if s[1] >= n * v]
    assert len(big) == 1 and "empty" in big[0][0], big  # the gradient (the scatter_ writes into it)


# ----------------------------------------------------------------------------- top-K KL from logits

def _reference_kl(x64, ids, t_lp, valid, temperature, kind, renorm, reduction):
    """float64, the formula of linear_topk_kl on logits: -inf teacher slots out of the support."""
    log_q = torch.log_softmax(x64 / temperature, -1).gather(-1, ids)
    lp = t_lp.double()
    support = lp > -math.inf
    if renorm:
        lp = torch.log_softmax(lp, -1)
    lp0 = torch.where(support, lp, 0.0)
    terms = lp0.exp() * (lp0 - log_q) if kind == "forward" else log_q.exp() * (log_q - lp0)
    per = torch.where(valid, torch.where(support, terms, 0.0).sum(-1) * temperature ** 2, 0.0)
    return {"none": per, "sum": per.sum(), "mean": per.sum() / valid.sum(),
            "batchmean": per.sum() / per.shape[0]}[reduction]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,renorm,reduction,temperature,select", [
    ("forward", False, "mean", 1.0, "mask"),
    ("reverse", True, "none", 0.7, "labels"),
    ("forward", True, "batchmean", 1.4, "both"),
])
def test_topk_kl_values_and_gradients(poison, backend, kind, renorm, reduction, temperature, select):
    lead, v, k = (2, 4), 101, 5
    g = torch.Generator().manual_seed(6)
    base = 2 * torch.randn(*lead, v, generator=g)
    ids = _ids(lead, v, k, g)
    t_lp = torch.log_softmax(2 * torch.randn(*lead, k, generator=g), -1) - 0.1 * torch.rand(*lead, k, generator=g)
    t_lp[0, 1, 2] = -math.inf  # a slot the server filtered
    mask = torch.ones(lead, dtype=torch.bool)
    mask[1, 2] = False
    labels = torch.randint(0, v, lead, generator=g)
    labels[0, 3] = -100
    kw = {"mask": dict(mask=mask), "labels": dict(labels=labels),
          "both": dict(mask=mask, labels=labels)}[select]
    valid = {"mask": mask, "labels": labels != -100, "both": mask & (labels != -100)}[select]
    x = base.clone().requires_grad_()
    got = topk_kl_from_logits(x, ids, t_lp, temperature=temperature, kind=kind, renormalize_teacher=renorm,
                              reduction=reduction, backend=backend, **kw)
    x64 = base.double().requires_grad_()
    ref = _reference_kl(x64, ids, t_lp, valid, temperature, kind, renorm, reduction)
    up = torch.randn(ref.shape, generator=g)
    (got * up).sum().backward()
    (ref * up.double()).sum().backward()
    assert got.dtype == torch.float32 and got.shape == ref.shape
    # + the KL's sum over the K ids (and the teacher's renormalization), T^2 rounded and the product by it (2), a
    # reduction's sum over the 8 rows (+ 1 for its division); magnitude the larger of the logits' and the
    # teacher's log-probs (times 8 for "sum")
    n = math.prod(lead)
    fwd = _depths(v)[0] + k + 2 + (n + 1 if reduction != "none" else 0)
    m = max(logits_magnitude(base, temperature), logits_magnitude(t_lp)) * (n if reduction == "sum" else 1)
    assert_close_f32(got, ref, depth=fwd, logits=m, msg="loss")
    assert_close_f32(x.grad, x64.grad, depth=fwd + v, logits=m, floor=0, msg="dx")
    assert torch.all(x.grad[~valid] == 0)


def test_topk_kl_from_logits_equals_linear_topk_kl_on_the_same_logits():
    """The twin: on logits = h W^T, topk_kl_from_logits gives linear_topk_kl's loss (one loss
    tail, ``distill.topk_kl_loss``), and the logits' gradient chained through W gives its dh."""
    g = torch.Generator().manual_seed(7)
    h, w = torch.randn(9, 16, generator=g), 0.4 * torch.randn(61, 16, generator=g)
    ids = _ids((9,), 61, 4, g)
    t_lp = torch.log_softmax(torch.randn(9, 4, generator=g), -1)
    mask = torch.rand(9, generator=g) > 0.3
    for kind in ("forward", "reverse"):
        h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
        a = linear_topk_kl(h1, w, ids, t_lp, temperature=1.2, mask=mask, kind=kind, backend="torch")
        b = topk_kl_from_logits(h2 @ w.T, ids, t_lp, temperature=1.2, mask=mask, kind=kind, backend="torch")
        a.backward()
        b.backward()
        # two float32 results: twice one's bound against the exact value (a logit's dot product over H = 16,
        # 1/T's and T^2's two roundings each, the row's sum over V = 61, the KL's over K = 4, batchmean's over 9
        # rows + 1; dh: + its sum over V)
        fwd = 16 + 61 + 4 + 4 + 9 + 1
        m = max(head_magnitude(h, w, 1.2), logits_magnitude(t_lp))
        assert_close_f32(a, b, depth=2 * fwd, logits=m, msg=f"{kind} loss")
        assert_close_f32(h1.grad, h2.grad, depth=2 * (fwd + 61), logits=m, floor=0, msg=f"{kind} dh")


# ----------------------------------------------------------------------------- torch.compile

def _compiled_cases(backend):
    def log_probs(x, ids, t_lp, mask):
        return topk_log_probs_from_logits(x, ids, temperature=0.7, backend=backend)

    def kl(x, ids, t_lp, mask):
        return topk_kl_from_logits(x, ids, t_lp, temperature=0.7, mask=mask, reduction="none", backend=backend)
    return {"topk_log_probs_from_logits": log_probs, "topk_kl_from_logits": kl}


def _compile_inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(n, 37, generator=g)).requires_grad_()
    ids = _ids((n,), 37, 3, g)
    t_lp = torch.log_softmax(torch.randn(n, 3, generator=g), -1)
    return x, ids, t_lp, torch.rand(n, generator=g) > 0.2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["topk_log_probs_from_logits", "topk_kl_from_logits"])
def test_fullgraph_compile_matches_eager(name, backend):
    """No graph break; compiled equals eager (values and gradients, bitwise); another batch size
    without recompiling; an id out of range raises under compile too, naming the argument."""
    compiled = assert_compiled_equals_eager(_compiled_cases(backend)[name], _compile_inputs)
    x, ids, t_lp, mask = _compile_inputs(9, 8)
    ids[4, 1] = 37  # out of range: raised by the op's body, naming the argument
    with pytest.raises(ValueError, match="token_ids: values must lie in"):
        compiled(x, ids, t_lp, mask)


@pytest.mark.parametrize("op", ["checked_token_ids", "logits_forward", "logits_forward-labels", "logits_backward"])
def test_custom_ops_pass_opcheck(op):
    """torch.library.opcheck: schema, fake implementation, AOT dispatch of the family's ops with
    token ids (top-K). They are backend calls inside the family's Function (which does the
    autograd), so their inputs need no grad."""
    x, ids, _, mask = _compile_inputs(5, 10)
    x = x.detach()
    record = LogitsParams(get_backend("torch", x.device), 1 / 0.7, -100, False, "topk_log_probs_from_logits")
    params = OP_ARGS.pack(record, None)
    rows = torch.where(mask, ids[:, 0], -100)
    n, k = ids.shape
    row_max, log_sum, lse = (torch.randn(n) for _ in range(3))  # (their values do not matter here)
    # the backward's saved slots (entropy, lse, sum_pi_squared, row_max, log_sum, shard_labels, tail_lse,
    # shard_ids), then one gradient per output (log_probs, entropy, lse, mean_log_p, sum_pi_squared,
    # topk_log_probs, tail_log_probs)
    saved = (None, lse, None, row_max, log_sum, None, None, None)
    args = {"checked_token_ids": (ids, 37, "token_ids"),
            "logits_forward": (x, None, ids, *params),
            "logits_forward-labels": (x, rows, ids, *params),
            "logits_backward": (x, rows, ids, *saved, None, None, torch.randn(n), None, None, torch.randn(n, k), None,
                                *params)}[op]  # (no tail: tests/api/test_logits_topk_tail.py)
    torch.library.opcheck(getattr(torch.ops.rl_kernels, op.split("-")[0]).default, args)
    if op != "checked_token_ids":  # the packed record comes back whole
        assert OP_ARGS.unpack(params)[0] == record


# ----------------------------------------------------------------------------- bad inputs

def test_bad_inputs_name_the_argument():
    x = torch.randn(4, 50)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])
    t_lp = torch.full((4, 2), -0.7)
    with pytest.raises(TypeError, match="token_ids: expected int64 or int32 token ids, got shape"):
        topk_log_probs_from_logits(x, ids.float())
    with pytest.raises(ValueError, match=r"token_ids: expected shape \(4, 'K'\)"):
        topk_log_probs_from_logits(x, ids[:3])
    with pytest.raises(ValueError, match=r"token_ids: expected shape \(4, 'K'\) .*K >= 1"):
        topk_log_probs_from_logits(x, ids[:, :0])
    with pytest.raises(TypeError, match="token_ids: expected a torch.Tensor, got list"):
        topk_log_probs_from_logits(x, [[0]] * 4)
    bad = ids.clone()
    bad[2, 1] = 50
    with pytest.raises(ValueError, match=r"token_ids: values must lie in \[0, vocab_size=50\); 1 do not, first "
                                         r"at flat position 5: 50"):
        topk_log_probs_from_logits(x, bad)
    bad[2, 1] = -1
    with pytest.raises(ValueError, match="token_ids: values must lie in"):
        topk_log_probs_from_logits(x, bad)
    with pytest.raises(TypeError, match="logits: expected bfloat16, float16 or float32"):
        topk_log_probs_from_logits(x.double(), ids)
    with pytest.raises(ValueError, match="token_ids: a meta tensor holds no data"):
        topk_log_probs_from_logits(x, ids.to("meta"))
    with pytest.raises(ValueError, match="temperature: expected a positive finite number"):
        topk_log_probs_from_logits(x, ids, temperature=-1.0)
    with pytest.raises(ValueError, match="backend: expected one of"):
        topk_log_probs_from_logits(x, ids, backend="cuda")
    # the KL: its own arguments, then linear_topk_kl's checks naming logits where it names hidden_states
    with pytest.raises(ValueError, match="teacher_token_ids: values must lie in"):
        topk_kl_from_logits(x, bad.abs() * 60, t_lp)
    with pytest.raises(ValueError, match=r"teacher_log_probs: expected shape \(4, 2\)"):
        topk_kl_from_logits(x, ids, t_lp[:, :1])
    with pytest.raises(ValueError, match="teacher_token_ids: expected"):
        topk_kl_from_logits(x, ids[:2], t_lp[:2])
    nan = t_lp.clone()
    nan[1, 0] = float("nan")
    with pytest.raises(ValueError, match="teacher_log_probs: 1 entries are NaN or"):
        topk_kl_from_logits(x, ids, nan)
    with pytest.raises(ValueError, match="logits: expected shape .* at least one token dim"):
        topk_kl_from_logits(x[0], ids[0], t_lp[0])
    with pytest.raises(ValueError, match=r"labels: expected shape \(4,\) \(logits without its last dim\)"):
        topk_kl_from_logits(x, ids, t_lp, labels=torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="labels: 1 entries lie outside"):
        topk_kl_from_logits(x, ids, t_lp, labels=torch.tensor([0, 1, 50, -100]))
    with pytest.raises(ValueError, match="mask: expected bool or 0/1 values"):
        topk_kl_from_logits(x, ids, t_lp, mask=torch.tensor([1.0, 0.5, 0.0, 1.0]))
    with pytest.raises(ValueError, match="kind: expected one of"):
        topk_kl_from_logits(x, ids, t_lp, kind="symmetric")
    with pytest.raises(ValueError, match="reduction: expected one of"):
        topk_kl_from_logits(x, ids, t_lp, reduction="max")
    with pytest.raises(TypeError, match="renormalize_teacher: expected a bool"):
        topk_kl_from_logits(x, ids, t_lp, renormalize_teacher=1)
    assert rl_kernels.topk_kl_from_logits is topk_kl_from_logits
