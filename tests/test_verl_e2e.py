"""End to end: verl's own Ray worker (ActorRolloutRefWorker, role 'ref', FSDP2 engine) reads
``external_lib`` from a config composed with our Hydra group, and computes log-probs with rl-kernels.

Proof that rl-kernels computed them *in the worker*: the worker process's own
``rl_kernels.integrations.verl.call_counts()`` (read through Ray's ``__ray_call__``) counts the
calls and tokens, and the values match verl's unpatched logits path computed here, in the driver.

CPU scaffolding (none of it touches rl-kernels): verl 0.9.1 has no CPU platform, so the workers
load ``tests/support/verl_cpu_platform.py`` through verl's ``VERL_USE_EXTERNAL_MODULES`` hook;
the gloo process group is created before ``init_model`` (verl would ask for 'cpu:gloo,cpu:gloo');
FSDP2 with fp32 parameters and forward_only=False (verl's ref offload policy pins memory, which
needs an accelerator). The tiny model is saved with ``save_pretrained`` under the test's tmp path.
"""
import contextlib
import os

import pytest
import torch

from verl_helpers import rollout_tensors, tiny_qwen2

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
T = 0.7


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    import ray

    tmp = tmp_path_factory.mktemp("ray")
    pythonpath = os.pathsep.join([REPO, HERE, os.path.join(HERE, "support"),
                                  os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(tmp), log_to_driver=False,
             runtime_env={"env_vars": {
                 "VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform",
                 "VERL_ENGINE_DEVICE": "cuda", "VERL_ENGINE_VENDOR": "nvidia",
                 "PYTHONPATH": pythonpath, "TRITON_INTERPRET": "1"}})
    yield ray
    ray.shutdown()


def _compose(model_dir, option, extra=()):
    """option: a file of the conf/ group (``fused``, ``logits``), or None for verl unpatched."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=[
            f"hydra.searchpath=[file://{REPO}/conf]",
            *([f"+rl_kernels={option}"] if option else []),
            f"actor_rollout_ref.model.path={model_dir}",
            "+actor_rollout_ref.model.load_tokenizer=False",
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
            "actor_rollout_ref.model.use_remove_padding=False",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.ref.fsdp_config.strategy=fsdp2",
            "actor_rollout_ref.ref.fsdp_config.model_dtype=fp32",
            "+actor_rollout_ref.ref.fsdp_config.mixed_precision={param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}",
            "actor_rollout_ref.ref.fsdp_config.forward_only=False",
            "actor_rollout_ref.ref.fsdp_config.use_torch_compile=False",
            "+actor_rollout_ref.ref.optim=${actor_rollout_ref.actor.optim}",
            *extra])


def _batch():
    """The two rollout sequences of ``verl_helpers.rollout_tensors`` as a TensorDict."""
    from tensordict import TensorDict

    return TensorDict(rollout_tensors()[0], batch_size=[2])


def _driver_reference(model, batch):
    """verl's unpatched logits path on each unpadded sequence: (B, 6) response log-probs, entropy."""
    from verl_helpers import verl_logits_path

    lps = torch.zeros(2, 6)
    ents = torch.zeros(2, 6)
    for b in range(2):
        mask = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][mask][None]
        n_prompt = int(mask[:5].sum())
        n_resp = int(mask[5:].sum())
        lp, ent = verl_logits_path(model, type(model).forward, T, torch.roll(ids, -1, -1), input_ids=ids)
        lps[b, :n_resp] = lp[0, n_prompt - 1:n_prompt - 1 + n_resp]
        ents[b, :n_resp] = ent[0, n_prompt - 1:n_prompt - 1 + n_resp]
    return lps, ents


def _counts(self):
    import rl_kernels.integrations.verl as rkv
    return rkv.call_counts(), rkv.options().backend


def _init_gloo(self):
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo")


@contextlib.contextmanager
def _worker_group(ray, config, role):
    """One Ray ActorRolloutRefWorker of ``role`` on a 1-CPU pool, with its gloo group and
    ``init_model`` done (HFModelConfig.__post_init__ imports external_lib in the worker there);
    the worker is killed and the pool's placement group freed on exit (the cluster has 2 CPUs,
    each run reserves one)."""
    from ray.util.placement_group import remove_placement_group
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.engine_workers import ActorRolloutRefWorker

    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    worker = RayClassWithInitArgs(cls=ray.remote(ActorRolloutRefWorker), config=config.actor_rollout_ref,
                                  role=role)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=worker, device_name="cpu")
    try:
        ray.get([w.__ray_call__.remote(_init_gloo) for w in group.workers])
        group.init_model()
        yield group
    finally:
        for w in group.workers:
            ray.kill(w)
        for pg in pool.pgs or []:
            remove_placement_group(pg)


@pytest.mark.parametrize("option", ["fused", "logits"])
def test_verl_ref_worker_on_ray_uses_rl_kernels(ray_cluster, tmp_path, option):
    ray = ray_cluster
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    model = tiny_qwen2()
    model.save_pretrained(tmp_path / "model")
    config = _compose(tmp_path / "model", option,
                      ["actor_rollout_ref.model.fused_kernel_options.rl_kernels.backend=triton"]
                      if option == "fused" else [])
    assert config.actor_rollout_ref.model.external_lib == "rl_kernels.integrations.verl"

    with _worker_group(ray, config, "ref") as group:
        batch = _batch()
        data = left_right_2_no_padding(batch.clone())
        tu.assign_non_tensor(data, calculate_entropy=True, compute_loss=False, temperature=T)
        out = group.compute_ref_log_prob(data)
        counts, backend = ray.get(group.workers[0].__ray_call__.remote(_counts))

    log_probs = no_padding_2_padding(tu.get(out, "log_probs"), data)
    entropy = no_padding_2_padding(tu.get(out, "entropy"), data)
    ref_lp, ref_ent = _driver_reference(model, batch)
    mask = batch["response_mask"].bool()
    assert int(mask.sum()) == 10
    torch.testing.assert_close(log_probs[mask], ref_lp[mask], atol=1e-4, rtol=0)
    torch.testing.assert_close(entropy[mask], ref_ent[mask], atol=1e-4, rtol=0)
    if option == "fused":  # all 18 tokens of the two sequences, by the kernel the config asked for
        assert backend == "triton"
        assert counts["fused_calls"] >= 1 and counts["fused_tokens"] == 18, counts
        assert counts["logits_log_probs_calls"] == 0
    else:
        assert counts["fused_calls"] == 0
        assert counts["logits_log_probs_calls"] >= 1 and counts["logits_entropy_calls"] >= 1, counts


# ----------------------------------------------------------------------------- actor update
ACTOR_OVERRIDES = [
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.entropy_coeff=0.01",
    "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
    "+actor_rollout_ref.actor.fsdp_config.mixed_precision={param_dtype: fp32, reduce_dtype: fp32, buffer_dtype: fp32}",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile=False",
    # SGD: the parameter update is the (clipped) gradient; AdamW's first step, lr * g / (|g| + eps),
    # would magnify float32 noise in near-zero gradient entries
    "actor_rollout_ref.actor.optim.optimizer=SGD",
    "actor_rollout_ref.actor.optim.weight_decay=0.0",
    "actor_rollout_ref.actor.optim.lr=1.0",
]


def _params(self):
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in self.actor.engine.module.named_parameters()}


def _update_actor(ray, tmp_path, model, option):
    """One verl update_actor step through a Ray actor worker (role 'actor'); returns the
    parameters before and after, and the worker's rl-kernels counts."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    model_dir = tmp_path / "model"
    if not model_dir.exists():
        model.save_pretrained(model_dir)
    extra = ["actor_rollout_ref.model.fused_kernel_options.rl_kernels.backend=torch"] if option == "fused" else []
    config = _compose(model_dir, option, ACTOR_OVERRIDES + extra)
    with _worker_group(ray, config, "actor") as group:
        before = ray.get(group.workers[0].__ray_call__.remote(_params))
        batch = _batch()
        g = torch.Generator().manual_seed(3)
        mask = batch["response_mask"]
        batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
        batch["old_log_probs"] = torch.zeros(mask.shape)  # on-policy: verl uses the detached log-probs
        data = left_right_2_no_padding(batch)
        tu.assign_non_tensor(data, calculate_entropy=True, distillation_use_topk=False, distillation_only=False,
                             global_batch_size=2, mini_batch_size=2, epochs=1, seed=1,
                             dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=T)
        group.update_actor(data)
        after = ray.get(group.workers[0].__ray_call__.remote(_params))
        counts, _ = ray.get(group.workers[0].__ray_call__.remote(_counts))
    return before, after, counts


@pytest.mark.parametrize("option", ["fused", "logits"])
def test_verl_update_actor_on_ray_matches_unpatched(ray_cluster, tmp_path, option):
    """verl's actor worker runs one update_actor step (PPO loss with entropy bonus, SGD) with
    rl-kernels and without (no external_lib): the parameter updates match to 1e-4 relative."""
    model = tiny_qwen2()
    ref_before, ref_after, ref_counts = _update_actor(ray_cluster, tmp_path, model, None)
    before, after, counts = _update_actor(ray_cluster, tmp_path, model, option)
    assert ref_counts is not None and sum(ref_counts.values()) == 0  # unpatched worker: nothing served
    if option == "fused":
        assert counts["fused_fsdp_calls"] >= 1 and counts["logits_log_probs_calls"] == 0, counts
    else:
        assert counts["fused_calls"] == 0 and counts["logits_log_probs_calls"] >= 1, counts
    moved = 0
    for name in ref_before:
        torch.testing.assert_close(before[name], ref_before[name], atol=0, rtol=0)
        ref = ref_after[name] - ref_before[name]
        update = after[name] - before[name]
        if ref.norm() == 0:
            assert update.norm() == 0, name
            continue
        moved += 1
        err = (update - ref).norm() / ref.norm()
        assert err < 1e-4, f"{name}: relative parameter-update error {err:.2e} ({option})"
    assert moved >= 10
