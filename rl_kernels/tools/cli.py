"""Command line: ``rl-kernels repro [PATH ...]``, ``rl-kernels bench`` and ``rl-kernels verl-check
[OVERRIDES ...]`` (also ``python -m rl_kernels``).

Bad input never ends in a traceback: a usage error (a bad option value) is one line on stderr and
exit status 2; a sample file that cannot be replayed is an ERROR row and one line on stderr, the
other files still run, and the exit status is 1. ``-v`` (before or after the subcommand) logs at
INFO level and prints the traceback of any error.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import sys
import textwrap
import traceback

import torch

from .usage import DEFAULT_LOGITS_SHAPES, DEFAULT_SHAPES, VARYING_N_SHAPE, UsageError, report_written  # noqa: F401

# argparse prints these as they are: plain text, no reStructuredText markup
DESCRIPTION = """\
rl-kernels: fused linear + log-prob / entropy kernels for RL training of LLMs.

Bad input never ends in a traceback: a bad option value is one line on stderr and exit status 2;
a sample file that cannot be replayed is an ERROR row plus one line on stderr, the other files
still run, and the exit status is 1. -v (before or after the command) logs at INFO level and
prints the traceback of any error."""

EPILOG = """\
examples:
  rl-kernels repro                          the bundled samples, every backend available here
  rl-kernels repro bad_step.safetensors     a sample saved by rl_kernels.samples.save_sample
  rl-kernels repro anomalies/               every sample file in a directory, in name order
  rl-kernels repro --save samples/          write the bundled samples as .safetensors files
  rl-kernels bench --json out.json          GPU timings, saved as JSON
  rl-kernels verl-check 'hydra.searchpath=[pkg://rl_kernels.integrations.conf]' +rl_kernels=fused
                                            is rl-kernels on in that verl run? (exit 1: off)
  rl-kernels <command> --help               the options of one command"""

class CommandError(Exception):
    """An error of the command that is not a usage error (exit status 1), already one line."""


def _one_line(exc: BaseException, limit: int | None = 300) -> str:
    """The message of ``exc`` on one line; cut to ``limit`` characters unless ``limit`` is None
    (what goes into a table row is never cut)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if limit is None or len(text) <= limit else text[:limit - 3] + "..."


def _verbose(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "verbose", False))


# ----------------------------------------------------------------------------- argument types
def _tolerance(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}; expected cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise argparse.ArgumentTypeError(f"{text!r} is not supported; expected cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text!r} is not available here (no CUDA device); use --device cpu")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r} is not available here ({torch.cuda.device_count()} "
                                         f"CUDA device(s))")
    return device


def _writable_file(option: str, path: str) -> None:
    """UsageError unless ``path`` can be created: its directory exists and it is not a directory
    (and, for --png, it ends in .png)."""
    if option == "--png" and not path.lower().endswith(".png"):
        raise UsageError(f"argument {option}: {path!r}: expected a file name ending in .png")
    if os.path.isdir(path):
        raise UsageError(f"argument {option}: {path!r} is a directory; expected a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"argument {option}: cannot write {path!r}: directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"argument {option}: cannot write {path!r}: directory {folder!r} is not writable")


# ----------------------------------------------------------------------------- repro
def _save_bundled(target: str) -> int:
    from ..samples import write_sample
    from .bundled_samples import bundled_samples

    if os.path.exists(target) and not os.path.isdir(target):
        raise UsageError(f"argument --save: {target!r} exists and is not a directory")
    try:
        os.makedirs(target, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"argument --save: cannot create directory {target!r}: "
                         f"{exc.strerror or _one_line(exc)}") from exc
    if not os.access(target, os.W_OK | os.X_OK):
        raise UsageError(f"argument --save: directory {target!r} is not writable")
    for s in bundled_samples():
        path = os.path.join(target, f"{s.name}.safetensors")
        try:
            write_sample(path, s)
        except Exception as exc:  # noqa: BLE001 - OSError, SafetensorError: one line
            raise CommandError(f"--save: cannot write {path}: {_one_line(exc)}") from exc
        print(report_written(path))
    return 0


_METADATA_FIRST = ("reason", "rank", "call", "verl_version", "model", "time", "step", "source")


_METADATA_SHOWN_ELSEWHERE = ("description", "rl_kernels.baseline_bugs")  # the sample's line, the notes


def _describe_metadata(meta: dict) -> str:
    keys = [k for k in _METADATA_FIRST if k in meta]
    keys += sorted(k for k in meta if k not in _METADATA_FIRST and k not in _METADATA_SHOWN_ELSEWHERE)
    return "; ".join(f"{k}={' '.join(str(meta[k]).split())}" for k in keys)


def _sample_paths(paths: list[str]) -> list[tuple[str, str | None]]:
    """(path, None) per file to replay: each PATH, or every sample file of a directory PATH in
    name order; (PATH, message) for a directory that holds none or cannot be listed. A
    CommandError (one line) when no PATH leaves anything to replay."""
    from ..samples import SAMPLE_SUFFIXES, sample_files

    targets: list[tuple[str, str | None]] = []
    for path in paths:
        if not os.path.isdir(path):
            targets.append((path, None))
            continue
        try:
            files = sample_files(path)
        except OSError as exc:
            targets.append((path, f"{path}: directory cannot be listed ({exc.strerror or _one_line(exc)})"))
            continue
        if not files:
            targets.append((path, f"{path}: no sample files in this directory (files ending in "
                                  f"{' or '.join(SAMPLE_SUFFIXES)})"))
        targets.extend((f, None) for f in files)
    if targets and all(message for _, message in targets):
        raise CommandError("; ".join(message for _, message in targets))
    return targets


def _say(text: str, indent: str = "") -> None:
    """Print prose wrapped to the repro table's width (words never broken: a path stays whole)."""
    from .repro import TABLE_WIDTH

    print(textwrap.fill(text, TABLE_WIDTH, initial_indent=indent, subsequent_indent=indent + "  ",
                        break_long_words=False, break_on_hyphens=False))


def _repro(args: argparse.Namespace) -> int:
    from .repro import (BASELINE_FAIL, INPUT_NON_FINITE, available_backends,
                        available_logits_backends, check_sample, error_row, format_table,
                        unavailable_backends)
    from ..samples import LogitsSample, SampleError, load_sample
    from .bundled_samples import BUNDLED

    if args.save:
        if args.paths:
            raise UsageError("argument --save: writes the bundled samples; give no PATH with it")
        return _save_bundled(args.save)
    targets = _sample_paths(args.paths)
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backends = available_backends(device)
    logits_backends = available_logits_backends(device)
    print(f"device: {device}; Δ: max |error| against float64; PASS: Δ <= {args.atol:g}, no NaN/inf, no log-prob > 0")
    _say(f"backends, hidden-state samples: {', '.join(backends)}", "  ")
    _say(f"backends, logits samples: {', '.join(logits_backends)}", "  ")
    for name, why in unavailable_backends(device).items():
        _say(f"skipped: {name}: {why}", "  ")

    rows, errors = [], []

    def error(label: str, message: str) -> None:
        if _verbose(args) and sys.exc_info()[0] is not None:
            traceback.print_exc()
        print(f"rl-kernels repro: error: {message}", file=sys.stderr)
        errors.append(message)
        rows.append(error_row(label, message.removeprefix(f"{label}: ")))

    def run(s) -> None:
        try:
            rows.extend(check_sample(s, device, atol=args.atol,
                                     backends=logits_backends if isinstance(s, LogitsSample) else backends))
        except Exception as exc:  # noqa: BLE001 - reported as an error row; the others go on
            error(s.name, f"{s.name}: check failed: {type(exc).__name__}: {_one_line(exc, None)}")

    if not args.paths:
        for make in BUNDLED.values():
            s = make()
            _say(f"{s.name}: {s.description}", "  ")
            run(s)
    for path, message in targets:
        if message:
            error(path, message)
            continue
        try:
            s = load_sample(path)
        except SampleError as exc:
            error(path, str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - an unforeseen way for a file to be bad
            error(path, f"{path}: {type(exc).__name__}: {_one_line(exc, None)}")
            continue
        s = dataclasses.replace(s, name=path)  # a file's rows are named by its path, as given or in its directory
        if s.description:
            _say(f"{s.name}: {s.description}", "  ")
        if set(s.metadata) - set(_METADATA_SHOWN_ELSEWHERE):
            print(f"  {s.name}: metadata: {_describe_metadata(s.metadata)}")  # data: in full, on one line
        run(s)
    print(format_table(rows))
    print()
    failed = [r for r in rows if r.ours and not r.passed]
    if any(r.status == BASELINE_FAIL for r in rows):
        _say(f"{BASELINE_FAIL}: a baseline (not rl-kernels) further from float64 than the tolerance: "
             f"that baseline's own error (the note says what it computes differently), not a failure "
             f"of this run; only rl_kernels rows decide the exit status")
    non_finite = list(dict.fromkeys(r.sample for r in rows if "input holds NaN/inf" in r.note))
    if non_finite:
        _say(f"input NaN/inf: {', '.join(non_finite)}: the rows named in the note are not "
             f"compared (a non-finite input, not a kernel failure)")
    if failed or errors:
        what = ([f"{len(failed)} case(s) of ours failed"] if failed else []) + \
            ([f"{len(errors)} sample(s) could not be checked (ERROR rows)"] if errors else [])
        print(f"FAIL: {'; '.join(what)}", file=sys.stderr)
        return 1
    if rows and all(r.status == INPUT_NON_FINITE for r in rows if r.ours):
        print("no rl_kernels row failed; nothing was compared (every row's input holds NaN/inf)")
        return 0
    print("all rl_kernels backends PASS" + (" on the rows with finite inputs" if non_finite else ""))
    return 0


# ----------------------------------------------------------------------------- bench
def load_bench():
    """The benchmark module, ``rl_kernels.tools.bench``, imported on first use (``rl-kernels repro`` and
    building the parser never import it)."""
    from . import bench

    return bench


def _bench(args: argparse.Namespace) -> int:
    for option, path in (("--json", args.json), ("--png", args.png)):
        if path:
            _writable_file(option, path)
    bench = load_bench()
    if args.plot:
        results, text = bench.load_results(args.plot)
        if not args.png:  # a chart only where asked for: nothing is written next to the JSON
            print(text)
            return 0
        try:
            bench.plot(results, args.png)
        except ImportError as exc:
            raise CommandError(f"--png: the chart needs matplotlib (pip install matplotlib, or the "
                               f"bench extra: pip install '/path/to/rl-kernels[bench]'): "
                               f"{_one_line(exc)}") from exc
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise CommandError(f"{args.plot}: not a complete rl-kernels bench result "
                               f"({type(exc).__name__}: {_one_line(exc)})") from exc
        print(text)
        print(report_written(args.png))
        return 0
    if args.shapes:
        bench.parse_shapes(args.shapes, logits=args.logits)  # a bad shape: exit 2 before timing
    if args.varying_n:
        if args.logits:
            raise UsageError("argument --varying-n: not with --logits (it times the fused head)")
        bench.parse_hidden_vocab(args.varying_n)
    return bench.run(args.shapes, json_path=args.json, png_path=args.png, stub_verl=args.stub_verl,
                     only=args.impls, logits=args.logits, varying_n=args.varying_n)


# ----------------------------------------------------------------------------- parser / main
class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line (no usage block) and exit status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_verbose(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("-v", "--verbose", "--debug", action="store_true", default=default,
                        help="log at INFO level; print the traceback of an error")


def version_text() -> str:
    """``rl-kernels X.Y.Z (torch A, triton B)``: the package version (rl_kernels.__version__, the
    installed distribution's when it is installed), and the torch and Triton it runs with."""
    from importlib import metadata

    from .. import __version__

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"rl-kernels {__version__} (torch {torch.__version__}, triton {installed('triton')})"


def build_parser() -> argparse.ArgumentParser:
    from .repro import DEFAULT_ATOL

    parser = _Parser(prog="rl-kernels", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the version of rl-kernels (and of torch and Triton) and exit")
    _add_verbose(parser, False)
    # the commands' list in --help is argparse's, from each command's help: every command, once
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    repro = sub.add_parser("repro", help="replay the bundled bug-catalogue samples (or sample files) through "
                           "every backend available here and compare with float64; exit status 1 when one of "
                           "ours fails",
                           description="Replay samples through every backend available here "
                           "(ours Triton and torch, torch eager, verl's kernel when importable on "
                           "CUDA) and print, per backend, the max |error| of log-probs and entropy "
                           "against float64 and PASS / FAIL, each row's note (a count of NaN/inf "
                           "outputs or of log-probs > 0, an error) numbered under the table; a "
                           "baseline further from float64 than the tolerance is FAIL (baseline), that "
                           "baseline's own error, never a failure of the run. A file's rows are named "
                           "by its path (a directory's files: DIR/NAME). Exit status 1 when one of ours "
                           "fails or a file cannot be replayed, 2 for a bad option.")
    _add_verbose(repro, argparse.SUPPRESS)
    repro.add_argument("paths", nargs="*", metavar="PATH",
                       help=".safetensors/.pt sample files, each holding hidden_states/weight/labels "
                       "or logits/labels, or directories of them (every .safetensors/.pt file in "
                       "it, in name order) (default: the bundled bug-catalogue samples)")
    repro.add_argument("--atol", type=_tolerance, default=DEFAULT_ATOL,
                       help="max |error| for PASS, a finite number >= 0 (default %(default)g)")
    repro.add_argument("--device", type=_device, help="cpu, cuda or cuda:N (default: cuda when available)")
    repro.add_argument("--save", metavar="DIR",
                       help="write the bundled samples to DIR as .safetensors files (about "
                            "150 MB; one line per file: its path and size) and exit")
    repro.set_defaults(func=_repro)

    bench = sub.add_parser("bench", help="time the fused head vs a cuBLAS matmul and its peers, or "
                           "(--logits) the from-logits kernels vs bandwidth ceilings (needs a CUDA GPU; "
                           "without one it says so and exits 0)",
                           description="Time the fused head against a cuBLAS matmul of the same "
                           "shape and its peers (torch eager; verl, Liger, CCE when importable), or "
                           "with --logits the from-logits kernels against the read / copy "
                           "bandwidth measured in the same run. Needs a CUDA GPU; without one it "
                           "says so and exits 0 (--plot works anywhere).")
    _add_verbose(bench, argparse.SUPPRESS)
    bench.add_argument("--logits", action="store_true",
                       help="benchmark the from-logits path (logits_stats) on bf16 N x V logits "
                            "instead: ms and GB/s vs the read / copy bandwidth measured in the run")
    bench.add_argument("--shapes", nargs="+", metavar="SHAPE",
                       help=f"bf16 shapes N,H,V (default: {' '.join(DEFAULT_SHAPES)}); with "
                            f"--logits N,V (default: {' '.join(DEFAULT_LOGITS_SHAPES)})")
    bench.add_argument("--impls", nargs="+", help="only these implementations (names as in the table)")
    bench.add_argument("--json", help="write the results as JSON here")
    bench.add_argument("--png", metavar="PATH", help="write a bar chart to PATH, a .png file name "
                       "in an existing directory (needs matplotlib); nothing else writes one")
    bench.add_argument("--plot", metavar="JSON", help="no timing: re-print the tables of a saved "
                       "--json result (with --png PATH: chart it there too)")
    bench.add_argument("--varying-n", nargs="?", const=VARYING_N_SHAPE, metavar="H,V",
                       help="first time 8 forward+backward calls whose token count changes from call "
                            "to call (3000-20000, as verl's dynamic micro-batches), compilation "
                            f"included, hidden size H and vocabulary V (default {VARYING_N_SHAPE})")
    bench.add_argument("--stub-verl", action="store_true",
                       help="import verl's kernels without its Ray/tensordict stack (GPU machines "
                            "without a package index)")
    bench.set_defaults(func=_bench)

    check = sub.add_parser("verl-check", help="say whether rl-kernels is on in the verl run these overrides "
                           "make (needs verl); exit status 1 when off or when an override is lost",
                           description="Compose verl's config with these overrides the way the run does "
                           "(python -m verl.trainer.main_ppo --cfg job OVERRIDES; nothing is trained) and "
                           "say in one line whether rl-kernels is on (which path, backend, options) or off "
                           "and why, with the likely fix; then a line per optional feature the config asks "
                           "for (sum_pi_squared, top-K distillation), WARNING where it is not served. Exit "
                           "status 0 when on, 1 when off or when an override composes into a key that "
                           "nothing reads (the run would not have that option), 2 for a usage error. The "
                           "options below may come anywhere among the overrides. Needs verl (the verl extra).")
    _add_verbose(check, argparse.SUPPRESS)
    check.add_argument("--entry", default="verl.trainer.main_ppo",
                       help="verl's entry module that composes the config (default: %(default)s)")
    check.add_argument("--config-dir", "-cd", metavar="DIR",
                       help="a directory of configs added to Hydra's search path, as on verl's command line "
                            "(conf from the root of a clone holds the rl_kernels group)")
    check.add_argument("--config-name", "-cn", metavar="NAME",
                       help="verl's config to compose, as on verl's command line (default: the entry's own, "
                            "e.g. ppo_trainer; ppo_megatron_trainer for the Megatron engine)")
    check.add_argument("overrides", nargs="*", metavar="OVERRIDE",
                       help="the run's Hydra overrides, as on verl's command line")
    check.set_defaults(func=_verl_check)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, except that verl-check's options may come anywhere among its
    overrides: argparse stops filling the OVERRIDE list at the first option, and hands back the
    overrides after it as unrecognized (in order), which are verl-check's too."""
    args, rest = parser.parse_known_args(argv)
    if rest and args.command == "verl-check":
        flags = [a for a in rest if a.startswith("-")]
        if not flags:
            args.overrides = [*args.overrides, *rest]
            return args
        rest = flags
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def _verl_check(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("verl") is None:
        raise UsageError("verl is not installed here (pip install '/path/to/rl-kernels[verl]')")
    try:
        found = importlib.util.find_spec(args.entry) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UsageError(f"--entry: no module named {args.entry!r}")
    if args.config_dir is not None and not os.path.isdir(args.config_dir):
        raise UsageError(f"argument --config-dir: {args.config_dir!r} is not a directory")
    from .verl_check import check

    flags = [*(("--config-dir", args.config_dir) if args.config_dir is not None else ()),
             *(("--config-name", args.config_name) if args.config_name is not None else ())]
    verdict = check(list(args.overrides), args.entry, tuple(flags))
    print(verdict.line)
    for note in verdict.notes:
        print(note)
    return 0 if verdict.on else 1


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (raises SystemExit(2) for a usage error)."""
    args = parse_args(build_parser(), argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    prog = f"rl-kernels {args.command}"
    try:
        return args.func(args)
    except UsageError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"{prog}: error: {exc.message} (see {prog} --help)", file=sys.stderr)
        raise
    except SystemExit as exc:  # a plain SystemExit("message") from below: a usage error too
        if isinstance(exc.code, int) or exc.code is None:
            raise
        print(f"{prog}: error: {_one_line(exc)}", file=sys.stderr)
        raise UsageError(str(exc.code)) from exc
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (CommandError, OSError, ValueError, TypeError, ImportError) as exc:
        if args.verbose:
            traceback.print_exc()
        detail = _one_line(exc) if isinstance(exc, (CommandError, ValueError)) else \
            f"{type(exc).__name__}: {_one_line(exc)}"
        print(f"{prog}: error: {detail}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - no traceback unless asked for
        if args.verbose:
            traceback.print_exc()
        print(f"{prog}: error: {type(exc).__name__}: {_one_line(exc)} (an internal error; rerun "
              f"with -v for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
