"""Tiny random Hugging Face causal LMs of any model type, for tests/test_lm_heads.py.

``tiny_model(model_type)`` builds the type's config with small sizes (the common size arguments,
then every expert / intermediate / rank count it has shrunk), refuses configs of more than
``MAX_PARAMS`` parameters (checked on the meta device first), and returns the model in float32
with a fixed seed, or raises ``Untestable`` with the reason (a config this recipe cannot make
small, an extra dependency) so the test can say which audited types it could not build.
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
          "mamba_d_ssm": 64, "num_kv_shared_layers": 0, "laurel_rank": 4}
# per model type: what the recipe above cannot guess
OVERRIDES = {"gemma3n_text": {"activation_sparsity_pattern": [0.0, 0.0]}}


class Untestable(Exception):
    pass


def _config(model_type):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    kwargs = dict(SIZES)
    try:
        probe = cls()
    except Exception as exc:  # noqa: BLE001
        raise Untestable(f"default config: {type(exc).__name__}: {str(exc)[:80]}") from exc
    text = probe.get_text_config() if hasattr(probe, "get_text_config") else probe
    for name, value in SHRINK.items():
        if hasattr(text, name):
            kwargs[name] = value
    kwargs.update(OVERRIDES.get(model_type, {}))
    accepted = inspect.signature(type(text).__init__).parameters
    for name in ("layer_types", "block_types"):  # one of each kind in the first layers, when settable
        kinds = list(dict.fromkeys(getattr(text, name, None) or []))
        if kinds and name in accepted:
            kwargs[name] = (kinds * 2)[:max(2, len(kinds))]
            kwargs["num_hidden_layers"] = len(kwargs[name])
    if text is not probe:  # a composite config: the sizes go to its text config
        text_kwargs = {k: v for k, v in kwargs.items() if hasattr(text, k) or k in SIZES}
        try:
            return cls(text_config=type(text)(**text_kwargs))
        except Exception as exc:  # noqa: BLE001
            raise Untestable(f"composite config: {type(exc).__name__}: {str(exc)[:80]}") from exc
    try:
        return cls(**kwargs)
    except Exception as exc:  # noqa: BLE001
        raise Untestable(f"config: {type(exc).__name__}: {str(exc)[:80]}") from exc


def tiny_model(model_type, model_class):
    config = _config(model_type)
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
