"""Training parity through verl's own actor update (issue 27; made independent of the CPU's rounding in
issue 52): 20 PPO updates of a tiny Qwen2 on CPU, verl unpatched against rl-kernels' fused path and its
logits path, each in verl's own Ray worker (``ActorRolloutRefWorker``, role ``actor``: the engine worker
on verl 0.8+, the legacy FSDP worker with DataProto batches on 0.7.x; ``compute_log_prob`` then
``update_actor`` each step, so the whole of verl's update runs: its PPO loss with clipping and an
entropy bonus, two mini-batches per step (the second one off-policy, so the clip acts: in most steps
here), two micro-batches per mini-batch (gradient accumulation), gradient clipping and AdamW).

**In lock step.** Free-running float32 trajectories cannot be compared tightly: 20 AdamW steps at a
high learning rate amplify a difference in the last bit of one log-prob step by step (a token that
crosses the clip boundary in one run and not in the other changes the next update discretely), by
an amount that depends on the machine's BLAS kernels (a bound read off one CPU fails on another:
MKL's SSE4.2 and AVX-512 kernels round differently from its AVX2 ones). So before each step every
patched worker is given verl's parameters and optimizer state, bit for bit, and the step's results
are compared with verl's from that same start: the difference of one step is float32 rounding, with
nothing to amplify it, on every step of a real 20-step PPO trajectory (verl's own).

Compared per step, from the same state: the old log-probs (``compute_log_prob``), verl's own metrics
of the update (loss, pg_loss, pg_clipfrac, entropy, grad_norm, ppo_kl, per mini-batch) and the
parameters after it. Bounds, from float32 (tests/support/tolerances.py): both paths run the same body
on the same state, so a log-prob differs only by the head's rounding, a logit's dot product and the
row's sum, H + V roundings: gamma_(H+V) * max |log p| (6.6e-5 relative here; measured: 2e-3 of that
bound, on MKL's SSE4.2 kernels too); a metric is a mean over tokens of functions of log-probs with
derivatives of order 1 in the log-probs, so it differs by no more than the log-probs do, relative to
the size of the terms it averages, not to the mean's own size: pg_loss's terms (advantage times ratio,
of either sign) cancel to 1e-3 of their mean size |A| and ppo_kl's (old minus new log-prob) to less
than that of |log p|, so their bounds are relative to mean |A| and to mean |old log p| (a bound
relative to the mean itself failed on CI's CPU at a step where pg_loss was 5e-4); the other metrics
do not cancel (entropy, grad_norm). 1e-4 of that scale (measured under MKL's SSE4.2 kernels, verl
0.7.1 to 0.9.1: up to 0.07 of it, and 0.33 for verl 0.7.1's entropy, whose second mini-batch runs on
parameters one update apart), and a wrong
temperature, a shifted or missing log-prob, a wrong entropy or a lost gradient is off by 1e-2 of it
and more. ``pg_clipfrac`` counts tokens:
it may differ by one token's share if a ratio lands within float32 of the clip boundary. The
parameters after one update from the same state: AdamW divides each element's step by the root of
its own gradient history, so an element whose gradient is float32 noise (a bias the softmax is
invariant to, an embedding row whose gradient cancels) moves by up to the learning rate whatever
the noise's size; measured on this test's trajectory: 2e-6 to 1e-3 of the step's length, the most
in embedding rows, alike for both of rl-kernels' paths. 1e-2 of the step's length is the bound; an
update with a wrong temperature, a lost term or a wrong sign is off by 1e-1 and more.

Also: two patched workers given the same states give bitwise identical metrics and parameters.
Run with ``pytest -k parity``.
"""
import concurrent.futures
import os

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[verl]')")

from verl_ray import HERE, REPO, SUPPORT, _compose  # noqa: E402 - (the model fixture: tests/integrations/conftest.py)
from verl_cpu import legacy_workers, use_torch_padding, worker_class, worker_env  # noqa: E402
from tolerances import f32_bound  # noqa: E402
from verl_helpers import VOCAB  # noqa: E402

pytestmark = [pytest.mark.verl_matrix, pytest.mark.filterwarnings("ignore::UserWarning")]

STEPS = 20
BATCH, PROMPT, RESPONSE = 8, 5, 6
T = 0.7
LEGACY = legacy_workers()
# verl's own metric names: the engine workers (0.8+) and the legacy workers (0.7.x, no total loss)
METRICS = (("actor/pg_loss", "actor/pg_clipfrac", "actor/entropy", "actor/grad_norm", "actor/ppo_kl") if LEGACY else
           ("loss", "actor/pg_loss", "actor/pg_clipfrac", "actor/entropy_loss", "grad_norm", "actor/ppo_kl"))
METRIC_RTOL = 1e-4  # relative to the size of the terms the metric averages (module docstring, _metric_scale)
CLIPFRAC_ATOL = 1 / (BATCH * RESPONSE)  # one token's share of the clip fraction
STEP_RTOL = 1e-2  # ||theta_run - theta_verl|| after one step, relative to the step's length
RUNS = {"verl": None, "fused": "fused", "logits": "logits", "fused again": "fused", "logits again": "logits"}


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A local Ray with one logical CPU per worker: the five workers run in lock step."""
    import ray

    tmp = tmp_path_factory.mktemp("ray")
    pythonpath = os.pathsep.join([REPO, HERE, SUPPORT, os.environ.get("PYTHONPATH", "")])
    ray.init(num_cpus=len(RUNS), include_dashboard=False, _temp_dir=str(tmp), log_to_driver=False,
             runtime_env={"env_vars": {**worker_env(), "PYTHONPATH": pythonpath, "TRITON_INTERPRET": "1"}})
    yield ray
    ray.shutdown()


def _config(model_dir, option):
    config = _compose(model_dir, option)
    actor = config.actor_rollout_ref.actor
    actor.ppo_mini_batch_size = BATCH // 2  # two mini-batches per step: the second is off-policy
    actor.ppo_micro_batch_size_per_gpu = BATCH // 4  # two micro-batches per mini-batch
    config.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu = BATCH // 4
    actor.optim.optimizer = "AdamW"
    actor.optim.lr = 3e-3
    actor.optim.weight_decay = 0.01
    actor.grad_clip = 1.0
    if "fused_kernel_options" in config.actor_rollout_ref.model and option == "fused":
        config.actor_rollout_ref.model.fused_kernel_options.rl_kernels.backend = "auto"  # torch on CPU
    return config


def _batch(step):
    """Step ``step``'s rollout: BATCH sequences of PROMPT + RESPONSE tokens, some left- or
    right-padded, and seeded advantages; the same in every run."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, PROMPT + RESPONSE), generator=g)
    mask = torch.ones_like(ids)
    for b in range(BATCH):
        left, right = int(torch.randint(0, 3, (), generator=g)), int(torch.randint(0, 3, (), generator=g))
        mask[b, :left] = 0
        mask[b, PROMPT + RESPONSE - right:] = 0
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    response_mask = mask[:, PROMPT:].clone()
    advantages = torch.randn(response_mask.shape, generator=g) * response_mask
    return {"prompts": ids[:, :PROMPT], "responses": ids[:, PROMPT:], "input_ids": ids, "attention_mask": mask,
            "position_ids": position_ids, "response_mask": response_mask}, advantages


def _port_race(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it chains) is a worker's ``init_process_group`` losing its
    port: verl picks the rendezvous port by binding port 0 and releasing it, and the worker binds it
    later, so another process (the workers start at once here, and Ray's own sockets) can take it in
    between. Not a fault of the code under test."""
    while exc is not None:
        if "EADDRINUSE" in str(exc) or "ddress already in use" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _start(ray, config, attempts: int = 2):
    """(worker group, its resource pool) of one actor worker, started again (once) when it lost the
    rendezvous port race (:func:`_port_race`); any other failure, or a second one, is raised."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup

    for attempt in range(attempts):
        pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
        group = None
        try:
            group = RayWorkerGroup(resource_pool=pool, device_name="cpu",
                                   ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(worker_class()),
                                                                          config=config.actor_rollout_ref,
                                                                          role="actor"))
            group.init_model()
            return group, pool
        except Exception as exc:
            _stop(ray, group, pool)
            if attempt + 1 == attempts or not _port_race(exc):
                raise
            print(f"\nparity: a worker lost its rendezvous port ({type(exc).__name__}); starting it again")


def _stop(ray, group, pool):
    from ray.util.placement_group import remove_placement_group

    for w in group.workers if group is not None else []:
        ray.kill(w)
    for pg in getattr(pool, "pgs", None) or []:
        remove_placement_group(pg)


def _step(group, step):
    """One PPO step of ``group`` on step ``step``'s rollout: compute_log_prob, then update_actor with
    those old log-probs. Returns (old log-probs (BATCH, RESPONSE) float32, {metric: values})."""
    tensors, advantages = _batch(step)
    if LEGACY:
        return _legacy_step(group, tensors, advantages)
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

    batch = TensorDict(tensors, batch_size=[BATCH])
    infer = left_right_2_no_padding(batch.clone())
    tu.assign_non_tensor(infer, calculate_entropy=False, compute_loss=False, temperature=T)
    old = no_padding_2_padding(tu.get(group.compute_log_prob(infer), "log_probs"), infer).float()
    batch["advantages"] = advantages
    batch["old_log_probs"] = old
    update = left_right_2_no_padding(batch)
    tu.assign_non_tensor(update, calculate_entropy=True, distillation_use_topk=False,
                         distillation_only=False, global_batch_size=BATCH, mini_batch_size=BATCH // 2,
                         epochs=1, seed=1, dataloader_kwargs={"shuffle": False}, compute_loss=True,
                         temperature=T)
    metrics = tu.get(group.update_actor(update), "metrics")
    return old * tensors["response_mask"], {k: [float(x) for x in metrics[k]] for k in METRICS}


def _legacy_step(group, tensors, advantages):
    """verl 0.7.x's legacy worker: padded DataProtos (it removes the padding itself and reads the
    log-prob temperature from ``rollout.temperature``, the update's from the batch's meta_info)."""
    from verl import DataProto

    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    old = group.compute_log_prob(DataProto.from_dict(tensors={k: tensors[k] for k in keys})).batch["old_log_probs"]
    update = DataProto.from_dict(
        tensors={**{k: tensors[k] for k in keys}, "advantages": advantages, "old_log_probs": old.float()},
        meta_info={"temperature": T, "global_token_num": tensors["attention_mask"].sum(-1).tolist()})
    metrics = group.update_actor(update).meta_info["metrics"]

    def flat(value):  # a value per mini-batch (or micro-batch), nested in lists by the worker group
        return [y for x in value for y in flat(x)] if isinstance(value, (list, tuple)) else [float(value)]

    return old.float() * tensors["response_mask"], {k: flat(metrics[k]) for k in METRICS}


def _actor(self):
    """In the worker: (the actor's module, its optimizer), on the engine and the legacy workers."""
    if hasattr(self, "actor_module_fsdp"):
        return self.actor_module_fsdp, self.actor_optimizer
    return self.actor.engine.module, self.actor.engine.optimizer


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _get_state(self):
    """In the worker: its parameters and AdamW state by parameter name (one rank: the local shard
    of an FSDP2 DTensor is the whole tensor), cloned."""
    module, optimizer = _actor(self)
    params = dict(module.named_parameters())
    names = {id(p): n for n, p in params.items()}
    state = {names[id(p)]: {k: _local(v).detach().clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
             for p, s in optimizer.state.items()}
    return {"params": {n: _local(p).detach().clone() for n, p in params.items()}, "optimizer": state}


def _set_state(self, state):
    """In the worker: overwrite its parameters and AdamW state in place with ``state`` (bit for bit);
    an optimizer that has stepped as often holds the same keys."""
    module, optimizer = _actor(self)
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in state["params"].items():
            _local(params[name]).copy_(value)
        assert len(optimizer.state) == len(state["optimizer"])
        for name, values in state["optimizer"].items():
            for key, value in values.items():
                _local(optimizer.state[params[name]][key]).copy_(value)



@pytest.fixture(scope="module")
def trained(ray_cluster, model):  # model: the shared fixture (tests/integrations/conftest.py)
    """Per run: per step (its old log-probs, metrics, parameters before and after the step), every
    patched run starting each step from verl's state."""
    ray = ray_cluster
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_torch_padding(monkeypatch)
        configs = {name: _config(model[1], option) for name, option in RUNS.items()}
        out = {name: [] for name in RUNS}
        groups = {}
        with concurrent.futures.ThreadPoolExecutor(len(RUNS)) as pool:
            try:
                futures = {name: pool.submit(_start, ray, config) for name, config in configs.items()}
                for name, future in futures.items():
                    groups[name] = future.result()
                workers = {name: group.workers[0] for name, (group, _) in groups.items()}
                for step in range(STEPS):
                    before = ray.get(workers["verl"].__ray_call__.remote(_get_state))
                    ray.get([workers[name].__ray_call__.remote(_set_state, before) for name in RUNS if name != "verl"])
                    results = {name: pool.submit(_step, groups[name][0], step) for name in RUNS}
                    results = {name: r.result() for name, r in results.items()}
                    after = ray.get([workers[name].__ray_call__.remote(_get_state) for name in RUNS])
                    for name, state in zip(RUNS, after):
                        old, metrics = results[name]
                        out[name].append({"old_log_probs": old, "metrics": metrics, "before": before["params"],
                                          "after": state["params"]})
            finally:
                for name, (group, resources) in groups.items():
                    _stop(ray, group, resources)
    return out


def _metric_scale(key, values, step, old_log_probs):
    """The size of the per-token terms that metric ``key`` averages at step ``step`` (module
    docstring): mean |advantage| for pg_loss (and, added to its own size, for the total loss, which
    holds pg_loss), mean |old log-prob| for ppo_kl, the metric's own size for the rest."""
    mask = _batch(step)[0]["response_mask"].bool()
    size = max(abs(x) for x in values)
    if key in ("actor/pg_loss", "loss"):
        advantage = _batch(step)[1][mask].abs().mean().item()
        return advantage if key == "actor/pg_loss" else advantage + size
    if key == "actor/ppo_kl":
        return old_log_probs[mask].abs().mean().item()
    return size


def _step_length(a, b):
    return torch.sqrt(sum((a[k] - b[k]).double().norm() ** 2 for k in b))


@pytest.mark.parametrize("path", ["fused", "logits"])
def test_parity_of_20_ppo_updates_through_verls_update_step(trained, model, path):  # noqa: F811
    ref, run = trained["verl"], trained[path]
    hidden = model[0].config.hidden_size
    assert len(run) == len(ref) == STEPS
    clipped = sum(max(s["metrics"]["actor/pg_clipfrac"]) > 0 for s in ref)
    assert clipped >= STEPS // 2, "the PPO clip rarely acted: the test would not see a wrong ratio"
    moved = _step_length(ref[-1]["after"], ref[0]["before"])
    assert moved > 0.1, "training barely moved the parameters"
    worst = {k: 0.0 for k in METRICS}
    worst_lp = worst_step = 0.0
    for step, (got, want) in enumerate(zip(run, ref)):
        assert all(torch.equal(got["before"][k], want["before"][k]) for k in want["before"])  # the same start
        lp = (got["old_log_probs"] - want["old_log_probs"]).abs().max().item()
        # the same body, another head: the logit's dot product and the row's sum (tests/support/tolerances.py)
        lp_bound = f32_bound(hidden + VOCAB, scale=want["old_log_probs"].abs().max().item())
        worst_lp = max(worst_lp, lp / lp_bound)
        assert lp <= lp_bound, (step, "old log-probs", lp, lp_bound)
        for key in METRICS:
            dev = max(abs(a - b) for a, b in zip(got["metrics"][key], want["metrics"][key]))
            scale = _metric_scale(key, want["metrics"][key], step, want["old_log_probs"])
            bound = CLIPFRAC_ATOL if key == "actor/pg_clipfrac" else METRIC_RTOL * scale + 1e-7
            worst[key] = max(worst[key], dev / bound)
            assert dev <= bound, (step, key, got["metrics"][key], want["metrics"][key])
        step_len = _step_length(want["after"], want["before"])
        diff = _step_length(got["after"], want["after"])
        worst_step = max(worst_step, (diff / step_len).item())
        assert diff <= STEP_RTOL * step_len, (step, "parameters after the step", diff.item(), step_len.item())
    print(f"\nparity {path}, {STEPS} steps in lock step with verl: old log-probs' worst deviation / its bound "
          f"{worst_lp:.3f}; each "
          f"metric's worst deviation / its bound {({k: round(v, 3) for k, v in worst.items()})}; parameters "
          f"within {worst_step:.1e} of the step; clipping in {clipped} steps")


@pytest.mark.parametrize("path", ["fused", "logits"])
def test_parity_reruns_are_bitwise_identical(trained, path):
    first, again = trained[path], trained[f"{path} again"]
    for a, b in zip(first, again):
        assert a["metrics"] == b["metrics"]
        assert torch.equal(a["old_log_probs"], b["old_log_probs"])
        for name in a["after"]:
            assert torch.equal(a["after"][name], b["after"][name]), name
