"""Without verl: ``import rl_kernels.integrations.verl`` (what verl's ``external_lib`` does) fails with
one ImportError naming verl and how to install it, not with one of verl's own dependencies
("No module named 'packaging'", issue 46). verl and packaging are hidden by a finder in a fresh
interpreter, so the test holds whether or not they are installed here."""
import os
import subprocess
import sys

import rl_kernels

HIDE = """
import importlib.abc, sys

class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("verl", "packaging"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Hide())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(rl_kernels.__file__)),
                                         env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", HIDE + code], capture_output=True, text=True, timeout=120, env=env)


def test_import_without_verl_names_verl():
    proc = _run("""
try:
    import rl_kernels.integrations.verl
except ImportError as exc:
    print(f"{type(exc).__name__} name={exc.name}: {exc}")
""")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.strip() == ("ImportError name=verl: rl_kernels.integrations.verl patches verl, and verl is not "
                                   "installed here: pip install '/path/to/rl-kernels[verl]'"), proc.stdout


def test_a_module_of_the_package_without_verl_names_verl_too():
    """A module of the package that needs verl (through ``patch_state``, first) raises the same error."""
    proc = _run("import rl_kernels.integrations.verl_impl.signatures\n")
    assert proc.returncode == 1 and "packaging" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("ImportError: rl_kernels.integrations.verl patches verl, "
                                                           "and verl is not installed here"), proc.stderr


def test_the_library_and_the_cli_import_without_verl():
    proc = _run("import rl_kernels, rl_kernels.tools.cli, rl_kernels.integrations.verl_impl.schema; print('ok')\n")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
