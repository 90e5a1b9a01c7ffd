"""`rl-kernels bench` off the GPU: it says so and exits 0; `--plot` re-charts a saved result."""
import json
import os

import pytest
import torch

from rl_kernels.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message")
def test_bench_without_cuda_exits_cleanly(capsys):
    assert main(["bench"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_bench_plot_from_json(tmp_path, capsys):
    results = {"device": "test", "torch": "x", "triton": "y", "date": "2026-11-22", "absent": {},
               "shapes": [{"shape": [16, 8, 33], "cublas_ms": 1.0, "cublas_tflops": 1.0, "impls": {
                   "rl_kernels": {"fwd_ms": 1.5, "fwd_x_mm": 1.5, "fwd_bwd_ms": 6.0, "fwd_bwd_x_mm": 6.0,
                                  "fwd_extra_gb": 0.001, "fwd_bwd_extra_gb": 0.5, "max_err": 2e-5},
                   "liger (CE only)": {"error": "out of memory"}}}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    assert main(["bench", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "16 x 8 x 33" in out and "6.00" in out and "out of memory" in out
    png = tmp_path / "r.png"
    assert png.exists() and os.path.getsize(png) > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_bad_shape(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("rl_kernels.bench.implementations", lambda stub_verl: ({"rl_kernels": None}, {}))
    with pytest.raises(SystemExit, match="--shapes: expected N,H,V"):
        main(["bench", "--shapes", "16,8"])
