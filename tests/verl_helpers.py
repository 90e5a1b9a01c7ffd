"""Shared pieces of the verl integration tests: a tiny random Qwen2 and verl's unpatched path."""
from __future__ import annotations

import contextlib

import pytest
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


@pytest.fixture
def qwen2_forward():
    """apply_monkey_patch replaces Qwen2ForCausalLM.forward on the class: restore it after."""
    from transformers import Qwen2ForCausalLM

    original = Qwen2ForCausalLM.forward
    yield original
    Qwen2ForCausalLM.forward = original


# ----------------------------------------------------------------------------- the tail log-mass (issue 45)
def _gathered(z, process_group):
    """This rank's vocab shard ``z`` (..., V_r) and the others' (detached): the whole (..., V) row,
    differentiable w.r.t. this rank's shard only (each rank its shard's gradient)."""
    import torch.distributed as dist

    parts = [torch.empty_like(z) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(parts, z.detach().contiguous(), group=process_group)
    parts[dist.get_rank(process_group)] = z
    return torch.cat(parts, -1)


class _SumGrad(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the group (the hidden states' dh)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _check_distinct(token_ids, counted=None):
    """The library's rule for the tail: distinct ids in each (counted) row (ValueError naming token_ids)."""
    ids = token_ids.sort(-1).values
    repeated = (ids[..., 1:] == ids[..., :-1]).any(-1)
    if counted is not None:
        repeated = repeated & counted
    if bool(repeated.any()):
        raise ValueError("token_ids: an id repeated in a row, with return_tail (stand-in)")


def _at_ids(z, token_ids, return_tail):
    lse = z.logsumexp(-1)
    log_q = z.gather(-1, token_ids.long()) - lse[..., None]
    if not return_tail:
        return log_q, None
    inside = torch.zeros(z.shape, dtype=torch.bool, device=z.device).scatter(-1, token_ids.long(), True)
    return log_q, z.masked_fill(inside, float("-inf")).logsumexp(-1) - lse


def standin_topk_log_probs_from_logits(logits, token_ids, *, temperature=1.0, backend="auto", process_group=None,
                                       vocab_start_index=None, return_tail=False):
    """Plain-torch stand-in (materialized float32 logits; masked logsumexp for the tail) of the
    library's ``topk_log_probs_from_logits`` with ``return_tail`` / ``process_group``, for tests
    run before that library piece is in this checkout."""
    if return_tail:
        _check_distinct(token_ids)
    z = logits.float() / temperature
    if process_group is not None:
        z = _gathered(z, process_group)
    log_q, tail = _at_ids(z, token_ids, return_tail)
    return (log_q, tail) if return_tail else log_q


def standin_linear_log_probs_at_ids(hidden_states, weight, labels, token_ids, *, temperature=1.0, softcap=None,
                                    return_entropy=False, backend="auto", process_group=None, vocab_start_index=None,
                                    reduce_hidden_grad=False, return_tail=False):
    """Plain-torch stand-in of the library's ``linear_log_probs_at_ids`` with ``return_tail``."""
    assert softcap is None
    if return_tail:
        _check_distinct(token_ids, labels != -100)
    h = hidden_states
    if process_group is not None and reduce_hidden_grad:
        h = _SumGrad.apply(h, process_group)
    temperature = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    z = (h.float() @ weight.float().T) / temperature
    if process_group is not None:
        z = _gathered(z, process_group)
    ignored = labels == -100
    log_p = z.log_softmax(-1)
    log_probs = torch.where(ignored, 0.0, log_p.gather(-1, labels.clamp_min(0).long()[..., None])[..., 0])
    entropy = -(log_p.exp() * log_p).sum(-1) if return_entropy else None
    log_q, tail = _at_ids(z, token_ids, return_tail)
    log_q = torch.where(ignored[..., None], log_q.detach(), log_q)
    if not return_tail:
        return log_probs, entropy, log_q
    return log_probs, entropy, log_q, torch.where(ignored, tail.detach(), tail)


def library_has_tail() -> bool:
    """Whether this checkout's library computes the student's tail log-mass (``return_tail``)."""
    import inspect

    from rl_kernels.distill import linear_log_probs_at_ids
    from rl_kernels.logits import topk_log_probs_from_logits

    return all("return_tail" in inspect.signature(fn).parameters
               for fn in (topk_log_probs_from_logits, linear_log_probs_at_ids))


def use_tail_standins(setattr_) -> bool:
    """Where the library has no ``return_tail`` yet, put the plain-torch stand-ins where the verl
    integration looks the two functions up (``setattr_``: a monkeypatch's setattr, or setattr in a
    spawned worker), for the calls the library cannot serve yet (``return_tail``, and
    ``process_group`` for the from-logits one); the others still go to the library. Returns whether
    it did (once the library has them, nothing is replaced)."""
    if library_has_tail():
        return False
    import inspect

    from rl_kernels.integrations.verl import distill

    real_logits, real_linear = distill.topk_log_probs_from_logits, distill.linear_log_probs_at_ids
    logits_tp = "process_group" in inspect.signature(real_logits).parameters

    def topk_log_probs_from_logits(logits, token_ids, *, return_tail=False, **kwargs):
        if return_tail or (kwargs.get("process_group") is not None and not logits_tp):
            return standin_topk_log_probs_from_logits(logits, token_ids, return_tail=return_tail, **kwargs)
        return real_logits(logits, token_ids, **kwargs)

    def linear_log_probs_at_ids(hidden_states, weight, labels, token_ids, *, return_tail=False, **kwargs):
        if return_tail:
            return standin_linear_log_probs_at_ids(hidden_states, weight, labels, token_ids, return_tail=True,
                                                   **kwargs)
        return real_linear(hidden_states, weight, labels, token_ids, **kwargs)

    setattr_(distill, "topk_log_probs_from_logits", topk_log_probs_from_logits)
    setattr_(distill, "linear_log_probs_at_ids", linear_log_probs_at_ids)
    return True


@pytest.fixture
def tail_library(monkeypatch):
    """The library's tail log-mass for the verl integration: the real one, or the stand-ins."""
    return use_tail_standins(monkeypatch.setattr)
