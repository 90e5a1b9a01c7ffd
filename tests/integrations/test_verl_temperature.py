"""Per-sample temperature on verl's FSDP fused path (issue 44, item 2), through verl's own
``FSDPEngineWithLMHead.prepare_model_inputs`` / ``prepare_model_outputs`` (a bare engine: the
methods read a few attributes only) on the tiny Qwen2.

A micro-batch of three sequences (5, 7 and 3 tokens) with temperatures 0.5, 1.3 and 0.8: the fused
path of a model rl-kernels serves (``impl_backend=rl_kernels``) against verl's unpatched logits path
(the model's logits divided per token by verl's own layout of the temperature, then verl's
``logprobs_from_logits`` / ``entropy_from_logits``), with remove-padding (and ``pad_to_length``: one
static pad token, temperature pad 1) and without. Float32 throughout, so the tolerances (values
2e-5 absolute, gradients 1e-4 relative in norm, as in test_verl_patch.py) leave only float32
rounding of other summation orders; a temperature applied to the wrong sample moves log-probs by
about 1 nat. For a model rl-kernels does not serve, verl's refusal stays.
"""
import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch
from transformers import Qwen2ForCausalLM

import rl_kernels.integrations.verl as rkv
from rl_kernels.integrations.verl_impl import patching as verl_patching
from verl_helpers import VOCAB, as_second_ulysses_rank_of_two, bare_fsdp_engine, tiny_qwen2, verl_unpatched

transformer_impl = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl",
                                       reason="this verl has no FSDP engine")
from tensordict import TensorDict  # noqa: E402
from verl.models.transformers.monkey_patch import apply_monkey_patch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

LENGTHS = (5, 7, 3)
TEMPERATURES = (0.5, 1.3, 0.8)
VALUE_ATOL = 2e-5
GRAD_RTOL = 1e-4
REFUSAL = "use_fused_kernels does not support per sample temperature"


@pytest.fixture
def qwen2_forward():
    """apply_monkey_patch replaces Qwen2ForCausalLM.forward on the class: restore it after."""
    original = Qwen2ForCausalLM.forward
    previous = rkv.options().backend
    rkv.configure(backend="torch")
    yield original
    rkv.configure(backend=previous)
    Qwen2ForCausalLM.forward = original


def _engine(model, entropy_from_logits=None):
    """A bare FSDPEngineWithLMHead around ``model`` (what prepare_model_inputs / outputs read); 15
    tokens -> one static pad token."""
    return bare_fsdp_engine(model, pad_to_length=True, pad_to_length_bucket=8,
                            compute_entropy_from_logits=entropy_from_logits)


def _micro_batch(rmpad: bool, use_fused_kernels: bool):
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]
    micro_batch = TensorDict({
        "input_ids": torch.nested.nested_tensor(ids, layout=torch.jagged),
        "position_ids": torch.nested.nested_tensor([torch.arange(n) for n in LENGTHS], layout=torch.jagged),
        "temperature": torch.tensor(TEMPERATURES),
    }, batch_size=[len(LENGTHS)])
    tu.assign_non_tensor(micro_batch, use_remove_padding=rmpad, use_fused_kernels=use_fused_kernels,
                         calculate_entropy=True)
    return micro_batch


def _compared(rmpad: bool) -> torch.Tensor:
    """The tokens whose log-probs are compared: all with remove-padding. Without it, not the last
    token of each sequence: verl's padded logits path takes its label from the packed roll (the
    next sequence's first token), its padded fused forward from the padded row's roll (a pad
    token); verl drops that log-prob (no response token follows it)."""
    keep = torch.ones(sum(LENGTHS), dtype=torch.bool)
    if not rmpad:
        keep[torch.tensor(LENGTHS).cumsum(0) - 1] = False
    return keep


def _step(engine, micro_batch, keep):
    """verl's engine step without the loss: (log_probs, entropy) of the valid tokens, and the
    parameters' gradients of a loss with random weights on both (log-probs: the ``keep`` ones)."""
    model_inputs, output_args = engine.prepare_model_inputs(micro_batch)
    output = engine.module(**model_inputs, use_cache=False)
    out = engine.prepare_model_outputs(output, output_args, micro_batch, None)
    log_probs, entropy = out["log_probs"].values(), out["entropy"].values()
    g = torch.Generator().manual_seed(4)
    loss = (log_probs * torch.randn(log_probs.shape, generator=g))[keep].sum() \
        + (entropy * torch.randn(entropy.shape, generator=g)).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters()}
    return log_probs.detach()[keep], entropy.detach(), grads


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_per_sample_temperature_on_the_fused_path_matches_verls_logits_path(qwen2_forward, rmpad):
    with verl_unpatched():  # verl's own logits path on the model's own forward
        import verl.utils.torch_functional as verl_F

        ref_lp, ref_ent, ref_grads = _step(_engine(tiny_qwen2(), verl_F.entropy_from_logits),
                                           _micro_batch(rmpad, use_fused_kernels=False), _compared(rmpad))
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=rmpad, use_fused_kernels=True,
                       fused_kernels_backend=rkv.BACKEND_NAME)
    before = rkv.call_counts()["fused_fsdp_calls"]
    lp, ent, grads = _step(_engine(model), _micro_batch(rmpad, use_fused_kernels=True), _compared(rmpad))
    assert rkv.call_counts()["fused_fsdp_calls"] == before + 1  # one call of rl-kernels' fused head
    assert ent.shape == (sum(LENGTHS),)
    torch.testing.assert_close(lp, ref_lp.float(), atol=VALUE_ATOL, rtol=0)
    torch.testing.assert_close(ent, ref_ent.float(), atol=VALUE_ATOL, rtol=0)
    for name, grad in grads.items():
        ref = ref_grads[name]
        err = (grad - ref).norm() / ref.norm()
        assert err < GRAD_RTOL, f"{name}: relative gradient error {err:.2e}"


def test_verls_refusal_stays_for_a_model_rl_kernels_does_not_serve(qwen2_forward):
    """verl's own fused backend (impl_backend='torch') or a plain model: verl's assert, unchanged."""
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch")
    for module in (model, tiny_qwen2()):
        with pytest.raises(AssertionError, match=REFUSAL):
            _engine(module).prepare_model_inputs(_micro_batch(rmpad=True, use_fused_kernels=True))
    assert rkv.report()[verl_patching.PER_SAMPLE_TEMPERATURE][0]


def test_per_token_temperature_with_the_models_head_transform():
    """The fused head of a served model with a soft-cap and a logit multiplier (Gemma 2 / Granite
    style) and a temperature per token: against float64, z = multiplier * cap tanh(h.w / cap) / T_row;
    a bad row is refused with rl-kernels' one-line error naming verl's value."""
    from rl_kernels.integrations.lm_heads import HeadTransform
    from rl_kernels.integrations.verl_impl import fsdp_fused
    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(1, 9, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (1, 9), generator=g)
    temperature = torch.tensor([[0.5] * 4 + [1.3] * 5])
    head = HeadTransform(softcap=3.0, multiplier=0.8, description="a test head")
    z = 0.8 * 3.0 * torch.tanh(hidden.double() @ weight.double().T / 3.0) / temperature.double()[..., None]
    log_p = torch.log_softmax(z, -1)
    token = fsdp_fused._head.set(head)
    try:
        lp, ent = fsdp_fused.fused_log_probs_entropy(hidden, weight, labels, temperature)
        torch.testing.assert_close(lp.double(), log_p.gather(-1, labels[..., None])[..., 0], atol=1e-5, rtol=0)
        torch.testing.assert_close(ent.double(), -(log_p.exp() * log_p).sum(-1), atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match=r"^temperature: row 2 is 0\.0; every per-row temperature"):
            bad = temperature.index_fill(1, torch.tensor([2]), 0.0)
            fsdp_fused.fused_log_probs_entropy(hidden, weight, labels, bad)
    finally:
        fsdp_fused._head.reset(token)


def test_ulysses_slice_of_the_per_token_temperature(qwen2_forward, monkeypatch):
    """Under Ulysses SP the fused forward's temperature is this rank's slice of the packed, padded
    per-token temperature, aligned with its shift_labels (a stand-in for rank 1 of 2: 15 tokens,
    one SP pad token of temperature 1, the second half taken)."""
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    engine = as_second_ulysses_rank_of_two(monkeypatch, _engine(model))
    model_inputs, output_args = engine.prepare_model_inputs(_micro_batch(rmpad=True, use_fused_kernels=True))
    packed = [t for n, t in zip(LENGTHS, TEMPERATURES) for _ in range(n)] + [1.0]
    expected = torch.tensor(packed[len(packed) // 2:])[None]
    assert model_inputs["shift_labels"].shape == expected.shape and output_args["pad_size"] == 1
    torch.testing.assert_close(model_inputs["temperature"], expected, atol=0, rtol=0)


def _megatron_resolve_fused_temperature():
    """(the Megatron engine's ``_resolve_fused_temperature`` as patched, verl's own function behind
    it); the test is skipped where verl's Megatron engine does not import or the per-sample
    temperature is not served."""
    mti = pytest.importorskip("verl.workers.engine.megatron.transformer_impl",
                              reason="verl's Megatron engine is not importable (no megatron-core)")
    resolve = mti._resolve_fused_temperature
    own = getattr(resolve, "_rl_kernels_original", None)
    if own is None:
        pytest.skip("the Megatron per-sample temperature is not served here")
    return resolve, own


def _in_megatron_step(resolve, temperature):
    """``resolve(temperature)`` inside the step request of a fused Megatron engine micro-batch (as
    verl's forward_step calls it, :mod:`rl_kernels.integrations.verl_impl.megatron_step`): (its value,
    the per-sample temperature it recorded in the step's inputs, or None)."""
    from rl_kernels.integrations.verl_impl import megatron_step, patch_state
    token = patch_state.new_step(engine=megatron_step.ENGINE)
    try:
        return resolve(temperature), patch_state.step_request.get().inputs.get("temperature_per_sample")
    finally:
        patch_state.step_request.reset(token)


@pytest.mark.parametrize("values", [(0.5, float("nan")), (1.0, float("inf")), (float("-inf"), 0.5)])
def test_megatron_per_sample_temperature_keeps_verls_finite_check(values):
    """Where rl-kernels lifts the Megatron engine's "uniform temperature" refusal, verl's own
    check of the values runs first, with verl's error and message (issue 53)."""
    resolve, own = _megatron_resolve_fused_temperature()
    with pytest.raises(ValueError) as verls:
        own(torch.tensor(values))
    with pytest.raises(type(verls.value), match=str(verls.value)):
        _in_megatron_step(resolve, torch.tensor(values))


@pytest.mark.parametrize("values", [(0.0, 1.0), (-1.0, 1.3), (0.5, 1.3, 0.5)])
def test_megatron_per_sample_temperature_is_what_verls_function_makes_of_each_value(values):
    """A tensor of unequal values: the per-sample temperature recorded in the step request holds,
    per sample, what verl's own function returns for that value alone (its floor for a value <= 0,
    the value otherwise); verl gets the stand-in 1.0. Outside a Megatron fused step, verl's own
    function (its "uniform temperature" refusal)."""
    from rl_kernels.integrations.verl_impl.megatron_step import STAND_IN

    resolve, own = _megatron_resolve_fused_temperature()
    out, per_sample = _in_megatron_step(resolve, torch.tensor(values))
    assert type(out) is float and out == STAND_IN
    expected = torch.tensor([own(torch.tensor([v])) for v in values], dtype=torch.float32)
    assert torch.equal(per_sample, expected), (per_sample, expected)
    assert bool((per_sample > 0).all())
    with pytest.raises(NotImplementedError, match="uniform temperature"):
        resolve(torch.tensor(values))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 0.0, -1.0])
def test_fsdp_per_sample_temperature_refuses_what_is_not_positive_and_finite(qwen2_forward, bad):
    """The FSDP fused path with a per-sample temperature: verl's own prepare_model_inputs runs on
    the micro-batch (its checks of the tensor: shape, ...), and a NaN / inf / <= 0 value raises
    rl-kernels' ValueError naming the temperature (verl's fused path refuses any tensor; its logits
    path would clamp <= 0 to 1e-8 and carry a NaN into the log-probs)."""
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    micro_batch = _micro_batch(rmpad=True, use_fused_kernels=True)
    micro_batch["temperature"] = torch.tensor([TEMPERATURES[0], bad, TEMPERATURES[2]])
    engine = _engine(model)
    with pytest.raises(ValueError, match="temperature"):
        model_inputs, output_args = engine.prepare_model_inputs(micro_batch)
        engine.module(**model_inputs, use_cache=False)
