"""The package's layers, read from its source: every import of an rl_kernels module (at module level
or inside a function) goes to the importer's own layer or a lower one.

    0 base          rl_kernels._logging, rl_kernels.backends, rl_kernels.label_flag
    1 kernels       rl_kernels.ops.*, rl_kernels.torch_ops.*
    2 library       the public API and what it is built of (rl_kernels, linear, logits, distill,
                    validation, label_check, reference, samples, autograd.*)
    3 integrations  rl_kernels.integrations.* (the verl integration, anomaly capture)
    4 tooling       rl_kernels.tools.* (command line, bench, repro, bundled samples, verl's kernels as
                    comparison points, verl-check), __main__

So the kernels import nothing above them, the library neither its integrations nor its tooling,
and the integrations not the tooling."""
import ast
import os
import pathlib

import pytest

import rl_kernels

ROOT = os.path.dirname(rl_kernels.__file__)
BASE = {"rl_kernels._logging", "rl_kernels.backends", "rl_kernels.label_flag"}
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
    assert {"rl_kernels.ops.logits", "rl_kernels.tools.cli", "rl_kernels.integrations.verl.patching",
            "rl_kernels.label_flag"} <= set(known)
    assert "rl_kernels.ops.common" in imports("rl_kernels.ops.logits", known["rl_kernels.ops.logits"], known)
    assert "rl_kernels.tools.bench" in imports("rl_kernels.tools.cli", known["rl_kernels.tools.cli"], known)
    assert layer("rl_kernels.tools.cli") > layer("rl_kernels.integrations.verl.patching") > layer("rl_kernels.linear") \
        > layer("rl_kernels.ops.config") > layer("rl_kernels._logging")


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


PATCHING = "rl_kernels.integrations.verl"
"""The verl integration: importing it, or any module of it (Python runs the package's __init__
first), patches verl."""


def _in_patching_package(module: str) -> bool:
    return module == PATCHING or module.startswith(PATCHING + ".")


def test_no_module_outside_the_verl_package_imports_it():
    """The library, the tooling (rl-kernels verl-check, bench, repro) and the other integrations
    (lm_heads, verl_schema) leave verl unpatched: none of them imports the package."""
    known = modules()
    assert {PATCHING, f"{PATCHING}.patching", "rl_kernels.integrations.verl_schema"} <= set(known)
    assert not _in_patching_package("rl_kernels.integrations.verl_schema")  # a test of the test
    assert f"{PATCHING}.common" in imports(f"{PATCHING}.patching", known[f"{PATCHING}.patching"], known)
    offenders = sorted(f"{name} imports {dep}" for name, path in known.items() if not _in_patching_package(name)
                       for dep in imports(name, path, known) if _in_patching_package(dep))
    assert not offenders, offenders


def test_no_module_of_the_verl_package_is_shadowed_by_an_exported_name():
    """A module of the package named after a name its __init__ binds (``patch``, ``options``, ...)
    would be hidden by it: ``import rl_kernels.integrations.verl.patch as m`` would give the
    function. The names __init__ binds (``from .x import name``, its functions and classes) are
    read from its source."""
    known = modules()
    submodules = {name.rsplit(".", 1)[1] for name in known if name.startswith(PATCHING + ".")}
    with open(known[PATCHING], encoding="utf-8") as f:
        tree = ast.parse(f.read())
    bound = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.module
             for alias in node.names}
    bound |= {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    assert {"patch", "options", "configure"} <= bound and "patching" in submodules  # a test of the test
    assert not submodules & bound, f"modules of {PATCHING} hidden by names its __init__ binds: {sorted(submodules & bound)}"


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
    model's head) is one ``StepRequest`` in one context variable (``common.step_request``): a
    feature that adds its own ``ContextVar`` fails here."""
    known = modules()
    found = {name: pathlib.Path(path).read_text(encoding="utf-8").count("ContextVar(")
             for name, path in known.items() if _in_patching_package(name)}
    assert found[f"{PATCHING}.common"] == 1, found
    assert sum(found.values()) == 1, {name: n for name, n in found.items() if n}
