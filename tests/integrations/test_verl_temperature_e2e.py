"""Per-sample temperature end to end through verl's own Ray worker and FSDP engine (issue 44,
item 2): ``ActorRolloutRefWorker`` (role ``actor``, verl's engine workers: 0.8+) computes the
log-probs and entropy of two sequences with temperatures 0.5 and 1.3 in one micro-batch and runs
one ``update_actor`` step (PPO loss with an entropy bonus, SGD lr 1: the update is the clipped
gradient), with rl-kernels' fused path (``+rl_kernels=fused``, the Triton kernel in its CPU
interpreter), which verl refuses without rl-kernels, and with verl's unpatched logits path
(``use_fused_kernels=False``, no ``external_lib``), the reference. The two workers run side by
side on the cluster of ``test_verl_e2e.py`` (shared fixtures: tests/integrations/conftest.py).

Tolerances as in ``test_verl_e2e.py`` (both float32): log-probs and entropy 1e-4 absolute,
parameter updates 1e-4 relative. A temperature on the wrong sample moves log-probs by ~1 nat.
"""

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[verl]')")

from verl_ray import _compose, _engine_batches, assert_same_updates, run_configs  # noqa: E402
from verl_cpu import legacy_workers  # noqa: E402
from verl_helpers import rollout_tensors  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.skipif(legacy_workers(), reason="verl 0.7.x's legacy workers take one temperature")]

TEMPERATURES = (0.5, 1.3)


def _per_sample(batch):
    """The batch with a temperature per sample (a float tensor (bsz,)) in place of the number."""
    batch = batch.copy()
    del batch["temperature"]
    batch["temperature"] = torch.tensor(TEMPERATURES)
    return batch


@pytest.fixture(scope="module")
def runs(ray_cluster, model):  # the shared fixtures (tests/integrations/conftest.py)
    configs = {option: _compose(model[1], option) for option in ("fused", None)}
    return run_configs(ray_cluster, configs, lambda: tuple(_per_sample(b) for b in _engine_batches()))


def test_per_sample_temperature_through_verls_worker_matches_verls_logits_path(runs):
    fused, ref = runs["fused"], runs[None]
    assert ref["counts_init"] is None and fused["counts_init"] is not None  # rl-kernels imported in one only
    counts = {k: fused["counts_log_prob"][k] - fused["counts_init"][k] for k in fused["counts_init"]}
    assert counts["fused_fsdp_calls"] == 1 and counts["logits_log_probs_calls"] == 0, counts
    mask = rollout_tensors()[0]["response_mask"].bool()
    torch.testing.assert_close(fused["log_probs"][mask], ref["log_probs"][mask], atol=1e-4, rtol=0)
    torch.testing.assert_close(fused["entropy"][mask], ref["entropy"][mask], atol=1e-4, rtol=0)
    assert_same_updates(ref, fused)
