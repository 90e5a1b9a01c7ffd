"""The repro command and sample files."""
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch

import rl_kernels.tools.repro as repro
from rl_kernels.tools.cli import main
from rl_kernels.tools.reference import make_inputs, reference_logits_stats
from rl_kernels.tools.bundled_samples import BUNDLED
from rl_kernels.samples import (LogitsSample, Sample, SampleError, load_sample,
                                save_logits_sample, save_sample)
from repro_rows import table_rows



def test_bundled_repro_main_job_passes():
    """The README's main job: every bundled bug-catalogue sample, every CPU backend."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "rl_kernels", "repro"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    ours = [line for line in table if "rl_kernels torch" in line]
    assert len(ours) == len(BUNDLED) and all("PASS" in line for line in ours)
    # the anchors' symptom is visible: bf16 logits fail the 5e-4 tolerance, as the baseline's error
    assert any("torch eager" in line and "FAIL (baseline)" in line for line in table)
    assert not any(re.search(r"\| FAIL +\|", line) for line in table)  # every failing row is a baseline's
    # the from-logits sample: ours passes; eager fails (bf16 logits divided by T in bf16)
    logits_rows = [line for line in table if line.startswith("| logits_bf16_temperature ")]
    assert any("rl_kernels torch" in line and "PASS" in line for line in logits_rows)
    assert any("torch eager" in line and "FAIL" in line for line in logits_rows)
    if not torch.cuda.is_available():  # no interpreter in the main job: Triton rows are skipped
        assert "skipped: rl_kernels triton" in proc.stdout
        assert not any("triton" in line for line in table)
    # the output fits the width: a baseline's long note is a numbered note under the table, once
    assert max(len(line) for line in proc.stdout.splitlines()) <= repro.TABLE_WIDTH, proc.stdout
    eager_notes = {row["note"] for row in table_rows(proc.stdout) if row["backend"] == "torch eager"}
    assert eager_notes == {EAGER_BF16, EAGER_LOGITS}, eager_notes
    assert sum(line.startswith("[") for line in proc.stdout.splitlines()) == 2


EAGER_BF16 = "baseline's own error: logits computed in bfloat16 (the inputs' dtype), as verl's default path does"
EAGER_LOGITS = "baseline's own error: logits divided by T in bfloat16 (the logits' dtype), as verl's logits path does"


def test_the_table_fits_the_width_for_every_bundled_sample_and_backend():
    """Every bundled sample with every backend name there can be (the interpreter's and CUDA's
    included), each result: the table keeps to TABLE_WIDTH; the notes follow it, numbered."""
    names = list(BUNDLED) + ["verl linear_cross_entropy"]
    backends = list(repro.available_backends(torch.device("cpu"))) + ["verl linear_cross_entropy",
                                                                      "rl_kernels triton 1-level",
                                                                      "rl_kernels triton 2-level"]
    rows = [repro.Row(sample, backend, True, 3.1e-6, 1.25e-13, 0, 0, True) for sample in names for backend in backends]
    rows += [repro.Row("hidden_904", "torch eager", False, 0.17, 6.2e-14, 0, 0, False, EAGER_BF16,
                       repro.BASELINE_FAIL),
             repro.Row("hidden_904", "rl_kernels torch", True, 0.2, 0.1, 3, 2, False),
             repro.Row("softcap_past_cap", "rl_kernels torch", True, 0, 0, 0, 0, True, "input holds NaN/inf",
                       repro.INPUT_NON_FINITE),
             repro.error_row("logits_bf16_temperature", "check failed: " + " ".join(["x"] * 100))]
    text = repro.format_table(rows)
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows) and max(len(line) for line in table) <= repro.TABLE_WIDTH, text
    read = table_rows(text)
    assert [r["note"] for r in read[-4:]] == [
        EAGER_BF16, "3 non-finite log_probs/entropy value(s); 2 log_probs > 0", "input holds NaN/inf",
        "check failed: " + " ".join(["x"] * 100)]
    assert [(r["log_probs"], r["entropy"], r["result"]) for r in read[-4:]] == [
        ("0.17", "6.2e-14", "FAIL (baseline)"), ("0.2", "0.1", "FAIL"), ("-", "-", "n/a: input NaN/inf"),
        ("-", "-", "ERROR")]
    assert text.splitlines()[-5] == "" and text.splitlines()[-4].startswith("[1] ")


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


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_save_load_logits_round_trip(tmp_path, suffix):
    logits = torch.randn(2, 3, 17).bfloat16()
    labels = torch.tensor([[1, -1, 16], [0, 5, -1]])
    path = tmp_path / f"s{suffix}"
    save_logits_sample(path, logits, labels, temperature=0.6, ignore_index=-1,
                       metadata={"step": 3})
    s = load_sample(path)
    assert isinstance(s, LogitsSample) and s.logits.dtype == torch.bfloat16
    assert torch.equal(s.logits, logits) and torch.equal(s.labels, labels)
    assert s.temperature == 0.6 and s.ignore_index == -1 and s.metadata["step"] == "3"


EPS32 = torch.finfo(torch.float32).eps


def _f64_stats(z, labels, ignore_index=-100):
    """float64 log-probs and entropy of softmax(z) (z already divided by the temperature), written
    here from the definition; 0 at ignored positions."""
    log_p = torch.log_softmax(z, -1)
    valid = labels != ignore_index
    lp = log_p.gather(-1, torch.where(valid, labels, 0)[..., None])[..., 0]
    ent = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0), valid


@pytest.mark.parametrize("kind,suffix,t_dtype", [("linear", ".safetensors", torch.float64),
                                                 ("logits", ".pt", torch.float32)])
def test_per_row_temperature_round_trips_and_replays(tmp_path, capsys, kind, suffix, t_dtype):
    """A temperature per row (verl's per-sample temperature laid out per token: a float tensor shaped
    like labels) is saved in its dtype, loads back bit for bit, and `rl-kernels repro` replays it
    through every backend against float64 with that temperature: PASS. Each of our backends is also
    compared here with a float64 computation written from the definition, divided row by row; a
    scalar temperature (the rows' mean) would be far off it, so a replay that lost the rows fails."""
    g = torch.Generator().manual_seed(11)
    temperature = (0.4 + 1.2 * torch.rand(2, 3, generator=g, dtype=torch.float64)).to(t_dtype)
    path = tmp_path / f"rows{suffix}"
    if kind == "linear":
        hidden, weight, labels = make_inputs(6, 24, 77, torch.bfloat16, seed=4, lead=(2, 3))
        labels[1, 1] = -100
        save_sample(path, hidden, weight, labels, temperature=temperature, metadata={"step": 5})
        raw = hidden.double() @ weight.double().T
    else:
        logits = (3.0 * torch.randn(2, 3, 77, generator=g)).bfloat16()
        labels = torch.randint(0, 77, (2, 3), generator=g)
        labels[0, 2] = -100
        save_logits_sample(path, logits, labels, temperature=temperature, metadata={"step": 5})
        raw = logits.double()
    s = load_sample(path)
    assert isinstance(s, LogitsSample) == (kind == "logits")
    assert s.temperature.dtype == t_dtype and torch.equal(s.temperature, temperature)
    z = raw / temperature.double()[..., None]
    want_lp, want_ent, valid = _f64_stats(z, labels)
    # float32 logits of magnitude |z| and log-sum-exp: a few float32 roundings of max(|z|, lse)
    atol = 64 * EPS32 * float(torch.logsumexp(z, -1).abs().max().clamp(min=1) + z.abs().max())
    scalar_lp = _f64_stats(raw / float(temperature.double().mean()), labels)[0]
    assert float((scalar_lp - want_lp)[valid].abs().max()) > 100 * atol  # the rows matter
    backends = (repro.available_logits_backends if kind == "logits" else repro.available_backends)(
        torch.device("cpu"))
    for name, (fn, ours) in backends.items():
        if ours:
            lp, ent = fn(s)
            torch.testing.assert_close(lp.double()[valid], want_lp[valid], atol=atol, rtol=0, msg=name)
            torch.testing.assert_close(ent.double()[valid], want_ent[valid], atol=atol, rtol=0, msg=name)
    assert main(["repro", "--device", "cpu", str(path)]) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert {r["backend"] for r in rows} == set(backends)
    assert all(r["result"] == "PASS" for r in rows if r["backend"].startswith("rl_kernels")), out
    assert out.splitlines()[-1] == "all rl_kernels backends PASS"


def test_older_sample_files_keep_a_scalar_temperature(tmp_path):
    """A 0-d temperature, or a one-element tensor of another shape than the labels (what older files
    may hold), still loads as a number; a tensor of the labels' shape is a temperature per row."""
    hidden, weight, labels = make_inputs(6, 8, 30, torch.float32, seed=1, lead=(2, 3))
    for i, (t, want) in enumerate([(torch.tensor(0.7, dtype=torch.float64), 0.7),
                                   (torch.tensor([0.7], dtype=torch.float64), 0.7)]):
        torch.save({"hidden_states": hidden, "weight": weight, "labels": labels, "temperature": t}, tmp_path / f"{i}.pt")
        assert load_sample(tmp_path / f"{i}.pt").temperature == want
    one = make_inputs(1, 8, 30, torch.float32, seed=1)
    torch.save({"hidden_states": one[0], "weight": one[1], "labels": one[2], "temperature": torch.tensor([0.5])},
               tmp_path / "one.pt")
    assert torch.equal(load_sample(tmp_path / "one.pt").temperature, torch.tensor([0.5]))


def test_saved_bundled_sample_replays_through_every_backend(tmp_path, capsys):
    old_umask = os.umask(0o027)
    try:
        assert main(["repro", "--save", str(tmp_path)]) == 0
    finally:
        os.umask(old_umask)
    files = sorted(os.listdir(tmp_path))
    assert files == sorted(f"{name}.safetensors" for name in BUNDLED)
    # one line per file written: its path and size; each file has the umask's mode (not 0600)
    wrote = [line for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert len(wrote) == len(BUNDLED)
    for line in wrote:
        path, size = re.fullmatch(r"wrote (.+) \(([0-9.]+) MB\)", line).groups()
        assert os.path.dirname(path) == str(tmp_path)
        assert abs(float(size) - os.path.getsize(path) / 1e6) <= 0.05 + 1e-9, line
        assert os.stat(path).st_mode & 0o777 == 0o640, (path, oct(os.stat(path).st_mode))
    saved = load_sample(tmp_path / "logits_bf16_temperature.safetensors")
    made = BUNDLED["logits_bf16_temperature"]()
    assert isinstance(saved, LogitsSample) and torch.equal(saved.logits, made.logits)
    assert torch.equal(saved.labels, made.labels) and saved.temperature == made.temperature
    assert saved.description == made.description
    assert main(["repro", str(tmp_path / "ignore_index_3d.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "rl_kernels torch" in out and "PASS" in out
    if "rl_kernels triton" in repro.available_backends(torch.device("cpu")):
        path = str(tmp_path / "ignore_index_3d.safetensors")  # the row's name: the file's path, as given
        assert [r["sample"] for r in table_rows(out)] == [path] * 3  # triton (interpreter), torch, eager


def _rows(out):
    """(sample, backend) -> [result, note] of the table in ``out``; a file's sample name without
    its folder and suffix."""
    return {(os.path.basename(r["sample"]).removesuffix(".safetensors"), r["backend"]): [r["result"], r["note"]]
            for r in table_rows(out)}


def test_saved_bundled_samples_replay_from_their_directory_as_bundled(tmp_path, monkeypatch, capsys):
    """`repro --save DIR` then `repro DIR`: every file, in name order, with the bundled run's results
    and notes (a failing baseline is FAIL (baseline) with the same words, the known bug kept in the
    file's metadata and not printed as metadata); the exit status is 0 both times."""
    import rl_kernels.tools.bundled_samples as samples

    monkeypatch.setattr(repro, "interpreting", lambda: False)  # our torch backend and eager: cheap
    monkeypatch.setattr(samples, "BUNDLED", {k: samples.BUNDLED[k] for k in
                                             ("logits_bf16_temperature", "hidden_904")})
    sample = samples.BUNDLED["hidden_904"]()
    monkeypatch.setitem(sample.baseline_bugs, "torch eager", "a known bug of eager")
    monkeypatch.setitem(samples.BUNDLED, "hidden_904", lambda: sample)
    assert main(["repro"]) == 0
    bundled = _rows(capsys.readouterr().out)
    assert main(["repro", "--save", str(tmp_path)]) == 0
    capsys.readouterr()
    assert main(["repro", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert _rows(out) == bundled and list(_rows(out)) == sorted(bundled)
    assert bundled[("hidden_904", "torch eager")] == [
        repro.BASELINE_FAIL, "baseline's own error: logits computed in bfloat16 (the inputs' dtype), as "
        "verl's default path does; known bug: a known bug of eager"]
    assert bundled[("logits_bf16_temperature", "torch eager")] == [
        repro.BASELINE_FAIL, "baseline's own error: logits divided by T in bfloat16 (the logits' "
        "dtype), as verl's logits path does"]
    described = f"{tmp_path / 'hidden_904.safetensors'}: verl triton asserts H % 128 == 0"
    assert "metadata:" not in out and described in " ".join(out.split())  # (wrapped to the width)
    # a directory's files are named by their path in it, as a file given by its path
    assert {r["sample"] for r in table_rows(out)} == {str(tmp_path / f"{k}.safetensors") for k in
                                                      ("logits_bf16_temperature", "hidden_904")}


def test_failing_baseline_never_fails_the_run(tmp_path, monkeypatch, capsys):
    hidden, weight, labels = make_inputs(5, 8, 30, torch.float32, seed=2)
    path = tmp_path / "s.safetensors"
    save_sample(path, hidden, weight, labels)

    def broken(s):
        raise RuntimeError("peer crashed")

    monkeypatch.setattr(repro, "available_backends", lambda device: {
        "rl_kernels torch": (repro._ours("torch"), True), "some peer": (broken, False)})
    assert main(["repro", str(path)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows[("s", "rl_kernels torch")] == ["PASS", ""]
    assert rows[("s", "some peer")] == [repro.BASELINE_FAIL, "baseline's own error: not an rl-kernels "
                                        "backend; RuntimeError: peer crashed"]


def test_interpreted_backends_warn_nothing():
    """Under Triton's CPU interpreter (the tests run there) the replay prints no numpy warning:
    the interpreter computes the masked-off lanes too (log 0, 0 * inf), silenced around our runs."""
    if "rl_kernels triton" not in repro.available_backends(torch.device("cpu")):
        pytest.skip("needs Triton's CPU interpreter")
    hidden, weight, labels = make_inputs(5, 8, 30, torch.bfloat16, seed=2)
    bad = hidden.clone()
    bad[1] = float("inf")  # a non-finite row: NaN through the interpreter's reductions (not compared)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rows = repro.check_sample(Sample("s", hidden, weight, labels, temperature=0.7), torch.device("cpu"))
        rows += repro.check_sample(Sample("inf", bad, weight, labels, softcap=2.0), torch.device("cpu"))
    assert [r.result for r in rows if r.ours] == ["PASS"] * 4
    assert [str(w.message) for w in caught] == []


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


def _logits_file(tmp_path, dtype=torch.float32):
    """A small from-logits sample: 5 rows x 150 (three interpreter splits of 64, the last
    partial), two ignored labels, T = 0.8."""
    g = torch.Generator().manual_seed(7)
    logits = (3.0 * torch.randn(5, 150, generator=g)).to(dtype)
    labels = torch.randint(0, 150, (5,), generator=g)
    labels[1] = labels[4] = -100
    path = tmp_path / "logits.safetensors"
    save_logits_sample(path, logits, labels, temperature=0.8)
    return path


def _table(out):
    return [line for line in out.splitlines() if line.startswith("| ")]


def test_logits_sample_replays_through_every_backend(tmp_path, capsys):
    path = _logits_file(tmp_path)
    assert main(["repro", str(path)]) == 0
    rows = {line.split("|")[2].strip(): line for line in _table(capsys.readouterr().out)[1:]}
    expected = {"rl_kernels torch", "torch eager"}
    if "rl_kernels triton 1-level" in repro.available_logits_backends(torch.device("cpu")):
        expected |= {"rl_kernels triton 1-level", "rl_kernels triton 2-level"}
        # both launch shapes do the same arithmetic: the same errors
        one, two = (rows[f"rl_kernels triton {k}-level"].split("|")[3:5] for k in (1, 2))
        assert one == two
    assert set(rows) == expected
    # float32 logits: every backend, eager included, is within the tolerance
    assert all("PASS" in line for line in rows.values())


def test_logits_triton_rows_skipped_without_cuda_or_interpreter(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(repro, "interpreting", lambda: False)
    path = _logits_file(tmp_path, torch.bfloat16)
    assert main(["repro", "--device", "cpu", str(path)]) == 0
    out = capsys.readouterr().out
    assert "skipped: rl_kernels triton" in out
    assert [line.split("|")[2].strip() for line in _table(out)[1:]] == ["rl_kernels torch",
                                                                      "torch eager"]


def test_failing_logits_backend_of_ours_gives_nonzero_exit(tmp_path, monkeypatch, capsys):
    path = _logits_file(tmp_path)

    def broken(s):
        lp, ent = repro._torch_eager_logits(s)
        return lp, ent + 1e-2

    monkeypatch.setattr(repro, "available_logits_backends",
                        lambda device: {"ours broken": (broken, True)})
    assert main(["repro", str(path)]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_reference_logits_stats():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 40, generator=g).bfloat16()
    labels = torch.randint(0, 40, (2, 3), generator=g)
    labels[0, 2] = -100
    ref = reference_logits_stats(logits, labels, temperature=0.5, chunk_elements=100)
    z = logits.double() / 0.5
    log_p = torch.log_softmax(z, -1)
    valid = labels != -100
    lp = log_p.gather(-1, labels.clamp(min=0)[..., None])[..., 0]
    ent = -(log_p.exp() * log_p).sum(-1)
    assert ref.log_probs.dtype == torch.float64 and ref.log_probs.shape == (2, 3)
    torch.testing.assert_close(ref.log_probs, torch.where(valid, lp, 0.0), rtol=0, atol=1e-12)
    torch.testing.assert_close(ref.entropy, torch.where(valid, ent, 0.0), rtol=0, atol=1e-12)
    torch.testing.assert_close(ref.lse, torch.logsumexp(z, -1), rtol=0, atol=1e-12)
    assert reference_logits_stats(logits).log_probs is None


def test_sample_errors(tmp_path):
    torch.save({"logits": torch.randn(2, 5)}, tmp_path / "logits.pt")
    with pytest.raises(ValueError, match=r"missing \['labels'\]; a from-logits sample"):
        load_sample(tmp_path / "logits.pt")
    torch.save({"logits": torch.randn(2, 5), "labels": torch.zeros(3, dtype=torch.long)},
               tmp_path / "mismatch.pt")
    with pytest.raises(ValueError, match=r"labels \(3,\) do not match logits \(2, 5\)"):
        load_sample(tmp_path / "mismatch.pt")
    with pytest.raises(ValueError, match="labels: expected shape"):
        save_logits_sample(tmp_path / "x.pt", torch.randn(2, 5), torch.zeros(5, dtype=torch.long))
    torch.save({"hidden_states": torch.randn(2, 5)}, tmp_path / "partial.pt")
    with pytest.raises(ValueError, match=r"missing \['weight', 'labels'\]"):
        load_sample(tmp_path / "partial.pt")
    with pytest.raises(ValueError, match="path: expected a .safetensors or .pt"):
        save_sample(tmp_path / "x.npz", torch.randn(2, 3), torch.randn(4, 3),
                    torch.zeros(2, dtype=torch.long))


def test_logits_sample_with_bad_label(tmp_path, capsys):
    """A label outside [0, V) is named before anything reads the logits at it: by
    save_logits_sample, by load_sample (an ERROR row of repro, exit 1) and by our backends."""
    logits, labels = torch.randn(3, 20), torch.tensor([1, 20, -100])
    with pytest.raises(ValueError, match=r"labels: 1 entries lie outside \[0, vocab_size=20\)"):
        save_logits_sample(tmp_path / "bad.pt", logits, labels)
    torch.save({"logits": logits, "labels": labels}, tmp_path / "bad.pt")  # written around the check
    with pytest.raises(SampleError, match=r"bad.pt: labels: 1 entries lie outside \[0, vocab_size=20\)"):
        load_sample(tmp_path / "bad.pt")
    assert main(["repro", str(tmp_path / "bad.pt")]) == 1
    captured = capsys.readouterr()
    assert "labels: 1 entries lie outside" in captured.err and "ERROR" in captured.out
    sample = LogitsSample("bad", logits, labels)
    for name, (fn, ours) in repro.available_logits_backends(torch.device("cpu")).items():
        if ours:  # ours check before the kernels run (the reference checks for check_sample)
            with pytest.raises(ValueError, match="labels: 1 entries"):
                fn(sample)
