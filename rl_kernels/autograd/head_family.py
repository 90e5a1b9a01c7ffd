"""What every autograd Function of rl_kernels shares: first-order-only backward (double backward
raises), the selection of ignored non-finite rows out of the weight gradient, and the custom ops'
conventions (the runtime temperature, a parameter record as plain arguments: ``OpArgs``)."""
from __future__ import annotations

import collections
import functools
import importlib
import inspect
import operator
import types
import typing

import torch

from ..core.backends import Backend, backend_by_name
from ..core.validation import row_inv_temperature
from .vocab_parallel import GROUP_SCHEMA, group_from_op, op_group


_KERNELS: dict[tuple[str, str], types.ModuleType] = {}  # (package, family) -> the module, once imported


def kernels(backend: Backend, family: str) -> types.ModuleType:
    """The module that runs head family ``family`` ("linear", "logits", "linear_jsd", "linear_topk")
    on ``backend``: ``rl_kernels.ops.<family>`` (the Triton kernels, imported on the first call that
    runs them) or ``rl_kernels.torch_ops.<family>`` (their torch twin); both expose the family's
    functions under the same names (the family's autograd module lists them). Logs the choice of
    ``backend='auto'`` once."""
    backend.log_choice()
    module = _KERNELS.get((backend.package, family))
    if module is None:
        module = _KERNELS[backend.package, family] = importlib.import_module(f"rl_kernels.{backend.package}.{family}")
    return module


def first_order_only(backward):
    """Decorate an autograd Function's ``backward``: gradients are computed without a graph, and
    under ``create_graph=True`` they are wired to a node that raises "double backward is not
    supported by rl_kernels.<ctx.fn_name>" when differentiated again. The first derivatives stay
    correct; a second derivative never comes out silently wrong (or silently zero)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        if not torch.is_grad_enabled():  # the usual case (no create_graph): nothing to wire
            return backward(ctx, *grads)
        with torch.no_grad():
            outs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outs
        msg = (f"double backward is not supported by rl_kernels.{ctx.fn_name}: its backward "
               f"computes first derivatives only")
        present = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        # the node's extra inputs: what the gradients depend on (the saved inputs and the
        # incoming gradients), so that differentiating the gradients reaches the node
        deps = [t for t in (*ctx.saved_tensors, *grads)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if not present or not deps:
            return outs
        delayed = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)
        if delayed is None:  # pragma: no cover - torch without the C++ node: refuse up front
            raise RuntimeError(msg + " (create_graph=True)")
        guarded = delayed(msg.encode(), len(present) + len(deps))(*[outs[i] for i in present], *deps)
        outs = list(outs)
        for i, g in zip(present, guarded):
            outs[i] = g
        return tuple(outs)
    return wrapper


def hidden_for_weight_grad(hidden_states: torch.Tensor, ignored: torch.Tensor,
                           lse: torch.Tensor):
    """A zero-argument function giving ``hidden_states`` with the rows that must not reach dW
    zeroed: rows that are ``ignored`` (label == ignore_index, or masked) and non-finite. Their
    dlogits rows are exactly 0, but in dW = dz^T h a NaN/inf hidden value times 0 is NaN, which
    would spread over all of dW. A row of non-finite hidden states has a non-finite lse (every
    logit of the row is NaN or +-inf), so the check reads O(N) values; a copy of hidden_states is
    made only when such a row exists.

    The check needs the host to see one value. On CUDA it is copied into pinned host memory
    without blocking, and the host waits for it only when the function is first called: the
    backward schedule calls it at its first dW matmul, after it has queued the first window's
    kernels, so the GPU is never left idle while the host waits (a sync at the start of the
    backward cost 3-5% of a 4096-row step on the H100, 2026-11-24)."""
    bad = ignored & ~torch.isfinite(lse)
    if hidden_states.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        # a CUDA graph being captured: no host read; the selection is always made (one copy of
        # hidden_states, replayed with the graph), so every replay is right whatever its rows
        return lambda: hidden_states.masked_fill(bad[:, None], 0)
    if hidden_states.device.type != "cuda":
        any_bad = bool(bad.any())
        return lambda: hidden_states.masked_fill(bad[:, None], 0) if any_bad else hidden_states
    flag = torch.empty((), dtype=torch.bool, pin_memory=True)
    flag.copy_(bad.any(), non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()

    def resolve() -> torch.Tensor:  # called once, by chunked_backward (which keeps the result)
        ready.synchronize()
        return hidden_states.masked_fill(bad[:, None], 0) if bool(flag) else hidden_states
    return resolve


# The temperature on torch.compile's route. A custom op's ``float`` argument is a constant of the
# graph: Dynamo holds a temperature that changed between calls as a symbolic float, and passing it
# (or 1 / T) to a ``float`` argument specializes it again (a recompilation per temperature, and a
# FailOnRecompileLimitHit under fullgraph=True after 8), while its other uses (the T^2 of the
# distillation losses) stay symbolic: inductor's caches then returned the graph of an earlier
# temperature (issue 35: T = 1.3 after 0.5 and 0.7 gave the loss at T = 0.7 times 1.3^2). So every
# op that takes ``inv_temperature`` also takes ``Tensor? temperature``: a symbolic temperature
# travels as a 0-d float64 CPU tensor, a runtime value of the one graph (its multiplication below
# is one that Dynamo's float tensorification keeps symbolic), which the op's body (run eagerly)
# reads on the host; a constant one stays a float, as before.
# The body launches the kernels with 1 / T as a kernel argument: replayed from a CUDA graph, a
# captured call would keep the temperature of its capture. So each such op has a twin,
# ``<name>_runtime_temperature``, tagged cudagraph-unsafe (under mode="reduce-overhead" inductor
# runs it outside its CUDA graphs: graph partitions, or no CUDA graph for that graph), which the
# compiled route calls when it passes a runtime temperature; with a constant one the ops stay in.
RUNTIME_TEMPERATURE_SCHEMA = "Tensor? temperature=None"  # the last argument of the ops that take one
RUNTIME_TEMPERATURE_SUFFIX = "_runtime_temperature"
_CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


class CustomOpPair:
    """A ``torch.library`` custom op ``rl_kernels::<name>`` and its cudagraph-unsafe twin
    ``rl_kernels::<name>_runtime_temperature`` (same schema, body, fake implementation and
    autograd: none, the family's Function is the autograd): ``register_fake`` registers on both."""

    def __init__(self, qualname: str, schema: str, fn):
        self.ops = (torch.library.custom_op(qualname, fn, mutates_args=(), schema=schema),
                    torch.library.custom_op(qualname + RUNTIME_TEMPERATURE_SUFFIX, fn, mutates_args=(),
                                            schema=schema, tags=_CUDAGRAPH_UNSAFE))

    def register_fake(self, fn):
        for op in self.ops:
            op.register_fake(fn)
        return fn



def stage_op(name: str, schema: str, samples):
    """Decorator: a family's stage body ``fn`` as the custom op ``rl_kernels::<name>`` with
    ``schema`` (its arguments; the result part included) and its runtime-temperature twin
    (:class:`CustomOpPair`), listed in ``OPS`` with ``samples()``: a dict {op name: [OpSample]}
    for opcheck (:func:`temperature_samples` makes a stage's). Returns the pair: its
    ``register_fake`` decorates the hand-written fake implementation."""
    def make(fn):
        pair = CustomOpPair(f"rl_kernels::{name}", schema, fn)
        OPS[name] = OPS[name + RUNTIME_TEMPERATURE_SUFFIX] = lambda op: samples().get(op, [])
        return pair
    return make


def temperature_samples(op: str, tensors: tuple, op_args, params, tail: tuple = (), rows: int | None = None) -> dict:
    """opcheck's samples of one stage op (see :func:`stage_op`): ``op`` with the float temperature of
    ``params`` (arguments: ``tensors``, then ``tail`` (e.g. a backward's need flags), then the
    record's), and its twin with the same temperature as the runtime 0-d float64 tensor (and, with
    ``rows``, as a per-row (rows,) tensor), each to give the float's bits."""
    as_float = (*tensors, *tail, *op_args.pack(params, None))
    unit, t = params._replace(inv_temperature=1.0), 1.0 / params.inv_temperature
    runtime = [torch.tensor(t, dtype=torch.float64)] + ([torch.full((rows,), t)] if rows is not None else [])
    return {op: [OpSample(as_float)],
            op + RUNTIME_TEMPERATURE_SUFFIX: [OpSample((*tensors, *tail, *op_args.pack(unit, r)), as_float)
                                              for r in runtime]}

_SCHEMA_TYPES = {bool: "bool", int: "int", float: "float", str: "str", Backend: "str"}


def _schema_type(hint) -> str:
    if isinstance(hint, types.UnionType) and type(None) in hint.__args__:  # X | None
        (inner,) = [a for a in hint.__args__ if a is not type(None)]
        return _SCHEMA_TYPES[inner] + "?"
    return _SCHEMA_TYPES[hint]


class OpArgs:
    """A family's parameter record (a NamedTuple) as its custom ops' trailing plain arguments, read
    from the record's own fields and type hints (a custom op takes no Python objects): the fields in
    order (``skip``: fields that do not travel; a ``Backend`` as its ``op_name``), then, with ``group``,
    the vocab-parallel layout (``autograd.vocab_parallel.GROUP_SCHEMA``), then the runtime
    temperature (``RUNTIME_TEMPERATURE_SCHEMA``). ``schema`` is that part of the ops' schema,
    :meth:`pack` the values in the traced code, :meth:`unpack` the record back in an op's body. A
    new field of the record travels with no edit here or in the ops."""

    def __init__(self, record_type, skip: tuple = (), group: bool = True):
        hints = typing.get_type_hints(record_type)
        self.record_type, self.group = record_type, group
        self.fields = tuple(f for f in record_type._fields if f not in skip)
        parts = [f"{_schema_type(hints[f])} {f}" for f in self.fields] + ([GROUP_SCHEMA] if group else [])
        self.schema = ", ".join(parts + [RUNTIME_TEMPERATURE_SCHEMA])

    def pack(self, params, temperature, tp=None) -> tuple:
        """The plain values of ``params`` (and of the layout ``tp``), then ``temperature`` (None,
        or the 0-d runtime temperature of a compiled graph)."""
        values = tuple(v.op_name if isinstance(v, Backend) else v for v in (getattr(params, f) for f in self.fields))
        return values + (op_group(tp) if self.group else ()) + (temperature,)

    def unpack(self, args, read_temperature: bool = True) -> tuple:
        """(the record, the layout's values (group name, vocab_start_index, reduce_hidden_grad) or
        None without ``group``) from an op's trailing arguments; 1 / T from the runtime temperature
        when there is one (the dispatcher leaves out a trailing None). A fake implementation passes
        ``read_temperature=False``: reading the tensor there would make an unbacked symbol."""
        n, g = len(self.fields), 3 if self.group else 0
        temperature = args[n + g] if len(args) > n + g and read_temperature else None
        values = dict(zip(self.fields, args[:n]))
        values["backend"] = backend_by_name(values["backend"])
        values["inv_temperature"] = op_inv_temperature(values["inv_temperature"], temperature)
        return self.record_type(**values), (tuple(args[n:n + g]) if self.group else None)


# ------------------------------------------------------------------ a family's wiring, generated once
class Out(typing.NamedTuple):
    """One output of a family's forward op (a "slot"), declared for :class:`HeadFamily` (and
    :func:`plain_op`): what its fake implementation makes and what the Function does with it.

    ``shape``: a tuple of sizes, each an int, ``"x[i]"`` (dim i of the input ``x``) or the name of a
    field of the parameter record (``"k"``); or ``"x"`` (the input's whole shape); or a callable of
    the call's arguments (``a.<input>``, ``a.params``, ``a.sharded``: a vocab-parallel layout is
    given) giving the shape. ``dtype``: a ``torch.dtype``, ``"x"`` (that input's dtype) or a callable of
    the arguments.
    ``when``: None (always made), the name of an optional input (made when it is given), the name of
    a record field (made when it is true), or a callable of the arguments; a slot not made is None
    in the Function and an empty float32 tensor in the op. ``saved``: the backward reads it.
    ``output``: returned by the Function (False: state the forward hands to the backward only)."""

    name: str
    shape: object
    dtype: object = torch.float32
    when: object = None
    saved: bool = False
    output: bool = True


class OpSample(typing.NamedTuple):
    """Arguments for ``torch.library.opcheck`` of one op; ``same_as``: other arguments the op must
    answer with the same bits (a runtime temperature against the float)."""

    args: tuple
    same_as: tuple | None = None


# Every op of the ``rl_kernels::`` namespace that this module made: its name (without the
# namespace) -> a function giving its ``OpSample``s. tests/autograd/test_compile.py runs opcheck on each and
# fails on an op of the namespace not found here or without samples.
OPS: dict = {}


def _getter(spec: str):
    """``"x[i]"`` -> size i of argument x; ``"x"`` -> argument x."""
    name, _, dim = spec.partition("[")
    if dim:
        i = int(dim.rstrip("]"))
        return lambda a: getattr(a, name).shape[i]
    return lambda a: getattr(a, name)


def _shape_fn(spec, arg_names):
    if callable(spec):
        return spec
    if isinstance(spec, str):  # an argument's whole shape
        return lambda a: getattr(a, spec).shape
    sizes = [(lambda a, s=s: s) if isinstance(s, int) else _getter(s) if s.split("[")[0] in arg_names
             else (lambda a, f=s: getattr(a.params, f)) for s in spec]
    return lambda a: tuple(s(a) for s in sizes)


def _dtype_fn(spec):
    if callable(spec) and not isinstance(spec, torch.dtype):
        return spec
    return (lambda a: spec) if isinstance(spec, torch.dtype) else (lambda a: getattr(a, spec).dtype)


def _when_fn(spec, arg_names):
    if spec is None or callable(spec):
        return spec
    if spec in arg_names:
        return lambda a: getattr(a, spec) is not None
    return lambda a: bool(getattr(a.params, spec))


def _fake_outputs(shapes, dtypes, whens, a, like):
    """The fake implementation's tensors: each made slot with its declared shape and dtype, the
    others empty float32 (as :func:`or_empty` makes them)."""
    made = [w is None or w(a) for w in whens]
    return tuple(like.new_empty(s(a), dtype=d(a)) if m else like.new_empty(0, dtype=torch.float32)
                 for s, d, m in zip(shapes, dtypes, made))


def _tensor_args(schema: str) -> tuple:
    """(names, optional flags) of a schema fragment of tensors: ``"Tensor x, Tensor? y"``."""
    parts = [p.split() for p in schema.split(",")]
    return tuple(n for _, n in parts), tuple(t == "Tensor?" for t, _ in parts)


def _picker(indices: tuple):
    """A function giving the tuple of a sequence's items at ``indices`` (eager code only)."""
    if not indices:
        return lambda seq: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda seq: (seq[i],)
    return operator.itemgetter(*indices)


def _all_grads(asked: tuple, output_grads: tuple, n_outputs: int):
    """One gradient (or None) per output slot, from the Function's returned outputs' (``asked``)."""
    if len(asked) == n_outputs:
        return output_grads
    grads = [None] * n_outputs
    for p, g in zip(asked, output_grads):
        grads[p] = g
    return grads


def _placed(res, positions: tuple, n_args: int) -> tuple:
    """The Function's backward result: ``res[k]`` at argument ``positions[k]``, None elsewhere."""
    out = [None] * n_args
    for i, r in zip(positions, res):
        out[i] = r
    return tuple(out)


class HeadFamily:
    """A head family's wiring, made once from its declaration: the forward and backward custom ops
    (``rl_kernels::<forward_op>`` / ``<backward_op>`` and their ``_runtime_temperature`` twins:
    :class:`CustomOpPair`), their fake implementations (from the declared outputs, :class:`Out`),
    the autograd Function (``function``; ``apply`` is its ``apply``) and ``forward_call`` (the
    forward alone, no autograd node), each eager and compiled. The family writes its math only.

    The recipe (``autograd/linear_jsd.py`` is the example):

    1. the parameter record, a NamedTuple with ``backend`` and ``inv_temperature`` (``OpArgs``
       derives the ops' trailing arguments from it);
    2. ``forward(*inputs, params, tp) -> slots``: one backend call, eager code (host reads and
       checks here, ``raise_label_errors()`` first): a tuple with one tensor (or None) per declared
       ``Out``, in order; with ``refines_params`` ``(slots, params)``, the record the eager
       backward then reads (e.g. what a host check of the labels learnt);
    3. ``backward(*saved_inputs, *saved_slots, *grads, params, tp, *needs)`` -> one gradient (or
       None) per input of ``grads``: ``saved_inputs`` are the inputs named in ``saves``, in input
       order, ``saved_slots`` the slots declared ``saved`` (None where not made), ``grads`` one per
       slot declared ``output`` (None where none came: the Function does not materialize them; the
       body makes them float32 contiguous as it needs), ``needs`` one bool per input of ``grads``;
    4. the declaration::

           FAMILY = HeadFamily(
               JSDParams, "Tensor student_hidden, Tensor student_weight, ..., Tensor valid",
               outputs=(Out("per_token", ("student_hidden[0]",)), Out("lse_s", ..., saved=True, output=False), ...),
               forward=jsd_forward, backward=jsd_backward, grads=("student_hidden", "student_weight"),
               forward_op="jsd_forward", backward_op="jsd_backward", name="linear_jsd",
               vocab=("student_weight", 0), examples=_op_examples)

       then ``FAMILY.apply(*inputs, params, temperature, tp)`` (every argument, by position: the
       Function, ``FAMILY.function``, named after the record: ``JSDFunction``) returns
       the made ``output`` slots, a tuple of tensors (Dynamo's rule: no None among a Function's
       outputs); ``temperature``: None or the runtime temperature of ``split_temperature``; ``tp``:
       the vocab-parallel layout or None (``vocab`` None: the family has no shard form, no ``tp``).

    Eagerly the Function calls the bodies directly (no dispatcher on the host path); while
    torch.compile traces, the ops (``rl_op``: the twin with a runtime temperature), whose bodies
    unpack the record, derive the layout (``group_from_op``, the local vocabulary from ``vocab``:
    (input, dim)) and call the same bodies: the same kernels in the same order, the same bits. The
    backward is ``first_order_only`` (errors name ``params.name`` when the record has one, else
    ``name``). ``in_op(params, forward)``: the record as the ops' bodies use it (None: as passed).
    ``examples()``: a list of (inputs, params) on CPU, torch backend, no layout, for opcheck
    (``OPS``: the forward op with the float and the runtime temperature, per row too with
    ``row_temperature``, and the backward op). No backward (``backward=None``): no Function, no
    backward op; ``forward_call`` is the family's route. ``row_temperature``: True, or a function of
    an example's (inputs, params) saying whether that example takes a per-row temperature.
    ``eager_asked(inputs, params, sharded)``: for a family with conditional slots, the positions
    (among the ``output`` slots) of the outputs a call makes, as its ``when``s say, computed more
    cheaply than :meth:`made` (host time of small calls); the eager Function then takes the fast
    route: no call of :meth:`made`, the slots saved as the body returns them (None where not
    made). Keep it equal to the ``when``s (a family's test compares them)."""

    def __init__(self, params, inputs: str, outputs, forward, forward_op: str, name: str, *, backward=None,
                 backward_op: str | None = None, grads: tuple = (), saves: tuple | None = None, vocab=None,
                 reduce_hidden_grad: bool = True, refines_params: bool = False, in_op=None, examples=None,
                 row_temperature: bool = False, eager_asked=None):
        self.input_names, optional = _tensor_args(inputs)
        self.forward, self.backward, self.forward_op, self.backward_op = forward, backward, forward_op, backward_op
        self.name, self.refines_params, self.in_op, self.vocab = name, refines_params, in_op, vocab
        self.reduce_hidden_grad, self.examples, self.row_temperature = reduce_hidden_grad, examples, row_temperature
        self.eager_asked = eager_asked
        self.op_args = OpArgs(params, group=vocab is not None)
        self.outputs = tuple(outputs)
        names = self.input_names
        self.args_type = collections.namedtuple(f"{name}_args", names + ("params", "sharded"))
        self._shapes = [_shape_fn(o.shape, names) for o in self.outputs]
        self._dtypes = [_dtype_fn(o.dtype) for o in self.outputs]
        self._whens = [_when_fn(o.when, names) for o in self.outputs]
        self.conditional = any(w is not None for w in self._whens)
        self.output_slots = tuple(j for j, o in enumerate(self.outputs) if o.output)
        n = len(names)
        self.n_args = n + 3  # the inputs, params, temperature, tp
        returns = "(" + ", ".join(["Tensor"] * len(self.outputs)) + ")" if len(self.outputs) > 1 else "Tensor"
        self.forward_pair = CustomOpPair(f"rl_kernels::{forward_op}", f"({inputs}, {self.op_args.schema}) -> {returns}",
                                         self._forward_op)
        self.forward_pair.register_fake(self._forward_fake)
        OPS[forward_op] = OPS[forward_op + RUNTIME_TEMPERATURE_SUFFIX] = self._samples_of
        self.function = self.apply = None
        if backward is None:
            return
        saves = names if saves is None else saves
        self.saved_inputs = tuple(i for i, k in enumerate(names) if k in saves)
        self.saved_slots = tuple(j for j, o in enumerate(self.outputs) if o.saved)
        self.grad_inputs = tuple(names.index(k) for k in grads)
        assert set(grads) <= set(saves), "a gradient's input must be saved (its shape and dtype)"
        schema = [f"{'Tensor?' if optional[i] else 'Tensor'} {names[i]}" for i in self.saved_inputs]
        schema += [f"{'Tensor?' if self._whens[j] else 'Tensor'} {self.outputs[j].name}" for j in self.saved_slots]
        schema += [f"Tensor? grad_{self.outputs[j].name}" for j in self.output_slots]
        schema += [f"bool need_{k}" for k in grads] + [self.op_args.schema]
        returns = "(" + ", ".join(["Tensor"] * len(grads)) + ")" if len(grads) > 1 else "Tensor"
        self.backward_pair = CustomOpPair(f"rl_kernels::{backward_op}", f"({', '.join(schema)}) -> {returns}",
                                          self._backward_op)
        self.backward_pair.register_fake(self._backward_fake)
        OPS[backward_op] = OPS[backward_op + RUNTIME_TEMPERATURE_SUFFIX] = self._samples_of
        self.function = self._make_function(params.__name__.removesuffix("Params") + "Function")
        self.apply = self.function.apply

    # -------------------------------------------------------------- what is made
    def made(self, inputs, params, sharded: bool):
        """One bool per slot: whether the call makes it (the declaration's ``when``)."""
        a = self.args_type(*inputs, params, sharded)
        return [w is None or w(a) for w in self._whens]

    def forward_call(self, *args):
        """``(*inputs, params, temperature, tp)`` -> the slots (None where not made), no autograd:
        the forward body eagerly, the forward op while torch.compile traces."""
        inputs, (params, temperature, tp) = args[:-3], args[-3:]
        if not torch.compiler.is_compiling():
            slots = self.forward(*inputs, params, tp)
            return slots[0] if self.refines_params else slots
        slots = self._traced_forward(inputs, params, temperature, tp)
        return tuple(slots) if not self.conditional else \
            tuple(t if m else None for t, m in zip(slots, self.made(inputs, params, tp is not None)))

    def _traced_forward(self, inputs, params, temperature, tp):
        out = rl_op(self.forward_op, temperature)(*inputs, *self.op_args.pack(params, temperature, tp))
        return (out,) if len(self.outputs) == 1 else out

    # -------------------------------------------------------------- the Function
    def _make_function(self, class_name: str):
        """The Function. Its eager route picks tensors with ``operator.itemgetter`` (on CPU, 0.5 us
        less per forward and 1.5 us less per forward and backward than comprehensions); Dynamo does
        not trace itemgetter, so the traced route, and a family with conditional slots, take the
        general code below."""
        family, n, name = self, len(self.input_names), self.name
        out_slots, saved_inputs, saved_slots = self.output_slots, self.saved_inputs, self.saved_slots
        grad_inputs, n_args, n_outputs = self.grad_inputs, self.n_args, len(self.output_slots)
        every, nones = tuple(range(n_outputs)), (None,) * n_args
        named = "name" in self.op_args.record_type._fields  # (errors name the public function)
        pick_inputs, pick_saved, pick_outputs = _picker(saved_inputs), _picker(saved_slots), _picker(out_slots)
        pick_needs = _picker(grad_inputs)
        leading = grad_inputs == tuple(range(len(grad_inputs)))  # the gradients are the first inputs'
        asked = self.eager_asked

        def forward(ctx, *args):
            inputs, (params, temperature, tp) = args[:n], args[n:]
            if torch.compiler.is_compiling() or (family.conditional and asked is None):
                return general_forward(ctx, inputs, params, temperature, tp)
            slots = family.forward(*inputs, params, tp)
            if family.refines_params:
                slots, params = slots
            ctx.save_for_backward(*pick_inputs(inputs), *pick_saved(slots), temperature)
            ctx.params, ctx.tp, ctx.fn_name = params, tp, params.name if named else name
            ctx.set_materialize_grads(False)
            if asked is None:
                ctx.asked = every
                return pick_outputs(slots)
            ctx.asked = made = asked(inputs, params, tp is not None)
            return tuple([slots[out_slots[p]] for p in made])

        def general_forward(ctx, inputs, params, temperature, tp):
            made = family.made(inputs, params, tp is not None) if family.conditional else None
            if torch.compiler.is_compiling():
                slots = family._traced_forward(inputs, params, temperature, tp)
            else:
                slots = family.forward(*inputs, params, tp)
                if family.refines_params:
                    slots, params = slots
            if made is not None:
                slots = [t if m else None for t, m in zip(slots, made)]
            ctx.save_for_backward(*[inputs[i] for i in saved_inputs], *[slots[j] for j in saved_slots], temperature)
            ctx.params, ctx.tp, ctx.fn_name = params, tp, params.name if named else name
            ctx.set_materialize_grads(False)
            ctx.asked = every if made is None else tuple([p for p, j in enumerate(out_slots) if made[j]])
            return tuple([slots[out_slots[p]] for p in ctx.asked])

        @first_order_only
        def backward(ctx, *output_grads):
            if torch.compiler.is_compiling():
                return traced_backward(ctx, output_grads)
            needs = pick_needs(ctx.needs_input_grad)
            if True not in needs:
                return nones
            for g in output_grads:
                if g is not None:
                    break
            else:
                return nones
            *saved, temperature = ctx.saved_tensors
            res = family.backward(*saved, *_all_grads(ctx.asked, output_grads, n_outputs), ctx.params, ctx.tp, *needs)
            res = (res,) if len(needs) == 1 else res
            return (*res, *nones[len(res):]) if leading else _placed(res, grad_inputs, n_args)

        def traced_backward(ctx, output_grads):
            needs = tuple([ctx.needs_input_grad[i] for i in grad_inputs])
            if not any(needs) or all(g is None for g in output_grads):
                return nones
            *saved, temperature = ctx.saved_tensors
            grads = _all_grads(ctx.asked, output_grads, n_outputs)
            res = rl_op(family.backward_op, temperature)(*saved, *grads, *needs,
                                                         *family.op_args.pack(ctx.params, temperature, ctx.tp))
            res = [r if need else None for r, need in zip((res,) if len(needs) == 1 else res, needs)]
            return _placed(res, grad_inputs, n_args)

        return type(class_name, (torch.autograd.Function,), {
            "forward": staticmethod(forward), "backward": staticmethod(backward),
            "__doc__": f"The {self.name} family's Function (``autograd.head_family.HeadFamily``): inputs "
                       f"({', '.join(self.input_names)}, params, temperature, tp), outputs "
                       f"({', '.join(self.outputs[j].name for j in out_slots)}) where made.",
            "__module__": getattr(self.forward, "__module__", __name__)})

    # -------------------------------------------------------------- the ops' bodies and fakes
    def _unpacked(self, args, forward: bool):
        params, group = self.op_args.unpack(args)
        return (self.in_op(params, forward) if self.in_op is not None else params), group

    def _forward_op(self, *args):
        n = len(self.input_names)
        inputs = args[:n]
        params, group = self._unpacked(args[n:], True)
        tp = None
        if group is not None:
            name, dim = self.vocab
            local_vocab = inputs[self.input_names.index(name)].shape[dim]
            tp = group_from_op(*group, getattr(params, "ignore_index", -100), local_vocab, inputs[0].device,
                               self.reduce_hidden_grad)
        slots = self.forward(*inputs, params, tp)
        if self.refines_params:
            slots = slots[0]
        if self.conditional:
            slots = [t if m else None for t, m in zip(slots, self.made(inputs, params, tp is not None))]
        out = or_empty(slots, inputs[0], inputs)
        return out[0] if len(out) == 1 else out

    def _forward_fake(self, *args):
        n = len(self.input_names)
        params, group = self.op_args.unpack(args[n:], read_temperature=False)
        a = self.args_type(*args[:n], params, group is not None and group[0] is not None)
        out = _fake_outputs(self._shapes, self._dtypes, self._whens, a, args[0])
        return out[0] if len(out) == 1 else out

    def _backward_op(self, *args):
        k = len(self.saved_inputs) + len(self.saved_slots) + len(self.output_slots)
        g = len(self.grad_inputs)
        needs = args[k:k + g]
        params, group = self._unpacked(args[k + g:], False)
        res = self.backward(*args[:k], params, group_from_op(*group) if group is not None else None, *needs)
        res = (res,) if g == 1 else res
        grad_of = [args[self.saved_inputs.index(i)] for i in self.grad_inputs]
        out = tuple(x.new_empty(0) if r is None or not need else r.clone() if r is x else r.contiguous()
                    for r, x, need in zip(res, grad_of, needs))  # (contiguous; empty where not needed)
        return out[0] if g == 1 else out

    def _backward_fake(self, *args):
        k = len(self.saved_inputs) + len(self.saved_slots) + len(self.output_slots)
        needs = args[k:k + len(self.grad_inputs)]
        grad_of = [args[self.saved_inputs.index(i)] for i in self.grad_inputs]
        out = tuple(x.new_empty(x.shape if need else (0,)) for x, need in zip(grad_of, needs))
        return out[0] if len(out) == 1 else out

    # -------------------------------------------------------------- opcheck samples
    @functools.cache
    def op_samples(self) -> dict:
        """{op name: [OpSample]} of the family's ops, from ``examples()`` (see the class docstring)."""
        samples = collections.defaultdict(list)
        gen = torch.Generator().manual_seed(0)
        for inputs, params in (self.examples() if self.examples is not None else ()):
            t = 1.0 / params.inv_temperature
            as_float = (*inputs, *self.op_args.pack(params, None))
            runtime = [torch.tensor(t, dtype=torch.float64)]
            if self.row_temperature(inputs, params) if callable(self.row_temperature) else self.row_temperature:
                runtime.append(torch.full((inputs[0].shape[0],), t))
            unit = params._replace(inv_temperature=1.0)
            twin = self.forward_op + RUNTIME_TEMPERATURE_SUFFIX
            samples[self.forward_op].append(OpSample(as_float))
            samples[twin] += [OpSample((*inputs, *self.op_args.pack(unit, r)), as_float) for r in runtime]
            if self.backward is None:
                continue
            slots = getattr(torch.ops.rl_kernels, self.forward_op)(*as_float)
            slots = (slots,) if len(self.outputs) == 1 else slots
            made = self.made(inputs, params, False)
            grads = [torch.randn(slots[j].shape, generator=gen) if made[j] else None for j in self.output_slots]
            tensors = ([inputs[i] for i in self.saved_inputs] + [slots[j] if made[j] else None
                                                                 for j in self.saved_slots] + grads)
            needs = [True] * len(self.grad_inputs)
            as_float = (*tensors, *needs, *self.op_args.pack(params, None))
            samples[self.backward_op].append(OpSample(as_float))
            samples[self.backward_op + RUNTIME_TEMPERATURE_SUFFIX] += [
                OpSample((*tensors, *needs, *self.op_args.pack(unit, r)), as_float) for r in runtime]
        return dict(samples)

    def _samples_of(self, op: str) -> list:
        return self.op_samples().get(op, [])


def plain_op(qualname: str, schema: str, examples):
    """Decorator: ``fn`` as the custom op ``qualname`` (no record, no runtime temperature, no twin:
    a value check as an opaque step of a traced function), listed in ``OPS`` with ``examples()`` (a
    list of argument tuples) for opcheck. Returns the op: its ``register_fake`` decorates the
    hand-written fake implementation."""
    def make(fn):
        op = torch.library.custom_op(qualname, fn, mutates_args=(), schema=schema)
        OPS[qualname.split("::")[1]] = lambda op_name: [OpSample(tuple(a)) for a in examples()]
        return op
    return make


def rl_op(name: str, temperature):
    """``torch.ops.rl_kernels.<name>``, or its cudagraph-unsafe twin when ``temperature`` (the
    op's runtime-temperature argument) is a tensor rather than None."""
    return getattr(torch.ops.rl_kernels, name if temperature is None else name + RUNTIME_TEMPERATURE_SUFFIX)


def op_temperature(inv_temperature: float, temperature) -> tuple:
    """(inv_temperature, temperature) as the custom ops take them, in the traced code:
    ``(inv_temperature, None)`` when ``temperature`` (the checked Python number, or Dynamo's
    symbolic float of it) is None or has a static value, else ``(1.0, 0-d float64 tensor T)``
    (the op's body then ignores the float; see :func:`op_inv_temperature`)."""
    if temperature is None or has_static_value(temperature):
        return inv_temperature, None
    return 1.0, torch.ones((), dtype=torch.float64) * temperature


def split_temperature(temperature) -> tuple:
    """(inv_temperature, runtime temperature) of a public function's checked ``temperature`` (a
    Python number, or a per-row tensor: ``validation.check_temperature``), for a family's
    Function. Eagerly ``(1 / T, None)``, 1 / T a float or the per-row (N,) float32 tensor of
    ``validation.row_inv_temperature`` (its values checked there). While torch.compile traces, a
    number gives :func:`op_temperature`'s pair (a temperature that Dynamo holds symbolically
    becomes the 0-d runtime tensor of the custom ops, and the float 1.0), a tensor ``(1.0, T)``
    flattened: the custom op's body (eager) makes and checks 1 / T (:func:`op_inv_temperature`)."""
    if isinstance(temperature, torch.Tensor):
        if torch.compiler.is_compiling():
            return 1.0, temperature.reshape(-1)
        return row_inv_temperature(temperature), None
    if not torch.compiler.is_compiling():
        return 1.0 / temperature, None
    return op_temperature(1.0 / temperature, temperature)


def op_inv_temperature(inv_temperature: float, temperature):
    """In a custom op's body: 1 / T from the runtime ``temperature`` tensor when there is one, as
    the eager route computes it (a 0-d T: ``1.0 / T`` in Python floats, the same bits; a per-row
    (N,) T: ``validation.row_inv_temperature``), else the float."""
    if temperature is None:
        return inv_temperature
    return 1.0 / temperature.item() if temperature.dim() == 0 else row_inv_temperature(temperature)


def has_static_value(value) -> bool:
    """Whether a Python number (or Dynamo's symbolic version of one) is a constant of the graph
    being traced (``torch.fx.experimental.symbolic_shapes.has_static_value``, which Dynamo answers
    without a guard)."""
    from torch.fx.experimental.symbolic_shapes import has_static_value as static

    return static(value)


def as_float_grad(g: torch.Tensor) -> torch.Tensor:
    """``g`` as a float32 contiguous tensor (itself when it is one: no torch call at all, which
    matters for the host time of small calls)."""
    return g if g.dtype is torch.float32 and g.is_contiguous() else g.float().contiguous()


def or_empty(outputs, like: torch.Tensor, inputs=()) -> tuple:
    """A custom op's outputs: each tensor as it is, a view (e.g. a row of the from-logits
    forward's one output block), a tensor already among the outputs or one of ``inputs`` (the op's
    arguments) as a copy, each None as a new empty float32 tensor on ``like``'s device (outputs may
    alias neither each other nor the inputs)."""
    out, seen = [], set()
    storages = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor) and x.numel()}
    for t in outputs:
        if t is None:
            t = like.new_empty(0, dtype=torch.float32)
        elif id(t) in seen or _shares_storage(t) or (t.numel() and t.untyped_storage().data_ptr() in storages):
            t = t.clone()
        seen.add(id(t))
        out.append(t)
    return tuple(out)


def _shares_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` covers only part of its storage (a view, e.g. one row of a block)."""
    return t.untyped_storage().nbytes() != t.numel() * t.element_size()


def sorted_tail_ids(ids: torch.Tensor, vocab_start: int = 0, local_vocab: int | None = None) -> torch.Tensor:
    """(N, K) int32 contiguous, each row sorted ascending: the ids ``among_ids`` reads, made local to
    a vocab shard starting at ``vocab_start`` (ids of other shards become -1 or values >= the shard's
    width after the shift: they never match a column of this shard when the kernel's columns are
    local). ``ids``: (N, K) int64/int32 global ids."""
    local = ids.to(torch.int64) - vocab_start
    if local_vocab is not None:
        local = torch.where((local >= 0) & (local < local_vocab), local, -1)
    return torch.sort(local.to(torch.int32), dim=1).values.contiguous()


def sum_over_equal_ids(token_ids, grad_log_probs) -> torch.Tensor:
    """(N, K) float32: for each slot, the sum of ``grad_log_probs`` over the slots of its row that
    hold the same id (itself alone when its id is unique in the row). The runs of equal ids of
    each sorted row are summed in float64 (``scatter_add_`` over at most K slots: a slot alone is
    its own value exactly) and rounded to float32 once."""
    if token_ids.shape[1] == 1:
        return grad_log_probs
    sorted_ids, order = token_ids.sort(dim=1, stable=True)
    starts = torch.ones_like(sorted_ids, dtype=torch.bool)
    starts[:, 1:] = sorted_ids[:, 1:] != sorted_ids[:, :-1]
    run = starts.cumsum(1) - 1  # the run (of equal ids) each sorted slot belongs to
    sums = torch.zeros(sorted_ids.shape, dtype=torch.float64, device=token_ids.device)
    sums.scatter_add_(1, run, grad_log_probs.gather(1, order).double())
    return torch.empty_like(grad_log_probs).scatter_(1, order, sums.gather(1, run).float())
