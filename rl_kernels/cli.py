"""Command line: ``rl-kernels repro [PATH ...]`` and ``rl-kernels bench`` (also ``python -m rl_kernels``)."""
from __future__ import annotations

import argparse
import logging
import os
import sys

import torch


def _repro(args: argparse.Namespace) -> int:
    from .repro import (available_backends, available_logits_backends, check_sample, format_table,
                        unavailable_backends)
    from .samples import BUNDLED, LogitsSample, bundled_samples, load_sample, write_sample

    if args.save:
        os.makedirs(args.save, exist_ok=True)
        for s in bundled_samples():
            path = os.path.join(args.save, f"{s.name}.safetensors")
            write_sample(path, s)
            print(f"wrote {path}")
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    backends = available_backends(device)
    logits_backends = available_logits_backends(device)
    print(f"device: {device}; tolerance {args.atol:g} vs float64")
    print(f"  backends, hidden-state samples: {', '.join(backends)}")
    print(f"  backends, logits samples: {', '.join(logits_backends)}")
    for name, why in unavailable_backends(device).items():
        print(f"  skipped: {name}: {why}")
    samples = [load_sample(p) for p in args.paths] if args.paths else None
    rows = []
    for s in samples if samples is not None else (make() for make in BUNDLED.values()):
        if not args.paths:
            print(f"  {s.name}: {s.description}")
        rows += check_sample(s, device, atol=args.atol,
                             backends=logits_backends if isinstance(s, LogitsSample) else backends)
    print(format_table(rows))
    failed = [r for r in rows if r.ours and not r.passed]
    if failed:
        print(f"FAIL: {len(failed)} case(s) of ours failed", file=sys.stderr)
        return 1
    print("all rl_kernels backends PASS")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.plot:
        import json

        with open(args.plot) as f:
            results = json.load(f)
        png = args.png or os.path.splitext(args.plot)[0] + ".png"
        bench.plot(results, png)
        print(bench.format_tables(results))
        print(f"wrote {png}")
        return 0
    return bench.run(args.shapes, json_path=args.json, png_path=args.png, stub_verl=args.stub_verl,
                     only=args.impls, logits=args.logits)


def build_parser() -> argparse.ArgumentParser:
    from .repro import DEFAULT_ATOL

    parser = argparse.ArgumentParser(prog="rl-kernels", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    repro = sub.add_parser("repro", help="compare every backend against float64 on samples")
    repro.add_argument("paths", nargs="*", help=".safetensors/.pt sample files, each holding "
                       "hidden_states/weight/labels or logits/labels "
                       "(default: the bundled bug-catalogue samples)")
    repro.add_argument("--atol", type=float, default=DEFAULT_ATOL,
                       help="max |error| for PASS (default %(default)g)")
    repro.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    repro.add_argument("--save", metavar="DIR",
                       help="write the bundled samples to DIR as .safetensors and exit")
    repro.set_defaults(func=_repro)

    from .bench import DEFAULT_LOGITS_SHAPES, DEFAULT_SHAPES

    bench = sub.add_parser("bench", help="time the fused head vs cuBLAS matmul and its peers, or "
                           "(--logits) the from-logits kernels vs bandwidth ceilings (GPU)")
    bench.add_argument("--logits", action="store_true",
                       help="benchmark the from-logits path (logits_stats) on bf16 N x V logits "
                            "instead: ms and GB/s vs the read / copy bandwidth measured in the run")
    bench.add_argument("--shapes", nargs="+", metavar="SHAPE",
                       help=f"bf16 shapes N,H,V (default: {' '.join(DEFAULT_SHAPES)}); with "
                            f"--logits N,V (default: {' '.join(DEFAULT_LOGITS_SHAPES)})")
    bench.add_argument("--impls", nargs="+", help="only these implementations (names as in the table)")
    bench.add_argument("--json", help="write the results as JSON here")
    bench.add_argument("--png", help="write a bar chart here (needs matplotlib)")
    bench.add_argument("--plot", metavar="JSON", help="no timing: re-print and chart a saved JSON")
    bench.add_argument("--stub-verl", action="store_true",
                       help="import verl's kernels without its Ray/tensordict stack (GPU machines "
                            "without a package index)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
