"""What the command line (``rl_kernels.tools.cli``) and the benchmark (``rl_kernels.tools.bench``) both use: the
usage error, the line for a file written, and the bench's default shapes (here so that building
the CLI's parser does not import the bench, and so that the bench does not import the CLI)."""
from __future__ import annotations

import os

# the bench's default shapes: N,H,V (fused head) and N,V (--logits)
DEFAULT_SHAPES = ("16384,3584,152064", "32768,4096,128256", "512,3584,152064")
DEFAULT_LOGITS_SHAPES = ("16384,152064", "512,152064")
VARYING_N_SHAPE = "3584,152064"  # H,V of --varying-n given without a value


class UsageError(SystemExit):
    """A bad command-line argument found after parsing: exit status 2, ``str()`` the message.
    ``rl_kernels.tools.cli.main`` prints it as one line; raised outside it, it still exits with status 2."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _megabytes(nbytes: int) -> str:
    mb = nbytes / 1e6
    return f"{mb:.1f} MB" if mb >= 0.1 else f"{mb:.3f} MB"


def report_written(path: str) -> str:
    """The line a command prints for a file it wrote: ``wrote PATH (SIZE MB)`` (MB = 10^6 bytes)."""
    return f"wrote {path} ({_megabytes(os.path.getsize(path))})"
