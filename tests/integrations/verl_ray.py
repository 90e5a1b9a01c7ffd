"""What the end-to-end tests through verl's own Ray worker share (test_verl_e2e.py, test_parity.py,
test_verl_distill_e2e.py, test_verl_loss_rows_e2e.py, test_verl_temperature_e2e.py; their fixtures
``ray_cluster`` and ``model`` are in tests/integrations/conftest.py): the paths the workers import from, verl's
composed config, the engine's batches and outputs, the probes run inside a worker (``_counts``,
``_params``: the worker imports them from here), one actor's run (``run_actor``, ``run_configs``), the
release of a run's workers, and the check of one update step."""
import os

import torch

from verl_cpu import legacy_workers, use_torch_padding, worker_class
from verl_helpers import rollout_tensors

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(os.path.dirname(HERE), "support")
REPO = os.path.dirname(os.path.dirname(HERE))
T = 0.7
LEGACY = legacy_workers()


def _compose(model_dir, option, anomaly_dir=None):
    """verl's ppo_trainer config with ``+rl_kernels=<option>`` (the group's ``fused`` / ``logits``;
    None: verl unpatched) and the test's overrides (``anomaly_dir``: the capture on, every call
    re-checked)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    engine = []
    for role in ("actor", "ref"):
        engine += [f"actor_rollout_ref.{role}.fsdp_config.strategy=fsdp2",
                   f"actor_rollout_ref.{role}.fsdp_config.model_dtype=fp32",
                   f"actor_rollout_ref.{role}.fsdp_config.dtype=float32",  # verl 0.7.x's autocast
                   f"+actor_rollout_ref.{role}.fsdp_config.mixed_precision="
                   "{param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}",
                   f"actor_rollout_ref.{role}.fsdp_config.use_torch_compile=False",
                   # verl 0.7.x indexes model._no_split_modules, a set in transformers 5
                   f"+actor_rollout_ref.{role}.fsdp_config.wrap_policy.transformer_layer_cls_to_wrap=[Qwen2DecoderLayer]"]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=[
            "hydra.searchpath=[pkg://rl_kernels.integrations.conf]",  # the group as installed users find it
            *([f"+rl_kernels={option}"] if option else []),
            # fused: the log-probs by the Triton kernel (its CPU interpreter here), not the torch fallback
            *(["actor_rollout_ref.model.fused_kernel_options.rl_kernels.backend=triton"] if option == "fused" else []),
            *([f"++actor_rollout_ref.model.fused_kernel_options.rl_kernels.anomaly_dir={anomaly_dir}",
               "++actor_rollout_ref.model.fused_kernel_options.rl_kernels.anomaly_recheck_every=1"]
              if anomaly_dir else []),
            f"actor_rollout_ref.model.path={model_dir}",
            "++actor_rollout_ref.model.load_tokenizer=False",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.model.use_remove_padding=True",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.rollout.temperature=0.7",  # verl 0.7.x's legacy worker reads T here
            "actor_rollout_ref.actor.entropy_coeff=0.01",
            # verl's unpatched entropy is torch.compile'd by default (the reference follows the actor):
            # inductor's CPU compile would take longer than the rest of a run
            "actor_rollout_ref.actor.use_torch_compile=False",
            *engine,
            "actor_rollout_ref.ref.fsdp_config.forward_only=False",
            "+actor_rollout_ref.ref.optim=${actor_rollout_ref.actor.optim}",
            # SGD: the parameter update is the (clipped) gradient; AdamW's first step, lr * g / (|g| + eps),
            # would magnify float32 noise in near-zero gradient entries
            "actor_rollout_ref.actor.optim.optimizer=SGD",
            "actor_rollout_ref.actor.optim.weight_decay=0.0",
            "actor_rollout_ref.actor.optim.lr=1.0",
        ])


# ----------------------------------------------------------------------------- batches per API
def _advantages(mask):
    return torch.randn(mask.shape, generator=torch.Generator().manual_seed(3)) * mask


def _engine_batches(tensors=None):
    """verl 0.8+: TensorDicts without padding, for compute_(ref_)log_prob and update_actor, from
    ``tensors`` (default: :func:`rollout_tensors`' first)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = TensorDict(rollout_tensors()[0] if tensors is None else tensors, batch_size=[2])
    infer = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(infer, calculate_entropy=True, compute_loss=False, temperature=T)
    mask = batch["response_mask"]
    batch["advantages"] = _advantages(mask)
    batch["old_log_probs"] = torch.zeros(mask.shape)  # on-policy: verl uses the detached log-probs
    update = left_right_2_no_padding(batch)
    tu.assign_non_tensor(update, calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=2, mini_batch_size=2, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=T)
    return infer, update


def _outputs(out, infer, key):
    """(B, 6) response log-probs / entropy from a worker's output (None where verl returns none)."""
    if LEGACY:
        return out.batch[key] if key in out.batch.keys() else None
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    value = tu.get(out, key)
    return None if value is None else no_padding_2_padding(value, infer)


def _metrics(result) -> dict:
    """The float metrics of an update_actor result (verl's TensorDict / DataProto)."""
    from verl.utils import tensordict_utils as tu

    metrics = tu.get(result, "metrics") if not hasattr(result, "meta_info") else result.meta_info.get("metrics")
    out = {}
    for key, value in (metrics or {}).items():
        values = value if isinstance(value, list) else [value]
        if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = [float(v) for v in values]
    return out


def run_actor(ray, config, batches) -> dict:
    """One worker process (role actor) on the CPU: ``compute_log_prob`` on the first of ``batches()``'s
    (infer, update), then ``update_actor`` on the second -> the response log-probs and entropy, the
    worker's rl-kernels counts (``counts_init``, ``counts_log_prob`` after compute_log_prob,
    ``counts`` at the end; None where verl never imported rl-kernels), the parameters ``before`` /
    ``after`` the update, and the update's float ``metrics``."""
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
        infer, update = batches()
        out["counts_init"] = ray.get(worker.__ray_call__.remote(_counts))[0]
        result = actor.compute_log_prob(infer)
        out["log_probs"], out["entropy"] = (_outputs(result, infer, key) for key in ("log_probs", "entropy"))
        out["counts_log_prob"] = ray.get(worker.__ray_call__.remote(_counts))[0]
        out["before"] = ray.get(worker.__ray_call__.remote(_params))
        out["metrics"] = _metrics(actor.update_actor(update))
        out["after"] = ray.get(worker.__ray_call__.remote(_params))
        out["counts"] = ray.get(worker.__ray_call__.remote(_counts))[0]
    finally:
        release(group, pool)
    return out


def run_configs(ray, configs: dict, batches) -> dict:
    """{key: :func:`run_actor` of each config}, two at a time, the driver padding and unpadding the
    batches with torch's helpers."""
    import concurrent.futures

    import pytest

    with pytest.MonkeyPatch.context() as monkeypatch:
        use_torch_padding(monkeypatch)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futures = {key: pool.submit(run_actor, ray, config, batches) for key, config in configs.items()}
        return {key: future.result() for key, future in futures.items()}


# ----------------------------------------------------------------------------- in the worker
def _counts(self):
    """The worker's rl-kernels counts and backend; None where verl never imported rl-kernels (the
    unpatched worker: importing it here would patch verl)."""
    import sys

    rkv = sys.modules.get("rl_kernels.integrations.verl")
    return (rkv.call_counts(), rkv.options().backend) if rkv is not None else (None, None)


def _params(self):
    from torch.distributed.tensor import DTensor

    actor = self.worker_dict["actor"]
    module = actor.actor_module_fsdp if hasattr(actor, "actor_module_fsdp") else actor.actor.engine.module
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in module.named_parameters()}


def release(group, pool) -> None:
    """Kill a run's Ray workers and free its placement groups (the cluster's CPUs are few)."""
    import ray
    from ray.util.placement_group import remove_placement_group

    for w in group.workers:
        ray.kill(w)
    for pg in pool.pgs or []:
        remove_placement_group(pg)


def assert_same_updates(ref: dict, out: dict, context: str = "") -> None:
    """One update step's parameters: the same starting values, and every parameter's update equal to
    the reference's within 1e-4 relative (an update the reference does not make stays 0); at least
    10 parameters move."""
    moved = 0
    assert ref["before"].keys() == out["before"].keys()
    for name in ref["before"]:
        torch.testing.assert_close(out["before"][name], ref["before"][name], atol=0, rtol=0)
        want = ref["after"][name] - ref["before"][name]
        update = out["after"][name] - out["before"][name]
        if want.norm() == 0:
            assert update.norm() == 0, name
            continue
        moved += 1
        err = (update - want).norm() / want.norm()
        assert err < 1e-4, f"{name}: relative parameter-update error {err:.2e}{context}"
    assert moved >= 10


def _delta(after, before):
    return {k: after[k] - before[k] for k in after}
