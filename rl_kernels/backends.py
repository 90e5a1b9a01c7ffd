"""Which backend runs a call: ``"triton"`` (CUDA, or Triton's CPU interpreter) or ``"torch"``.

Triton is never imported here (``importlib.util.find_spec`` only), so the torch backend works on
a machine without Triton.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os

import torch

from ._logging import log_once

BACKENDS = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    """Whether the ``triton`` package is installed (not imported)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map 'auto' | 'triton' | 'torch' to the backend that runs on ``device``: 'auto' is Triton on
    CUDA when installed, torch elsewhere (the choice is logged once). Raises ValueError for an
    unknown name and RuntimeError when 'triton' cannot run (not installed, or CPU tensors without
    TRITON_INTERPRET=1)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        chosen = "triton" if device.type == "cuda" and triton_available() else "torch"
        log_once(logging.INFO, f"rl_kernels: backend='auto' runs '{chosen}' for {device.type} tensors"
                 + ("" if chosen == "triton" or device.type != "cuda" else " (Triton is not installed)"))
        return chosen
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton': the triton package is not installed")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(f"backend='triton' needs CUDA tensors, got tensors on {device}; set "
                               f"TRITON_INTERPRET=1 before importing rl_kernels to use Triton's CPU "
                               f"interpreter, or use backend='torch'")
    return backend
