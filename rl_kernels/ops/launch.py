"""Direct launches of compiled Triton kernels: the host path below ``kernel[grid](...)``.

Where a call's GPU work is small (hundreds of rows), its time is host time, and most of it is
Triton's Python launch path: binding the arguments, specializing each of them (a C++ call per
argument), building a cache key from a list of tuples and the options' string, reading the
runtime knobs, and the launch metadata. A :class:`Launcher` does that work once per
*specialization class* of a kernel and then calls the compiled kernel's own launcher
(``CompiledKernel.run``, the C function that Triton itself calls last) with the arguments as they
are.

The specialization class is keyed by a function generated for the kernel from the parameter
types of its first call (like Triton's own binder): per tensor, its dtype and whether its address
is 16-byte aligned; per integer, whether it equals 1, whether it is divisible by 16 and its
integer width (i32, i64 or u64); per constexpr and launch option, its value; per argument, its
Python type. Triton's specialization of an argument is a function of exactly these (its type
string, "D" for 16-divisibility, the constant 1), so two calls with equal keys run the same
binary (tests/ops/test_launch.py checks this against Triton's own ``native_specialize_impl`` on
random arguments). Anything else takes Triton's own path, which also compiles and fills the
cache: the first call of each class, the CPU interpreter, argument types the key does not know
(tensor descriptors), launch hooks (a profiler's ``knobs.runtime.launch_enter_hook``), and
``$RL_KERNELS_TRITON_LAUNCH=1`` (always Triton's path; a fallback for a Triton whose internals
moved). The launch itself is Triton's: same binary, grid, stream (the current one of the current
device, as Triton takes it) and arguments, so results are bitwise those of ``kernel[grid]``.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch

from ..core.backends import interpreting

try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - a Triton before 3.4 (no knobs): no hooks to honour
    _knobs = None

TRITON_LAUNCH_ENV = "RL_KERNELS_TRITON_LAUNCH"
"""Set to 1 to launch every kernel through Triton's own ``kernel[grid](...)`` path."""

_I32_MIN, _I32_MAX = -2**31, 2**31 - 1


def _key_code(name: str, kind: str, specialize: bool, align: bool) -> str:
    """Key terms of one argument (Python source), for an argument of ``kind``."""
    if kind == "tensor":
        return f"{name}.dtype, {name}.data_ptr() & 15 == 0" if align else f"{name}.dtype"
    if kind == "int":  # Triton: 1 -> constexpr; 16-divisible -> "D"; i32 / i64 / u64 by range
        width = f"(0 if {_I32_MIN} <= {name} <= {_I32_MAX} else 1 if {name} < {2**63} else 2)"
        return f"{name} == 1, {name} & 15 == 0, {width}" if specialize else width
    if kind == "bool":
        return name
    return ""  # float (always fp32) and None (a constexpr None): the type says all


def _kind(value) -> str | None:
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
        return "tensor"
    if type(value) is int:
        return "int"
    if type(value) is bool:
        return "bool"
    if type(value) is float or value is None:
        return "other"
    return None  # e.g. a tensor descriptor: Triton's path


def make_binder(params, first_args: tuple, first_kwargs: dict):
    """``bind(*args, **kwargs) -> (key, args_in_order)`` for a kernel with Triton ``params``
    (``JITFunction.params``), generated from the types of a first call; None when an argument's
    type is not one the key covers. ``key`` is None when a later call's types differ (Triton's
    path then runs). Exposed for tests/ops/test_launch.py."""
    names = [p.name for p in params]
    values = dict(zip(names, first_args))
    values.update({k: v for k, v in first_kwargs.items() if k in names})
    sig, terms, type_terms, expected, namespace = [], [], [], [], {}
    for p in params:
        sig.append(p.name if not p.has_default else f"{p.name}=_default_{p.name}")
        if p.has_default:
            namespace[f"_default_{p.name}"] = p.default
        if p.is_constexpr:
            terms.append(p.name)
            continue
        value = values.get(p.name, p.default if p.has_default else None)
        kind = _kind(value)
        if kind is None:
            return None
        type_terms.append(f"type({p.name})")
        expected.append(type(value))
        code = _key_code(p.name, kind, not getattr(p, "do_not_specialize", False),
                         not getattr(p, "do_not_specialize_on_alignment", False))
        if code:
            terms.append(code)
    namespace["_expected"] = tuple(expected)
    src = (f"def bind({', '.join(sig)}, **options):\n"
           f"    if ({', '.join(type_terms)},) != _expected:\n"
           f"        return None, None\n"
           f"    return ({', '.join(terms)}, *options.items()), ({', '.join(names)},)\n")
    exec(src, namespace)  # noqa: S102 - source built above from the kernel's parameter names
    return namespace["bind"]


class Launcher:
    """``launcher[grid](*args, **meta)``: ``kernel[grid](*args, **meta)`` through the cached
    compiled kernel (see the module docstring). ``kernel``: a ``@triton.jit`` function."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._bind = None  # generated at the first call; False when this kernel's types are not keyed
        self._compiled: dict = {}  # key -> (run, function, packed_metadata)
        self.direct_launches = 0  # launches that bypassed Triton's path (tests read it)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict) -> None:
        if self._bind is None:
            self._bind = False if interpreting() else (
                make_binder(self.kernel.params, args, kwargs) or False)
        if self._bind is False or os.environ.get(TRITON_LAUNCH_ENV) == "1" or _hooks_active():
            with quiet_interpreter():  # nothing outside the CPU interpreter
                self.kernel[grid](*args, **kwargs)
            return
        key, ordered = self._bind(*args, **kwargs)
        device = torch.cuda.current_device()
        hit = self._compiled.get((device, key)) if key is not None else None
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            if key is not None and compiled is not None:
                compiled = compiled.result() if hasattr(compiled, "result") else compiled
                self._compiled[(device, key)] = (compiled.run, compiled.function, compiled.packed_metadata)
            return
        run, function, packed = hit
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _raw_stream(device), function, packed,
            None, None, None, *ordered)
        self.direct_launches += 1


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def quiet_interpreter():
    """Context for launches: under Triton's CPU interpreter (``TRITON_INTERPRET=1``) the numpy
    warnings of its arithmetic are off inside it; elsewhere it does nothing. The interpreter
    evaluates every lane of a block with numpy, the masked-off ones too (log 0, 0 * inf, a max
    over -inf padding), and a non-finite input row reaches its reductions as on the GPU, which
    computes the same values silently (the masked lanes' values are never stored). Off inside:
    numpy's floating-point warnings (``numpy.errstate``, thread-local) and its "All-NaN slice"
    RuntimeWarning (``warnings.catch_warnings``: the process's filters, restored on exit), nothing
    else. ``Launcher.launch`` uses it; a kernel launched as ``kernel[grid](...)`` can be wrapped
    in it the same way."""
    if not interpreting():
        return contextlib.nullcontext()
    return _quiet_numpy()


@contextlib.contextmanager
def _quiet_numpy():
    import numpy

    with numpy.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"All-NaN (slice|axis) encountered", category=RuntimeWarning)
        yield


def _hooks_active() -> bool:
    """Whether a launch hook is installed (a profiler such as Triton's proton): then Triton's own
    path runs, which calls it."""
    if _knobs is None:
        return False
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False
