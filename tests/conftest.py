"""Test setup. Without CUDA, Triton kernels run in the CPU interpreter: TRITON_INTERPRET must be
set before rl_kernels.ops is imported (Triton picks the interpreter when a kernel is defined).

verl counts as installed where its distribution is (``importlib.metadata``), as the integration
counts it (``verl_impl.patch_state.verl_version``): an importable ``verl`` without one (a partial
source tree on ``sys.path``, as on the lent GPU machine, 2026-12-07) is hidden here, so that the
verl tests' ``importorskip("verl")`` skips them there instead of their imports failing."""
import importlib.metadata
import importlib.util
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _verl_without_its_distribution() -> bool:
    try:
        importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return "verl" not in sys.modules and importlib.util.find_spec("verl") is not None
    return False


if _verl_without_its_distribution():
    sys.modules["verl"] = None  # (import verl raises ImportError)

_empty, _empty_like = torch.empty, torch.empty_like


def _poison(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype != torch.bool:
        return t.fill_(-7777)
    return t


@pytest.fixture
def poison(monkeypatch):
    """Every torch.empty / empty_like made during the test is filled with NaN (ints: -7777), so an
    output element that a kernel forgets to write shows up as a wrong value."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _poison(_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _poison(_empty_like(*a, **k)))


def pytest_collection_modifyitems(config, items):
    """``numerical``: every test of a module that bounds float32 rounding with tests/support/tolerances.py
    (.ci/run runs them once more with MKL's SSE4.2 kernels, whose rounding differs from AVX2's and
    AVX-512's); ``gpu`` tests skipped without CUDA."""
    import tolerances

    for item in items:
        module = getattr(item, "module", None)
        if module is not None and any(getattr(module, name, None) is getattr(tolerances, name)
                                      for name in ("assert_close_f32", "f32_bound", "gamma")):
            item.add_marker(pytest.mark.numerical)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
