"""Which backend runs a call: ``"triton"`` (CUDA, or Triton's CPU interpreter) or ``"torch"``,
as one :class:`Backend` object per backend.

A public function resolves its ``backend`` argument once (:func:`get_backend`) and hands the
object down in its head's parameter record; the autograd bodies reach the head family's kernels on
that backend in the package it names (``Backend.package``): the module ``rl_kernels.ops.<family>``
(Triton) or ``rl_kernels.torch_ops.<family>`` (its torch twin), which expose the same functions
(``autograd.head_family.kernels``). This module is the only one that tests a backend's name.

Triton is never imported here (``importlib.util.find_spec`` only), so the torch backend works on
a machine without Triton.
"""
from __future__ import annotations

import importlib.util
import logging
import os

import torch

from ._logging import log_once

BACKENDS = ("auto", "triton", "torch")
_PACKAGES = {"triton": "ops", "torch": "torch_ops"}  # each backend's kernel package, rl_kernels.<package>.<family>


_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # (looked up once, at import)


def triton_available() -> bool:
    """Whether the ``triton`` package is installed (not imported)."""
    return _TRITON_INSTALLED


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(backend: str, device: torch.device) -> str:
    """Map 'auto' | 'triton' | 'torch' to the backend that runs on ``device``: 'auto' is Triton on
    CUDA when installed, torch elsewhere. Raises ValueError for an unknown name and RuntimeError
    when 'triton' cannot run (not installed, or CPU tensors without TRITON_INTERPRET=1)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton': the triton package is not installed")
        if device.type != "cuda" and not interpreting():
            raise RuntimeError(f"backend='triton' needs CUDA tensors, got tensors on {device}; set "
                               f"TRITON_INTERPRET=1 before importing rl_kernels to use Triton's CPU "
                               f"interpreter, or use backend='torch'")
    return backend


class Backend:
    """One backend, resolved for a call: ``name`` ("triton" or "torch"),
    ``checks_labels_in_kernel`` (the kernels find a label outside [0, V) without a host sync), and
    ``package``, the package of its families' kernels under ``rl_kernels`` ("ops" or "torch_ops").
    ``auto_for``: the device type for which ``backend='auto'`` chose it (None when it was named):
    that choice is logged once, by :meth:`log_choice` as a backend call's body runs (always eagerly:
    under torch.compile inside a custom op), so that no logging is on a path that Dynamo traces."""

    def __init__(self, name: str, checks_labels_in_kernel: bool, auto_for: str | None = None):
        self.name = name
        self.checks_labels_in_kernel = checks_labels_in_kernel
        self.auto_for = auto_for
        self.package = _PACKAGES[name]
        # what a custom op carries (it takes no Python objects): the name, and the 'auto' mark
        self.op_name = name if auto_for is None else f"{name}@auto:{auto_for}"

    def log_choice(self) -> None:
        """Log, once per process, the backend that ``backend='auto'`` chose (nothing for a named one)."""
        if self.auto_for is not None:
            log_once(logging.INFO, self._auto_message, key=("backend='auto'", self.name, self.auto_for))

    def _auto_message(self) -> str:
        why = " (Triton is not installed)" if self.auto_for == "cuda" and self.name != "triton" else ""
        return f"rl_kernels: backend='auto' runs '{self.name}' for {self.auto_for} tensors{why}"

    def __repr__(self) -> str:
        auto = "" if self.auto_for is None else f", auto_for={self.auto_for!r}"
        return f"Backend({self.name!r}{auto})"


_BACKENDS = {"triton": Backend("triton", checks_labels_in_kernel=True),
             "torch": Backend("torch", checks_labels_in_kernel=False)}


def backend_by_name(op_name: str) -> Backend:
    """The resolved :class:`Backend` whose ``op_name`` this is ("triton", "torch", or such a name
    marked as the choice of ``backend='auto'``): the custom ops of ``torch.compile`` (whose
    arguments are plain values) carry that of the backend the public function resolved, and look
    the object up here."""
    name, _, auto_for = op_name.partition("@auto:")
    if not auto_for:
        return _BACKENDS[name]
    return _auto_backend(name, auto_for)


def _auto_backend(name: str, device_type: str) -> Backend:
    chosen = _AUTO.get((name, device_type))
    if chosen is None:
        chosen = Backend(name, _BACKENDS[name].checks_labels_in_kernel, auto_for=device_type)
        _AUTO[name, device_type] = chosen
    return chosen


def get_backend(backend: str, device: torch.device) -> Backend:
    """The :class:`Backend` that runs on ``device`` for the public ``backend`` argument ('auto' |
    'triton' | 'torch'); raises as :func:`resolve_backend`. For 'auto', the chosen backend's
    object marked with the device type (one object per pair, kept)."""
    name = resolve_backend(backend, device)
    return _BACKENDS[name] if backend != "auto" else _auto_backend(name, device.type)


# (name, device type) -> the Backend 'auto' chose; made here for the common device types, so that
# a call that torch.compile traces finds its object (a new one is made only for another type)
_AUTO: dict[tuple, Backend] = {(name, device): Backend(name, backend.checks_labels_in_kernel, auto_for=device)
                               for name, backend in _BACKENDS.items() for device in ("cpu", "cuda", "meta")}
