"""What each Hugging Face causal-LM class does between its last hidden state and its logits, so that
the fused head computes the model's own log-probs, or refuses.

verl's fused forwards (``dense_common`` and its VLM variants) compute the log-probs from
``model.model(...)``'s last hidden state and ``model.lm_head.weight`` alone: ``h @ W.T / T``. Several
model classes do more in their own ``forward`` after the last hidden state, and for those a fused head
that skips it is wrong by up to hundreds of nats, silently (Gemma 2's soft-capping, Cohere's
``logit_scale``, Granite's ``logits_scaling``). rl-kernels reads the transform from the model and
hands it to :func:`rl_kernels.linear_log_probs`:

* **plain**: logits = lm_head(h): nothing to do (the lm_head must have no bias: checked);
* **soft-capped**: logits = c tanh(lm_head(h) / c), c from the config (``softcap=c``; a config value of
  None means no cap where the model's forward skips it then);
* **scaled**: logits = s lm_head(h) or lm_head(h) / s (a constant): folded into the temperature,
  ``temperature=T / s`` (or ``T s``), which is exact in real arithmetic; the effective temperature is
  checked with the usual rules and an error names the model's attribute;
* **refused**: anything else, and every model type this table does not list (a newer transformers
  adds models; unknown means refused), with :class:`VerlIntegrationError` naming the model type and
  why.

The table :data:`LM_HEADS` is an audit of ``transformers`` 5.10.4's ``MODEL_FOR_CAUSAL_LM_MAPPING``
(every ``*ForCausalLM`` / ``*ForConditionalGeneration`` class that ``AutoModelForCausalLM`` builds,
163 model types) plus the text models behind verl's VLM fused forwards (qwen2_vl, qwen2_5_vl,
qwen3_vl, qwen3_vl_moe, glm4v, qwen3_5, qwen3_5_moe): each class's ``forward`` was read from the
assignment of ``hidden_states`` to the return. Re-audited on ``transformers`` 5.24.0 (2026-11-26,
196 model types): the 33 types it adds are marked "added in the 5.24.0 audit" below (with
``emu3_text_model``, which 5.10.4's audit missed), and the heads of the 163 earlier types were
compared with 5.10.4's (no change to what any of them does to its logits). Classes whose forward
does not get its hidden state from ``self.model(...)`` (what verl's fused forward calls) are
refused: verl's fused forward would not compute their hidden state.
``tests/integrations/test_lm_heads.py`` builds a tiny random model of every listed type it can, scales its
``lm_head`` so that the logits reach the cap, and compares the patched fused forward with the
model's own logits.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import torch

from .verl_impl.schema import VerlIntegrationError

PLAIN, SOFTCAPPED, SCALED, REFUSED = "plain", "soft-capped", "scaled", "refused"


@dataclasses.dataclass(frozen=True)
class LMHead:
    """One model type's audited transform. ``attribute``: where the constant is read, relative to the
    model (``config.x``; ``text_config.x`` is ``model.config.get_text_config().x``; other paths are
    attributes of the model); ``op``: ``"cap"`` (c tanh(z / c)), ``"mul"`` (z s) or ``"div"`` (z / s);
    a None value there means the forward skips the transform (every audited forward tests for None);
    ``why``: a refusal's reason."""

    kind: str
    attribute: str | None = None
    op: str | None = None
    why: str = ""


@dataclasses.dataclass(frozen=True)
class HeadTransform:
    """What the fused head applies for one model: logits = multiplier * cap(h . w), cap(z) =
    softcap tanh(z / softcap) (identity when softcap is None). ``description`` names the source."""

    softcap: float | None = None
    multiplier: float = 1.0
    description: str = "plain lm_head(hidden_states)"

    def temperature(self, temperature: float) -> float:
        """The temperature that folds ``multiplier`` in: z * multiplier / T = z / (T / multiplier)."""
        return temperature / self.multiplier


_PLAIN_TYPES = """
    afmoe apertus arcee aria_text bamba bitnet blt cwm deepseek_v2 deepseek_v3 deepseek_v4 diffllama
    doge dots1 emu3 ernie4_5 ernie4_5_moe exaone4 exaone_moe flex_olmo fuyu gemma gemma3 glm glm4
    glm4_moe glm4_moe_lite glm4v glm_moe_dsa got_ocr2 gpt_oss helium hrm_text hunyuan_v1_dense
    hunyuan_v1_moe hy_v3 jais2 jamba jetmoe laguna lfm2 lfm2_moe llama llama4 llama4_text
    longcat_flash mellum minimax minimax_m2 ministral ministral3 mistral mixtral mllama moshi
    nemotron nemotron_h olmo olmo2 olmo3 olmo_hybrid olmoe persimmon phi3 phi4_multimodal phimoe
    qwen2 qwen2_5_vl qwen2_moe qwen2_vl qwen3 qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text
    qwen3_moe qwen3_next qwen3_vl qwen3_vl_moe seed_oss smollm3 solar_open stablelm starcoder2 xglm
    youtu zamba zamba2
""".split() + """
    apertus1p5_text axk1 axk2 bailing_hybrid deepseek_v32 dots3_note dots3_note_text exaone flint hy_v4
    internlm3 iquestcoder kimi_linear kolibri1 lara_mini lfm3 mimo_v2_flash minimax_m3_vl_text
    moss_transcribe_diarize qwen4_exp qwen4_exp_text sarvam_mla sarvam_moe zaya
""".split()  # added in the 5.24.0 audit. exaone, internlm3, iquestcoder: LlamaForCausalLM; sarvam_mla:
# DeepseekV3ForCausalLM; sarvam_moe: Glm4MoeForCausalLM. zaya: lm_head bias=config.lm_head_bias (False by
# default; a bias is refused by the check in head_transform). hy_v4 keeps lm_head in float32 and casts
# the hidden state to it: the same logits in real arithmetic; the fused head computes in the hidden
# state's dtype (as the model's own lm_head does under verl's FSDP mixed precision).

_NOT_SELF_MODEL = ("its forward does not take its last hidden state from self.model(...), which is what "
                   "verl's fused forward calls")
_NOT_SELF_MODEL_TYPES = """
    bart bert bert-generation big_bird bigbird_pegasus biogpt blenderbot blenderbot-small bloom
    camembert codegen cpmant ctrl data2vec-text dbrx electra ernie falcon falcon_mamba git gpt-sw3
    gpt2 gpt_bigcode gpt_neo gpt_neox gpt_neox_japanese gptj mamba mamba2 marian mbart megatron-bert
    mpt mvp openai-gpt opt pegasus plbart prophetnet reformer rembert roberta roberta-prelayernorm
    roc_bert roformer rwkv trocr whisper xlm xlm-roberta xlm-roberta-xl xlnet xlstm xmod
""".split()

LM_HEADS: dict[str, LMHead] = {
    **{t: LMHead(PLAIN) for t in _PLAIN_TYPES},
    **{t: LMHead(REFUSED, why=_NOT_SELF_MODEL) for t in _NOT_SELF_MODEL_TYPES},
    # final-logit soft-capping (Gemma 2 and its descendants): None in the config = no cap
    **{t: LMHead(SOFTCAPPED, "config.final_logit_softcapping", "cap")
       for t in ("gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "gemma4_unified_text", "nanochat",
                 "vaultgemma")},
    **{t: LMHead(SOFTCAPPED, "text_config.final_logit_softcapping", "cap")
       for t in ("gemma3n", "gemma4", "gemma4_unified")},
    "beam": LMHead(SOFTCAPPED, "config.final_logit_softcapping", "cap"),  # added in the 5.24.0 audit
    # always capped by a module built from config.final_logit_softcapping at __init__ (Inkling2Softcap:
    # c tanh(z / c); no None test, a None cap fails in the model's own forward): read from the module
    **{t: LMHead(SOFTCAPPED, "logit_softcap.softcap", "cap") for t in ("inkling2_text", "inkling2_loop_text")},
    # always capped (logits_soft_cap), but its base model returns no past_key_values, which verl's fused
    # forward reads: verl cannot run it
    "recurrent_gemma": LMHead(REFUSED, why="verl's fused forward cannot run it (its base model output has no "
                                          "past_key_values); its forward also soft-caps at config.logits_soft_cap"),
    # MllamaForCausalLM's config (the text model of Llama 3.2 Vision) names itself so
    "mllama_text_model": LMHead(PLAIN),
    # and Emu3ForCausalLM's (AutoModelForCausalLM gives it the text config of an emu3 config; found in
    # the 5.24.0 audit, the same on 5.10.4)
    "emu3_text_model": LMHead(PLAIN),
    # constant multipliers of the logits
    **{t: LMHead(SCALED, "logit_scale", "mul") for t in ("cohere", "cohere2", "cohere2_moe", "cohere_compass_text")},
    "hyperclovax": LMHead(SCALED, "config.logits_scaling", "mul"),
    "falcon_h1": LMHead(SCALED, "model.lm_head_multiplier", "mul"),
    **{t: LMHead(SCALED, "config.logits_scaling", "div")
       for t in ("granite", "granitemoe", "granitemoehybrid", "granitemoeshared", "granite_swa", "granitemoe_swa")},
    # lm_head(hidden_states / s) = lm_head(hidden_states) / s (no bias); s is a read-only property of the
    # config, hidden_size / dim_model_base (added in the 5.24.0 audit)
    "minicpm3": LMHead(SCALED, "config.logits_scaling", "div"),
    # other heads
    "phi": LMHead(REFUSED, why="its lm_head has a bias (PhiForCausalLM builds it with bias=True), which "
                               "verl's fused forward and the fused head leave out"),
    **{t: LMHead(REFUSED, why="its logits are masked_embedding(last_hidden_state, lm_head.weight), "
                            "not lm_head(hidden_states)") for t in ("gemma4_assistant", "gemma4_unified_assistant")},
    "modernbert-decoder": LMHead(REFUSED, why="its logits are decoder(lm_head(hidden_states)): lm_head is a "
                                               "prediction head, not the vocabulary projection"),
    **{t: LMHead(REFUSED, why="its logits come from one head per audio codebook")
       for t in ("musicgen", "musicgen_melody")},
    # added in the 5.24.0 audit
    "dory": LMHead(REFUSED, why="its lm_head (DoryLMHead) multiplies the logits by a learned per-token scale "
                                "(lm_head.logit_scale, one value per vocabulary entry), which verl's fused forward "
                                "and the fused head leave out"),
    "inkling_text": LMHead(REFUSED, why="its logits are cut to config.unpadded_vocab_size (lm_head's padding rows "
                                        "leave the softmax), which the fused head, over every row of lm_head.weight, "
                                        "does not do; its forward also divides the hidden state by "
                                        "config.logits_mup_width_multiplier"),
}
"""model_type -> audited transform (see the module docstring)."""


def _read(model, path: str):
    obj = model
    if path.startswith("text_config."):
        obj, path = model.config.get_text_config(), path.removeprefix("text_config.")
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def _constant(model_type: str, path: str, value, what: str) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: model type {model_type!r}: {path} = {value!r} "
                                   f"is not a positive finite number; the fused head cannot apply it as {what}")
    return float(value)


def head_transform(model) -> HeadTransform:
    """The transform that ``model`` (a Hugging Face causal LM) applies between its last hidden state
    and its logits, per :data:`LM_HEADS`. Raises :class:`VerlIntegrationError` naming the model type
    (and the attribute) for a refused or unlisted type, an lm_head with a bias, or a non-positive
    or non-finite constant."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    cls = type(model).__name__
    entry = LM_HEADS.get(model_type)
    if entry is None:
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: model type {model_type!r} ({cls}) is not in rl-kernels' audit of "
            f"causal-LM heads, so rl-kernels cannot tell whether its forward changes the logits after "
            f"lm_head (soft-capping, scaling, a bias); the fused path is refused for it. Use "
            f"use_fused_kernels=False (rl-kernels' logits path runs on the model's own logits).")
    if entry.kind == REFUSED:
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: model type {model_type!r} ({cls}) is refused on the fused path: "
            f"{entry.why}. Use use_fused_kernels=False (rl-kernels' logits path).")
    head = getattr(model, "lm_head", None)
    if getattr(head, "bias", None) is not None:
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: model type {model_type!r} ({cls}): lm_head has a bias, which the "
            f"fused head (hidden_states @ lm_head.weight.T) does not add; refused. Use use_fused_kernels=False.")
    if entry.kind == PLAIN:
        return HeadTransform()
    value = _read(model, entry.attribute)
    if value is None:
        return HeadTransform(description=f"plain ({entry.attribute} is None)")
    if entry.op == "cap":
        cap = _constant(model_type, entry.attribute, value, "a soft cap")
        return HeadTransform(softcap=cap, description=f"soft-capped at {entry.attribute} = {cap:g}")
    scale = _constant(model_type, entry.attribute, value, "a logit scale")
    multiplier = scale if entry.op == "mul" else 1.0 / scale
    sign = "*" if entry.op == "mul" else "/"
    return HeadTransform(multiplier=multiplier,
                         description=f"logits {sign} {entry.attribute} ({scale:g}), folded into the temperature")


def kinds() -> dict[str, list[str]]:
    """kind -> sorted model types (the docs' table, integrations/verl/README.md, lists them so)."""
    out: dict[str, list[str]] = {}
    for model_type, entry in sorted(LM_HEADS.items()):
        out.setdefault(entry.kind, []).append(model_type)
    return out
