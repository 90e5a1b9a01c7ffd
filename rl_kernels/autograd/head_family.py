"""What every head family's autograd shares: ``kernels`` (a family's kernel module on a backend),
first-order-only backward (double backward raises), the selection of ignored non-finite rows out
of the weight gradient, and the custom ops' conventions: ``stage_op`` (a stage body as the op
``rl_kernels::<name>`` and its runtime-temperature twin, the fake written by hand beside it),
``plain_op`` (a check as an op), ``OpArgs`` (a parameter record as the ops' plain trailing
arguments), ``OPS`` (every op made, with its opcheck samples) and the runtime temperature
(``split_temperature``, ``rl_op``).

A family's ``autograd/<family>.py`` writes out its one ``torch.autograd.Function``: eagerly its
``forward`` / ``backward`` call the family's bodies directly (no dispatcher on the host path);
while torch.compile traces they call the stage ops (``rl_op``), whose bodies unpack the record,
derive the vocab-parallel layout and call the same bodies: the same kernels in the same order,
the same bits."""
from __future__ import annotations

import functools
import importlib
import types
import typing

import torch

from ..core.backends import Backend, backend_by_name
from ..core.validation import row_inv_temperature
from .vocab_parallel import GROUP_SCHEMA, op_group


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


class OpSample(typing.NamedTuple):
    """Arguments for ``torch.library.opcheck`` of one op; ``same_as``: other arguments the op must
    answer with the same bits (a runtime temperature against the float)."""

    args: tuple
    same_as: tuple | None = None


# Every op of the ``rl_kernels::`` namespace that this module made: its name (without the
# namespace) -> a function giving its ``OpSample``s. tests/autograd/test_compile.py runs opcheck on each and
# fails on an op of the namespace not found here or without samples.
OPS: dict = {}


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
