"""Vocab tensor parallelism on CPU: gloo groups of 2 and 3 processes with uneven vocab shards,
both backends (Triton in the interpreter), against the unsharded float64 reference
(``tests/api/tp_worker.py`` holds the per-rank checks)."""
import pytest
import torch
import torch.multiprocessing as mp

import rl_kernels
import tp_worker


@pytest.mark.parametrize("world,backend", [(2, "torch"), (3, "torch"), (2, "triton"), (3, "triton")])
def test_vocab_parallel_matches_unsharded(tmp_path, world, backend):
    mp.spawn(tp_worker.run, args=(world, str(tmp_path / "init"), backend), nprocs=world, join=True)


def test_process_group_argument_errors():
    h = torch.randn(3, 8)
    w = torch.randn(11, 8)
    labels = torch.tensor([1, 2, -100])
    with pytest.raises(RuntimeError, match="process_group: torch.distributed is not initialized"):
        rl_kernels.linear_log_probs(h, w, labels, process_group=object(), backend="torch")
    with pytest.raises(ValueError, match="vocab_start_index"):
        rl_kernels.linear_log_probs(h, w, labels, vocab_start_index=4, backend="torch")
    with pytest.raises(ValueError, match="vocab_start_index"):
        rl_kernels.logsumexp(h, vocab_start_index=4, backend="torch")
