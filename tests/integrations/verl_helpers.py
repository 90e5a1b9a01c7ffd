"""Shared pieces of the verl integration tests: a tiny random Qwen2, verl's unpatched path, a bare
FSDP engine, and a micro-batch for verl's distillation loss functions."""
from __future__ import annotations

import contextlib
import types

import torch

# H = 64, 2 layers, V = 1000 + 37 (odd, not a multiple of any tile or split)
VOCAB = 1037


def tiny_qwen2(seed: int = 0, lm_head_std: float = 0.5):
    """A random fp32 Qwen2ForCausalLM. lm_head ~ N(0, 0.5^2) so that, after the final RMSNorm,
    logits spread over several nats (the default 0.02 init gives a near-uniform softmax, where
    log-prob and entropy gradients are almost zero and a wrong gradient could hide)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False,
                      max_position_embeddings=128, attn_implementation="sdpa")
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, lm_head_std)
    return model


def rollout_tensors():
    """Two sequences (5 prompt + 6 response tokens), one left-padded, one right-padded: a dict of
    prompts, responses, input_ids, attention_mask, position_ids, response_mask, and the generator
    that drew them (for more draws in the same stream)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, VOCAB, (2, 5), generator=g)
    responses = torch.randint(0, VOCAB, (2, 6), generator=g)
    input_ids = torch.cat([prompts, responses], 1)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :2] = 0
    attention_mask[0, -2:] = 0
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return {"prompts": prompts, "responses": responses, "input_ids": input_ids,
            "attention_mask": attention_mask, "position_ids": position_ids,
            "response_mask": attention_mask[:, 5:].clone()}, g


@contextlib.contextmanager
def verl_unpatched():
    """verl exactly as installed (rl-kernels' patches removed), restored on exit."""
    import rl_kernels.integrations.verl as rkv

    was = rkv.is_patched()
    rkv.unpatch()
    try:
        yield
    finally:
        if was:
            rkv.patch()


def verl_logits_path(model, forward, temperature, labels, **inputs):
    """log-probs and entropy as verl computes them without fused kernels: the model's original
    HF forward materializes logits, then verl's own logprobs_from_logits / entropy_from_logits."""
    import verl.utils.torch_functional as verl_F

    with verl_unpatched():
        logits = forward(model, **inputs, return_dict=True).logits.float() / temperature
        return verl_F.logprobs_from_logits(logits, labels), verl_F.entropy_from_logits(logits)


def _loss_data(lengths):
    """A verl micro-batch for the loss functions: every token a response token except the first
    of each sequence, nested as verl's no-padding batches (prompts 1 token per sequence)."""
    from tensordict import TensorDict

    b, width = len(lengths), max(lengths) - 1
    mask = torch.zeros(b, width, dtype=torch.bool)
    attention = torch.zeros(b, width + 1, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n - 1] = True
        attention[i, :n] = 1
    return TensorDict({"prompts": torch.zeros(b, 1, dtype=torch.long),
                       "responses": torch.zeros(b, width, dtype=torch.long), "attention_mask": attention,
                       "response_mask": mask}, batch_size=[b])


def bare_fsdp_engine(model, **attributes):
    """verl's FSDPEngineWithLMHead without its __init__ (no FSDP, no process group; its methods as they
    are): ``model`` as its module, float32 autocast, no Ulysses, no padding to a static length, the
    entropy neither checkpointed nor chunked; then ``attributes`` set on it (what a test's forward
    step reads besides, or another value)."""
    import verl.workers.engine.fsdp.transformer_impl as impl

    engine = impl.FSDPEngineWithLMHead.__new__(impl.FSDPEngineWithLMHead)
    engine.module, engine.use_ulysses_sp, engine.pad_to_length = model, False, False
    engine._autocast_dtype = torch.float32
    engine.engine_config = types.SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False)
    for name, value in attributes.items():
        setattr(engine, name, value)
    return engine


def as_second_ulysses_rank_of_two(monkeypatch, engine):
    """``engine`` (:func:`bare_fsdp_engine`) as rank 1 of a Ulysses group of 2 in one process: verl's
    ``slice_input_tensor`` takes the second half of the dimension it slices, and the engine runs
    Ulysses SP of size 2 without static padding."""
    import verl.utils.ulysses as ulysses

    monkeypatch.setattr(ulysses, "slice_input_tensor",
                        lambda x, dim, padding=False: x.narrow(dim, x.shape[dim] // 2, x.shape[dim] // 2))
    engine.pad_to_length, engine.use_ulysses_sp, engine.ulysses_sequence_parallel_size = False, True, 2
    return engine
