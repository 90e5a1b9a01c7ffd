"""Every diagnostic script (scripts/diag/*.py) on a machine without CUDA: one line saying so and exit
status 0, as the top-level scripts do (``rl_kernels.tools.diag.require_cuda``), never a CUDA traceback; the
one that needs no GPU (sass_counts.py: it compiles for sm90 here) prints its table."""
import glob
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIAG = os.path.join(REPO, "scripts", "diag")
ARGS = {"ab_versions.py": ["--old", DIAG]}  # a required option: without it, argparse's usage error
HINTS = {"tp_bench.py": " (--cpu runs the same code on the CPU)"}
NO_GPU = {"sass_counts.py": 4}  # script -> lines of "... per element" it prints without a GPU


def test_every_diag_script_says_no_cuda_in_one_line(tmp_path):
    scripts = sorted(os.path.basename(p) for p in glob.glob(os.path.join(DIAG, "*.py")))
    assert len(scripts) >= 12, scripts
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    procs = {name: subprocess.Popen([sys.executable, os.path.join(DIAG, name), *ARGS.get(name, [])],
                                    cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for name in scripts}  # all at once: each is an interpreter start and the imports
    wrong = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        expected = f"{name[:-3]}: no CUDA device{HINTS.get(name, '')}; nothing to measure"
        if name in NO_GPU:
            ok = sum(" per element " in line for line in out.splitlines()) == NO_GPU[name]
        else:
            ok = out.splitlines() == [expected]
        if proc.returncode != 0 or not ok or "Traceback" in out:
            wrong[name] = (proc.returncode, out[-2000:])
    assert not wrong, wrong
