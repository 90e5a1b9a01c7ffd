"""scripts/distill_bench.py's CPU smoke mode (a tiny shape through the same code path: verl's top-K
distillation loss, chunked and not, and rl-kernels' replacement, checked against float64), in a
subprocess, with its JSON output in the scripts' one format (rl_kernels.tools.diag.write_json)."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_distill_bench_cpu_smoke(tmp_path):
    out = tmp_path / "distill.json"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "distill_bench.py"), "--cpu-smoke",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"device", "torch", "triton", "date", "command", "header", "rows"} <= set(data)
    assert data["device"] == "CPU" and "distill_bench.py --cpu-smoke" in data["command"]
    assert data["header"]["n"] == 24 and data["header"]["vocab"] == 301 and data["header"]["topk"] == 4
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"verl", "verl chunked", "rl_kernels"}
    ours, grad_scale = rows["rl_kernels"], data["header"]["max_abs_grad_float64"]
    # the loss in float32 from bf16 logits against float64 from the same logits; the gradient is
    # the logits' (bf16), so its error is bf16 rounding of values up to grad_scale
    assert ours["max_abs_err_loss"] < 1e-5, ours
    assert ours["max_abs_err_grad"] < grad_scale * 2 ** -7, (ours, grad_scale)
    assert all(r["fwd_bwd_ms"] > 0 for r in rows.values()), rows
