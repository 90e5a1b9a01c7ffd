"""``python scripts/bench.py [options]``: the same as ``rl-kernels bench [options]`` (the benchmark
itself is the package module ``rl_kernels.tools.bench``; see ``rl-kernels bench --help``)."""
import sys

from rl_kernels.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
