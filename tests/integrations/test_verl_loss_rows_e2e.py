"""``loss_rows_only`` end to end through verl's own Ray worker and FSDP engine (issue 53 item 3,
verl #7686): ``ActorRolloutRefWorker`` (role ``actor``, verl's engine workers: 0.8+) computes the
log-probs and entropy of two sequences whose response masks hold tool tokens (0 inside the
response) and runs one ``update_actor`` step (PPO loss with an entropy bonus, SGD lr 1: the update
is the clipped gradient), with the option on and off, on rl-kernels' fused path (``+rl_kernels=fused``,
the Triton kernel in its CPU interpreter) and on verl's logits path (``+rl_kernels=logits``: the
model's output layer makes the loss rows' logits only). The workers run two at a time on the
cluster of ``test_verl_e2e.py`` (shared fixtures: tests/integrations/conftest.py).

On every row the loss reads (response mask 1) the log-probs and entropy agree (1e-4 absolute,
both float32, as test_verl_e2e.py), and so do the parameter updates (1e-4 relative) and every
metric verl's update logs (1e-4 relative to its size, 1e-6 absolute); every other response row
is exactly 0 with the option on (the model's log-probs there are about -7 nats), and the worker
counts the rows it skipped. Without the option's code the exact-0 check fails.
"""
import math

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[verl]')")

from verl_ray import _compose, _engine_batches, assert_same_updates, run_configs  # noqa: E402
from verl_cpu import legacy_workers  # noqa: E402
from verl_helpers import rollout_tensors  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.skipif(legacy_workers(), reason="verl 0.7.x's legacy workers do not run the engine")]


def _tensors():
    """rollout_tensors() with tool tokens: response mask 0 at response tokens 1 (first sequence) and
    2, 3 (second), inside the responses (the first sequence's last two tokens are padding)."""
    tensors = rollout_tensors()[0]
    tensors["response_mask"][0, 1] = 0
    tensors["response_mask"][1, 2:4] = 0
    return tensors


@pytest.fixture(scope="module")
def runs(ray_cluster, model):  # the shared fixtures (tests/integrations/conftest.py)
    from omegaconf import open_dict

    configs = {}
    for path in ("fused", "logits"):
        for on in (True, False):
            config = _compose(model[1], path)
            with open_dict(config):
                config.actor_rollout_ref.model.fused_kernel_options.setdefault("rl_kernels", {})
                config.actor_rollout_ref.model.fused_kernel_options.rl_kernels.loss_rows_only = on
            configs[path, on] = config
    return run_configs(ray_cluster, configs, lambda: _engine_batches(_tensors()))


@pytest.mark.parametrize("path", ["fused", "logits"])
def test_loss_rows_only_through_verls_worker_equals_the_option_off_on_the_loss_rows(runs, path):
    on, off = runs[path, True], runs[path, False]
    tensors = _tensors()
    loss = tensors["response_mask"].bool()
    outside = tensors["attention_mask"][:, tensors["prompts"].shape[1]:].bool() & ~loss  # tool tokens
    assert int(outside.sum()) == 3
    skipped = on["counts"]["loss_rows_skipped_tokens"] - on["counts_init"]["loss_rows_skipped_tokens"]
    assert skipped > 0 and off["counts"]["loss_rows_skipped_tokens"] == off["counts_init"]["loss_rows_skipped_tokens"]
    assert bool((off["log_probs"][outside] < -1).all())  # what those rows hold without the option
    assert torch.equal(on["log_probs"][outside], torch.zeros(3)) and torch.equal(on["entropy"][outside], torch.zeros(3))
    torch.testing.assert_close(on["log_probs"][loss], off["log_probs"][loss], atol=1e-4, rtol=0)
    torch.testing.assert_close(on["entropy"][loss], off["entropy"][loss], atol=1e-4, rtol=0)
    assert_same_updates(off, on)
    assert on["metrics"].keys() == off["metrics"].keys() and len(on["metrics"]) >= 3, on["metrics"]
    for key, values in off["metrics"].items():
        for got, want in zip(on["metrics"][key], values, strict=True):
            if "time" in key or "perf" in key or "mfu" in key or "memory" in key or "throughput" in key:
                continue  # wall clock and memory, not values of the step
            assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6), (key, got, want)
