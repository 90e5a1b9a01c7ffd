"""Bad input to `rl-kernels repro` / `rl-kernels bench` and to the helpers behind them: one line
naming the file or argument, a non-zero exit (2 for usage errors), never a traceback (unless -v);
save_sample / save_logits_sample / AnomalyCapture / verl configure() validate every argument."""
import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import rl_kernels.tools.repro as repro
import rl_kernels.samples as samples
import rl_kernels.tools.bundled_samples as bundled_samples
from rl_kernels.integrations.anomaly import AnomalyCapture
from rl_kernels.tools.cli import build_parser, main
from rl_kernels.samples import SampleError, load_sample, save_logits_sample, save_sample
from repro_rows import table_rows


@pytest.fixture(autouse=True)
def _no_interpreter(monkeypatch):
    """Our torch backend and torch eager only: the Triton interpreter is slow, and beside the point."""
    monkeypatch.setattr(repro, "interpreting", lambda: False)


def _tensors(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(4, 8, 16, generator=g)
    weight = 0.5 * torch.randn(32, 16, generator=g)
    labels = torch.randint(0, 32, (4, 8), generator=g)
    return hidden, weight, labels


def _write(path, **tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def _good(tmp_path, name="good.safetensors", seed=0):
    hidden, weight, labels = _tensors(seed)
    save_sample(tmp_path / name, hidden, weight, labels, temperature=0.7)
    return tmp_path / name


def _one_line_naming(err: str, name: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if name in line]
    assert len(lines) == 1, err
    return lines[0]


def _table(out: str) -> list[dict]:
    return table_rows(out)


# ----------------------------------------------------------------------------- bad sample files
def _bad_files(tmp_path):
    """name -> (path, what the error line must say)."""
    hidden, weight, labels = _tensors()
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    junk = bytes(range(7, 256)) * 3
    (tmp_path / "junk.safetensors").write_bytes(junk)
    (tmp_path / "junk.pt").write_bytes(junk)
    (tmp_path / "pickle_junk.pt").write_bytes(b"\x80\x02" + junk)  # passes the header sniff
    (tmp_path / "notes.txt").write_text("not a sample\n")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    torch.save({"hidden_states": [1.0, 2.0], "weight": weight, "labels": labels}, tmp_path / "list.pt")
    return {
        "missing": (tmp_path / "nope.safetensors", "no such file"),
        "empty .pt": (tmp_path / "empty.pt", "is empty"),
        "empty .safetensors": (tmp_path / "empty.safetensors", "is empty"),
        "random bytes .safetensors": (tmp_path / "junk.safetensors", "not a readable .safetensors file"),
        "random bytes .pt": (tmp_path / "junk.pt", "not a torch.save file"),
        "pickle-like bytes .pt": (tmp_path / "pickle_junk.pt", "not a torch.save file"),
        "text file": (tmp_path / "notes.txt", "not a sample file"),
        "not a dict": (tmp_path / "tensor.pt", "expected a dict of tensors, got Tensor"),
        "list, not tensor": (tmp_path / "list.pt", "hidden_states: expected a torch.Tensor, got list"),
        "missing keys": (_write(tmp_path / "partial.safetensors", hidden_states=hidden, labels=labels),
                         "missing ['weight']"),
        "logits without labels": (_write(tmp_path / "lonely.safetensors", logits=torch.randn(3, 5)),
                                  "missing ['labels']"),
        "H of hidden vs weight": (_write(tmp_path / "h.safetensors", hidden_states=hidden,
                                         weight=torch.randn(32, 12), labels=labels),
                                  "weight: expected shape (vocab_size, H) with H = hidden_states.shape[-1] = 16"),
        "labels shape": (_write(tmp_path / "shape.safetensors", hidden_states=hidden, weight=weight,
                                labels=labels[:, :5]), "labels: expected shape (4, 8)"),
        "labels dtype": (_write(tmp_path / "ldtype.safetensors", hidden_states=hidden, weight=weight,
                                labels=labels.float()), "labels: expected int64 or int32"),
        "labels out of range": (_write(tmp_path / "range.safetensors", hidden_states=hidden,
                                       weight=weight, labels=labels + 32),
                                "labels: 32 entries lie outside [0, vocab_size=32)"),
        "weight dtype": (_write(tmp_path / "wdtype.safetensors", hidden_states=hidden.bfloat16(),
                                weight=weight, labels=labels), "weight: dtype torch.float32 differs"),
        "negative temperature": (_write(tmp_path / "tneg.safetensors", hidden_states=hidden,
                                        weight=weight, labels=labels, temperature=torch.tensor(-1.0)),
                                 "temperature: expected a positive finite number, got -1.0"),
        "NaN temperature": (_write(tmp_path / "tnan.safetensors", hidden_states=hidden, weight=weight,
                                   labels=labels, temperature=torch.tensor(math.nan)),
                            "temperature: expected a positive finite number, got nan"),
        "vector temperature": (_write(tmp_path / "tvec.safetensors", hidden_states=hidden,
                                      weight=weight, labels=labels, temperature=torch.ones(2)),
                               "temperature: a per-row temperature must have the shape of labels, (4, 8), got (2,)"),
        "bad row temperature": (_write(tmp_path / "trow.safetensors", hidden_states=hidden, weight=weight,
                                       labels=labels, temperature=torch.ones(4, 8).index_put_(
                                           (torch.tensor([1]), torch.tensor([2])), torch.tensor(-1.0))),
                                "temperature: row 10 is -1.0; every per-row temperature must be positive"),
        "float ignore_index": (_write(tmp_path / "ii.safetensors", hidden_states=hidden, weight=weight,
                                      labels=labels, ignore_index=torch.tensor(1.5)),
                               "ignore_index: expected an int"),
        "logits vs labels": (_write(tmp_path / "logits.safetensors", logits=torch.randn(4, 8, 32),
                                    labels=labels[:, :3]), "labels (4, 3) do not match logits (4, 8, 32)"),
        "bad baseline_bugs": (_bad_baseline_bugs(tmp_path / "bugs.safetensors", hidden, weight, labels),
                              "metadata 'rl_kernels.baseline_bugs': expected a JSON object"),
    }


def _bad_baseline_bugs(path, hidden, weight, labels):
    save_file({"hidden_states": hidden, "weight": weight, "labels": labels}, str(path),
              metadata={samples.BASELINE_BUGS_KEY: "[1, 2"})
    return path


def test_every_bad_sample_file_is_one_error_line(tmp_path, capsys):
    cases = _bad_files(tmp_path)
    for case, (path, what) in cases.items():
        assert main(["repro", "--device", "cpu", str(path)]) == 1, case
        out, err = capsys.readouterr()
        line = _one_line_naming(err, str(path))
        assert line.startswith("rl-kernels repro: error: ") and what in line, (case, line)
        assert "Traceback" not in out
        rows = _table(out)
        assert len(rows) == 1 and rows[0]["result"] == "ERROR" and rows[0]["sample"] == str(path), (case, out)
        assert what in rows[0]["note"], (case, rows)
        with pytest.raises(SampleError, match=re.escape(str(path))):  # the API: a ValueError naming the path
            load_sample(path)


def test_repro_directory(tmp_path, capsys):
    """A directory PATH replays its sample files in name order (not its other files, subfolders or
    hidden files); one that holds none is one line, exit 1, or an ERROR row beside other PATHs."""
    folder = tmp_path / "samples"
    folder.mkdir()
    for name, seed in (("b.pt", 1), ("a.safetensors", 0), ("c.safetensors", 2)):
        _good(folder, name, seed)
    (folder / "notes.txt").write_text("not a sample\n")
    (folder / ".tmp-write.safetensors").write_bytes(b"partial")
    (folder / "sub.pt").mkdir()
    assert main(["repro", "--device", "cpu", str(folder)]) == 0
    out, err = capsys.readouterr()
    # a directory's files are named by their path in it, as files given by their path are
    assert err == "" and [r["sample"] for r in _table(out)] == \
        [str(folder / "a.safetensors")] * 2 + [str(folder / "b.pt")] * 2 + [str(folder / "c.safetensors")] * 2
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "readme.txt").write_text("x")
    assert main(["repro", "--device", "cpu", str(empty)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"rl-kernels repro: error: {empty}: no sample files in this directory (files ending in "
        f".safetensors or .pt)"]
    assert main(["repro", "--device", "cpu", str(empty), str(folder / "a.safetensors")]) == 1
    out, err = capsys.readouterr()
    assert "no sample files in this directory" in _one_line_naming(err, str(empty))
    rows = _table(out)
    assert len(rows) == 3 and rows[0]["result"] == "ERROR" and rows[0]["sample"] == str(empty)
    with pytest.raises(SampleError, match="is a directory"):  # the API reads files only
        load_sample(folder)


def test_one_bad_file_among_several_does_not_discard_the_others(tmp_path, capsys):
    good, other = _good(tmp_path), _good(tmp_path, "other.safetensors", seed=1)
    bad = tmp_path / "junk.pt"
    bad.write_bytes(b"\x00garbage" * 10)
    assert main(["repro", "--device", "cpu", str(good), str(bad), str(other)]) == 1
    out, err = capsys.readouterr()
    rows = _table(out)
    assert [r["sample"] for r in rows] == [str(good)] * 2 + [str(bad)] + [str(other)] * 2  # one naming rule
    assert [r["result"] for r in rows] == ["PASS"] * 2 + ["ERROR"] + ["PASS"] * 2
    assert "not a torch.save file" in _one_line_naming(err, str(bad))
    assert "1 sample(s) could not be checked" in err


def test_subprocess_bad_files_and_usage_errors(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(64))
    good = _good(tmp_path)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "rl_kernels", *args], capture_output=True,
                              text=True, env=env, timeout=120)

    proc = run("repro", str(junk), str(good), "--atol", "1e-3")
    assert proc.returncode == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert "not a torch.save file" in _one_line_naming(proc.stderr, str(junk))
    assert [r["result"] for r in _table(proc.stdout)] == ["ERROR", "PASS", "PASS"]
    proc = run("repro", "--atol", "-1", str(good))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "rl-kernels repro: error: argument --atol: expected a finite number >= 0, got '-1' "
        "(see rl-kernels repro --help)"]


def test_verbose_shows_the_traceback(tmp_path, capsys):
    for argv in (["repro", "-v"], ["-v", "repro"], ["repro", "--debug"]):
        assert main([*argv, str(tmp_path / "nope.pt")]) == 1
        err = capsys.readouterr().err
        assert "Traceback" in err and "SampleError: " in err and "no such file" in err


# ----------------------------------------------------------------------------- usage errors: exit 2
def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2, argv
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_usage_errors_exit_2(tmp_path, capsys):
    good = str(_good(tmp_path))
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (["repro", "--atol", "-0.001", good], "argument --atol: expected a finite number >= 0, got '-0.001'"),
        (["repro", "--atol=-1e-3", good], "argument --atol: expected a finite number >= 0, got '-1e-3'"),
        (["repro", "--atol", "nan", good], "argument --atol: expected a finite number >= 0, got 'nan'"),
        (["repro", "--atol", "abc", good], "argument --atol"),
        (["repro", "--device", "tpu9", good], "argument --device: unknown device 'tpu9'"),
        (["repro", "--device", "meta", good], "argument --device: 'meta' is not supported"),
        (["repro", "--device", "cuda:99", good], "argument --device: 'cuda:99' is not available here"),
        (["repro", "--save", str(afile)], "argument --save: "),
        (["repro", "--save", str(afile / "sub")], "argument --save: cannot create directory"),
        (["repro", "--save", str(tmp_path), good], "argument --save: writes the bundled samples"),
        (["bench", "--shapes", "16,8"], "argument --shapes: expected N,H,V"),
        (["bench", "--logits", "--shapes", "16,8,4"], "argument --shapes: expected N,V"),
        (["bench", "--json", str(tmp_path / "no_dir" / "r.json")], "argument --json: cannot write"),
        (["bench", "--png", str(tmp_path)], "argument --png: "),
    ]
    for argv, what in cases:
        line = _usage_error(argv, capsys)
        assert what in line and line.startswith("rl-kernels"), (argv, line)


# ----------------------------------------------------------------------------- bench --plot
def test_bench_plot_bad_json(tmp_path, capsys):
    (tmp_path / "cut.json").write_text('{"shapes": [')
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "partial.json").write_text(json.dumps({"shapes": [{"shape": [1, 2, 3]}]}))
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe\x00junk")
    cases = {"nope.json": "no such file", "cut.json": "not valid JSON",
             "list.json": "not an rl-kernels bench result",
             "partial.json": "not a complete rl-kernels bench result (missing key 'device')",
             "bytes.json": "not valid JSON"}
    for name, what in cases.items():
        path = str(tmp_path / name)
        assert main(["bench", "--plot", path]) == 1, name
        out, err = capsys.readouterr()
        line = _one_line_naming(err, path)
        assert line.startswith("rl-kernels bench: error: ") and what in line, line
        assert "Traceback" not in out and not os.path.exists(tmp_path / (name[:-5] + ".png"))


def test_repro_does_not_import_the_bench(tmp_path, monkeypatch, capsys):
    import rl_kernels

    monkeypatch.delattr(rl_kernels, "bench", raising=False)  # an earlier test may have imported it
    monkeypatch.setitem(sys.modules, "rl_kernels.tools.bench", None)  # importing the bench now raises
    build_parser()
    assert main(["repro", "--device", "cpu", str(_good(tmp_path))]) == 0
    monkeypatch.undo()
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0 and "16384,3584,152064" in capsys.readouterr().out


# ----------------------------------------------------------------------------- what the table says
def test_nan_input_rows_are_reported_as_input_not_kernel_failure(tmp_path, capsys):
    hidden, weight, labels = _tensors()
    hidden[1, 2, 3] = math.nan
    hidden[3, 0, 0] = math.inf
    save_sample(tmp_path / "nan.safetensors", hidden, weight, labels)
    logits = torch.randn(5, 40)
    logits[2, 7] = math.nan
    save_logits_sample(tmp_path / "nan_logits.pt", logits, torch.randint(0, 40, (5,)))
    assert main(["repro", "--device", "cpu", str(tmp_path / "nan.safetensors"),
                 str(tmp_path / "nan_logits.pt")]) == 0
    out, err = capsys.readouterr()
    rows = _table(out)
    assert len(rows) == 4 and all(r["result"] == "PASS" for r in rows), out
    assert all("input holds NaN/inf in rows [(1, 2), (3, 0)]" in r["note"] for r in rows[:2])
    assert all("input holds NaN/inf in rows [2]" in r["note"] for r in rows[2:])
    assert "not a kernel failure" in " ".join(out.split()) and "Traceback" not in out + err


def test_anomaly_sample_replays_with_its_metadata(tmp_path, capsys):
    hidden, weight, labels = _tensors()
    weight[3, 0] = math.nan
    from rl_kernels import linear_log_probs

    out = linear_log_probs(hidden, weight, labels, temperature=0.7, backend="torch")
    capture = AnomalyCapture(str(tmp_path), metadata={"verl_version": "0.9.1", "model": "tiny"})
    reason = capture.check(hidden, weight, labels, temperature=0.7, ignore_index=-100,
                           log_probs=out.log_probs, entropy=out.entropy)
    assert reason == "non-finite log-prob or entropy"
    (path,) = [tmp_path / f for f in os.listdir(tmp_path)]
    assert main(["repro", "--device", "cpu", str(path)]) == 0
    text = capsys.readouterr().out
    meta = next(line for line in text.splitlines() if "metadata:" in line)
    for part in ("reason=non-finite log-prob or entropy", "rank=0", "call=1", "verl_version=0.9.1",
                 "model=tiny"):
        assert part in meta, meta
    rows = _table(text)
    assert rows and all(r["result"] == "n/a: input NaN/inf" for r in rows)
    assert all("input holds NaN/inf in weight rows (vocab ids) [3]" in r["note"] for r in rows)


EAGER_BF16 = "baseline's own error: logits computed in bfloat16 (the inputs' dtype), as verl's default path does"


def test_failing_baseline_reads_the_same_bundled_saved_or_captured(tmp_path, monkeypatch, capsys):
    """torch eager on bf16 inputs is further from float64 than the tolerance: the row says it is
    that baseline's own error, in the same words for a bundled sample, a user's save_sample file
    and an anomaly-capture file, and the run exits 0 (only rl_kernels rows decide)."""
    monkeypatch.setattr(bundled_samples, "BUNDLED", {"hidden_904": bundled_samples.BUNDLED["hidden_904"]})
    hidden, weight, labels = _tensors()
    hidden, weight = hidden.bfloat16() * 40, weight.bfloat16()
    save_sample(tmp_path / "mine.pt", hidden, weight, labels)
    from rl_kernels import linear_log_probs

    out = linear_log_probs(hidden, weight, labels, backend="torch")
    capture = AnomalyCapture(str(tmp_path / "anomalies"))
    assert capture.check(hidden, weight, labels, temperature=1.0, ignore_index=-100,
                         log_probs=out.log_probs.abs() + 1.0, entropy=out.entropy).startswith("log-prob above")
    (captured,) = (tmp_path / "anomalies").iterdir()
    for argv in ([], [str(tmp_path / "mine.pt")], [str(captured)]):
        assert main(["repro", "--device", "cpu", *argv]) == 0, argv
        text = capsys.readouterr().out
        rows = {r["backend"]: r for r in _table(text)}
        assert rows["rl_kernels torch"]["result"] == "PASS", argv
        assert [rows["torch eager"][k] for k in ("result", "note")] == ["FAIL (baseline)", EAGER_BF16], argv
        prose = " ".join(text.split())  # (wrapped to the width)
        assert "FAIL (baseline): a baseline (not rl-kernels) further from float64" in prose
        assert "only rl_kernels rows decide the exit status" in prose
        assert text.splitlines()[-1] == "all rl_kernels backends PASS"


# ----------------------------------------------------------------------------- helper arguments
def test_save_sample_validates_every_argument(tmp_path):
    hidden, weight, labels = _tensors()
    path = tmp_path / "s.safetensors"
    cases = [
        (dict(hidden_states=hidden.tolist()), TypeError, "hidden_states: expected a torch.Tensor, got list"),
        (dict(weight=weight.numpy()), TypeError, "weight: expected a torch.Tensor, got ndarray"),
        (dict(labels=labels.numpy()), TypeError, "labels: expected a torch.Tensor, got ndarray"),
        (dict(temperature="0.7"), TypeError, "temperature: expected a positive finite"),
        (dict(temperature=math.nan), ValueError, "temperature: expected a positive finite number, got nan"),
        (dict(temperature=torch.tensor(0.7)), TypeError, "temperature: .*pass float"),
        (dict(ignore_index="-100"), TypeError, "ignore_index: expected an int"),
        (dict(ignore_index=True), TypeError, "ignore_index: expected an int"),
        (dict(metadata=["step", 3]), TypeError, r"metadata: expected a dict or None, got \['step', 3\]"),
        (dict(weight=torch.randn(32, 12)), ValueError, "weight: expected shape"),
        (dict(labels=labels[:, :2]), ValueError, "labels: expected shape"),
        (dict(labels=labels + 32), ValueError, "labels: 32 entries lie outside"),
        (dict(path=3), TypeError, "path: expected a path"),
        (dict(path=tmp_path / "s.npz"), ValueError, "path: expected a .safetensors or .pt"),
    ]
    for change, error, match in cases:
        args = {**dict(path=path, hidden_states=hidden, weight=weight, labels=labels), **change}
        with pytest.raises(error, match=match):
            save_sample(args.pop("path"), args.pop("hidden_states"), args.pop("weight"),
                        args.pop("labels"), **args)
    assert os.listdir(tmp_path) == []


def test_save_logits_sample_validates_every_argument(tmp_path):
    logits, labels = torch.randn(3, 20), torch.tensor([1, 19, -100])
    path = tmp_path / "s.pt"
    cases = [
        (dict(logits=logits.tolist()), TypeError, "logits: expected a torch.Tensor, got list"),
        (dict(logits=np.zeros((3, 20))), TypeError, "logits: expected a torch.Tensor, got ndarray"),
        (dict(logits=logits.double()), TypeError, "logits: expected bfloat16, float16 or float32"),
        (dict(labels=[1, 2, 3]), TypeError, "labels: expected a torch.Tensor, got list"),
        (dict(labels=torch.tensor([1, 20, 0])), ValueError, "labels: 1 entries lie outside"),
        (dict(temperature="hot"), TypeError, "temperature: expected a positive finite"),
        (dict(temperature=-0.5), ValueError, "temperature: expected a positive finite number"),
        (dict(ignore_index=1.5), TypeError, "ignore_index: expected an int"),
        (dict(metadata="step 3"), TypeError, "metadata: expected a dict or None"),
    ]
    for change, error, match in cases:
        args = {**dict(logits=logits, labels=labels), **change}
        with pytest.raises(error, match=match):
            save_logits_sample(path, args.pop("logits"), args.pop("labels"), **args)
    assert os.listdir(tmp_path) == []


def test_anomaly_capture_validates_every_argument(tmp_path):
    cases = [
        (dict(max_count="abc"), TypeError, "max_count: expected an int >= 0, got 'abc' \\(str\\)"),
        (dict(max_count=True), TypeError, "max_count: expected an int >= 0, got True \\(bool\\)"),
        (dict(max_count=-1), ValueError, "max_count: expected an int >= 0, got -1"),
        (dict(max_bytes=1.5e9), TypeError, "max_bytes: expected an int"),
        (dict(recheck_every="often"), TypeError, "recheck_every: expected an int >= 0, got 'often'"),
        (dict(recheck_rows=None), TypeError, "recheck_rows: expected an int"),
        (dict(recheck_tolerance=math.nan), ValueError, "recheck_tolerance: expected a finite number > 0, got nan"),
        (dict(recheck_tolerance=0.0), ValueError, "recheck_tolerance: expected a finite number > 0"),
        (dict(recheck_tolerance="1e-3"), TypeError, "recheck_tolerance: expected a finite number"),
        (dict(max_log_prob=math.inf), ValueError, "max_log_prob: expected a finite number >= 0, got inf"),
        (dict(max_log_prob=-0.1), ValueError, "max_log_prob: expected a finite number >= 0"),
        (dict(directory=""), ValueError, "directory: expected a non-empty path"),
        (dict(directory=7), TypeError, "directory: expected a path"),
        (dict(metadata=[("a", 1)]), TypeError, "metadata: expected a dict or None"),
    ]
    for change, error, match in cases:
        with pytest.raises(error, match=match):
            AnomalyCapture(**{"directory": str(tmp_path), **change})
    AnomalyCapture(str(tmp_path), max_count=0, recheck_every=3, max_log_prob=0, recheck_tolerance=1)


# ----------------------------------------------------------------------------- verl configure()
def test_verl_configure_validates_and_is_atomic(tmp_path):
    pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
    import rl_kernels.integrations.verl as rkv

    previous = rkv.options()
    capture = rkv._capture
    prefix = "fused_kernel_options.rl_kernels."
    cases = [
        (dict(patch_logits_path="no"), TypeError, "patch_logits_path: expected a bool .*'no'"),
        (dict(patch_logits_path=1), TypeError, "patch_logits_path: expected a bool"),
        (dict(overlap_metrics="false"), TypeError, "overlap_metrics: expected a bool .*'false'"),
        (dict(backend=3), ValueError, "backend: expected one of"),
        (dict(anomaly_dir=5), TypeError, "anomaly_dir: expected a path"),
        (dict(anomaly_dir=""), ValueError, "anomaly_dir: expected a non-empty path"),
        (dict(anomaly_max_count="abc"), TypeError, "anomaly_max_count: expected an int >= 0, got 'abc'"),
        (dict(anomaly_max_count=-1), ValueError, "anomaly_max_count: expected an int >= 0, got -1"),
        (dict(anomaly_max_bytes=True), TypeError, "anomaly_max_bytes: expected an int"),
        (dict(anomaly_recheck_every="often"), TypeError, "anomaly_recheck_every: expected an int"),
        (dict(anomaly_recheck_rows=2.5), TypeError, "anomaly_recheck_rows: expected an int"),
        (dict(anomaly_recheck_tolerance=math.nan), ValueError,
         "anomaly_recheck_tolerance: expected a finite number > 0, got nan"),
        (dict(anomaly_max_log_prob=math.inf), ValueError, "anomaly_max_log_prob: expected a finite number"),
    ]
    try:
        for change, error, match in cases:
            for _ in range(2):  # the repeated call raises too: nothing of the first one was kept
                with pytest.raises(error, match=prefix + match):
                    rkv.configure(**change)
                assert rkv.options() == previous and rkv._capture is capture, change
            if "anomaly_dir" not in change:  # with capture on: not built, the options not taken
                with pytest.raises(error, match=match):
                    rkv.configure(anomaly_dir=str(tmp_path), **change)
                assert rkv.options() == previous and rkv._capture is capture
        # a good call still works, and builds the capture
        assert rkv.configure(anomaly_dir=str(tmp_path), anomaly_recheck_every=5).anomaly_recheck_every == 5
        assert rkv._capture is not None and rkv._capture.recheck_every == 5
    finally:
        rkv.configure(**{f: getattr(previous, f) for f in previous.__dataclass_fields__})
    assert rkv.options() == previous


# ----------------------------------------------------------------------------- found by the audit
def test_audit_cases_fifo_deep_json_png_suffix_and_save_targets(tmp_path, capsys):
    fifo = tmp_path / "x.safetensors"
    os.mkfifo(fifo)
    assert main(["repro", "--device", "cpu", str(fifo)]) == 1  # would block forever in open()
    assert "is not a regular file" in _one_line_naming(capsys.readouterr().err, "x.safetensors")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100000 + "]" * 100000)
    assert main(["bench", "--plot", str(deep)]) == 1
    assert "nested too deeply" in _one_line_naming(capsys.readouterr().err, "deep.json")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--plot", str(deep), "--png", str(tmp_path / "chart.notanimage")])
    assert exc.value.code == 2
    assert "expected a file name ending in .png" in _one_line_naming(capsys.readouterr().err, "--png")
    hidden, weight, labels = _tensors()
    (tmp_path / "d.safetensors").mkdir()
    for target, what in ((tmp_path / "d.safetensors", "is a directory"),
                         (tmp_path / "missing" / "s.safetensors", "does not exist"),
                         (tmp_path / "missing" / "s.pt", "does not exist")):
        with pytest.raises(ValueError, match=f"path: .*{what}"):
            save_sample(target, hidden, weight, labels)
