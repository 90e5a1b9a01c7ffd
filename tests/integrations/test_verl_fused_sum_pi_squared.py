"""Σπ² (``calculate_sum_pi_squared=True``) on verl's FSDP fused path (issue 44), through verl's own
``FSDPEngineWithLMHead.forward_step`` (its ``prepare_model_inputs``, the model, its
``prepare_model_outputs``) on a stand-in engine object that holds a tiny Qwen2 on CPU (no FSDP
wrapping, no process group: the engine's methods are verl's, only ``__init__`` is skipped).

verl refuses the flag with ``use_fused_kernels=True``; with rl-kernels' fused head
(``impl_backend=rl_kernels``) the refusal is lifted and the Σπ² comes back where and as verl's
logits path returns it (a jagged nested tensor per sequence, rmpad and padded). Compared with
verl's unpatched logits path (``use_fused_kernels=False``, its ``calculate_sum_pi_squared_from_logits``
on float32 logits) and with float64 (the model in float64). The tolerance is the float32 one of
the logits path itself, e = max |verl's logits path - float64| (measured 2.4e-6 here; Σπ² is a
probability in [1/V, 1]): the fused Σπ² must be within e of float64 (measured 8.7e-7) and within
2e of verl's logits path (measured 2.5e-6). With ``impl_backend='torch'`` (verl's own fused
head) verl's own error stays.

Marked ``verl_matrix``: on verl 0.8.0 too (its padded fused path lays its outputs out as a dense
response slice, unlike its logits path: there the padded case checks that Σπ² has the log-probs'
layout and skips the comparison); verl 0.7.x, whose workers are the legacy ones, skips.
"""

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch
from transformers import Qwen2ForCausalLM
from verl.models.transformers.monkey_patch import apply_monkey_patch

import rl_kernels.integrations.verl as rkv
from verl_helpers import bare_fsdp_engine, rollout_tensors, tiny_qwen2, verl_unpatched

T = 0.7
PART = "FSDP fused sum_pi_squared"


def _verl_has_sum_pi_squared() -> bool:
    import dataclasses

    from verl.workers.config.actor import ActorConfig

    return "calculate_sum_pi_squared" in {f.name for f in dataclasses.fields(ActorConfig)}


def _legacy_workers() -> bool:
    from verl_cpu import legacy_workers

    return legacy_workers()


pytestmark = [pytest.mark.verl_matrix,
              pytest.mark.skipif(not _verl_has_sum_pi_squared(), reason="this verl has no calculate_sum_pi_squared"),
              pytest.mark.skipif(_legacy_workers(), reason="verl 0.7.x: the legacy workers' actor, not the engine, "
                                                           "computes log-probs; its own refusal stays")]


@pytest.fixture
def engine_on_cpu(monkeypatch):
    """verl's FSDP engine module with the device queries answering CPU, and the Qwen2 class forward
    restored after the test (apply_monkey_patch replaces it on the class)."""
    import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    from verl_cpu import use_torch_padding

    use_torch_padding(monkeypatch)  # verl 0.8.x's padding helpers without flash_attn
    monkeypatch.setattr(fsdp_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(fsdp_impl, "get_device_name", lambda: "cpu")
    original = Qwen2ForCausalLM.forward
    yield fsdp_impl.FSDPEngineWithLMHead, original
    Qwen2ForCausalLM.forward = original


def _engine(engine_cls, model):
    """An FSDPEngineWithLMHead without its __init__: the attributes its forward step reads."""
    import verl.utils.torch_functional as verl_F

    assert engine_cls.__name__ == "FSDPEngineWithLMHead"
    return bare_fsdp_engine(model, ulysses_sequence_parallel_size=1,
                            compute_entropy_from_logits=verl_F.entropy_from_logits)


def _micro_batch(rmpad, fused):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    micro_batch = left_right_2_no_padding(TensorDict(rollout_tensors()[0], batch_size=[2]))
    tu.assign_non_tensor(micro_batch, calculate_entropy=True, calculate_sum_pi_squared=True,
                         use_remove_padding=rmpad, use_fused_kernels=fused, temperature=T)
    return micro_batch


def _forward_step(engine_cls, model, micro_batch):
    with torch.no_grad():
        _, out = _engine(engine_cls, model).forward_step(micro_batch, loss_function=None, forward_only=True)
    return out["model_output"]


def _float64_sum_pi_squared(forward, micro_batch):
    """Σπ² of softmax(logits / T) per token of each sequence, the model in float64."""
    model = tiny_qwen2().double()
    ids = micro_batch["input_ids"]
    out = []
    with torch.no_grad():
        for seq in ids.unbind():
            p = torch.softmax(forward(model, input_ids=seq[None], return_dict=True).logits[0] / T, -1)
            out.append((p * p).sum(-1))
    return torch.cat(out)


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_fused_sum_pi_squared_matches_verls_logits_path(engine_on_cpu, rmpad):
    engine_cls, hf_forward = engine_on_cpu
    assert rkv.report()[PART][0], rkv.report()[PART]
    with verl_unpatched():  # verl's own logits path, as installed
        model = tiny_qwen2()
        apply_monkey_patch(model, use_remove_padding=rmpad, use_fused_kernels=False)
        ref = _forward_step(engine_cls, model, _micro_batch(rmpad, fused=False))
    Qwen2ForCausalLM.forward = hf_forward
    want64 = _float64_sum_pi_squared(hf_forward, _micro_batch(rmpad, fused=False))

    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=rmpad, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    micro_batch = _micro_batch(rmpad, fused=True)
    before = rkv.call_counts()
    previous = rkv.options().backend
    rkv.configure(backend="triton")  # the kernel (its CPU interpreter here)
    try:
        got = _forward_step(engine_cls, model, micro_batch)
    finally:
        rkv.configure(backend=previous)
    after = rkv.call_counts()
    assert after["fused_fsdp_calls"] == before["fused_fsdp_calls"] + 1  # one fused pass computed all three
    assert after["fused_sum_pi_squared_calls"] == before["fused_sum_pi_squared_calls"] + 1
    from verl.utils import tensordict_utils as tu
    assert tu.get_non_tensor_data(micro_batch, "calculate_sum_pi_squared", None) is True  # verl's batch untouched

    if not got["log_probs"].is_nested:  # verl 0.8.0's padded fused path: a dense response slice of its own
        assert got["sum_pi_squared"].shape == got["log_probs"].shape
        pytest.skip("this verl lays out its padded fused outputs unlike its logits path; Σπ² follows its log-probs")
    assert set(got) == set(ref) == {"log_probs", "entropy", "sum_pi_squared"}
    sq, ref_sq = got["sum_pi_squared"], ref["sum_pi_squared"]
    assert sq.is_nested and sq.dtype == torch.float32
    assert torch.equal(sq.offsets(), ref_sq.offsets())  # verl's layout: the same sequences, the same tokens
    own = float((ref_sq.values().double() - want64).abs().max())  # the logits path's float32 error
    assert 0 < own < 1e-5, own
    assert float((sq.values().double() - want64).abs().max()) <= own
    torch.testing.assert_close(sq.values(), ref_sq.values().float(), atol=2 * own, rtol=0)
    assert float(sq.values().min()) > 1 / 1037 and float(sq.values().max()) < 1  # not a degenerate softmax
    torch.testing.assert_close(got["entropy"].values(), ref["entropy"].values(), atol=2e-5, rtol=0)


def test_verls_refusal_stays_for_its_own_fused_backend(engine_on_cpu):
    """impl_backend='torch': verl's own fused head computes no Σπ², and verl's NotImplementedError stays."""
    engine_cls, _ = engine_on_cpu
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch")
    before = rkv.call_counts()["fused_calls"]
    with pytest.raises(NotImplementedError, match="calculate_sum_pi_squared=True is not supported with "
                                                  "use_fused_kernels=True"):
        _forward_step(engine_cls, model, _micro_batch(rmpad=True, fused=True))
    assert rkv.call_counts()["fused_calls"] == before  # rl-kernels served nothing


def test_unpatch_restores_verls_engine_methods():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    def ours(name):
        return hasattr(vars(FSDPEngineWithLMHead)[name], "_rl_kernels_original")

    assert ours("prepare_model_outputs") and ours("forward_step")
    rkv.unpatch()
    try:
        assert not ours("prepare_model_outputs") and not ours("forward_step")
    finally:
        rkv.patch()
    assert ours("prepare_model_outputs")
