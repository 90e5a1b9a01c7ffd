"""torch.compile: every public function (the fused head, the from-logits family, the two
distillation losses; no process group) traces with
``fullgraph=True`` and no graph break (through the ``torch.ops.rl_kernels`` custom ops), gives the
same bits as eager (values and gradients), stays within a float64 reference's tolerance, and keeps
the promises of the eager path: bad labels raise ValueError naming ``labels``, double backward
raises. CPU: the torch backend and the Triton interpreter, with the ``aot_eager`` compiler (the
custom ops are opaque to any compiler, so inductor changes nothing inside them)."""
import pytest
import torch
import torch._dynamo.testing

import rl_kernels

BACKENDS = ["torch", "triton"]
N, H, V = 9, 16, 37  # small odd shapes: each Triton interpreter launch costs ~0.3 s
T = 0.7


def _inputs(n=N, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g).requires_grad_()
    weight = (0.5 * torch.randn(V, H, generator=g)).requires_grad_()
    logits = (2 * torch.randn(n, V, generator=g)).requires_grad_()
    labels = torch.randint(0, V, (n,), generator=g)
    labels[2] = -100  # an ignored position
    return hidden, weight, logits, labels


def _head(backend):
    def f(hidden, weight, logits, labels):
        o = rl_kernels.linear_log_probs(hidden, weight, labels, temperature=T, return_sum_pi_squared=True,
                                        backend=backend)
        return o.log_probs, o.entropy, o.sum_pi_squared
    return f


def _logits_stats(backend):
    def f(hidden, weight, logits, labels):
        o = rl_kernels.logits_stats(logits, labels, temperature=T, return_sum_pi_squared=True, backend=backend)
        return o.log_probs, o.entropy, o.lse, o.sum_pi_squared
    return f


def _one(name, **kw):
    def build(backend):
        def f(hidden, weight, logits, labels):
            fn = getattr(rl_kernels, name)
            args = (logits, labels) if name in ("log_probs_from_logits", "cross_entropy") else (logits,)
            return (fn(*args, backend=backend, **kw),)
        return f
    return build


K = 3


def _teacher(n):
    """K distinct ids per row and their log-probs, made from n without a Python loop (so the
    traced function stays shape-generic)."""
    ids = (torch.arange(n)[:, None] * 7 + torch.arange(K)[None, :] * 5) % V
    return ids, torch.log_softmax(torch.sin(torch.arange(n * K, dtype=torch.float32)).reshape(n, K) * 3, -1)


def _topk_kl(backend):
    def f(hidden, weight, logits, labels):
        ids, teacher = _teacher(hidden.shape[0])
        mask = torch.ones(hidden.shape[0], dtype=torch.long)
        return (rl_kernels.linear_topk_kl(hidden, weight, ids, teacher, temperature=T, labels=labels, mask=mask,
                                          reduction="none", backend=backend),)
    return f


def _jsd(backend):
    def f(hidden, weight, logits, labels):
        teacher_hidden = torch.sin(3 * hidden.detach() + 1)
        return (rl_kernels.linear_jsd(hidden, weight, teacher_hidden, weight.detach().flip(0), temperature=T,
                                      labels=labels, beta=0.3, reduction="sum", backend=backend),)
    return f


CASES = {
    "linear_topk_kl": _topk_kl,
    "linear_jsd": _jsd,
    "linear_log_probs": _head,
    "logits_stats": _logits_stats,
    "log_probs_from_logits": _one("log_probs_from_logits", temperature=T),
    "entropy_from_logits": _one("entropy_from_logits", temperature=T),
    "logsumexp": _one("logsumexp", temperature=T),
    "sum_pi_squared_from_logits": _one("sum_pi_squared_from_logits", temperature=T),
    "cross_entropy": _one("cross_entropy", label_smoothing=0.1),
}


def _reference(name, hidden, weight, logits, labels):
    """float64, from the definitions: the outputs of CASES[name] (ignored rows 0)."""
    keep = labels != -100
    safe = torch.where(keep, labels, 0)
    if name in ("linear_topk_kl", "linear_jsd"):
        z = (hidden.double() @ weight.double().T) / T
        log_q = torch.log_softmax(z, -1)
        if name == "linear_topk_kl":  # forward KL over the teacher's K ids, x T^2
            ids, teacher = _teacher(hidden.shape[0])
            kl = (teacher.double().exp() * (teacher.double() - log_q.gather(1, ids))).sum(-1) * T * T
            return (torch.where(keep, kl, 0.0),)
        teacher_hidden = torch.sin(3 * hidden.detach().double() + 1)
        log_p = torch.log_softmax(teacher_hidden @ weight.double().flip(0).T / T, -1)
        m = (0.3 * log_p.exp() + 0.7 * log_q.exp()).log()
        jsd = 0.3 * (log_p.exp() * (log_p - m)).sum(-1) + 0.7 * (log_q.exp() * (log_q - m)).sum(-1)
        return (torch.where(keep, jsd * T * T, 0.0).sum(),)
    if name == "linear_log_probs":
        z = (hidden.double() @ weight.double().T) / T
    elif name == "cross_entropy":
        z = logits.double()
    else:
        z = logits.double() / T
    log_p = torch.log_softmax(z, -1)
    p = log_p.exp()
    lp = torch.where(keep, log_p.gather(1, safe[:, None])[:, 0], 0.0)
    ent, sps, lse = -(p * log_p).sum(-1), (p * p).sum(-1), torch.logsumexp(z, -1)
    if name == "linear_log_probs":
        return lp, torch.where(keep, ent, 0.0), torch.where(keep, sps, 0.0)
    if name == "logits_stats":
        return lp, torch.where(keep, ent, 0.0), lse, torch.where(keep, sps, 0.0)
    if name == "cross_entropy":
        nll = -(0.9 * lp + 0.1 * log_p.mean(-1))
        return ((torch.where(keep, nll, 0.0).sum() / keep.sum()),)
    return ({"log_probs_from_logits": lp, "entropy_from_logits": ent, "logsumexp": lse,
             "sum_pi_squared_from_logits": sps}[name],)


def _run(f, inputs, weights):
    """Outputs and the gradients of sum_k weights[k] . outputs[k] w.r.t. hidden, weight, logits."""
    hidden, weight, logits, labels = inputs
    for t in (hidden, weight, logits):
        t.grad = None
    outs = f(hidden, weight, logits, labels)
    sum(((o * w).sum() for o, w in zip(outs, weights)), torch.zeros(())).backward()
    return [o.detach() for o in outs], [t.grad for t in (hidden, weight, logits)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_fullgraph_compile_equals_eager(name, backend):
    f = CASES[name](backend)
    inputs = _inputs()
    explained = torch._dynamo.explain(f)(*inputs)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(N, generator=g) if o.dim() else torch.randn((), generator=g)
               for o in f(*inputs)]
    eager_out, eager_grads = _run(f, inputs, weights)
    comp_out, comp_grads = _run(compiled, inputs, weights)
    frames = counter.frame_count
    for e, c in zip(eager_out + eager_grads, comp_out + comp_grads):
        assert (e is None) == (c is None)
        if e is not None:
            assert torch.equal(e, c), (e - c).abs().max()
    # float64: outputs within 1e-5 nats (float32 accumulation over V = 37)
    for c, r in zip(comp_out, _reference(name, *inputs)):
        torch.testing.assert_close(c.double(), r, rtol=1e-5, atol=1e-5)

    # another batch size runs the same graph (dynamic shapes), and still equals eager
    other = _inputs(n=13, seed=2)
    weights13 = [torch.randn(13, generator=g) if w.dim() else w for w in weights]
    e13, _ = _run(f, other, weights13)
    c13, _ = _run(compiled, other, weights13)
    assert all(torch.equal(a, b) for a, b in zip(e13, c13))
    assert counter.frame_count == frames, "recompiled for a new batch size"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["linear_log_probs", "log_probs_from_logits", "linear_topk_kl", "linear_jsd"])
def test_compiled_bad_label_raises(name, backend):
    f = torch.compile(CASES[name](backend), backend="aot_eager", fullgraph=True)
    hidden, weight, logits, labels = _inputs()
    labels[4] = V + 3
    with pytest.raises(ValueError, match="labels"):
        f(hidden, weight, logits, labels)
    rl_kernels.label_check.raise_label_errors()  # nothing left behind for the next test
    labels[4] = -5  # negative and not ignore_index
    with pytest.raises(ValueError, match="labels"):
        f(hidden, weight, logits, labels)


@pytest.mark.parametrize("name", ["linear_log_probs", "logits_stats"])
def test_double_backward_raises(name):
    """Compiled: torch's AOT autograd refuses create_graph=True itself. The custom ops called
    directly (eager): our node raises when the gradient is differentiated again."""
    hidden, weight, logits, labels = inputs = _inputs()
    x = hidden if name == "linear_log_probs" else logits
    f = torch.compile(CASES[name]("torch"), backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(f(*inputs)[0].sum(), x, create_graph=True)[0].sum().backward()
    if name == "linear_log_probs":
        out = torch.ops.rl_kernels.linear_forward(hidden, weight, labels, None, "torch", 1.0, -100, True, False,
                                                  None, name)
    else:
        out = torch.ops.rl_kernels.logits_forward(logits, labels, "torch", 1.0, -100, True, False, False, False,
                                                  name)
    (grad,) = torch.autograd.grad(out[0].sum() + out[1].sum(), x, create_graph=True)
    assert grad.requires_grad
    with pytest.raises(RuntimeError, match=f"double backward is not supported by rl_kernels.{name}"):
        grad.sum().backward()


def test_compiled_inplace_backward_is_out_of_place_and_says_so(caplog):
    def f(logits, labels):
        return rl_kernels.log_probs_from_logits(logits, labels, inplace_backward=True, backend="torch")
    _, _, logits, labels = _inputs()
    before = logits.detach().clone()
    with caplog.at_level("WARNING", logger="rl_kernels"):
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(logits, labels)
        out.sum().backward()
    assert any("not honoured under torch.compile" in r.message for r in caplog.records)
    assert torch.equal(logits.detach(), before)  # the logits' storage was not overwritten
    grad = logits.grad.clone()
    logits.grad = None
    rl_kernels.log_probs_from_logits(logits, labels, backend="torch").sum().backward()
    assert torch.equal(grad, logits.grad)


@pytest.mark.parametrize("op", ["linear_forward", "linear_forward_gather", "logits_forward", "jsd_forward",
                                "counted_positions"])
def test_custom_ops_pass_opcheck(op):
    """torch.library.opcheck: schema (no hidden mutation or aliasing), fake implementation,
    autograd registration and AOT dispatch with dynamic shapes. (The vocab-parallel ops need a
    process group: tests/tp_worker.py compiles them.)"""
    hidden, weight, logits, labels = _inputs()
    ids, teacher = _teacher(N)
    valid = labels != -100
    args = {
        "linear_forward": (hidden, weight, labels, None, "torch", 1 / T, -100, True, True, None, "linear_log_probs"),
        "linear_forward_gather": (hidden, weight, labels, ids, "torch", 1 / T, -100, False, False, None,
                                  "linear_topk_kl"),
        "logits_forward": (logits, labels, "torch", 1 / T, -100, True, False, True, False, "logits_stats"),
        "jsd_forward": (hidden, weight, torch.sin(hidden.detach()), weight.detach().flip(0), valid, "torch", 1 / T,
                        0.3, True, None, None, False, "linear_jsd"),
        "counted_positions": (hidden, labels, None, ids, teacher, V, -100, "hidden_states", None, None),
    }[op]
    name = "linear_forward" if op == "linear_forward_gather" else op
    torch.library.opcheck(getattr(torch.ops.rl_kernels, name).default, args)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_bad_arguments_under_compile_name_the_argument(fullgraph):
    """An argument error found while Dynamo traces: without fullgraph the original exception comes
    out (Dynamo runs the frame eagerly); with fullgraph torch wraps it in its own RuntimeError
    ("Observed exception"), whose text carries our message naming the argument."""
    hidden, weight, logits, labels = _inputs()
    torch._dynamo.reset()  # (a frame that failed to trace before is otherwise run eagerly)

    def f(h, w, y):
        return rl_kernels.linear_log_probs(h, w, y, backend="torch").log_probs

    compiled = torch.compile(f, backend="aot_eager", fullgraph=fullgraph)
    cases = [((hidden, weight, labels.float()), TypeError, "labels: expected int64 or int32"),
             ((hidden, weight, labels[:-1]), ValueError, "labels: expected shape"),
             ((hidden, weight.double(), labels), TypeError, "weight")]
    for args, error, message in cases:
        with pytest.raises(RuntimeError if fullgraph else error, match=message if not fullgraph else None) as info:
            compiled(*args)
        assert message in str(info.value), str(info.value)[:500]
