"""Test support: a pytest plugin that runs a pytest session with verl patched by rl-kernels, to
run verl's own unit tests against the integration (``scripts/verl_main_check.sh``)::

    PYTHONPATH=<rl-kernels root>/tests/support python -m pytest -p verl_patched <verl's test files>

Loaded with ``-p`` it is imported before pytest collects the test files, so verl's test modules
import (by name) the functions rl-kernels put in place, as verl's own modules do when
``external_lib`` is imported first. Without CUDA the Triton kernels run in the interpreter
(``TRITON_INTERPRET=1``, as in ``tests/conftest.py``). The header names what was patched, and the
summary the calls rl-kernels served (:func:`rl_kernels.integrations.verl.call_counts`), so that a
run in which nothing went through rl-kernels shows. It is test scaffolding, not part of rl-kernels.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import rl_kernels.integrations.verl as rk_verl  # noqa: E402  (patches verl on import)


def pytest_report_header(config):
    return [f"rl_kernels.integrations.verl: verl patched ({'yes' if rk_verl.is_patched() else 'NO'})"]


def pytest_terminal_summary(terminalreporter):
    served = {k: v for k, v in rk_verl.call_counts().items() if v}
    terminalreporter.write_line(f"rl_kernels calls served: {served or 'none'}")
