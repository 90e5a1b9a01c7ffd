"""Fixtures of the public functions' tests that more than one file of this folder uses
(test_linear_log_probs.py and test_row_temperature.py)."""
import pytest

import rl_kernels.autograd.backward_schedule as rl_autograd
from rl_kernels.core.backends import interpreting


@pytest.fixture
def _needs_interpreter(request):
    """A module that names it (``pytestmark = pytest.mark.usefixtures("_needs_interpreter")``) skips its
    tests on the Triton backend unless the kernels run in the CPU interpreter."""
    if "backend" in request.fixturenames and request.getfixturevalue("backend") == "triton" \
            and not interpreting():
        pytest.skip("CPU Triton tests need TRITON_INTERPRET=1 (set by conftest without CUDA)")


@pytest.fixture
def small_chunks(monkeypatch):
    """Force the backward into ~3 windows per pass so chunk boundaries are exercised."""
    monkeypatch.setattr(rl_autograd, "MIN_CHUNK_ELEMENTS", 15000)
    monkeypatch.setattr(rl_autograd, "CHUNK_FRACTION", 0.0)
