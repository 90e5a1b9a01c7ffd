"""The measuring scripts (scripts/*.py, scripts/*.sh, scripts/diag/*.py, found by glob: a new one is
covered without editing this file) on a machine without CUDA: ``--help`` prints their usage and
exits 0 before any work, and a run without a GPU prints one line and exits 0 (``rl_kernels.tools.
diag.require_cuda``), never a CUDA traceback; the one that needs no GPU (sass_counts.py: it compiles
for sm90 here) prints its table. Also their shared harness (``rl_kernels.tools.diag``): argument
checks, the JSON format, import without Triton, and the scripts' imports (the public API and the
documented tools only)."""
import ast
import glob
import json
import os
import pathlib
import subprocess
import sys

import pytest

import rl_kernels
from rl_kernels.tools import diag

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(glob.glob(os.path.join(REPO, "scripts", "*.py"))
                 + glob.glob(os.path.join(REPO, "scripts", "diag", "*.py")))
SHELL = sorted(glob.glob(os.path.join(REPO, "scripts", "*.sh")))
ARGS = {"ab_versions.py": ["--old", REPO]}  # a required option: without it, argparse's usage error
HINTS = {"tp_bench.py": " (--cpu runs the same code on the CPU)", "model_bench.py": " (use --smoke for the CPU check)",
         "distill_bench.py": " (use --cpu-smoke for the CPU check)"}
OTHER_LINES = {"bench.py": "rl-kernels bench: no CUDA device here; nothing to benchmark (the timings need a GPU)",
               # no GPU needed: it checks BENCHMARKS' tables against the committed results (tests/repo/test_docs.py)
               "bench_tables.py": "tables match the result files in benchmarks/results/ (BENCHMARKS.md, README.md, "
                                  "benchmarks/results/README.md); plots: "}
PREFIX_ONLY = {"bench_tables.py"}  # its line goes on with the renderer the plots were compared under
NO_GPU = {"sass_counts.py": 4}  # script -> lines of "... per element" it prints without a GPU

# Every script run twice (--help, then without arguments) in one interpreter: one import of torch
# instead of one per run. Each run gets the script's folder first on sys.path, its own argv, and
# sys.path and the environment back afterwards, as a fresh `python SCRIPT` would have them.
DRIVER = r"""
import contextlib, io, json, os, runpy, sys
results = []
for path, args in json.loads(sys.argv[1]):
    saved = (list(sys.argv), list(sys.path), dict(os.environ))
    sys.argv, sys.path[:0] = [path, *args], [os.path.dirname(path)]
    out, code = io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
    except BaseException as exc:  # noqa: BLE001 - reported, not raised
        code = f"{type(exc).__name__}: {exc}"
    sys.argv, sys.path[:] = saved[0], saved[1]
    os.environ.clear()
    os.environ.update(saved[2])
    results.append([path, args, code, out.getvalue()])
print(json.dumps(results))
"""


def _cpu_env() -> dict:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    env.pop("TRITON_INTERPRET", None)  # a user's CPU machine: the scripts do not run kernels here
    return env


def test_scripts_are_found():
    names = {os.path.basename(p) for p in SCRIPTS}
    assert len(SCRIPTS) >= 20 and {"model_bench.py", "sass_counts.py", "tp_bench.py"} <= names, names
    assert {os.path.basename(p) for p in SHELL} == {"transformers_check.sh", "verl_main_check.sh"}


def test_every_script_answers_help_and_says_no_cuda_in_one_line(tmp_path):
    runs = [[p, ["--help"]] for p in SCRIPTS] + [[p, ARGS.get(os.path.basename(p), [])] for p in SCRIPTS]
    proc = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(runs)], cwd=tmp_path, env=_cpu_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    wrong = {}
    for path, args, code, out in json.loads(proc.stdout.splitlines()[-1]):
        name = os.path.basename(path)
        if args == ["--help"]:
            ok = code in (0, None) and out.startswith("usage: ")
        elif name in NO_GPU:
            ok = code in (0, None) and sum(" per element " in line for line in out.splitlines()) == NO_GPU[name]
        else:
            expected = OTHER_LINES.get(name, f"{name[:-3]}: no CUDA device{HINTS.get(name, '')}; nothing to measure")
            lines = out.splitlines()
            ok = code in (0, None) and len(lines) == 1 and (
                lines[0] == expected or (name in PREFIX_ONLY and lines[0].startswith(expected)))
        if not ok or "Traceback" in out:
            wrong[f"{name} {' '.join(args)}"] = (code, out[-1500:])
    assert not wrong, wrong


@pytest.mark.parametrize("path", SHELL, ids=os.path.basename)
def test_shell_scripts_answer_help(path):
    proc = subprocess.run(["bash", path, "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stdout + proc.stderr
    assert "Run from the repository root" in proc.stdout  # the header comment, as the usage text


def test_the_scripts_import_only_the_public_api_and_the_tools():
    """No script imports the kernels, autograd, validation or another private module: the public
    names of ``rl_kernels``, the documented tools (``rl_kernels.tools.diag``, ``verl_kernels``,
    ``cli``) and the verl integration only."""
    allowed = {"rl_kernels", "rl_kernels.tools", "rl_kernels.tools.diag", "rl_kernels.tools.cli",
               "rl_kernels.tools.verl_kernels", "rl_kernels.integrations.verl", "rl_kernels.integrations.verl_impl"}
    found, wrong = set(), []
    for path in SCRIPTS:
        for node in ast.walk(ast.parse(pathlib.Path(path).read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rl_kernels"):
                modules = [node.module]
                if node.module == "rl_kernels":  # names of the package: public ones only
                    wrong += [f"{path}: rl_kernels.{a.name}" for a in node.names if a.name not in rl_kernels.__all__]
            elif isinstance(node, ast.Import):
                modules = [a.name for a in node.names if a.name.startswith("rl_kernels")]
            else:
                continue
            found.update(modules)
            wrong += [f"{path}: {m}" for m in modules if m not in allowed]
    assert {"rl_kernels", "rl_kernels.tools", "rl_kernels.tools.diag"} <= found  # a test of the test
    assert not wrong, wrong


def test_harness_parses_and_checks_shapes_and_sizes(capsys):
    ap = diag.parser("doc", shapes=["4,8,16", "5,9,17"], rounds=3, json_out=True, n=7, check_rows=2)
    args = ap.parse_args([])
    assert args.shapes == [(4, 8, 16), (5, 9, 17)] and args.rounds == 3 and args.n == 7 and args.check_rows == 2
    assert args.json is None
    args = ap.parse_args(["3,5,7", "--n", "11", "--json", "out.json"])
    assert args.shapes == [(3, 5, 7)] and args.n == 11 and args.json == "out.json"
    assert diag.parser("doc", shapes=["6,10"], form="N,V", one_shape=True).parse_args([]).shape == (6, 10)
    for bad, message in ((["1,2"], "argument shapes: expected N,H,V (3 positive integers), got '1,2'"),
                         (["1,0,3"], "argument shapes: expected N,H,V (3 positive integers), got '1,0,3'"),
                         (["--n", "0"], "argument --n: expected a positive integer, got '0'"),
                         (["--rounds", "x"], "argument --rounds: expected a positive integer, got 'x'")):
        with pytest.raises(SystemExit) as exc:
            ap.parse_args(bad)
        assert exc.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1].endswith(message), bad
    with pytest.raises(TypeError, match="unknown size 'heads'"):
        diag.parser("doc", heads=4)


def test_harness_json_format(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["scripts/x.py", "--n", "5"])
    path = str(tmp_path / "out.json")
    diag.write_json(path, [{"ms": 1.5}], device="cpu", header="a header", tokens=[64])
    data = json.loads(pathlib.Path(path).read_text())
    assert set(data) == {"device", "torch", "triton", "date", "command", "header", "tokens", "rows"}
    assert data["device"] == "CPU" and data["command"] == "python scripts/x.py --n 5"
    assert data["rows"] == [{"ms": 1.5}] and data["header"] == "a header" and data["tokens"] == [64]
    assert capsys.readouterr().out.startswith(f"wrote {path} (")


def test_harness_imports_without_triton(tmp_path):
    """Where Triton is absent the harness imports (the names that need Triton fail on first use,
    saying so)."""
    script = """
import sys
sys.modules["triton"] = None  # as if not installed
from rl_kernels.tools import diag
assert diag.parser("doc", shapes=["2,3,4"]).parse_args([]).shapes == [(2, 3, 4)]
try:
    diag.ops
except ImportError as exc:
    print("ops:", exc)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=_cpu_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ops: import of triton halted"), proc.stdout
