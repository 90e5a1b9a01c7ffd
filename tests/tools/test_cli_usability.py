"""The command line as a user meets it: --version, -v on either side of the command, help text
without reStructuredText markup, table values printed in full, and written files reported with
their size and created with the user's umask."""
import argparse
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
import torch

import rl_kernels
import rl_kernels.tools.repro as repro
from rl_kernels.tools.cli import build_parser, main, report_written
from rl_kernels.samples import save_logits_sample, save_sample
from repro_rows import table_rows


def _parsers():
    parser = build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(subs) == 1
    return {"rl-kernels": parser, **{f"rl-kernels {name}": p for name, p in subs[0].choices.items()}}


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    out = capsys.readouterr().out.strip()
    assert re.fullmatch(rf"rl-kernels {re.escape(rl_kernels.__version__)} \(torch "
                        rf"{re.escape(torch.__version__)}, triton [^)]+\)", out), out
    try:  # the installed distribution (pyproject's version) says the same
        assert metadata.version("rl-kernels") == rl_kernels.__version__
    except metadata.PackageNotFoundError:
        pass


def test_version_from_the_entry_point():
    proc = subprocess.run([sys.executable, "-m", "rl_kernels", "--version"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.startswith(f"rl-kernels {rl_kernels.__version__} (torch ")


@pytest.mark.parametrize("command", ["repro", "bench"])
def test_verbose_before_or_after_the_command(command):
    parser = build_parser()
    assert parser.parse_args([command]).verbose is False
    for argv in (["-v", command], [command, "-v"], ["--verbose", command], [command, "--debug"],
                 ["-v", command, "-v"]):
        assert parser.parse_args(argv).verbose is True, argv


def test_help_lists_every_command_with_what_it_does(capsys):
    """``rl-kernels --help`` lists each command (verl-check was missing, issue 46) under 'commands:',
    with the words of its own help."""
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    out = capsys.readouterr().out
    commands = out.split("\ncommands:\n", 1)[1].split("\n\n", 1)[0]
    names = [n.removeprefix("rl-kernels ") for n in _parsers() if n != "rl-kernels"]
    assert exc.value.code == 0 and names == ["repro", "bench", "verl-check"], names
    listed = {}  # name -> its help, wrapped lines joined
    for line in commands.splitlines()[1:]:  # after the COMMAND line
        if re.match(r" {4}\S", line):
            name = line.split()[0]
            listed[name] = line
        else:
            listed[name] += line
    assert list(listed) == names, commands
    helps = {a.dest: a.help for a in next(a for a in build_parser()._actions
                                            if isinstance(a, argparse._SubParsersAction))._choices_actions}
    for name in names:
        assert " ".join(listed[name].split()) == f"{name} {' '.join(helps[name].split())}", (name, commands)


@pytest.mark.parametrize("name", ["rl-kernels", "rl-kernels repro", "rl-kernels bench", "rl-kernels verl-check"])
def test_help_is_plain_text(name):
    """argparse prints descriptions and help as they are: no ``literal`` or :func:`role` markup."""
    text = _parsers()[name].format_help()
    assert "`" not in text, text
    assert not re.search(r":(func|class|meth|mod|attr|data|ref):", text), text
    if name == "rl-kernels":
        assert "--version" in text and "examples:" in text


def test_help_exits_zero_for_every_command(capsys):
    for argv in (["--help"], ["repro", "--help"], ["bench", "--help"], ["verl-check", "--help"]):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        out = capsys.readouterr().out
        assert exc.value.code == 0 and out.startswith("usage: rl-kernels") and "`" not in out


# ----------------------------------------------------------------------------- full values
def test_table_prints_long_values_in_full():
    """A long name stays in its row; a long note is a numbered line under the table, in full."""
    note = "input holds NaN/inf in rows " + ", ".join(str(i) for i in range(120)) + " (end of note)"
    name = "a_sample_with_a_rather_long_file_name_" + "x" * 150 + ".safetensors"
    message = "not a sample file " + "y" * 200 + " (end of message)"
    rows = [repro.Row(name, "rl_kernels torch", True, 1e-7, 2e-7, 0, 0, True, note),
            repro.error_row("short.pt", message)]
    table = repro.format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + len(rows) + 3  # header, rule, one line per row, a blank line, the notes
    assert name in lines[2] and lines[2].endswith(" | [1]    |") and "..." not in table
    assert lines[-2:] == [f"[1] {note}", f"[2] {message}"]
    assert [r["note"] for r in table_rows(table)] == [note, message]


def test_bad_file_with_a_long_path_is_named_in_full(tmp_path, capsys):
    folder = tmp_path / ("d" * 100) / ("e" * 100)
    folder.mkdir(parents=True)
    bad = folder / ("f" * 120 + ".safetensors")
    bad.write_bytes(b"\x00" * 64)
    assert main(["repro", "--device", "cpu", str(bad)]) == 1
    out, err = capsys.readouterr()
    (row,) = table_rows(out)
    assert row["sample"] == str(bad) and row["result"] == "ERROR"
    assert "..." not in out and "..." not in err and str(bad) in err


def test_backend_error_note_in_full(tmp_path, monkeypatch, capsys):
    hidden, weight = torch.randn(3, 8), torch.randn(20, 8)
    path = tmp_path / "s.safetensors"
    save_sample(path, hidden, weight, torch.tensor([0, 5, 19]))
    message = "a peer's error message that goes on " + "and on " * 40 + "to its very end"

    def broken(s):
        raise RuntimeError(message)

    ours = repro.available_backends(torch.device("cpu"))
    monkeypatch.setattr(repro, "available_backends",
                        lambda device: {**ours, "peer broken": (broken, False)})
    assert main(["repro", "--device", "cpu", str(path)]) == 0  # a peer failing is a result
    out = capsys.readouterr().out
    (row,) = [r for r in table_rows(out) if r["backend"] == "peer broken"]
    assert row["note"].endswith(f"RuntimeError: {' '.join(message.split())}"), row


def test_sample_metadata_printed_in_full(tmp_path, capsys):
    reason = "log-prob above 1e-05 at rows " + ", ".join(str(i) for i in range(60))
    path = tmp_path / "anomaly.safetensors"
    save_sample(path, torch.randn(2, 8), torch.randn(10, 8), torch.tensor([1, 2]),
                metadata={"reason": reason, "model": "m" * 150})
    assert main(["repro", "--device", "cpu", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"reason={reason}; " in out and f"model={'m' * 150}" in out


# ----------------------------------------------------------------------------- written files
def test_report_written_names_path_and_size(tmp_path):
    for size, shown in ((0, "0.000 MB"), (16_624, "0.017 MB"), (4_100_136, "4.1 MB"),
                        (103_154_712, "103.2 MB")):
        path = tmp_path / f"f{size}"
        with open(path, "wb") as f:
            f.truncate(size)
        assert report_written(str(path)) == f"wrote {path} ({shown})"


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_saved_sample_has_the_umask_mode(tmp_path, umask, suffix):
    """A sample file ends 0o666 & ~umask, as a file written with open() (safetensors writes
    through a private temporary file: 0o600 whatever the umask)."""
    old = os.umask(umask)
    try:
        path = tmp_path / f"s{suffix}"
        save_sample(path, torch.randn(2, 8), torch.randn(10, 8), torch.tensor([1, 2]))
        logits_path = tmp_path / f"l{suffix}"
        save_logits_sample(logits_path, torch.randn(2, 10), torch.tensor([1, 2]))
    finally:
        os.umask(old)
    for p in (path, logits_path):
        assert os.stat(p).st_mode & 0o777 == 0o666 & ~umask, (oct(os.stat(p).st_mode), oct(umask))


def test_overwritten_sample_keeps_its_mode(tmp_path):
    path = tmp_path / "s.safetensors"
    path.write_bytes(b"old")
    os.chmod(path, 0o604)
    save_sample(path, torch.randn(2, 8), torch.randn(10, 8), torch.tensor([1, 2]))
    assert os.stat(path).st_mode & 0o777 == 0o604
    assert os.path.getsize(path) > 100
