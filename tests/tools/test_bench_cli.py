"""`rl-kernels bench` off the GPU: it says so and exits 0; `--plot` re-prints a saved result and
charts it only where `--png` says. The
bench is a module of the package (`rl_kernels.tools.bench`): it runs without the clone's scripts/ and
does not import the command line."""
import ast
import json
import os
import subprocess
import sys

import pytest
import torch

from rl_kernels.tools.cli import load_bench, main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message")
def test_bench_without_cuda_exits_cleanly(capsys):
    assert main(["bench"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def _isolated(code: str, cwd) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter, from ``cwd``, with this package importable but not the
    clone's scripts/ (only the package's parent directory on the path)."""
    import rl_kernels

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(rl_kernels.__file__)),
           "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_bench_is_a_package_module_without_the_cli():
    """The bench's source imports nothing of the CLI, and importing it loads no CLI module."""
    import rl_kernels.tools.bench as bench

    with open(bench.__file__, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not any(name and name.split(".")[-1] == "cli" for name in imported), imported
    assert load_bench() is bench
    assert os.path.dirname(bench.__file__) == os.path.join(os.path.dirname(sys.modules["rl_kernels"].__file__), "tools")


def test_bench_module_imports_alone(tmp_path):
    """From outside the clone (no scripts/ on the path): ``rl_kernels.tools.bench`` imports, pulls in no
    CLI module, and its run() says there is no GPU (one line) and returns 0."""
    proc = _isolated("import sys, rl_kernels.tools.bench as b; assert 'rl_kernels.tools.cli' not in sys.modules, "
                     "sorted(sys.modules); print(b.__file__); sys.exit(b.run())", tmp_path)
    assert proc.returncode == 0, proc.stderr
    file, line = proc.stdout.splitlines()
    assert file.endswith(os.path.join("rl_kernels", "tools", "bench.py"))
    assert line == "rl-kernels bench: no CUDA device here; nothing to benchmark (the timings need a GPU)"


def test_bench_command_without_gpu_outside_the_clone(tmp_path):
    """`python -m rl_kernels bench` (what the `rl-kernels` entry point runs) from another directory,
    with no GPU visible: one line saying so, exit status 0."""
    proc = _isolated("import runpy, sys; sys.argv = ['rl-kernels', 'bench']; "
                     "runpy.run_module('rl_kernels', run_name='__main__')", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "rl-kernels bench: no CUDA device here; nothing to benchmark (the timings need a GPU)"]


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
    assert os.listdir(tmp_path) == ["r.json"] and "wrote" not in out  # no chart unless asked for
    png = tmp_path / "charts" / "chart.png"
    with pytest.raises(SystemExit) as exc:  # its directory must exist: one line, exit 2
        main(["bench", "--plot", str(path), "--png", str(png)])
    assert exc.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"rl-kernels bench: error: argument --png: cannot write {str(png)!r}: directory "
        f"{str(png.parent)!r} does not exist (see rl-kernels bench --help)"]
    png.parent.mkdir()
    assert main(["bench", "--plot", str(path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "16 x 8 x 33" in out and os.listdir(tmp_path / "charts") == ["chart.png"]
    assert sorted(os.listdir(tmp_path)) == ["charts", "r.json"]
    assert png.exists() and os.path.getsize(png) > 1000
    # the file written, with its size in MB
    (size,) = [line.removeprefix(f"wrote {png} (") for line in out.splitlines()
               if line.startswith(f"wrote {png} (") and line.endswith(" MB)")]
    assert abs(float(size.removesuffix(" MB)")) - os.path.getsize(png) / 1e6) <= 0.05 + 1e-9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_tables_show_entropy_error_and_varying_n(tmp_path, capsys):
    """A saved result with the entropy column (old results without it still print) and the
    varying-N case: its totals, the compile overhead and the per-call times."""
    rec = {"fwd_ms": 1.5, "fwd_x_mm": 1.5, "fwd_bwd_ms": 6.0, "fwd_bwd_x_mm": 6.0, "fwd_extra_gb": 0.001,
           "fwd_bwd_extra_gb": 0.5, "max_err": 2e-5}
    results = {"device": "test", "torch": "x", "triton": "y", "date": "2026-11-26", "absent": {},
               "shapes": [{"shape": [16, 8, 33], "cublas_ms": 1.0, "cublas_tflops": 1.0, "impls": {
                   "rl_kernels": {**rec, "max_ent_err": 8.5e-6, "entropy_dtype": "float32"},
                   "liger ppo (CuTe sm90)": {**rec, "max_ent_err": 3.0e-2, "entropy_dtype": "bfloat16"},
                   "liger (CE only)": {**rec, "max_ent_err": None, "entropy_dtype": None},
                   "old": rec}}],
               "varying_n": {"hidden": 8, "vocab": 33, "counts": [3, 5], "impls": {
                   "rl_kernels": {"first_s": [0.75, 0.25], "second_s": [0.125, 0.125]},
                   "liger ppo (CuTe sm90)": {"error": "ImportError: no cutlass"}}}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(results))
    assert main(["bench", "--plot", str(path)]) == 0
    out = capsys.readouterr().out
    assert "8.5e-06 (float32)" in out and "3.0e-02 (bfloat16)" in out and "no entropy" in out
    assert "varying N (verl's dynamic micro-batches): 2 forward+backward calls of N x 8 x 33 bf16, N = 3, 5" in out
    (line,) = [x for x in out.splitlines() if x.startswith("| rl_kernels ") and "0.75 0.25" in x]
    assert [c.strip() for c in line.split("|")[1:6]] == ["rl_kernels", "1.00", "0.250", "0.75", "0.75 0.25"]
    assert "ImportError: no cutlass" in out


def test_liger_ppo_called_as_verl_calls_it():
    """The Liger peer gets verl 0.9.1's positional arguments (T 1.0, ignore -100, 1 tile per
    cluster, entropy on) and int64 labels; its log-probs are -nll."""
    seen = {}

    class Fake:
        @staticmethod
        def apply(*args):
            seen["args"] = args
            return torch.tensor([0.5, 2.0]), torch.tensor([1.0, 1.5])

    bench = load_bench()
    labels = torch.tensor([3, 4], dtype=torch.int32)
    lp, ent = bench._liger_ppo(Fake, "h", "w", labels)
    assert seen["args"][:2] == ("h", "w") and seen["args"][2].dtype == torch.int64
    assert seen["args"][3:] == (1.0, -100, 1, True)
    assert lp.tolist() == [-0.5, -2.0] and ent.tolist() == [1.0, 1.5]


def test_bench_rejects_bad_varying_n(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit, match="--varying-n: expected H,V"):
        main(["bench", "--varying-n", "3584"])
    with pytest.raises(SystemExit, match="--varying-n: not with --logits"):
        main(["bench", "--logits", "--varying-n"])


def test_bench_rejects_bad_shape(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(load_bench(), "implementations", lambda stub_verl: ({"rl_kernels": None}, {}))
    with pytest.raises(SystemExit, match="--shapes: expected N,H,V"):
        main(["bench", "--shapes", "16,8"])


# ----------------------------------------------------------------------------- --logits

@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message")
def test_bench_logits_without_cuda_exits_cleanly(capsys):
    assert main(["bench", "--logits"]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def _logits_results():
    ceilings = {"bytes": 4 * 2**30, "read_sum_gbps": 2900.0, "read_amax_gbps": 3000.0,
                "read_gbps": 3000.0, "copy_gbps": 2800.0}
    ours = {"ce_only": False, "fwd_ms": 2.0, "fwd_gbps": 2491.0, "fwd_frac_read": 0.83, "fwd_bwd_ms": 6.0,
            "bwd_ms": 4.0, "bwd_gbps": 2491.0, "bwd_frac_copy": 0.89, "fwd_extra_gb": 0.0001,
            "fwd_bwd_extra_gb": 4.98, "max_err": 3e-6}
    tiny = {**ours, "fwd_bwd_ms": 1.9, "bwd_ms": -0.1, "bwd_gbps": None, "bwd_frac_copy": None}
    return {"kind": "logits", "device": "test", "torch": "x", "triton": "y", "date": "2026-11-23",
            "absent": {"flash-attn": "ModuleNotFoundError: No module named 'flash_attn'"},
            "ceilings": ceilings,
            "shapes": [{"shape": [16384, 152064], "impls": {
                "rl_kernels": ours, "torch eager": {"ce_only": False, "error": "out of memory"},
                "liger (CE only)": {**ours, "ce_only": True, "max_err": 1e-2}}},
                {"shape": [8, 1000], "impls": {"rl_kernels": tiny}}]}


def test_bench_logits_plot_from_json(tmp_path, capsys):
    path = tmp_path / "logits.json"
    path.write_text(json.dumps(_logits_results()))
    png = tmp_path / "logits.png"
    png.write_bytes(b"mine")  # a file of the user's: --plot alone leaves it alone
    assert main(["bench", "--plot", str(path)]) == 0
    assert png.read_bytes() == b"mine"
    assert main(["bench", "--plot", str(path), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "read 3000 GB/s (sum 2900, amax 3000); copy 2800 GB/s" in out
    assert "16384 x 152064 bf16 logits (4.64 GiB)" in out and "8 x 1000" in out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    ours = next(line for line in table if line.startswith("| rl_kernels ") and "2491" in line)
    assert "83%" in ours and "89%" in ours and "6.000" in ours
    assert any("liger (CE only)" in line and "CE only" in line.split("|")[-2] for line in table)
    assert any("torch eager" in line and "out of memory" in line for line in table)
    assert "not importable here: flash-attn" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and os.path.getsize(png) > 1000


def test_bench_logits_shapes(monkeypatch):
    bench = load_bench()

    assert bench.parse_shapes(bench.DEFAULT_LOGITS_SHAPES, logits=True) == [(16384, 152064), (512, 152064)]
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_logits", lambda shapes, **kw: calls.append((shapes, kw)) or 0)
    assert main(["bench", "--logits"]) == 0
    assert main(["bench", "--logits", "--shapes", "8,1000", "4,33", "--impls", "rl_kernels",
                 "--json", "r.json"]) == 0
    assert calls[0][0] is None  # the defaults, resolved by run_logits
    assert calls[1][0] == ["8,1000", "4,33"]
    assert calls[1][1] == {"json_path": "r.json", "png_path": None, "only": ["rl_kernels"]}


@pytest.mark.parametrize("shape", ["16,8,4", "16", "a,b", "0,100"])
def test_bench_logits_rejects_bad_shape(monkeypatch, shape):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(load_bench(), "logits_implementations", lambda: ({"rl_kernels": None}, {}))
    with pytest.raises(SystemExit, match="--shapes: expected N,V"):
        main(["bench", "--logits", "--shapes", shape])


def test_bench_logits_bandwidth_arithmetic():
    _bandwidths = load_bench()._bandwidths

    ceilings = {"read_gbps": 2000.0, "copy_gbps": 2500.0}
    rec = {"fwd_ms": 1.0, "fwd_bwd_ms": 3.0}
    _bandwidths(rec, 1000, 500_000, ceilings)  # 1e9 bytes of bf16 logits
    assert rec["fwd_gbps"] == pytest.approx(1000.0) and rec["fwd_frac_read"] == pytest.approx(0.5)
    assert rec["bwd_ms"] == pytest.approx(2.0)
    assert rec["bwd_gbps"] == pytest.approx(1000.0) and rec["bwd_frac_copy"] == pytest.approx(0.4)
    rec = {"fwd_ms": 1.0, "fwd_bwd_ms": 0.9}
    _bandwidths(rec, 1000, 500_000, ceilings)
    assert rec["bwd_gbps"] is None and rec["bwd_frac_copy"] is None


def test_bench_logits_implementations_on_cpu(monkeypatch):
    """Ours and torch eager as the bench calls them: log-probs and entropy match float64. The
    peers (CUDA only) are made unimportable, which the bench reports instead of failing."""
    logits_implementations = load_bench().logits_implementations
    from rl_kernels.tools.reference import reference_logits_stats

    for name in ("flash_attn", "liger_kernel"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    impls, absent = logits_implementations()
    assert set(impls) == {"rl_kernels", "torch eager"} and set(absent) == {"flash-attn", "liger"}
    g = torch.Generator().manual_seed(0)
    x = 2.0 * torch.randn(6, 37, generator=g)
    y = torch.randint(0, 37, (6,), generator=g)
    ref = reference_logits_stats(x, y)
    for name in ("rl_kernels", "torch eager"):
        lp, ent = impls[name](x, y)
        torch.testing.assert_close(lp.double(), ref.log_probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(ent.double(), ref.entropy, rtol=0, atol=1e-5)


def test_bench_each_implementation_gets_its_record_or_its_failure():
    """The one loop of every bench table: a record per implementation, started from ``first``
    (empty by default); one that raises gets its failure record (after ``first``'s keys, an out of
    memory named as such, a message cut at 100 characters) and the others still run; the progress bar advances once per
    implementation."""
    each = load_bench()._each_impl

    def measure(fn, rec):
        rec["value"] = fn()

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory")

    def broken():
        raise ValueError("x" * 300)

    class Progress:
        steps = 0

        def update(self, k):
            self.steps += k

    progress = Progress()
    impls = {"ok": lambda: 3, "oom": oom, "broken": broken, "also ok": lambda: 4}
    out = each(impls, measure, progress)
    assert out == {"ok": {"value": 3}, "oom": {"error": "out of memory"},
                   "broken": {"error": "ValueError: " + "x" * 100}, "also ok": {"value": 4}}
    assert list(out) == list(impls) and progress.steps == 4
    out = each(impls, measure, first=lambda name: {"ce_only": name == "oom"})
    assert out["oom"] == {"ce_only": True, "error": "out of memory"}
    assert out["ok"] == {"ce_only": False, "value": 3}
