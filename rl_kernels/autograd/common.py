"""What every autograd Function of rl_kernels shares: first-order-only backward (double backward
raises), the selection of ignored non-finite rows out of the weight gradient, and the custom ops'
conventions (the runtime temperature, a parameter record as plain arguments: ``OpArgs``)."""
from __future__ import annotations

import functools
import types
import typing

import torch

from ..backends import Backend, backend_by_name
from ..validation import row_inv_temperature
from .vocab_parallel import GROUP_SCHEMA, op_group


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


def custom_op_pair(qualname: str, schema: str):
    """Decorator: ``fn`` as the body of a :class:`CustomOpPair` (for the ops that take
    ``RUNTIME_TEMPERATURE_SCHEMA``)."""
    return lambda fn: CustomOpPair(qualname, schema, fn)


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


def grads_or_empty(dh, dw, hidden_states: torch.Tensor, weight: torch.Tensor) -> tuple:
    """A backward op's (dh, dW): contiguous, or an empty tensor for one that was not needed."""
    return (hidden_states.new_empty(0) if dh is None else dh.contiguous(),
            weight.new_empty(0) if dw is None else dw.contiguous())


def fake_grads(hidden_states: torch.Tensor, weight: torch.Tensor, need_dh: bool, need_dw: bool) -> tuple:
    """The fake (shape-only) twin of :func:`grads_or_empty`."""
    return (hidden_states.new_empty(hidden_states.shape if need_dh else (0,)),
            weight.new_empty(weight.shape if need_dw else (0,)))


def or_empty(outputs, like: torch.Tensor) -> tuple:
    """A custom op's outputs: each tensor as it is, a view (e.g. a row of the from-logits
    forward's one output block) or a tensor already among the outputs as a copy, each None as a
    new empty float32 tensor on ``like``'s device (outputs may alias neither each other nor the
    inputs)."""
    out, seen = [], set()
    for t in outputs:
        if t is None:
            t = like.new_empty(0, dtype=torch.float32)
        elif id(t) in seen or _shares_storage(t):
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
