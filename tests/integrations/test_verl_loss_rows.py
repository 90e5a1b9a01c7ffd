"""``loss_rows_only`` on verl's FSDP fused path (issue 53 item 3, verl #7686), through verl's own
``FSDPEngineWithLMHead.forward_step`` / ``prepare_model_inputs`` / ``prepare_model_outputs`` (a bare
engine: the methods read a few attributes only) on the tiny Qwen2 served by rl-kernels
(``impl_backend=rl_kernels``).

Three samples with prompts of 3, 5 and 2 tokens and responses of 6, 4 and 7, whose response masks
hold tool tokens (0 inside the response) and one all-0 sample (v1's DP padding sample), in both
layouts verl's trainers give the engine: the v1 trainer's nested ``(bsz, j_response)`` loss mask and
the legacy trainer's dense right-padded one (``left_right_2_no_padding``). With the option on, the
head runs on the loss rows only: their log-probs, entropy and Σπ² and the gradients of a loss that
reads them are those of the option off (float32 rounding of another summation order: values 2e-5
absolute, gradients 1e-4 relative in norm, as test_verl_temperature.py), every other row is exactly
0, and the skipped rows are counted. Without the option's code the other rows are the model's
log-probs (about -7 nats here), so the exact-0 check fails; a mask one row off fails the value
check.
"""
import re

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch
from transformers import Qwen2ForCausalLM

import rl_kernels.integrations.verl as rkv
from rl_kernels.integrations.verl_impl import fsdp_engine, patch_state, schema
from verl_helpers import VOCAB, as_second_ulysses_rank_of_two, bare_fsdp_engine, tiny_qwen2

transformer_impl = pytest.importorskip("verl.workers.engine.fsdp.transformer_impl",
                                       reason="this verl has no FSDP engine")
from tensordict import TensorDict  # noqa: E402
from verl.models.transformers.monkey_patch import apply_monkey_patch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402

PROMPTS = (3, 5, 2)
RESPONSES = (6, 4, 7)
RESPONSE_MASKS = ([1, 1, 0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 1, 1, 0, 0, 1])  # tool tokens, a padding sample
VALUE_ATOL = 2e-5
GRAD_RTOL = 1e-4
T = 0.7


@pytest.fixture
def served(monkeypatch):
    """The tiny Qwen2 on rl-kernels' fused path (torch backend: fast on the CPU), verl's device
    helpers on the CPU; the class forward and the options restored after."""
    original, previous = Qwen2ForCausalLM.forward, rkv.options()
    monkeypatch.setattr(transformer_impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(transformer_impl, "get_device_name", lambda: "cpu")
    rkv.configure(backend="torch")
    yield
    rkv.configure(backend=previous.backend, loss_rows_only=previous.loss_rows_only)
    Qwen2ForCausalLM.forward = original


def _engine(model):
    # 27 tokens -> 5 static pad tokens
    return bare_fsdp_engine(model, pad_to_length=True, pad_to_length_bucket=8, ulysses_device_mesh=None)


def _sequences():
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, VOCAB, (p,), generator=g), torch.randint(0, VOCAB, (r,), generator=g))
            for p, r in zip(PROMPTS, RESPONSES)]


def _micro_batch(layout: str, **flags):
    """The micro-batch as verl's v1 trainer (``nested``) or legacy trainer (``dense``) hands it to the engine."""
    sequences = _sequences()
    if layout == "nested":
        data = TensorDict({
            "input_ids": torch.nested.nested_tensor([torch.cat(s) for s in sequences], layout=torch.jagged),
            "position_ids": torch.nested.nested_tensor([torch.arange(p + r) for p, r in zip(PROMPTS, RESPONSES)],
                                                       layout=torch.jagged),
            "loss_mask": torch.nested.nested_tensor([torch.tensor(m) for m in RESPONSE_MASKS], layout=torch.jagged),
        }, batch_size=[len(PROMPTS)])
        data["response_mask"] = data["loss_mask"]
    else:
        from verl.workers.utils.padding import left_right_2_no_padding

        p_max, r_max = max(PROMPTS), max(RESPONSES)
        prompts = torch.zeros(len(PROMPTS), p_max, dtype=torch.long)
        responses = torch.zeros(len(PROMPTS), r_max, dtype=torch.long)
        attention_mask = torch.zeros(len(PROMPTS), p_max + r_max, dtype=torch.long)
        response_mask = torch.zeros(len(PROMPTS), r_max, dtype=torch.long)
        for i, (prompt, response) in enumerate(sequences):
            prompts[i, p_max - len(prompt):] = prompt
            responses[i, :len(response)] = response
            attention_mask[i, p_max - len(prompt):p_max + len(response)] = 1
            response_mask[i, :len(response)] = torch.tensor(RESPONSE_MASKS[i])
        data = left_right_2_no_padding(TensorDict({
            "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention_mask, "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "response_mask": response_mask}, batch_size=[len(PROMPTS)]))
    tu.assign_non_tensor(data, **{"use_remove_padding": True, "use_fused_kernels": True, "calculate_entropy": True,
                                  "temperature": T, **flags})
    return data


def _loss_rows_by_hand() -> torch.Tensor:
    """Label row t of the packed sequence is a loss row iff token t + 1 of the same sequence is a
    response token with mask 1."""
    rows = []
    for p, mask in zip(PROMPTS, RESPONSE_MASKS):
        rows += [0] * (p - 1) + list(mask) + [0]
    return torch.tensor(rows, dtype=torch.bool)


@pytest.mark.parametrize("layout", ["nested", "dense"])
def test_loss_mask_by_token_in_both_trainer_layouts(layout):
    by_token = patch_state.loss_mask_by_token(_micro_batch(layout))
    expected = torch.cat([torch.tensor([0] * p + m) for p, m in zip(PROMPTS, RESPONSE_MASKS)])
    assert by_token.is_nested and torch.equal(by_token.values(), expected)
    assert torch.equal(by_token.offsets(), _micro_batch(layout)["input_ids"].offsets())


def _step(engine, micro_batch, loss_rows_only: bool):
    """verl's engine step with a loss that reads the log-probs and entropy of the loss rows (random
    weights): the log-probs and entropy of every row, the loss's parameter gradients."""
    rkv.configure(loss_rows_only=loss_rows_only)
    g = torch.Generator().manual_seed(4)
    weights = torch.randn(2, sum(PROMPTS) + sum(RESPONSES), generator=g)
    rows = _loss_rows_by_hand()

    def loss_function(model_output, data, dp_group=None):
        lp, ent = model_output["log_probs"].values(), model_output["entropy"].values()
        return (lp * weights[0])[rows].sum() + (ent * weights[1])[rows].sum(), {}

    engine.module.zero_grad(set_to_none=True)
    loss, output = engine.forward_step(micro_batch, loss_function=loss_function, forward_only=False)
    loss.backward()
    out = output["model_output"]
    grads = {n: p.grad.detach().clone() for n, p in engine.module.named_parameters()}
    return out["log_probs"].values(), out["entropy"].values(), grads


def _assert_same_on_the_loss_rows(got, ref, rows) -> None:
    """``got`` / ``ref`` (log-probs, entropy, gradients) of a step with the option on / off: exactly 0
    at the rows outside the loss (which the option-off run shows below -1 nat), the option off's values
    on the loss rows, and its gradients."""
    (lp, ent, grads), (ref_lp, ref_ent, ref_grads) = got, ref
    assert bool((ref_lp[~rows] < -1).all())  # what the rows outside hold without the option
    assert torch.equal(lp[~rows], torch.zeros_like(lp[~rows])) and torch.equal(ent[~rows], torch.zeros_like(ent[~rows]))
    torch.testing.assert_close(lp[rows], ref_lp[rows], atol=VALUE_ATOL, rtol=0)
    torch.testing.assert_close(ent[rows], ref_ent[rows], atol=VALUE_ATOL, rtol=0)
    for name, grad in grads.items():
        ref = ref_grads[name]
        err = (grad - ref).norm() / ref.norm()
        assert err < GRAD_RTOL, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("layout", ["nested", "dense"])
def test_loss_rows_only_equals_the_option_off_on_the_loss_rows(served, layout):
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    engine = _engine(model)
    ref_lp, ref_ent, ref_grads = _step(engine, _micro_batch(layout), loss_rows_only=False)
    skipped = rkv.call_counts()["loss_rows_skipped_tokens"]
    lp, ent, grads = _step(engine, _micro_batch(layout), loss_rows_only=True)
    rows = _loss_rows_by_hand()
    # the packed rows and the 5 static pad rows: all but the loss rows skipped
    assert rkv.call_counts()["loss_rows_skipped_tokens"] - skipped == rows.numel() + 5 - int(rows.sum())
    _assert_same_on_the_loss_rows((lp, ent, grads), (ref_lp, ref_ent, ref_grads), rows)


def test_loss_rows_of_an_ulysses_rank(served, monkeypatch):
    """Under Ulysses SP the mask is this rank's slice of the rolled, padded packed mask, aligned with
    its shift_labels (a stand-in for rank 1 of 2: 27 tokens, one SP pad row, the second half)."""
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    engine = as_second_ulysses_rank_of_two(monkeypatch, _engine(model))
    micro_batch = _micro_batch("nested")
    token = patch_state.new_step(loss_rows_only=True)
    try:  # (what the engine's forward_step wrapper puts in force)
        model_inputs, _ = engine.prepare_model_inputs(micro_batch)
        rows = patch_state.step_request.get().inputs["loss_rows"]
    finally:
        patch_state.step_request.reset(token)
    packed = torch.cat([_loss_rows_by_hand(), torch.zeros(1, dtype=torch.bool)])
    assert rows.shape == model_inputs["shift_labels"].shape[1:]
    assert torch.equal(rows, packed[packed.numel() // 2:])


def test_sum_pi_squared_and_entropy_zero_outside_the_loss(served):
    """A log-prob step that asks Σπ² on the fused path (verl's optimal-token-baseline estimators):
    Σπ² of the loss rows as with the option off, 0 elsewhere."""
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    engine = _engine(model)
    outs = {}
    for on in (False, True):
        rkv.configure(loss_rows_only=on)
        with torch.no_grad():
            _, output = engine.forward_step(_micro_batch("nested", calculate_sum_pi_squared=True),
                                            loss_function=None, forward_only=True)
        outs[on] = output["model_output"]["sum_pi_squared"].values()
    rows = _loss_rows_by_hand()
    assert bool((outs[False][~rows] > 0).all()) and torch.equal(outs[True][~rows], torch.zeros(int((~rows).sum())))
    torch.testing.assert_close(outs[True][rows], outs[False][rows], atol=VALUE_ATOL, rtol=0)


@pytest.mark.parametrize("case, message", [
    ("sft", "loss_mask has the input_ids layout (SFT)"),
    ("model_output", "return_model_output"),
    ("response_outside", "response_mask selects rows outside loss_mask"),
    ("no_loss_mask", "the micro-batch has no loss_mask"),
    ("padded", "use_remove_padding=False is not served"),
])
def test_micro_batches_outside_the_audit_are_refused(served, case, message):
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    micro_batch = _micro_batch("nested")
    if case == "sft":
        micro_batch["loss_mask"] = torch.nested.nested_tensor_from_jagged(
            torch.ones(sum(PROMPTS) + sum(RESPONSES), dtype=torch.long), micro_batch["input_ids"].offsets())
        del micro_batch["response_mask"]
    elif case == "model_output":
        tu.assign_non_tensor(micro_batch, return_model_output=True)
    elif case == "response_outside":
        micro_batch["response_mask"] = torch.nested.nested_tensor([torch.ones(r, dtype=torch.long) for r in RESPONSES],
                                                                  layout=torch.jagged)
    elif case == "no_loss_mask":
        del micro_batch["loss_mask"]
    else:
        tu.assign_non_tensor(micro_batch, use_remove_padding=False)
    rkv.configure(loss_rows_only=True)
    with pytest.raises(rkv.VerlIntegrationError, match=f"loss_rows_only: .*{re.escape(message)}.*loss_rows_only"):
        _engine(model).forward_step(micro_batch, loss_function=None, forward_only=True)


@pytest.mark.parametrize("setting, key", [
    ({"policy_loss_mode": "my_registered_loss"}, "actor.policy_loss.loss_mode=my_registered_loss"),
    ({"use_prefix_grouper": True}, "actor.use_prefix_grouper=True"),
    ({"distillation_loss_mode": "my_kl"}, "distillation.distillation_loss.loss_mode=my_kl"),
    ({"distillation_policy_loss_mode": "my_pg"}, "distillation.distillation_loss.policy_loss_mode=my_pg"),
])
def test_losses_outside_the_audit_are_refused(served, setting, key):
    """A policy or distillation loss the audit of docs/verl.md does not cover (it may read log-probs
    outside loss_mask), or PrefixGrouper, refuses the option at the engine step, naming the key;
    the audited ones (verl's defaults) are served."""
    import functools
    from types import SimpleNamespace

    def loss_function(config=None, distillation_config=None):
        return None

    def bound(policy_loss_mode="vanilla", use_prefix_grouper=False, distillation_loss_mode="k3",
              distillation_policy_loss_mode="vanilla"):
        actor = SimpleNamespace(policy_loss=SimpleNamespace(loss_mode=policy_loss_mode),
                                use_prefix_grouper=use_prefix_grouper)
        distillation = SimpleNamespace(distillation_loss=SimpleNamespace(
            loss_mode=distillation_loss_mode, use_policy_gradient=True, policy_loss_mode=distillation_policy_loss_mode))
        return functools.partial(loss_function, config=actor, distillation_config=distillation)

    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    rkv.configure(loss_rows_only=True)
    fields = fsdp_engine.asks(_engine(model), _micro_batch("nested"), bound())
    assert fields["loss_rows_only"]
    with pytest.raises(rkv.VerlIntegrationError, match=f"loss_rows_only: {re.escape(key)} .*loss_rows_only=false"):
        fsdp_engine.asks(_engine(model), _micro_batch("nested"), bound(**setting))


def _logits_step(engine, micro_batch, loss_rows_only: bool, seen: list):
    """verl's engine step on the logits path (the model's own forward, rl-kernels' from-logits
    functions) with the loss of :func:`_step`; ``seen`` gets the row count of each output-layer call."""
    import verl.utils.torch_functional as verl_F

    engine.compute_entropy_from_logits = verl_F.entropy_from_logits  # (what verl's engine caches: patched)
    handle = engine.module.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.shape[-2]))
    try:
        return _step(engine, micro_batch, loss_rows_only)
    finally:
        handle.remove()


@pytest.mark.parametrize("layout", ["nested", "dense"])
def test_loss_rows_only_on_the_logits_path(served, layout):
    """On verl's FSDP logits path (use_fused_kernels=False) the model's output layer gets the loss
    rows' hidden states only, so their logits alone are made; rl-kernels' from-logits functions hand
    verl the labels' shape: log-probs, entropy and the loss's gradients of the loss rows as with the
    option off, 0 elsewhere (the temperature per row selected with them)."""
    model = tiny_qwen2()
    engine = _engine(model)
    rows = _loss_rows_by_hand()
    seen_off, seen_on = [], []
    ref_lp, ref_ent, ref_grads = _logits_step(engine, _micro_batch(layout, use_fused_kernels=False), False, seen_off)
    lp, ent, grads = _logits_step(engine, _micro_batch(layout, use_fused_kernels=False), True, seen_on)
    assert seen_off == [rows.numel() + 5] and seen_on == [int(rows.sum())]  # (5 static pad rows)
    _assert_same_on_the_loss_rows((lp, ent, grads), (ref_lp, ref_ent, ref_grads), rows)


@pytest.mark.parametrize("first, second, path", [(a, b, path) for a, b, paths, _ in schema.REFUSED_TOGETHER
                                                   for path in paths if path.startswith("FSDP")])
def test_each_refused_combination_is_refused_at_the_engine_step_by_the_one_table(served, first, second, path):
    """Every combination the integration's table refuses on an FSDP path (Σπ² with top-K on the
    fused path, loss_rows_only with top-K on the logits path) is refused by the engine step's
    asks() with the table's own message, naming both features; each feature alone is served."""
    fused = path == "FSDP fused"
    model = tiny_qwen2()
    if fused:
        apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True,
                           fused_kernels_backend=rkv.BACKEND_NAME)
    flags = {"sum_pi_squared": {"calculate_sum_pi_squared": True}, "topk": {"distillation_use_topk": True},
             "loss_rows_only": {}}

    def micro_batch(*features):
        data = _micro_batch("nested", use_fused_kernels=fused, **{k: v for f in features for k, v in flags[f].items()})
        if "topk" in features:  # the teacher's tensors, as verl's trainer hands them
            ids = torch.nested.nested_tensor([torch.zeros(p + r, 2, dtype=torch.long) for p, r in zip(PROMPTS, RESPONSES)],
                                             layout=torch.jagged)
            data["teacher_ids"], data["teacher_logprobs"] = ids, ids.float()
        return data

    for features in ((first,), (second,), (first, second)):
        rkv.configure(loss_rows_only="loss_rows_only" in features)
        if len(features) == 1:
            fields = fsdp_engine.asks(_engine(model), micro_batch(*features), None)
            assert all(fields[f] for f in features if f != "topk" or fused), (features, fields)
            continue
        message = schema.refused_together(set(features), path)
        assert schema.FEATURES[first] in message and schema.FEATURES[second] in message, message
        with pytest.raises(rkv.VerlIntegrationError, match=re.escape(message)):
            fsdp_engine.asks(_engine(model), micro_batch(*features), None)


def test_logits_path_refuses_top_k_distillation_with_loss_rows(served):
    model = tiny_qwen2()
    rkv.configure(loss_rows_only=True)
    micro_batch = _micro_batch("nested", use_fused_kernels=False, distillation_use_topk=True)
    with pytest.raises(rkv.VerlIntegrationError, match="loss_rows_only together with top-K distillation on the FSDP "
                                                       "logits path"):
        fsdp_engine.asks(_engine(model), micro_batch, None)
