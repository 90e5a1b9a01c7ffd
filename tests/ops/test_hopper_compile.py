"""Every Triton kernel that the public functions launch compiles for Hopper (sm90) with the tiles the
H100 / H200 ship, on this CPU machine: Triton's front end, its GPU passes and ptxas run without a
GPU. The CPU interpreter runs a kernel's Python body and never type-checks it the way the compiler
does (a loop-carried variable whose type changes inside the loop, a constexpr branch that returns
two types, a block too large for shared memory pass there and fail at the first GPU launch).

How: the public functions run on tiny inputs under the interpreter with the Hopper tiles forced
(``ops.config.forced_config``; the from-logits kernels take the interpreter's, their tiles being
free of such limits), every kernel launch is recorded (its arguments and meta-parameters), and each
distinct launch is compiled with ``triton.compile`` for ``GPUTarget("cuda", 90, 32)`` from the
recorded values: tensors as pointers of their dtype, tensor descriptors with their block, Python
numbers as scalars, the constexprs and ``num_warps`` / ``num_stages`` as given."""
import inspect
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

import rl_kernels
from rl_kernels.core.backends import interpreting
from rl_kernels.distill import linear_log_probs_at_ids
from rl_kernels.ops import config

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without these
    GPUTarget = None

pytestmark = [
    pytest.mark.skipif(GPUTarget is None, reason="needs Triton's compiler API (GPUTarget, ASTSource, TensorDescriptor)"),
    # the launches are recorded from the interpreter; on a CUDA machine the GPU tests compile the kernels themselves
    pytest.mark.skipif(not interpreting(), reason="records the CPU interpreter's launches (TRITON_INTERPRET=1)"),
]

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
           torch.int32: "i32", torch.int8: "i8", torch.bool: "i1", torch.uint8: "u8", torch.float64: "fp64"}


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, TensorDescriptor):
        return f"tensordesc<{_DTYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"an argument of type {type(value).__name__}")


def _record(monkeypatch) -> list:
    """The launches of the interpreter from now on: (function, bound arguments, num_warps, num_stages)."""
    launches = []
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        bound = inspect.signature(self.fn).bind_partial(*args, **{k: v for k, v in kwargs.items()
                                                                  if k not in ("num_warps", "num_stages")})
        launches.append((self.fn, dict(bound.arguments), kwargs.get("num_warps", 4), kwargs.get("num_stages", 3)))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording)
    return launches


def _spec(fn, arguments: dict) -> tuple:
    """(signature, constexprs by name) of a recorded launch, as ``ASTSource`` takes them."""
    signature, constexprs = {}, {}
    for p in inspect.signature(fn).parameters.values():
        value = arguments.get(p.name, p.default)
        constexpr = p.annotation is tl.constexpr or p.annotation == "tl.constexpr"
        if constexpr or value is None:
            signature[p.name] = "constexpr"
            constexprs[p.name] = value.value if isinstance(value, tl.constexpr) else value
        else:
            signature[p.name] = _type(value)
    return signature, constexprs


def _calls(dtype):
    """The public calls whose launches are compiled: each family, its variants that change the
    kernels (entropy, Σπ², the tail ids, the top K, per-row temperature, soft-capping)."""
    g = torch.Generator().manual_seed(0)
    n, h, v, k = 6, 64, 300, 4
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / 8).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g)
    ids = torch.randint(0, v, (n, k), generator=g)
    row_t = torch.rand(n, generator=g) + 0.5
    teacher = torch.log_softmax(torch.randn(n, k, generator=g), -1)

    def head():
        out = rl_kernels.linear_log_probs(hidden, weight, labels, return_sum_pi_squared=True, backend="triton")
        (out.log_probs.sum() + out.entropy.sum() + out.sum_pi_squared.sum()).backward()

    def head_row_temperature_softcap():
        out = rl_kernels.linear_log_probs(hidden, weight, labels, temperature=row_t, softcap=30.0, backend="triton")
        (out.log_probs.sum() + out.entropy.sum()).backward()

    def head_at_ids_top_k():
        out = linear_log_probs_at_ids(hidden, weight, labels, ids, return_entropy=True, top_k=k, backend="triton")
        sum(t.sum() for t in out if t is not None and t.requires_grad).backward()

    def topk_kl_tail():
        rl_kernels.linear_topk_kl(hidden, weight, ids, teacher, tail=True, backend="triton").backward()

    def topk():
        rl_kernels.linear_topk(hidden, weight, k=k, backend="triton")

    def jsd():
        rl_kernels.linear_jsd(hidden, weight, hidden.detach(), weight.detach(), backend="triton").backward()

    def from_logits():
        logits = torch.randn(n, v, generator=g).to(dtype).requires_grad_()
        out = rl_kernels.logits_stats(logits, labels, temperature=row_t, backend="triton")
        (out.log_probs.sum() + out.entropy.sum()).backward()
        rl_kernels.topk_kl_from_logits(logits, ids, teacher, tail=True, backend="triton").backward()

    return [head, head_row_temperature_softcap, head_at_ids_top_k, topk_kl_tail, topk, jsd, from_logits]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_every_launched_kernel_compiles_for_hopper(dtype, monkeypatch, tmp_path):
    launches = _record(monkeypatch)
    with config.forced_config(config.HOPPER.for_dtype(dtype)):
        for call in _calls(dtype):
            call()
    distinct = {}
    for fn, arguments, warps, stages in launches:
        signature, constexprs = _spec(fn, arguments)
        key = (fn.__module__, fn.__name__, tuple(signature.items()), repr(sorted(constexprs.items())), warps, stages)
        distinct.setdefault(key, (fn.__module__, fn.__name__, signature, constexprs, warps, stages))
    names = {key[1] for key in distinct}
    assert {"_linear_split_stats_kernel", "_linear_dlogits_kernel", "_linear_topk_kernel", "_jsd_split_sums_kernel",
            "_logits_fwd_kernel", "_logits_bwd_kernel"} <= names, names
    jobs = tmp_path / "launches.pkl"
    jobs.write_bytes(pickle.dumps(list(distinct.values())))
    # compiled in a process without TRITON_INTERPRET: there the kernels and the helpers they call
    # are Triton's JITFunctions (under the interpreter they are its Python functions)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__, str(jobs)], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]


def _compile_all(path: str) -> None:
    """In the compiling process: each recorded launch, compiled for sm90; every failure reported."""
    import importlib

    failed, launches = [], pickle.loads(Path(path).read_bytes())
    for module, name, signature, constexprs, warps, stages in launches:
        kernel = getattr(importlib.import_module(module), name)
        index = {p.name: i for i, p in enumerate(kernel.params)}
        try:
            triton.compile(ASTSource(kernel, signature, constexprs={(index[k],): v for k, v in constexprs.items()}),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        except Exception as e:  # noqa: BLE001 - every kernel's error is reported, not the first only
            failed.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:400]}")
    if failed:
        sys.exit(f"{len(failed)} of {len(launches)} launches do not compile for sm90:\n" + "\n".join(failed))
    print(f"compiled {len(launches)} launches for sm90")


if __name__ == "__main__":
    _compile_all(sys.argv[1])
