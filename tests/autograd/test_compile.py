"""torch.compile: every public function (tests/support/heads.py's registry: the fused head, the
from-logits family, the two distillation losses; no process group) traces with
``fullgraph=True`` and no graph break (through the ``torch.ops.rl_kernels`` custom ops), gives the
same bits as eager (values and gradients), stays within a float64 reference's tolerance, and keeps
the promises of the eager path: bad labels raise ValueError naming ``labels``, double backward
raises. CPU: the torch backend and the Triton interpreter, with the ``aot_eager`` compiler (the
custom ops are opaque to any compiler, so inductor changes nothing inside them). The temperature
(issue 35): a runtime value of one inductor graph over a schedule of ten, with inductor's caches
on, for every function that takes one and for the vocab-parallel routes (a group of two)."""
import os
import shutil

import pytest
import torch
import torch._dynamo.testing

import heads
import rl_kernels
import rl_kernels.autograd.linear as linear_autograd
import rl_kernels.autograd.logits as logits_autograd
from heads import HEADS, N, T, V
from rl_kernels.core.backends import get_backend

BACKENDS = ["torch", "triton"]
TORCH = get_backend("torch", torch.device("cpu"))


def _inputs(n=N, seed=0):
    return heads.inputs(n, seed)


def _teacher(n):
    return heads.teacher(n, V)


# every public head (tests/support/heads.py): each case's function takes the temperature as an optional
# last argument (T when left out: a constant of the graph; passed, a Python float that Dynamo may
# hold symbolically)
CASES = {name: head.call for name, head in HEADS.items()}


def _reference(name, hidden, weight, logits, labels, temperature=T):
    """float64, from the definitions: the outputs of CASES[name] (ignored rows 0; differentiable
    w.r.t. float64 hidden, weight and logits, the teacher's side excepted)."""
    return HEADS[name].reference(hidden, weight, logits, labels, temperature)


def _run(f, inputs, weights, *temperature):
    """Outputs and the gradients of sum_k weights[k] . outputs[k] w.r.t. hidden, weight, logits
    (``temperature``: passed on to ``f`` when given)."""
    hidden, weight, logits, labels = inputs
    for t in (hidden, weight, logits):
        t.grad = None
    outs = f(hidden, weight, logits, labels, *temperature)
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
    weights = [torch.randn(o.shape, generator=g) for o in f(*inputs)]
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
    weights13 = [torch.randn((13, *w.shape[1:]), generator=g) if w.dim() else w for w in weights]
    e13, _ = _run(f, other, weights13)
    c13, _ = _run(compiled, other, weights13)
    assert all(torch.equal(a, b) for a, b in zip(e13, c13))
    assert counter.frame_count == frames, "recompiled for a new batch size"


# ----------------------------------------------------------------------------- the temperature
# A runtime value of the compiled graph (issue 35): inductor with its default caches, a schedule of
# more temperatures than Dynamo's recompile limit (8), values and gradients against float64 at
# each. The torch backend: the ops' bodies are the backends' shared code; the temperature's way
# into them is what is tested (the Triton path would add ~0.3 s per launch and nothing here).
TEMPERATURE_CASES = {name: head.call for name, head in HEADS.items() if head.takes_temperature}
SCHEDULE = (0.5, 0.7, 1.3, 2.0, 0.9, 1.1, 3.0, 0.4, 1.7, 0.6)
needs_cxx = pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX"), "g++", "clang++", "c++") if c),
                               reason="inductor on CPU needs a C++ compiler")


def _reference_and_grads(name, inputs, weights, temperature):
    """``_run``'s outputs and gradients, from the float64 reference."""
    leaves = [t.detach().double().requires_grad_() for t in inputs[:3]]
    outs = _reference(name, *leaves, inputs[3], temperature=temperature)
    total = sum((o * w.double()).sum() for o, w in zip(outs, weights))
    return [o.detach() for o in outs], list(torch.autograd.grad(total, leaves, allow_unused=True))


def _check_against_float64(name, outs, grads, inputs, weights, temperature):
    ref_outs, ref_grads = _reference_and_grads(name, inputs, weights, temperature)
    for c, r in zip(outs, ref_outs):
        torch.testing.assert_close(c.double(), r, rtol=1e-5, atol=1e-5, msg=lambda m: f"T = {temperature}: {m}")
    for which, c, r in zip(("hidden", "weight", "logits"), grads, ref_grads):
        assert (c is None) == (r is None), (which, temperature)
        if c is not None:
            torch.testing.assert_close(c.double(), r, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"T = {temperature}, d/d{which}: {m}")


@needs_cxx
@pytest.mark.parametrize("name", sorted(TEMPERATURE_CASES))
def test_temperature_schedule_compiles_once_and_is_right_at_every_value(name):
    """Ten temperatures through one inductor graph (``dynamic=True``: a Python float argument is
    then symbolic from the first call), fullgraph=True (no FailOnRecompileLimitHit), each output
    and gradient within float64's tolerance at its own temperature."""
    torch._dynamo.reset()  # (other tests compile the same code objects)
    f = TEMPERATURE_CASES[name]("torch")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    inputs = _inputs()
    g = torch.Generator().manual_seed(3)
    weights = [torch.randn(o.shape, generator=g) for o in f(*inputs)]
    for temperature in SCHEDULE:
        outs, grads = _run(compiled, inputs, weights, temperature)
        _check_against_float64(name, outs, grads, inputs, weights, temperature)
    assert counter.frame_count == 1, f"{counter.frame_count} compilations for {len(SCHEDULE)} temperatures"


@needs_cxx
def test_inductor_caches_do_not_serve_an_earlier_temperature():
    """Issue 35's reproduction: linear_topk_kl under inductor (its FX graph and AOT autograd caches
    on, as by default; ``dynamic`` left to Dynamo) at T = 0.5, 0.7, 1.3, 2.0. Dynamo holds T as a
    constant at the first call and symbolically from the second on; 1 / T entering the custom op as
    a ``float`` was specialized again while T^2 stayed symbolic, so the recompiled graphs looked
    alike and the caches returned T = 0.7's: the loss at 1.3 was KL(0.7) x 1.3^2 (14.26 here instead
    of 9.14), its gradients likewise. Now: two compilations (the constant, then the runtime value),
    and each temperature's own loss and gradients."""
    torch._dynamo.reset()
    f = HEADS["linear_topk_kl"].call("torch", reduction="mean")
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    inputs = _inputs()
    weights = [torch.ones(())]
    with torch._inductor.config.patch(fx_graph_cache=True), \
            torch._functorch.config.patch(enable_autograd_cache=True):
        compiled = torch.compile(f, backend=counter, fullgraph=True)
        losses = {}
        for temperature in (0.5, 0.7, 1.3, 2.0):
            outs, grads = _run(compiled, inputs, weights, temperature)
            losses[temperature] = outs[0].item()
            ref_mean = HEADS["linear_topk_kl"].reference(*inputs, temperature=temperature, reduction="mean")[0]
            torch.testing.assert_close(outs[0].double(), ref_mean, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"T = {temperature}: {m}")
            eager_grads = _run(f, inputs, weights, temperature)[1]
            for c, e in zip(grads, eager_grads):
                assert (c is None) == (e is None)
                if c is not None:
                    torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6, msg=lambda m: f"T = {temperature}: {m}")
    # the stale value would be the loss at 0.7 rescaled by (T / 0.7)^2: far from the right one
    assert abs(losses[1.3] - losses[0.7] * (1.3 / 0.7) ** 2) > 0.1
    assert counter.frame_count == 2


def test_vocab_parallel_temperature_schedule_compiles_once():
    """The vocab-parallel routes (their own custom ops) with a runtime temperature: a gloo group of
    2 processes (tests/api/tp_worker.py checks these functions against float64 at fixed temperatures),
    ten temperatures through one graph each (aot_eager: the ops' plumbing and Dynamo's handling of
    the temperature are what is tested), values and gradients equal to eager's at each."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_vp_temperature_worker, args=(2, os.path.join(tmp, "init")), nprocs=2, join=True)


def _vp_temperature_worker(rank, world, init_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        hidden, weight, logits, labels = _inputs()
        lo, hi = (0, 20) if rank == 0 else (20, V)
        group = dist.group.WORLD
        ids, teacher = _teacher(N)
        teacher_hidden, teacher_weight = torch.sin(3 * hidden.detach() + 1), weight.detach().flip(0)[lo:hi]
        g = torch.Generator().manual_seed(5)
        g_lp, g_ent, g_lse = torch.randn(3, N, generator=g)

        def head(h, w, y, t):
            o = rl_kernels.linear_log_probs(h, w, y, temperature=t, backend="torch", process_group=group)
            return (o.log_probs * g_lp + o.entropy * g_ent).sum()

        def from_logits(h, w, y, t):
            o = rl_kernels.logits_stats(h @ w.T, y, temperature=t, backend="torch", process_group=group)
            return (o.log_probs * g_lp + o.entropy * g_ent + o.lse * g_lse).sum()

        def topk(h, w, y, t):
            return rl_kernels.linear_topk_kl(h, w, ids, teacher, labels=y, temperature=t, reduction="sum",
                                             backend="torch", process_group=group)

        def jsd(h, w, y, t):
            return rl_kernels.linear_jsd(h, w, teacher_hidden, teacher_weight, labels=y, temperature=t, beta=0.3,
                                         reduction="sum", backend="torch", process_group=group)

        for fn in (head, from_logits, topk, jsd):
            counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
            compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=True)
            for t in SCHEDULE:
                results = []
                for f in (fn, compiled):
                    hx, wx = hidden.detach().clone().requires_grad_(), weight.detach()[lo:hi].clone().requires_grad_()
                    loss = f(hx, wx, labels, t)
                    loss.backward()
                    results.append((loss.detach(), hx.grad, wx.grad))
                for a, b in zip(*results):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6,
                                               msg=lambda m: f"{fn.__name__}, T = {t}, rank {rank}: {m}")
            assert counter.frame_count == 1, (fn.__name__, counter.frame_count)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["linear_log_probs", "log_probs_from_logits", "linear_topk_kl", "linear_jsd"])
def test_compiled_bad_label_raises(name, backend):
    f = torch.compile(CASES[name](backend), backend="aot_eager", fullgraph=True)
    hidden, weight, logits, labels = _inputs()
    labels[4] = V + 3
    with pytest.raises(ValueError, match="labels"):
        f(hidden, weight, logits, labels)
    rl_kernels.core.label_check.raise_label_errors()  # nothing left behind for the next test
    labels[4] = -5  # negative and not ignore_index
    with pytest.raises(ValueError, match="labels"):
        f(hidden, weight, logits, labels)


@pytest.mark.parametrize("name", ["linear_log_probs", "logits_stats"])
def test_double_backward_raises(name):
    """Compiled: torch's AOT autograd refuses create_graph=True itself. Eager: our node raises when
    the gradient is differentiated again."""
    hidden, weight, logits, labels = inputs = _inputs()
    x = hidden if name == "linear_log_probs" else logits
    f = torch.compile(CASES[name]("torch"), backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(f(*inputs)[0].sum(), x, create_graph=True)[0].sum().backward()
    if name == "linear_log_probs":
        out = rl_kernels.linear_log_probs(hidden, weight, labels, backend="torch")
    else:
        out = rl_kernels.logits_stats(logits, labels, backend="torch")
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


def test_compiled_auto_backend_logs_its_choice_at_run_time(caplog):
    """The library's traced code does not log (a logger call would break the graph): with a fresh
    log, a fullgraph compile of ``backend='auto'`` compiles, and the choice is logged once, when
    the custom op's body runs (the op carries the 'auto' mark with the backend's name)."""
    import rl_kernels.core._logging as rl_logging

    def f(logits, labels):
        return rl_kernels.log_probs_from_logits(logits, labels, temperature=T)
    _, _, logits, labels = _inputs()
    rl_logging._seen.clear()
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="rl_kernels"):
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        compiled(logits, labels).sum().backward()
        compiled(logits, labels).sum().backward()
    said = [r.getMessage() for r in caplog.records if "backend='auto'" in r.getMessage()]
    assert said == ["rl_kernels: backend='auto' runs 'torch' for cpu tensors"], said


# ----------------------------------------------------------------------------- opcheck of every op
# The ops are found, not listed: every op torch knows under ``rl_kernels::`` (after every autograd
# module is imported), each checked on the samples that ``autograd.head_family.OPS`` gives for it (a
# family's ``stage_op`` registers its ``_op_samples()``: each stage op with the float temperature, its
# runtime-temperature twin with the 0-d tensor (and the per-row one); ``plain_op``: its examples).

def _ops_of_the_namespace() -> set:
    """The names (without ``rl_kernels::``) of every op registered under ``rl_kernels::``."""
    import importlib
    import pkgutil

    import rl_kernels.autograd

    for m in pkgutil.iter_modules(rl_kernels.autograd.__path__):
        importlib.import_module(f"rl_kernels.autograd.{m.name}")
    return {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("rl_kernels::")}


def _samples(name: str) -> list:
    from rl_kernels.autograd.head_family import OPS

    return OPS[name](name) if OPS.get(name) is not None else []


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def test_every_op_is_found():
    """Every op of the namespace is made by ``autograd.head_family``'s helpers (``OPS`` lists exactly those) and has
    opcheck samples."""
    from rl_kernels.autograd.head_family import OPS

    ops = _ops_of_the_namespace()
    assert ops == set(OPS), (ops ^ set(OPS))
    assert all(_samples(name) for name in ops), [name for name in ops if not _samples(name)]


@pytest.mark.parametrize("name", sorted(_ops_of_the_namespace()))
def test_custom_ops_pass_opcheck(name):
    """torch.library.opcheck of each sample: schema (no hidden mutation or aliasing), fake
    implementation, autograd registration (a family's ops are backend calls inside its Function:
    their inputs need no grad) and AOT dispatch with dynamic shapes. A runtime-temperature twin is
    tagged cudagraph-unsafe (``autograd.head_family.CustomOpPair``), and its runtime tensor (0-d, or one
    T per row: constant here), not the float (1.0 there), gives the temperature: the same bits as the
    float. (The vocab-parallel ops need a process group: tests/api/tp_worker.py compiles them.)"""
    op = getattr(torch.ops.rl_kernels, name)
    samples = _samples(name)
    assert samples, f"rl_kernels::{name} has no opcheck samples"
    if name.endswith("_runtime_temperature"):
        assert torch.Tag.cudagraph_unsafe in op.default.tags
    for sample in samples:
        torch.library.opcheck(op.default, sample.args)
        if sample.same_as is not None:
            got, expected = _as_tuple(op(*sample.args)), _as_tuple(op(*sample.same_as))
            assert all(torch.equal(a, b) for a, b in zip(got, expected)), name


@pytest.mark.parametrize("name", sorted(_ops_of_the_namespace()))
def test_backend_call_ops_are_not_differentiable_by_themselves(name):
    """Every op of the namespace is a backend call inside a Function (which does the autograd on
    both routes) or a check: called directly on floating inputs that require grad, a floating
    output's backward raises (torch: no autograd formula), never a silently missing gradient."""
    sample = _samples(name)[0]
    args = [a.detach().clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
            and a.dim() > 0 else a for a in sample.args]
    if not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        pytest.skip(f"rl_kernels::{name} takes no floating tensor")
    outs = [o for o in _as_tuple(getattr(torch.ops.rl_kernels, name)(*args)) if o.is_floating_point() and o.numel()]
    if not outs:
        pytest.skip(f"rl_kernels::{name} gives no floating tensor (a check)")
    assert all(o.requires_grad for o in outs), f"rl_kernels::{name}: an output is cut from its inputs' graph"
    with pytest.raises(RuntimeError, match="no autograd formula"):
        outs[0].sum().backward()


def _every_op_args():
    """(module name, OpArgs) of every autograd module (a new family's included)."""
    import importlib
    import pkgutil

    import rl_kernels.autograd
    from rl_kernels.autograd.head_family import OpArgs

    found = []
    for m in pkgutil.iter_modules(rl_kernels.autograd.__path__):
        mod = importlib.import_module(f"rl_kernels.autograd.{m.name}")
        found += [(f"{m.name}.{k}", v) for k, v in vars(mod).items() if isinstance(v, OpArgs)]
    return found


def _unusual_record(op_args):
    """A record of ``op_args``' type with a non-default value in every field that travels."""
    import typing

    from rl_kernels.core.backends import Backend

    hints = typing.get_type_hints(op_args.record_type)
    unusual = {bool: lambda d: not d, int: lambda d: -7, float: lambda d: 0.5, str: lambda d: "n",
               Backend: lambda d: TORCH}
    values = {}
    for f in op_args.fields:
        hint = hints[f]
        base = next((a for a in getattr(hint, "__args__", ()) if a is not type(None)), hint)
        default = op_args.record_type._field_defaults.get(f, None)
        values[f] = 30.0 if base is float and default is None and hint is not float else unusual[base](default)
    return op_args.record_type(**values)


def test_op_arguments_carry_every_field_of_each_record():
    """``OpArgs`` derives the ops' trailing arguments from the records' fields: each field is in
    the schema with its type, and a record with a non-default value in every field comes back whole
    (1 / T from the runtime temperature when one is passed). Every family's ``OpArgs`` is found by
    itself."""
    from rl_kernels.autograd.head_family import OpArgs

    found = _every_op_args()
    assert {"linear.OP_ARGS", "linear.BACKWARD_OP_ARGS", "logits.OP_ARGS", "linear_jsd.OP_ARGS", "linear_topk.OP_ARGS"} <= {n for n, _ in found}
    found.append(("no group", OpArgs(logits_autograd.LogitsParams, group=False)))  # a head without a shard form
    for name, op_args in found:
        record = _unusual_record(op_args)
        assert all(f" {f}" in op_args.schema for f in op_args.fields), (name, op_args.schema)
        assert op_args.unpack(op_args.pack(record, None))[0] == record, name
        runtime = op_args.pack(record, torch.tensor(4.0, dtype=torch.float64))
        assert op_args.unpack(runtime)[0] == record._replace(inv_temperature=0.25), name
    head_schema = linear_autograd.OP_ARGS.schema
    assert "float? softcap" in head_schema and "str backend" in head_schema


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
