"""Fixtures of the public functions' tests that more than one file of this folder uses
(test_linear_log_probs.py and test_row_temperature.py; test_linear_topk.py and test_head_top_k.py)."""
import dataclasses

import pytest

import rl_kernels.autograd.backward_schedule as rl_autograd
import rl_kernels.torch_ops.linear_topk as topk_torch
from rl_kernels.core.backends import interpreting
from rl_kernels.ops.config import INTERPRETER_CONFIG, forced_config

# the top-K tests' Triton tiles: 16-row blocks, 32-column tiles, splits (lse chunks) of 64 columns
SMALL_TOPK = dataclasses.replace(INTERPRETER_CONFIG, split_v=64, block_m=16, block_n=32, block_k=16, group_m=2)


@pytest.fixture
def _needs_interpreter(request):
    """A module that names it (``pytestmark = pytest.mark.usefixtures("_needs_interpreter")``) skips its
    tests on the Triton backend unless the kernels run in the CPU interpreter."""
    if "backend" in request.fixturenames and request.getfixturevalue("backend") == "triton" \
            and not interpreting():
        pytest.skip("CPU Triton tests need TRITON_INTERPRET=1 (set by conftest without CUDA)")


@pytest.fixture
def small_topk_tiles(monkeypatch):
    """The top-K tests' small Triton tiles (``SMALL_TOPK``), and the torch twin's selection in chunks
    of 3 rows of V = 203 (so calls cross chunk boundaries)."""
    monkeypatch.setattr(topk_torch, "CHUNK_ELEMENTS", 3 * 203)
    with forced_config(SMALL_TOPK):
        yield


@pytest.fixture
def small_chunks(monkeypatch):
    """Force the backward into ~3 windows per pass so chunk boundaries are exercised."""
    monkeypatch.setattr(rl_autograd, "MIN_CHUNK_ELEMENTS", 15000)
    monkeypatch.setattr(rl_autograd, "CHUNK_FRACTION", 0.0)
