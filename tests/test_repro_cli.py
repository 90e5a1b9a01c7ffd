"""The repro command and sample files."""
import os
import subprocess
import sys

import pytest
import torch

import rl_kernels.repro as repro
from rl_kernels.cli import main
from rl_kernels.samples import BUNDLED, load_sample, save_sample

from helpers import make_inputs


def test_bundled_repro_main_job_passes():
    """The README's main job: every bundled bug-catalogue sample, every CPU backend."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "rl_kernels", "repro"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    ours = [line for line in table if "rl_kernels torch" in line]
    assert len(ours) == len(BUNDLED) and all("PASS" in line for line in ours)
    # the anchors' symptom is visible: bf16 logits fail the 5e-4 tolerance
    assert any("torch eager" in line and "FAIL" in line for line in table)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_save_load_round_trip(tmp_path, suffix):
    hidden, weight, labels = make_inputs(6, 8, 30, torch.bfloat16, seed=1, lead=(2, 3))
    path = tmp_path / f"s{suffix}"
    save_sample(path, hidden, weight, labels, temperature=0.6, ignore_index=-1,
                metadata={"step": 12})
    s = load_sample(path)
    assert torch.equal(s.hidden_states, hidden) and s.hidden_states.dtype == torch.bfloat16
    assert torch.equal(s.weight, weight) and torch.equal(s.labels, labels)
    assert s.temperature == 0.6 and s.ignore_index == -1 and s.metadata["step"] == "12"


def test_saved_bundled_sample_replays_through_every_backend(tmp_path, capsys):
    assert main(["repro", "--save", str(tmp_path)]) == 0
    files = sorted(os.listdir(tmp_path))
    assert files == sorted(f"{name}.safetensors" for name in BUNDLED)
    assert main(["repro", str(tmp_path / "ignore_index_3d.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "rl_kernels torch" in out and "PASS" in out
    if "rl_kernels triton" in repro.available_backends(torch.device("cpu")):
        assert out.count("| ignore_index_3d") == 3  # triton (interpreter), torch, eager


def test_failing_backend_of_ours_gives_nonzero_exit(tmp_path, monkeypatch, capsys):
    hidden, weight, labels = make_inputs(5, 8, 30, torch.float32, seed=2)
    path = tmp_path / "s.safetensors"
    save_sample(path, hidden, weight, labels)

    def broken(s):
        lp, ent = repro._torch_eager(s)
        return lp + 1e-2, ent

    monkeypatch.setattr(repro, "available_backends",
                        lambda device: {"ours broken": (broken, True)})
    assert main(["repro", str(path)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_sample_errors(tmp_path):
    torch.save({"logits": torch.randn(2, 5), "labels": torch.zeros(2, dtype=torch.long)},
               tmp_path / "logits.pt")
    with pytest.raises(ValueError, match="from-logits sample"):
        load_sample(tmp_path / "logits.pt")
    torch.save({"hidden_states": torch.randn(2, 5)}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"missing \['weight', 'labels'\]"):
        load_sample(tmp_path / "partial.pt")
    with pytest.raises(ValueError, match="path: expected a .safetensors or .pt"):
        save_sample(tmp_path / "x.npz", torch.randn(2, 3), torch.randn(4, 3),
                    torch.zeros(2, dtype=torch.long))
