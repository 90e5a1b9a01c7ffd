"""verl 0.7.x's legacy FSDP actor, ``DataParallelPPOActor``, with rl-kernels vs verl unpatched.

verl 0.7.x trains with the legacy workers (``trainer.use_legacy_worker_impl=auto``), whose actor is
``verl.workers.actor.dp_actor.DataParallelPPOActor``: it imports ``logprobs_from_logits`` by name
and caches ``torch.compile(entropy_from_logits)`` in ``__init__``. Here the actor itself runs, in
this process on CPU (gloo, world size 1, the tiny Qwen2 without FSDP wrapping: the actor's code
is the same), ``compute_log_prob`` and one ``update_policy`` step (SGD, so that the parameter
update is the clipped gradient), with rl-kernels' fused path and logits path, against verl's
unpatched logits path: log-probs to 1e-5, parameter updates to 1e-4 relative.
"""
import os

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch

import rl_kernels.integrations.verl as rkv
from verl_helpers import rollout_tensors, tiny_qwen2, verl_unpatched

pytestmark = [pytest.mark.verl_matrix,
              pytest.mark.skipif(not rkv.verl_features().legacy_actor,
                                 reason="this verl has no legacy DataParallelPPOActor (0.7.x's; 0.8.0+ use engines)"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

T = 0.7
LOG_PROB_ATOL = 1e-5
UPDATE_RTOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def gloo():
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def padding_helpers(monkeypatch):
    """CPU scaffolding: verl 0.7.x's rmpad path unpads with flash_attn.bert_padding (no CPU build);
    verl's own pure-torch equivalents (``verl.utils.npu_flash_attn_utils``, einops) stand in."""
    import importlib.util

    import verl.utils.attention_utils as attention_utils

    if importlib.util.find_spec("flash_attn") is None:
        from verl.utils import npu_flash_attn_utils as helpers

        funcs = (helpers.index_first_axis, helpers.pad_input, helpers.rearrange, helpers.unpad_input)
        monkeypatch.setattr(attention_utils, "_get_attention_functions", lambda: funcs)


@pytest.fixture(autouse=True)
def qwen2_forward():
    from transformers import Qwen2ForCausalLM

    original = Qwen2ForCausalLM.forward
    yield
    Qwen2ForCausalLM.forward = original


def _data():
    """The two rollout sequences of ``verl_helpers.rollout_tensors`` with advantages."""
    from verl import DataProto

    tensors, g = rollout_tensors()
    advantages = torch.randn(2, 6, generator=g) * tensors["response_mask"]
    return DataProto.from_dict(
        tensors={**tensors, "advantages": advantages, "old_log_probs": torch.zeros(2, 6)},
        meta_info={"temperature": T, "micro_batch_size": 2, "use_dynamic_bsz": False})


def _actor(fused: bool, rmpad: bool, use_torch_compile: bool):
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig

    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=rmpad, use_fused_kernels=fused,
                       fused_kernels_backend=rkv.BACKEND_NAME if fused else None)
    config = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                             use_remove_padding=rmpad, use_fused_kernels=fused,
                             use_torch_compile=use_torch_compile, entropy_coeff=0.01, rollout_n=1,
                             fsdp_config=FSDPEngineConfig(dtype="float32"))  # autocast dtype: fp32 here
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return DataParallelPPOActor(config, model, optimizer), model


def _run(actor, model):
    data = _data()
    out = actor.compute_log_prob(data, calculate_entropy=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    actor.update_policy(data)
    updates = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    return out["log_probs"], out["entropys"], updates, data.batch["response_mask"].bool()


@pytest.mark.parametrize("rmpad", [False, True], ids=["padded", "rmpad"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
def test_dp_actor_matches_verl_unpatched(rmpad, fused):
    with verl_unpatched():
        ref_lp, ref_ent, ref_updates, mask = _run(*_actor(fused=False, rmpad=rmpad, use_torch_compile=False))

    previous = rkv.options().backend
    rkv.configure(backend="torch")
    try:
        before = rkv.call_counts()
        # use_torch_compile=True (verl's default): the compiled entropy cache is rl-kernels' function
        actor, model = _actor(fused=fused, rmpad=rmpad, use_torch_compile=not fused)
        if not fused:
            assert actor.compute_entropy_from_logits is rkv.entropy_from_logits
        lp, ent, updates, _ = _run(actor, model)
        after = rkv.call_counts()
    finally:
        rkv.configure(backend=previous)

    if fused:  # compute_log_prob + update_policy: one fused call each
        assert after["fused_fsdp_calls"] == before["fused_fsdp_calls"] + 2, after
        assert after["logits_log_probs_calls"] == before["logits_log_probs_calls"]
    else:
        assert after["fused_fsdp_calls"] == before["fused_fsdp_calls"]
        assert after["logits_log_probs_calls"] == before["logits_log_probs_calls"] + 2, after
        assert after["logits_entropy_calls"] == before["logits_entropy_calls"] + 2, after
    torch.testing.assert_close(lp[mask], ref_lp[mask], atol=LOG_PROB_ATOL, rtol=0)
    torch.testing.assert_close(ent[mask], ref_ent[mask].float(), atol=LOG_PROB_ATOL, rtol=0)
    for name, update in updates.items():
        ref = ref_updates[name]
        err = (update - ref).norm() / ref.norm()
        assert err < UPDATE_RTOL, f"{name}: relative parameter-update error {err:.2e}"


def test_dp_actor_refuses_fused_with_ulysses():
    """verl 0.7.x + fused kernels + Ulysses SP rolls labels per shard (verl #3512, #3723): refused
    when the actor is built, before any step."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.workers.actor.dp_actor import DataParallelPPOActor
    from verl.workers.config import FSDPActorConfig

    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True,
                       fused_kernels_backend=rkv.BACKEND_NAME)
    config = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2,
                             use_remove_padding=True, use_fused_kernels=True, use_torch_compile=False,
                             ulysses_sequence_parallel_size=2, rollout_n=1)
    with pytest.raises(rkv.VerlIntegrationError, match="Ulysses"):
        DataParallelPPOActor(config, model, torch.optim.SGD(model.parameters(), lr=1.0))
