"""The backend objects (``rl_kernels.core.backends``): one object per backend, resolved once per call,
naming the package of its families' kernels; ``autograd.head_family.kernels`` gives a family's module
on it (``rl_kernels.ops.<family>`` or ``rl_kernels.torch_ops.<family>``, the same function names), so a
new family needs its two modules and nothing else from the package (CONTRIBUTING.md, "Adding a head")."""
import importlib
import inspect
import pathlib
import re

import pytest
import torch

import rl_kernels
from rl_kernels.autograd.head_family import kernels
from rl_kernels.core import backends


def test_get_backend_resolves_once_to_one_object_per_backend():
    cpu = torch.device("cpu")
    torch_backend = backends.get_backend("torch", cpu)
    auto = backends.get_backend("auto", cpu)  # auto on CPU: torch, marked as auto's choice for cpu
    assert auto is backends.get_backend("auto", cpu) and auto.auto_for == "cpu" and torch_backend.auto_for is None
    assert auto.name == "torch" and kernels(auto, "logits") is kernels(torch_backend, "logits")
    for b in (torch_backend, auto):  # what a custom op carries brings the same object back
        assert backends.backend_by_name(b.op_name) is b
    assert torch_backend.name == "torch" and not torch_backend.checks_labels_in_kernel
    triton_backend = backends.get_backend("triton", cpu)  # the interpreter (TRITON_INTERPRET=1 in conftest)
    assert triton_backend.name == "triton" and triton_backend.checks_labels_in_kernel
    with pytest.raises(ValueError, match="backend: expected one of"):
        backends.get_backend("cuda", cpu)
    with pytest.raises(ModuleNotFoundError, match="rl_kernels.torch_ops.nope"):
        kernels(torch_backend, "nope")


# each family's functions, which its two kernel modules both give (the autograd bodies call them)
FAMILY_FUNCTIONS = {"linear": ("forward", "dlogits", "gathered_logits"), "logits": ("forward", "backward"),
                    "linear_jsd": ("sums", "dlogits"), "linear_topk": ("select",)}


@pytest.mark.parametrize("family", sorted(FAMILY_FUNCTIONS))
def test_both_kernel_modules_of_a_family_give_its_functions_with_one_signature(family):
    cpu = torch.device("cpu")
    triton_module = kernels(backends.get_backend("triton", cpu), family)
    torch_module = kernels(backends.get_backend("torch", cpu), family)
    assert triton_module is importlib.import_module(f"rl_kernels.ops.{family}")
    assert torch_module is importlib.import_module(f"rl_kernels.torch_ops.{family}")
    for name in FAMILY_FUNCTIONS[family]:
        a, b = getattr(triton_module, name), getattr(torch_module, name)
        assert list(inspect.signature(a).parameters) == list(inspect.signature(b).parameters), (family, name)


def test_only_backends_py_tests_a_backend_name():
    """The backend's name is tested in one module: everything else goes through the object."""
    root = pathlib.Path(rl_kernels.__file__).parent
    pattern = re.compile(r"""backend\s*[!=]=|[!=]=\s*["'](triton|torch)["']""")
    hits = [f"{path.relative_to(root)}:{i}" for path in root.rglob("*.py") if path.name != "backends.py"
            for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
