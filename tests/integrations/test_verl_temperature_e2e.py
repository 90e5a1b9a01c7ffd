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
import concurrent.futures

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[verl]')")

from verl_ray import (_compose, _counts, _engine_batches, _outputs, _params, assert_same_updates,  # noqa: E402
                      release)
from verl_cpu import legacy_workers, use_torch_padding, worker_class  # noqa: E402
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


def _run(ray, config):
    """One worker process (role actor): compute_log_prob, then update_actor, both with the
    per-sample temperature; its outputs, counts and parameters before / after the update."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls

    colocated = create_colocated_worker_cls({"actor": RayClassWithInitArgs(
        cls=ray.remote(worker_class()), config=config.actor_rollout_ref, role="actor")})
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=colocated, device_name="cpu")
    out = {}
    try:
        worker = group.workers[0]
        actor = group.spawn(prefix_set={"actor"})["actor"]
        actor.init_model()
        infer, update = (_per_sample(b) for b in _engine_batches())
        out["counts_init"] = ray.get(worker.__ray_call__.remote(_counts))[0]
        result = actor.compute_log_prob(infer)
        out["log_probs"], out["entropy"] = (_outputs(result, infer, key) for key in ("log_probs", "entropy"))
        out["counts_log_prob"] = ray.get(worker.__ray_call__.remote(_counts))[0]
        out["before"] = ray.get(worker.__ray_call__.remote(_params))
        actor.update_actor(update)
        out["after"] = ray.get(worker.__ray_call__.remote(_params))
    finally:
        release(group, pool)
    return out


@pytest.fixture(scope="module")
def runs(ray_cluster, model):  # the shared fixtures (tests/integrations/conftest.py)
    with pytest.MonkeyPatch.context() as monkeypatch:  # the driver pads / unpads the batches
        use_torch_padding(monkeypatch)
        configs = {option: _compose(model[1], option) for option in ("fused", None)}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {option: pool.submit(_run, ray_cluster, config) for option, config in configs.items()}
        return {option: future.result() for option, future in futures.items()}


def test_per_sample_temperature_through_verls_worker_matches_verls_logits_path(runs):
    fused, ref = runs["fused"], runs[None]
    assert ref["counts_init"] is None and fused["counts_init"] is not None  # rl-kernels imported in one only
    counts = {k: fused["counts_log_prob"][k] - fused["counts_init"][k] for k in fused["counts_init"]}
    assert counts["fused_fsdp_calls"] == 1 and counts["logits_log_probs_calls"] == 0, counts
    mask = rollout_tensors()[0]["response_mask"].bool()
    torch.testing.assert_close(fused["log_probs"][mask], ref["log_probs"][mask], atol=1e-4, rtol=0)
    torch.testing.assert_close(fused["entropy"][mask], ref["entropy"][mask], atol=1e-4, rtol=0)
    assert_same_updates(ref, fused)
