"""rl_kernels.integrations.verl on verl 0.9.1's Megatron engine, on CPU: gloo groups of 2 and 3
ranks with Megatron's tensor-parallel state (``tests/integrations/megatron_worker.py`` holds the per-rank
checks: verl's own logits processor and fused output processor against the unsharded float64
reference and verl's original functions, the hidden-state gradient with and without sequence
parallelism, identical bits on every rank, by-name patching, unpatch, call counts, the engine
report, signature-change rollback and the skip without megatron.core; Σπ² on the fused path through
verl's own engine forward_step on a stand-in GPT model)."""
import importlib.util

import pytest

# found, not imported: only the spawned ranks pay for importing verl and Megatron-Core
for _name in ("verl", "megatron", "megatron.core"):  # the parent first: find_spec of a child raises
    if importlib.util.find_spec(_name) is None:
        pytest.skip(f"{_name} is not installed (pip install -e '.[verl]')", allow_module_level=True)
import torch.multiprocessing as mp

import megatron_worker


@pytest.mark.parametrize("world", [2, 3])
def test_megatron_engine_paths(tmp_path, world):
    mp.spawn(megatron_worker.run, args=(world, str(tmp_path / "init")), nprocs=world, join=True)
