"""The package's layers, read from its source: every import of an rl_kernels module (at module level
or inside a function) goes to the importer's own layer or a lower one.

    0 base          rl_kernels.core (its __init__), rl_kernels.core._logging, rl_kernels.core.backends,
                    rl_kernels.core.label_flag
    1 kernels       rl_kernels.ops.*, rl_kernels.torch_ops.*
    2 library       the public API and what it is built of (rl_kernels, linear, logits, distill,
                    samples, core.validation, core.label_check, autograd.*)
    3 integrations  rl_kernels.integrations.* (the verl integration, anomaly capture)
    4 tooling       rl_kernels.tools.* (command line, bench, repro, bundled samples, the float64
                    oracles, verl's kernels as comparison points, verl-check), __main__

So the kernels import nothing above them, the library neither its integrations nor its tooling,
and the integrations not the tooling."""
import ast
import os
import pathlib
import subprocess
import sys

import pytest

import rl_kernels

ROOT = os.path.dirname(rl_kernels.__file__)
BASE = {"rl_kernels.core", "rl_kernels.core._logging", "rl_kernels.core.backends", "rl_kernels.core.label_flag"}
LAYERS = ("base", "kernels", "library", "integrations", "tooling")


def layer(module: str) -> int:
    if module in BASE:
        return 0
    if module.startswith(("rl_kernels.ops", "rl_kernels.torch_ops")):
        return 1
    if module.startswith("rl_kernels.integrations"):
        return 3
    if module.startswith("rl_kernels.tools") or module == "rl_kernels.__main__":
        return 4
    return 2


def modules() -> dict[str, str]:
    """Module name -> source path, every .py file of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


def imports(module: str, path: str, known: dict) -> set[str]:
    """The rl_kernels modules ``module`` imports anywhere in its source (a name imported from a
    package counts as its submodule where one exists)."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(pathlib.Path(path).read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.startswith("rl_kernels"):
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    out.add(sub if sub in known else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("rl_kernels"))
    out.discard(module)
    return out


def test_the_graph_is_read():
    """The reader finds what is known to be there (a test of the test)."""
    known = modules()
    assert {"rl_kernels.ops.logits", "rl_kernels.tools.cli", "rl_kernels.integrations.verl_impl.patching",
            "rl_kernels.core.label_flag"} <= set(known)
    assert "rl_kernels.ops.building_blocks" in imports("rl_kernels.ops.logits", known["rl_kernels.ops.logits"], known)
    assert "rl_kernels.tools.bench" in imports("rl_kernels.tools.cli", known["rl_kernels.tools.cli"], known)
    assert layer("rl_kernels.tools.cli") > layer("rl_kernels.integrations.verl_impl.patching") > layer("rl_kernels.linear") \
        > layer("rl_kernels.ops.config") > layer("rl_kernels.core._logging")


@pytest.mark.parametrize("module", sorted(modules()))
def test_no_import_from_a_lower_layer_to_a_higher_one(module):
    known = modules()
    upward = sorted(f"{dep} ({LAYERS[layer(dep)]})" for dep in imports(module, known[module], known)
                    if layer(dep) > layer(module))
    assert not upward, f"{module} ({LAYERS[layer(module)]}) imports {', '.join(upward)}"


def test_library_tooling_and_integrations_are_separate_folders():
    known = modules()
    for name in known:
        if layer(name) == 4 and name != "rl_kernels.__main__":
            assert name == "rl_kernels.tools" or name.startswith("rl_kernels.tools."), name
        if layer(name) == 3:
            assert known[name].startswith(os.path.join(ROOT, "integrations")), name
    assert not {"rl_kernels.cli", "rl_kernels.bench", "rl_kernels.repro", "rl_kernels.anomaly"} & set(known)


SWITCH = "rl_kernels.integrations.verl"
"""The verl integration's switch: importing it patches verl (``external_lib`` names it)."""
PACKAGE = "rl_kernels.integrations.verl_impl"
"""The verl integration's implementation: its modules import without side effects."""


def _in_package(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def test_no_module_imports_the_verl_switch():
    """The library, the tooling (rl-kernels verl-check, bench, repro), the other integrations and
    the verl package itself leave verl unpatched: no module imports the switch."""
    known = modules()
    assert known[SWITCH].endswith(os.path.join("integrations", "verl.py"))  # a module, not a package
    assert f"{PACKAGE}.patching" in imports(SWITCH, known[SWITCH], known)  # a test of the test
    offenders = sorted(name for name, path in known.items() if name != SWITCH and SWITCH in imports(name, path, known))
    assert not offenders, offenders


def test_every_module_of_the_verl_package_imports_without_patching_verl():
    """Importing every module of the package (in a fresh interpreter) patches nothing of verl and
    does not import the switch; importing the switch then does patch (a test of the test)."""
    pytest.importorskip("verl")
    package_modules = sorted(name for name in modules() if _in_package(name))
    assert f"{PACKAGE}.megatron" in package_modules and f"{PACKAGE}.schema" in package_modules
    code = (
        "import importlib, sys\n"
        "import verl.utils.torch_functional as F\n"
        "original = [F.logprobs_from_logits]  # (in a list: the patch replaces a module-level binding too)\n"
        f"for name in {package_modules!r}:\n"
        "    importlib.import_module(name)\n"
        "assert F.logprobs_from_logits is original[0], F.logprobs_from_logits\n"
        f"assert {SWITCH!r} not in sys.modules\n"
        f"importlib.import_module({SWITCH!r})\n"
        "assert F.logprobs_from_logits is not original[0]\n"
        "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def _cycles(graph: dict) -> list[list[str]]:
    """Every import cycle of ``graph`` (module -> the modules it imports), each as a path that
    starts and ends at the same module, found by depth-first search."""
    found, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_no_import_cycle_between_modules():
    """No module imports, directly or through others, a module that imports it back (a package's
    ``__init__``, which binds its modules' names, is left out: Python runs it first anyway). A test
    of the test: a planted back-edge is found."""
    known = modules()
    graph = {name: {dep for dep in imports(name, path, known) if not known.get(dep, "").endswith("__init__.py")}
             for name, path in known.items() if not path.endswith("__init__.py")}
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_verl_integration_keeps_its_state_in_one_context_variable():
    """What a verl step asks of the heads (entropy, Σπ², top-K, per-sample temperature, the served
    model's head) is one ``StepRequest`` in one context variable (``patch_state.step_request``): a
    feature that adds its own ``ContextVar`` fails here."""
    known = modules()
    found = {name: pathlib.Path(path).read_text(encoding="utf-8").count("ContextVar(")
             for name, path in known.items() if _in_package(name)}
    assert found[f"{PACKAGE}.patch_state"] == 1, found
    assert sum(found.values()) == 1, {name: n for name, n in found.items() if n}
