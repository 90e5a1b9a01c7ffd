"""The fused path on every audited model type (rl_kernels.integrations.lm_heads): the patched fused
forward against the model's own logits, or a clear refusal.

For each model type of ``LM_HEADS`` that the installed transformers has: a tiny random float32
model (tests/integrations/lm_head_models.py) whose lm_head is scaled so that its raw logits have a std of ~3
(and, for a soft-capped type, a cap of 2: most logits are past it; for a scaled type, a scale of
1/16 or 8), run once through its own forward (logits -> log_softmax / T, the reference) and once
through verl's ``apply_monkey_patch(..., fused_kernels_backend='rl_kernels')`` fused forward.
Values within 1e-4 nats and parameter gradients of a PPO-like loss within 1e-3 relative (float32
on both sides; what is left is summation order and tanh rounding). The uncapped / unscaled head is
checked to be off by > 1 nat on the same inputs, so a patch that skipped the transform would fail.
Refused and unlisted types raise VerlIntegrationError naming the model type.
"""
import re
import types

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from verl.models.transformers.monkey_patch import apply_monkey_patch

import rl_kernels.integrations.verl as rkv
from lm_head_models import VOCAB, Untestable, tiny_model
from rl_kernels.integrations.lm_heads import LM_HEADS, PLAIN, REFUSED, SCALED, SOFTCAPPED, head_transform
from rl_kernels.integrations.verl_impl.schema import VerlIntegrationError

pytestmark = pytest.mark.verl_matrix  # the patch path differs per verl release (.ci/run: 0.7.1, 0.8.0)

# verl's VLM fused forwards serve these through their text models
VLM_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
               "qwen3_vl": "Qwen3VLForConditionalGeneration", "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
               "glm4v": "Glm4vForConditionalGeneration", "qwen3_5": "Qwen3_5ForConditionalGeneration",
               "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}
INSTALLED = {**{t: (c[0] if isinstance(c, (list, tuple)) else c) for t, c in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()},
             **VLM_CLASSES}
SERVED = sorted(t for t, e in LM_HEADS.items() if e.kind != REFUSED and t in INSTALLED)
T = 0.8
VALUE_ATOL, GRAD_RTOL = 1e-4, 1e-3
SCALE = {"mul": 1 / 16, "div": 8.0}  # Cohere's logit_scale 1/16, Granite's logits_scaling 8


def _stub(model_type):
    return types.SimpleNamespace(config=types.SimpleNamespace(model_type=model_type), lm_head=None)


def test_every_installed_causal_lm_type_is_served_or_refused():
    """Every causal-LM type of the installed transformers either is in the audit table or is
    refused (a newer transformers adds types: unknown means refused, never a silent plain head)."""
    unknown = sorted(set(INSTALLED) - set(LM_HEADS))
    for model_type in unknown + ["a_model_type_from_the_future"]:
        with pytest.raises(VerlIntegrationError, match=f"model type '{model_type}'.*not in rl-kernels' audit"):
            head_transform(_stub(model_type))
    assert len(SERVED) >= 90 and {"gemma2", "cohere", "granite", "llama", "qwen2"} <= set(SERVED)


@pytest.mark.parametrize("model_type", sorted(t for t, e in LM_HEADS.items() if e.kind == REFUSED))
def test_refused_types_raise_with_the_model_type_and_why(model_type):
    with pytest.raises(VerlIntegrationError, match=f"model type '{model_type}'.*refused on the fused path: "
                                                   + re.escape(LM_HEADS[model_type].why[:30])):
        head_transform(_stub(model_type))


def test_lm_head_bias_and_bad_constants_are_refused():
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="llama"),
                                  lm_head=types.SimpleNamespace(bias=torch.zeros(3)))
    with pytest.raises(VerlIntegrationError, match="'llama'.*lm_head has a bias"):
        head_transform(model)
    for value in (0.0, -30.0, float("nan"), "30"):
        model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gemma2", final_logit_softcapping=value),
                                      lm_head=types.SimpleNamespace(bias=None))
        with pytest.raises(VerlIntegrationError, match="'gemma2': config.final_logit_softcapping = .* is not a "
                                                       "positive finite number"):
            head_transform(model)
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gemma2", final_logit_softcapping=None),
                                  lm_head=types.SimpleNamespace(bias=None))
    assert head_transform(model).softcap is None  # Gemma 2's forward skips a None cap


def _set(model, path, value):
    obj = model.config.get_text_config() if path.startswith("text_config.") else model
    parts = path.removeprefix("text_config.").split(".")
    for part in parts[:-1]:
        obj = getattr(obj, part)
    prop = getattr(type(obj), parts[-1], None)
    if isinstance(prop, property) and prop.fset is None:  # derived (MiniCPM3's logits_scaling): the tiny
        assert getattr(obj, parts[-1]) == value, (path, value)  # config sets it (lm_head_models.OVERRIDES)
        return
    setattr(obj, parts[-1], value)


def _prepared(model_type):
    """A tiny model of ``model_type`` with raw logits of std ~3 and its transform made active."""
    try:
        model = tiny_model(model_type, getattr(transformers, INSTALLED[model_type]))
    except Untestable as exc:
        pytest.skip(f"audited from the source; no tiny {model_type} model here: {exc}")
    entry = LM_HEADS[model_type]
    ids = torch.randint(3, VOCAB - 3, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        try:
            raw = model.lm_head(model.model(input_ids=ids)[0])
        except Exception as exc:  # noqa: BLE001 - the tiny config does not run
            pytest.skip(f"audited from the source; the tiny {model_type} model does not run: {str(exc)[:80]}")
        model.lm_head.weight.mul_(3.0 / raw.std().clamp_min(1e-3))
    if entry.kind == SOFTCAPPED:
        _set(model, entry.attribute, 2.0)
    elif entry.kind == SCALED:
        _set(model, entry.attribute, SCALE[entry.op])
    return model, ids


def _reference(model, forward, ids):
    logits = forward(model, input_ids=ids, return_dict=True).logits.float() / T
    log_p = torch.log_softmax(logits, -1)
    labels = torch.roll(ids, shifts=-1, dims=-1)
    return log_p.gather(-1, labels[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)


def _loss(log_probs, entropy):
    adv = torch.randn(log_probs.shape, generator=torch.Generator().manual_seed(2))
    return -(torch.exp(log_probs - log_probs.detach()) * adv).mean() - 0.01 * entropy.mean()


@pytest.fixture
def kernel_backend(request):
    previous = rkv.options().backend
    rkv.configure(backend=request.param)
    yield request.param
    rkv.configure(backend=previous)


def _params(model_type):
    kind = LM_HEADS[model_type].kind
    backends = ["torch", "triton"] if kind != PLAIN or model_type in ("llama", "qwen2") else ["torch"]
    return [(model_type, b) for b in backends]


@pytest.mark.parametrize("model_type,kernel_backend", [p for t in SERVED for p in _params(t)], indirect=["kernel_backend"])
def test_patched_fused_forward_matches_the_model_logits(model_type, kernel_backend):
    cls = getattr(transformers, INSTALLED[model_type])
    original = cls.forward
    try:
        ref_model, ids = _prepared(model_type)
        ref_lp, ref_ent = _reference(ref_model, original, ids)
        _loss(ref_lp, ref_ent).backward()
        model, _ = _prepared(model_type)
        head = head_transform(model)
        if LM_HEADS[model_type].kind != PLAIN:  # the transform matters on these inputs
            with torch.no_grad():
                plain = torch.log_softmax(model.lm_head(model.model(input_ids=ids)[0]).float() / T, -1)
            plain_lp = plain.gather(-1, torch.roll(ids, -1, -1)[..., None])[..., 0]
            assert (plain_lp - ref_lp).abs().max() > 1.0, head
        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                           fused_kernels_backend=rkv.BACKEND_NAME)
        before = rkv.call_counts()["fused_calls"]
        out = model(input_ids=ids, temperature=T, return_dict=True)
        assert rkv.call_counts()["fused_calls"] == before + 1
        torch.testing.assert_close(out.log_probs, ref_lp.detach(), atol=VALUE_ATOL, rtol=0)
        torch.testing.assert_close(out.entropy, ref_ent.detach(), atol=VALUE_ATOL, rtol=0)
        _loss(out.log_probs, out.entropy).backward()
        ref_grads = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
        total = torch.sqrt(sum(g.double().norm() ** 2 for g in ref_grads.values()))
        assert total > 0
        for name, p in model.named_parameters():
            g, r = p.grad, ref_grads.get(name)
            if r is None:
                assert g is None or g.norm() == 0, name
                continue
            # relative to the parameter's own gradient, or to 1e-4 of the whole gradient where that
            # one is ~0 by symmetry (a key bias, an unused expert's gate): float32 noise there
            err = ((g - r).norm() / torch.maximum(r.norm(), 1e-4 * total)).item()
            assert err <= GRAD_RTOL, f"{model_type} {name}: relative gradient error {err:.2e}"
    finally:
        cls.forward = original


def test_patch_refuses_at_apply_monkey_patch_and_warns_for_verl_backends(caplog):
    """A refused type raises when verl patches the model (before any step runs); verl's own fused
    backends on a soft-capped model get a warning that their log-probs skip the cap."""
    phi = getattr(transformers, INSTALLED["phi"])
    original = phi.forward
    try:
        model = tiny_model("phi", phi)
        with pytest.raises(VerlIntegrationError, match="model type 'phi'.*lm_head has a bias"):
            apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                               fused_kernels_backend=rkv.BACKEND_NAME)
        assert not getattr(model, "_rl_kernels_fused", False)
    finally:
        phi.forward = original
    gemma2 = transformers.Gemma2ForCausalLM
    original = gemma2.forward
    try:
        model, _ = _prepared("gemma2")
        with caplog.at_level("WARNING", logger="rl_kernels"):
            apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")
        assert any("impl_backend='torch'" in r.getMessage() and "soft-capped at config.final_logit_softcapping = 2"
                   in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    finally:
        gemma2.forward = original


def test_scaled_head_with_an_unusable_effective_temperature_names_both():
    """Granite's logits_scaling folds into the temperature: an effective temperature outside the
    float32 range is refused with verl's temperature and the model's attribute named."""
    granite = transformers.GraniteForCausalLM
    original = granite.forward
    try:
        model, ids = _prepared("granite")
        model.config.logits_scaling = 1e-40
        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                           fused_kernels_backend=rkv.BACKEND_NAME)
        with pytest.raises(VerlIntegrationError, match=r"temperature 0.8 with the model's logits / "
                                                       r"config.logits_scaling \(1e-40\).*effective temperature"):
            model(input_ids=ids, temperature=0.8, return_dict=True)
    finally:
        granite.forward = original


def test_megatron_fused_path_refuses_models_whose_logits_are_not_the_output_layer():
    """Megatron-Core's GPTModel applies nothing after its output layer; a config that sets a logit
    transform, an output-layer bias or a GPTModel subclass overriding its forward / _postprocess
    is refused where verl sets up the fused forward (patch_fused_forward) on verl 0.9."""
    pytest.importorskip("megatron.core")
    fused = rkv.report()["Megatron fused path"]
    if not fused[0]:  # a verl without every function the Megatron part replaces (0.7.x, 0.8.x)
        pytest.skip(f"rl-kernels does not serve this verl's Megatron engine: {fused[1]}")
    from megatron.core.models.gpt import GPTModel
    from verl.models.mcore import model_forward_fused

    from rl_kernels.integrations.verl_impl.megatron import check_output_layer

    def stub(cls=GPTModel, bias=None, **config):
        model = cls.__new__(cls)
        torch.nn.Module.__init__(model)
        model.config = types.SimpleNamespace(**config)
        model.output_layer = types.SimpleNamespace(bias=bias)
        return model

    check_output_layer(stub(final_logit_softcapping=None, logit_scale=1.0))  # plain: served
    with pytest.raises(VerlIntegrationError, match=r"Megatron model GPTModel: its config sets "
                                                   r"\{'final_logit_softcapping': 30.0\}"):
        check_output_layer(stub(final_logit_softcapping=30.0))
    with pytest.raises(VerlIntegrationError, match="output layer has a bias"):
        check_output_layer(stub(bias=torch.zeros(3)))

    class CappedGPT(GPTModel):
        def _postprocess(self, *args, **kwargs):  # a head transform verl's fused forward would skip
            return super()._postprocess(*args, **kwargs)

    with pytest.raises(VerlIntegrationError, match=r"CappedGPT overrides GPTModel._postprocess"):
        check_output_layer(stub(CappedGPT))
    patched = model_forward_fused.patch_fused_forward
    assert patched._rl_kernels_original is not None  # the engine's setup goes through the check
    with pytest.raises(VerlIntegrationError, match="logits_scaling"):
        patched(stub(logits_scaling=8.0))


def test_the_docs_table_lists_every_audited_type_under_its_kind():
    """integrations/verl/README.md's table is the code's table: every model type in the row or list
    of its kind, in the 5.10.4 audit's section or in the later re-audit's ("## transformers audit")."""
    import pathlib

    from rl_kernels.integrations.lm_heads import kinds

    text = (pathlib.Path(__file__).parents[2] / "integrations" / "verl" / "README.md").read_text()
    sections = [text.split(title, 1)[1].split("\n## ", 1)[0]
                for title in ("## Which models the fused path serves", "## transformers audit")]

    def listed(section, kind, model_type):
        if kind in (SOFTCAPPED, SCALED):
            return f"| `{model_type}` | {kind} |" in section
        head = "Plain (" if kind == PLAIN else "Refused ("
        return head in section and f"`{model_type}`" in section.split(head, 1)[1].split("\n\n", 1)[0]

    for kind, model_types in kinds().items():
        for model_type in model_types:
            assert any(listed(section, kind, model_type) for section in sections), (kind, model_type)
