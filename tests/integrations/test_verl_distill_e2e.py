"""End to end (verl 0.9.1 engine workers, Ray, CPU): one ``update_actor`` step with top-K
distillation (``forward_kl_topk``, with the task reward's PPO loss: ``distillation_only`` False)
through verl's own ``ActorRolloutRefWorker`` and FSDP engine, on the fused path served by
rl-kernels (``+rl_kernels=fused``: the fused forward fills ``fused_linear_aux``) against verl's
unpatched logits path (no ``external_lib``). Two worker processes side by side, the same model,
batch and teacher tensors (random top-8 per token, nested as verl's batches hold them, one slot per
third token below ``log_prob_min_clamp`` = -10). Checked: the update (SGD, lr 1: the clipped
gradient) equal to 1e-4 relative per parameter (every parameter moves), and the fused worker's
counts (one fused distillation call; the unpatched worker never imported rl-kernels). Checked to
fail when the fused path's student log-probs ignore the temperature (embedding update 0.54 off).
The Ray cluster, the saved model and verl's config composition are those of
``tests/integrations/test_verl_e2e.py`` (tests/integrations/conftest.py, tests/integrations/verl_ray.py).

``forward_kl_topk_tail`` (issue 45; verl has no such mode: rl-kernels registers it), the same
update step through verl's FSDP engine: on the fused path and on the logits path (both rl-kernels'),
whose updates agree to 1e-4 relative per parameter (the per-token losses are checked against
float64 in ``tests/integrations/test_verl_distill.py``) and differ from forward_kl_topk's; and with the patch
removed (``external_lib=rl_kernels.integrations.verl_plugin``: the mode registered, verl's own
top-K computation running) the update raises rl-kernels' VerlIntegrationError instead of training
on forward_kl_topk's clamped terms.
"""
import concurrent.futures

import pytest
import torch

from verl_helpers import VOCAB, rollout_tensors

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[verl]')")

from verl_ray import LEGACY, T, _compose, _counts, _delta, release  # noqa: E402
from verl_cpu import use_torch_padding, worker_class  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.skipif(LEGACY, reason="verl 0.7.x has no distillation")]

K, CLAMP = 8, -10.0


def _distillation(config, loss_mode="forward_kl_topk", clamp=CLAMP):
    """Top-K distillation on in the composed config: one teacher (the student's own path, never
    started here), ``loss_mode`` with the task reward's loss."""
    from omegaconf import OmegaConf, open_dict

    with open_dict(config):
        for key, value in {"distillation.enabled": True, "distillation.n_gpus_per_node": 1,
                           "distillation.nnodes": 1,
                           "distillation.teacher_models.teacher_model.model_path":
                               config.actor_rollout_ref.model.path,
                           **{f"distillation.teacher_models.teacher_model.inference.{size}": 1 for size in (
                               "tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size")},
                           "distillation.teacher_models.teacher_model.inference.name": "vllm",
                           "distillation.distillation_loss.loss_mode": loss_mode,
                           "distillation.distillation_loss.topk": K,
                           "distillation.distillation_loss.log_prob_min_clamp": clamp,
                           "distillation.distillation_loss.use_task_rewards": True,
                           "distillation.distillation_loss.use_policy_gradient": False}.items():
            OmegaConf.update(config, key, value, force_add=True)
    return config


def _update_batch():
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch = TensorDict(rollout_tensors()[0], batch_size=[2])
    mask = batch["response_mask"]
    g = torch.Generator().manual_seed(7)
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    batch["old_log_probs"] = torch.zeros(mask.shape)
    update = left_right_2_no_padding(batch)
    offsets = update["input_ids"].offsets()
    total = int(offsets[-1])
    t_lp, t_ids = torch.log_softmax(3 * torch.randn(total, VOCAB, generator=g), -1).topk(K, dim=-1)
    t_lp[::3, 2] = -12.0
    lengths = offsets.diff().tolist()
    update["teacher_logprobs"] = torch.nested.as_nested_tensor(list(t_lp.split(lengths)), layout=torch.jagged)
    update["teacher_ids"] = torch.nested.as_nested_tensor(list(t_ids.split(lengths)), layout=torch.jagged)
    tu.assign_non_tensor(update, calculate_entropy=False, distillation_use_topk=True, distillation_only=False,
                         global_batch_size=2, mini_batch_size=2, epochs=1, seed=1,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True, temperature=T)
    return update


def _params(self):
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in self.actor.engine.module.named_parameters()}


def _run_worker(ray, config):
    """init_model, update_actor: the parameters before and after, the counts; the update's error
    (a Ray error) under "error" where it raises."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    cls = ray.remote(worker_class())
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    init = RayClassWithInitArgs(cls=cls, config=config.actor_rollout_ref, role="actor",
                                distillation_config=config.distillation)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=init, device_name="cpu")
    out = {}
    try:
        worker = group.workers[0]
        group.init_model()
        out["before"] = ray.get(worker.__ray_call__.remote(_params))
        try:
            group.update_actor(_update_batch())
        except Exception as exc:  # noqa: BLE001 - read by the test
            out["error"] = exc
            return out
        out["after"] = ray.get(worker.__ray_call__.remote(_params))
        out["counts"], _ = ray.get(worker.__ray_call__.remote(_counts))
    finally:
        release(group, pool)
    return out


@pytest.fixture(scope="module")
def runs(ray_cluster, model):  # the fixtures of tests/integrations/conftest.py
    """forward_kl_topk unpatched / fused, forward_kl_topk_tail fused / logits / with the patch removed
    (the plugin only), side by side (the cluster runs three at a time)."""
    from omegaconf import OmegaConf

    tail = "forward_kl_topk_tail"
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_torch_padding(monkeypatch)
        configs = {option: _distillation(_compose(model[1], option)) for option in (None, "fused")}
        configs.update({(tail, option): _distillation(_compose(model[1], option), tail, None)
                        for option in ("fused", "logits")})
        plugin_only = _distillation(_compose(model[1], None), tail, None)
        OmegaConf.update(plugin_only, "actor_rollout_ref.model.external_lib", "rl_kernels.integrations.verl_plugin")
        configs[(tail, "plugin only")] = plugin_only
        with concurrent.futures.ThreadPoolExecutor(len(configs)) as pool:
            futures = {option: pool.submit(_run_worker, ray_cluster, config) for option, config in configs.items()}
        return {option: future.result() for option, future in futures.items()}


def test_distillation_update_on_the_fused_path_matches_verls_logits_path(runs):
    ref, got = runs[None], runs["fused"]
    assert ref["counts"] is None  # verl unpatched never imported rl-kernels
    assert got["counts"]["distillation_calls"] == 1 and got["counts"]["fused_fsdp_calls"] >= 1, got["counts"]
    for name, before in ref["before"].items():
        torch.testing.assert_close(got["before"][name], before, atol=0, rtol=0)
    delta_ref, delta_got = _delta(ref["after"], ref["before"]), _delta(got["after"], got["before"])
    moved = 0
    for name, d in delta_ref.items():
        err = (delta_got[name] - d).norm() / d.norm().clamp_min(1e-30)
        assert err < 1e-4, f"{name}: relative update difference {err:.2e}"
        moved += bool(d.norm() > 0)
    assert moved == len(delta_ref), "every parameter moves"


def test_tail_mode_update_on_the_fused_and_logits_paths_and_refused_without_the_patch(runs):
    tail = "forward_kl_topk_tail"
    fused, logits, plain = runs[(tail, "fused")], runs[(tail, "logits")], runs[(tail, "plugin only")]
    for out in (fused, logits):
        assert "error" not in out, out.get("error")
    assert fused["counts"]["distillation_calls"] == 1 and fused["counts"]["fused_fsdp_calls"] >= 1, fused["counts"]
    assert logits["counts"]["distillation_calls"] == 1 and logits["counts"]["fused_fsdp_calls"] == 0, logits["counts"]
    delta_fused, delta_logits = _delta(fused["after"], fused["before"]), _delta(logits["after"], logits["before"])
    delta_topk = _delta(runs["fused"]["after"], runs["fused"]["before"])
    moved, apart = 0, 0.0
    for name, d in delta_logits.items():
        torch.testing.assert_close(fused["before"][name], logits["before"][name], atol=0, rtol=0)
        err = (delta_fused[name] - d).norm() / d.norm().clamp_min(1e-30)
        assert err < 1e-4, f"{name}: relative update difference {err:.2e}"
        moved += bool(d.norm() > 0)
        apart = max(apart, float((d - delta_topk[name]).norm() / d.norm().clamp_min(1e-30)))
    assert moved == len(delta_logits), "every parameter moves"
    assert apart > 1e-2, "the tail-aware update is forward_kl_topk's"
    # the patch removed (the mode registered by the plugin, verl's own top-K computation): refused, never trained
    assert "after" not in plain and "error" in plain, "the update ran on verl's own top-K terms"
    message = str(plain["error"])
    assert "VerlIntegrationError" in message and "went through verl's own top-K computation" in message, message
