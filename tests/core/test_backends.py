"""The backend objects (``rl_kernels.core.backends``): one object per backend, resolved once per call,
through which every head family reaches its implementation; a new family registers its two
implementations and needs nothing else from the package (CONTRIBUTING.md, "Adding a head")."""
import dataclasses
import pathlib
import re

import pytest
import torch

import rl_kernels
from rl_kernels.core import backends
from tolerances import assert_close_f32, head_magnitude


def test_get_backend_resolves_once_to_one_object_per_backend():
    cpu = torch.device("cpu")
    torch_backend = backends.get_backend("torch", cpu)
    auto = backends.get_backend("auto", cpu)  # auto on CPU: torch, marked as auto's choice for cpu
    assert auto is backends.get_backend("auto", cpu) and auto.auto_for == "cpu" and torch_backend.auto_for is None
    assert auto.name == "torch" and auto.family("logits") is torch_backend.family("logits")
    for b in (torch_backend, auto):  # what a custom op carries brings the same object back
        assert backends.backend_by_name(b.op_name) is b
    assert torch_backend.name == "torch" and not torch_backend.checks_labels_in_kernel
    triton_backend = backends.get_backend("triton", cpu)  # the interpreter (TRITON_INTERPRET=1 in conftest)
    assert triton_backend.name == "triton" and triton_backend.checks_labels_in_kernel
    with pytest.raises(ValueError, match="backend: expected one of"):
        backends.get_backend("cuda", cpu)
    for family in ("linear", "logits", "linear_jsd"):  # every family of the package has both
        assert torch_backend.family(family) is not triton_backend.family(family)
    with pytest.raises(NotImplementedError, match="head family 'nope' has no 'torch' backend"):
        torch_backend.family("nope")


def test_a_new_family_registers_and_is_dispatched_by_the_resolved_backend():
    """A toy head family (the row maximum of the logits h W^T / T) defined here, as a new head's
    backend entry would be: the Function reaches the implementation of the backend that the
    public argument resolved to, and the result equals float64."""
    calls = []

    @dataclasses.dataclass(frozen=True)
    class MaxParams:
        backend: backends.Backend
        inv_temperature: float

    def row_max(hidden_states, weight, params):
        return (hidden_states.float() @ weight.float().T * params.inv_temperature).amax(-1)

    @backends.implements("test_max_logit", "torch")
    class TorchMax:
        @staticmethod
        def forward(hidden_states, weight, params):
            calls.append("torch")
            return row_max(hidden_states, weight, params)

    @backends.implements("test_max_logit", "triton")
    class TritonMax:
        @staticmethod
        def forward(hidden_states, weight, params):  # a real head launches its kernel here
            calls.append("triton")
            return row_max(hidden_states, weight, params)

    def max_logit(hidden_states, weight, *, temperature=1.0, backend="auto"):
        params = MaxParams(backends.get_backend(backend, hidden_states.device), 1.0 / temperature)
        return params.backend.family("test_max_logit").forward(hidden_states, weight, params)

    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(5, 7, generator=g), torch.randn(11, 7, generator=g)
    ref = (h.double() @ w.double().T / 0.7).amax(-1)
    # float32 rounding bound (tests/support/tolerances.py): a logit's dot product over the 7 hidden units, then
    # 1 / T rounded to float32 and the product by it (2 roundings); the row maximum itself is exact
    m = head_magnitude(h, w, 0.7)
    for backend in ("torch", "triton", "auto"):
        assert_close_f32(max_logit(h, w, temperature=0.7, backend=backend), ref, depth=7 + 2, logits=m, msg=backend)
    assert calls == ["torch", "triton", "torch"]


def test_only_backends_py_tests_a_backend_name():
    """The backend's name is tested in one module: everything else goes through the object."""
    root = pathlib.Path(rl_kernels.__file__).parent
    pattern = re.compile(r"""backend\s*[!=]=|[!=]=\s*["'](triton|torch)["']""")
    hits = [f"{path.relative_to(root)}:{i}" for path in root.rglob("*.py") if path.name != "backends.py"
            for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
