"""scripts/model_bench.py's CPU smoke mode: the tiny model through every CPU-capable variant of the
model-level benchmark (verl's logits path, the same patched by rl-kernels, verl's fused torch
backend, rl-kernels' fused backend), two steps each, in a subprocess (the benchmark patches and
unpatches verl); and its ``--fsdp`` mode under torchrun with two CPU ranks (gloo): verl's FSDP2 layout,
the optimizer step and the rank-agreed timing."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_model_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "model_bench.py"), "--smoke",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"verl logits", "logits + rl_kernels", "verl fused torch", "fused rl_kernels"}
    for name, row in rows.items():
        assert "error" not in row, (name, row["error"])
        assert row["at_64"]["step_ms"] > 0 and row["at_64"]["tokens_per_s"] > 0, row
        # the head's time over the step's, two separate timings: on a loaded CPU the smoke's tiny
        # shapes measured 1.2 (CI simulation beside another job, 2026-11-28); the value is checked for
        # being a positive finite ratio, not for its size (a benchmark's number, not a test's)
        assert 0 < row["head_share"] < float("inf"), row
    assert "verl logits path:" in data["header"] and "largest micro-batch" in proc.stdout


def test_model_bench_smoke_loss_outside(tmp_path):
    """``--loss-outside``: the loss masked (a quarter of each 16-token sequence outside), and the fused
    variant with ``loss_rows_only`` on beside it: the head skipped exactly the rows outside (the
    integration's own count), and the loss is the option-off loss (the rows it skipped have no
    weight in it)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "model_bench.py"), "--smoke",
                           "--variants", "verl logits", "fused rl_kernels", "--loss-outside", "0.25",
                           "--json", str(out)], capture_output=True, text=True, timeout=600, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"verl logits", "fused rl_kernels", "fused rl_kernels, loss_rows_only"}
    for name, row in rows.items():
        assert "error" not in row, (name, row["error"])
        assert row["loss_outside"] == 0.25 and row["at_64"]["step_ms"] > 0 and row["head_ms"] > 0, row
    on, off = rows["fused rl_kernels, loss_rows_only"]["at_64"], rows["fused rl_kernels"]["at_64"]
    assert on["skipped_tokens_per_step"] == 16, on  # 4 sequences x their first 4 rows
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-5, abs=1e-6)
    assert off["loss"] == pytest.approx(rows["verl logits"]["at_64"]["loss"], rel=1e-4, abs=1e-5)
    assert "25% outside the loss: loss_rows_only" in proc.stdout and "predicted from the head's share" in proc.stdout


def test_model_bench_fsdp_smoke(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           os.path.join(REPO, "scripts", "model_bench.py"), "--smoke", "--fsdp", "--json", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert "x 2, FSDP2 with the optimizer step" in data["header"]
    rows = {r["variant"]: r for r in data["rows"]}
    assert set(rows) == {"verl logits", "logits + rl_kernels", "verl fused torch", "fused rl_kernels"}
    for name, row in rows.items():
        assert "error" not in row, (name, row["error"])
        assert row["ranks"] == 2 and row["at_64"]["step_ms"] >= row["at_64"]["host_ms"] > 0, row
