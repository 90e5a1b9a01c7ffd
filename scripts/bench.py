"""Same as ``rl-kernels bench`` (see rl_kernels/bench.py): python scripts/bench.py [--shapes N,H,V ...]"""
import sys

from rl_kernels.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
