"""Tiny random Hugging Face causal LMs of any model type, for tests/integrations/test_lm_heads.py.

``tiny_model(model_type)`` builds the type's config with small sizes (the common size arguments,
then every expert / intermediate / rank count it has shrunk), refuses configs of more than
``MAX_PARAMS`` parameters (checked on the meta device first), and returns the model in float32
with a fixed seed, or raises ``Untestable`` with the reason (a config this recipe cannot make
small, an extra dependency) so the test can say which audited types it could not build.

Works on transformers releases with and without heterogeneous configs (``per_layer_config``, newer
5.x): there an attribute that differs between layers (Gemma 4's ``head_dim``, ...) raises
``AmbiguousGlobalPerLayerAttributeError`` when read on the global config, so the recipe looks for
the config's ``per_layer_attributes`` before reading one, and passes the tiny model its own
``per_layer_config`` (detected from the config, never from a version string).
"""
import inspect
import warnings

import torch

MAX_PARAMS = 2_000_000
VOCAB = 97
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
# attribute names (substrings) that count experts, ranks or widths: shrunk when present
SHRINK = {"num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_intermediate_size": 16,
          "num_experts_per_tok": 2, "n_shared_experts": 1, "kv_lora_rank": 16, "q_lora_rank": 16,
          "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "shared_expert_intermediate_size": 16,
          "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "linear_num_key_heads": 2,
          "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
          "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 8, "mamba_n_groups": 1,
          "mamba_expand": 2, "mamba_d_conv": 4, "num_nextn_predict_layers": 0, "vocab_size_per_layer_input": VOCAB,
          "hidden_size_per_layer_input": 8, "altup_num_inputs": 2, "sliding_window": 16, "attention_window_size": 16,
          "lru_width": 32, "num_shared_experts": 1, "moe_num_experts": 4, "moe_k": 2, "moe_topk": 2,
          "mamba_d_ssm": 64, "num_kv_shared_layers": 0, "laurel_rank": 4, "unpadded_vocab_size": VOCAB,
          # Mamba-2 blocks (nemotron_h): heads x head dim = expand x hidden_size; their naive CPU path
          # materializes (heads, chunk, chunk, state) tensors: 25 s a test at the default sizes
          "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 8, "n_groups": 1, "chunk_size": 16}
# per model type: what the recipe above cannot guess
_QWEN4_EXP = {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
              "indexer_compress_ratio": 4}  # its indexed-attention layers need all five
_DOTS3 = {"head_dim": 16}  # its sliding-window layers need head_dim = qk_nope_head_dim + qk_rope_head_dim
OVERRIDES = {"gemma3n_text": {"activation_sparsity_pattern": [0.0, 0.0]},
             "minicpm3": {"dim_model_base": 4},  # its logits_scaling = hidden_size / dim_model_base = 8
             "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 10000.0}}},
             "zaya": {"num_experts_per_tok": 1},
             "qwen4_exp": _QWEN4_EXP, "qwen4_exp_text": _QWEN4_EXP, "dots3_note": _DOTS3, "dots3_note_text": _DOTS3}


class Untestable(Exception):
    pass


def _per_layer_attributes(config):
    """The attributes that ``config`` sets per layer (a heterogeneous config: its
    ``per_layer_attributes`` property); empty where transformers has no per-layer configs."""
    return set(getattr(config, "per_layer_attributes", None) or ())


def _has(config, name):
    """``hasattr`` that does not read a per-layer attribute on the global config (that raises)."""
    return name in _per_layer_attributes(config) or hasattr(config, name)


def _per_layer_config(text, kwargs):
    """For a heterogeneous default config ``text``: the tiny model's ``per_layer_config``. Tiny
    layer i takes the per-layer values of the first default layer of its layer type (else of default
    layer i), and the small size of this recipe for every per-layer attribute that the recipe sizes
    (so those are the same in every tiny layer). None for a homogeneous config."""
    per_layer = _per_layer_attributes(text)
    if not per_layer:
        return None
    default_types = list(getattr(text, "layer_types", None) or [])
    tiny_types = kwargs.get("layer_types") or []
    out = {}
    for i in range(kwargs["num_hidden_layers"]):
        kind = tiny_types[i] if i < len(tiny_types) else None
        layer = text.per_layer_config[default_types.index(kind) if kind in default_types else i]
        out[i] = {name: kwargs[name] if name in kwargs else getattr(layer, name) for name in sorted(per_layer)}
    return out


def _config(model_type, model_class=None):
    """The tiny config of ``model_type``; for a composite type whose ``model_class`` takes the text
    config (as AutoModelForCausalLM gives it), the tiny text config alone."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    text_only = (getattr(model_class, "config_class", None) is not None
                 and (getattr(cls, "sub_configs", None) or {}).get("text_config") is model_class.config_class)
    kwargs = dict(SIZES)
    try:
        probe = cls()
    except Exception as exc:  # noqa: BLE001
        raise Untestable(f"default config: {type(exc).__name__}: {str(exc)[:80]}") from exc
    text = probe.get_text_config() if hasattr(probe, "get_text_config") else probe
    for name, value in SHRINK.items():
        if _has(text, name):
            kwargs[name] = value
    if _has(text, "kv_lora_rank"):  # multi-head latent attention: one key/value head per query head
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    kwargs.update(OVERRIDES.get(model_type, {}))
    accepted = inspect.signature(type(text).__init__).parameters
    for name in ("layer_types", "block_types"):  # one of each kind in the first layers, when settable
        kinds = list(dict.fromkeys(getattr(text, name, None) or []))
        if kinds and name in accepted:
            kwargs[name] = (kinds * 2)[:max(2, len(kinds))]
            kwargs["num_hidden_layers"] = len(kwargs[name])
    per_layer_config = _per_layer_config(text, kwargs)
    if per_layer_config is not None:
        kwargs["per_layer_config"] = per_layer_config
    if text is not probe:  # a composite config: the sizes go to its text config
        text_kwargs = {k: v for k, v in kwargs.items() if _has(text, k) or k in SIZES}
        try:
            text_config = type(text)(**text_kwargs)
            return text_config if text_only else cls(text_config=text_config)
        except Exception as exc:  # noqa: BLE001
            raise Untestable(f"composite config: {type(exc).__name__}: {str(exc)[:80]}") from exc
    try:
        return cls(**kwargs)
    except Exception as exc:  # noqa: BLE001
        raise Untestable(f"config: {type(exc).__name__}: {str(exc)[:80]}") from exc


def tiny_model(model_type, model_class):
    config = _config(model_type, model_class)
    for attr in ("use_cache",):
        setattr(config, attr, False)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.device("meta"):
                probe = model_class(config)
            params = sum(p.numel() for p in probe.parameters())
            if params > MAX_PARAMS:
                raise Untestable(f"{params} parameters with the small sizes")
            torch.manual_seed(0)
            model = model_class(config).float().eval()
    except Untestable:
        raise
    except Exception as exc:  # noqa: BLE001
        raise Untestable(f"model: {type(exc).__name__}: {str(exc)[:80]}") from exc
    return model
