"""Public API of the fused linear head: ``linear_log_probs`` (log-probs, entropy and sum of
squared probabilities of softmax(hidden_states @ weight.T / temperature), logits never stored) and
``linear_topk`` (the K most probable tokens of each row and their log-probs, logits never stored)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .autograd.head_family import split_temperature
from .autograd.linear import HeadParams, linear_head
from .autograd.linear_topk import TopkParams, linear_topk_call
from .autograd.vocab_parallel import parallel_params
from .core.backends import get_backend
from .core.validation import (check_bool_arg, check_head_inputs, check_hidden_weight, check_softcap, check_temperature,
                              check_top_k, public_signature, raise_extra_positional)

# the public names (rl_kernels/__init__.py exports them)
__all__ = ["LogProbsOutput", "linear_log_probs", "linear_topk"]


class LogProbsOutput(NamedTuple):
    """log_probs, entropy and sum_pi_squared, float32, shaped like ``labels`` (entropy /
    sum_pi_squared None when not asked)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None
    sum_pi_squared: torch.Tensor | None = None


@public_signature
def linear_log_probs(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *extra_positional,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    ignore_index: int = -100,
    return_entropy: bool = True,
    return_sum_pi_squared: bool = False,
    backend: str = "auto",
    process_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = False,
) -> LogProbsOutput:
    """Log-probability of ``labels``, entropy and sum of squared probabilities of p = softmax(z),
    z = hidden_states @ weight.T / temperature, without storing the (tokens x vocab) logits.

    log p_y = z_y - logsumexp(z), entropy = -sum_v p_v log p_v, sum_pi_squared = sum_v p_v^2; gradients from the
    softmax derivative d p_v / d z_j = p_v ([v = j] - p_j). With ``softcap`` c: z_v = c tanh((h . w_v) / c) / T
    (final-logit soft-capping of "Gemma 2: Improving Open Language Models at a Practical Size", 2024, sec. 2).

    Args:
        hidden_states: (..., H) bfloat16, float16 or float32, any strides, H >= 1. Differentiable.
        weight: (V, H) lm_head weight, same dtype and device. Differentiable.
        labels: int64/int32 of shape ``hidden_states.shape[:-1]``, each in [0, V) or ``ignore_index``.
        temperature: a Python number in [2.9e-39, 8.5e37] (1 / T a normal float32), or a float
            tensor shaped like ``labels`` of such values (one per row, read once on the host; not requiring grad).
        softcap: None (no cap) or a positive Python number c with 1 / c and c / T normal float32 numbers.
        ignore_index: int that fits the labels' dtype (negative with ``process_group``): the label of rows that
            get 0 for every output and contribute nothing to either gradient, even when non-finite.
        return_entropy: bool; False: entropy is None (not computed).
        return_sum_pi_squared: bool; True: also sum_pi_squared (differentiable).
        backend: 'auto' (Triton on CUDA, torch elsewhere), 'triton' (CUDA, or TRITON_INTERPRET=1), 'torch'.
        process_group: a torch.distributed group sharding the vocabulary: ``weight`` is this rank's contiguous
            (V_r, H) shard (group-rank order) and ``labels`` are global ids. Every rank returns the same outputs;
            backward gives this shard's weight gradient and a partial hidden gradient.
        vocab_start_index: int >= 0, global id of ``weight``'s first row (only with ``process_group``); None
            derives it from the group (one small all_gather).
        reduce_hidden_grad: bool (only with ``process_group``): all-reduce the hidden gradient over the group;
            leave False under Megatron's ColumnParallelLinear, whose input region does it.

    Returns:
        ``LogProbsOutput(log_probs, entropy, sum_pi_squared)``: float32 shaped like ``labels`` (log_probs and
        entropy in nats, sum_pi_squared a probability in (0, 1]; None where not asked), the logits accumulated in
        float32 on every backend. A row whose hidden state is non-finite gets non-finite outputs (that row only).

    Raises:
        TypeError: an argument of the wrong type or dtype (the message names it).
        ValueError: an argument outside the domain stated above: shape, device, value (the message names it).
            On CUDA with the Triton backend a label outside [0, V) is found without a host sync (the row's outputs
            are NaN) and raised by the next rl_kernels call or backward (RL_KERNELS_SYNC_LABEL_CHECK=1: the call).
        RuntimeError: backend 'triton' without CUDA or TRITON_INTERPRET=1, or without triton;
            ``process_group`` with torch.distributed not initialized; a double backward.
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(linear_log_probs, extra_positional)
    check_head_inputs(hidden_states, weight, labels, ignore_index, check_values=False)
    temperature = check_temperature(temperature, labels)
    softcap = check_softcap(softcap, temperature)
    check_bool_arg("return_entropy", return_entropy)
    check_bool_arg("return_sum_pi_squared", return_sum_pi_squared)
    tp = parallel_params(process_group, vocab_start_index, reduce_hidden_grad, ignore_index, weight.shape[0],
                         hidden_states.device)
    resolved = get_backend(backend, hidden_states.device)
    lead_shape = labels.shape
    h2, labels1 = hidden_states.reshape(-1, hidden_states.shape[-1]), labels.reshape(-1)
    inv_temperature, runtime_temperature = split_temperature(temperature)
    params = HeadParams(backend=resolved, inv_temperature=inv_temperature, ignore_index=int(ignore_index),
                        return_entropy=return_entropy, return_sum_pi_squared=return_sum_pi_squared, softcap=softcap)
    # the family's one route (eager and compiled, a vocab shard with ``tp``): label values are
    # checked in its backend call
    out = linear_head(h2, weight, labels1, params, None, runtime_temperature, tp)
    return LogProbsOutput(*(o if o is None else o.view(lead_shape)
                            for o in (out.log_probs, out.entropy, out.sum_pi_squared)))




@public_signature(required=("k",))  # (k defaults to None only for a misplaced positional k's message)
def linear_topk(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    *extra_positional,
    temperature: float | torch.Tensor = 1.0,
    softcap: float | None = None,
    k: int | None = None,
    backend: str = "auto",
    process_group=None,
    vocab_start_index: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most probable tokens of each row of p = softmax(hidden_states @ weight.T / temperature), as
    log-probs and ids, without storing the (tokens x vocab) logits: the student's top-K of the overlap metrics
    of "Rethinking On-Policy Distillation" (arXiv:2604.13016).

    Ids in the order of ``torch.topk`` of the float32 logits (descending, ties to the smaller id); their
    log-probs log p_v = z_v - logsumexp(z). Logits closer than their float32 rounding may rank otherwise than
    in float64.

    Args:
        hidden_states: (..., H) bfloat16, float16 or float32, any strides, H >= 1. No gradient (none of the
            outputs has one), so it may require grad.
        weight: (V, H) lm_head weight, same dtype and device. No gradient, so it may require grad.
        temperature: a Python number in [2.9e-39, 8.5e37] (1 / T a normal float32), or a float
            tensor of such values shaped ``hidden_states.shape[:-1]`` (one per row). Scales the log-probs only.
        softcap: None (no cap) or a positive Python number c: z_v = c tanh((h . w_v) / c) / T (the Gemma 2 cap),
            1 / c and c / T normal float32 numbers.
        k: int in [1, min(128, V)] (V: the whole vocabulary with ``process_group``). Required.
        backend: 'auto' (Triton on CUDA, torch elsewhere), 'triton' (CUDA, or TRITON_INTERPRET=1), 'torch'.
        process_group: a torch.distributed group sharding the vocabulary: ``weight`` is this rank's contiguous
            (V_r, H) shard (group-rank order). Every rank returns the same outputs, with global ids.
        vocab_start_index: int >= 0, global id of ``weight``'s first row (only with ``process_group``); None
            derives it from the group (one small all_gather).

    Returns:
        ``(log_probs, token_ids)``: (..., k) float32 in nats, descending, and (..., k) int64; neither has a
        gradient (for differentiable log-probs at these ids: ``rl_kernels.distill.linear_log_probs_at_ids``).
        A NaN or -inf logit is never selected; a row with a NaN logit gets NaN log-probs; a slot that nothing
        fills (fewer than k logits neither NaN nor -inf) gets id -1 and log-prob NaN. Other rows are unaffected.

    Raises:
        TypeError: an argument of the wrong type or dtype, ``k`` not an int (the message names the argument).
        ValueError: an argument outside the domain stated above: shape, device, value (the message names it).
        RuntimeError: backend 'triton' without CUDA or TRITON_INTERPRET=1, or without triton;
            ``process_group`` with torch.distributed not initialized.
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(linear_topk, extra_positional)
    check_hidden_weight(hidden_states, weight)
    rows = hidden_states.select(-1, 0)  # (the leading shape and device, for a per-row temperature)
    # (no output has a gradient: inputs that require grad are taken, and detached as the tensors below)
    temperature = check_temperature(temperature, rows, "hidden_states.shape[:-1]", differentiable=False)
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.detach()
    softcap = check_softcap(softcap, temperature)
    tp = parallel_params(process_group, vocab_start_index, False, -100, weight.shape[0], hidden_states.device)
    vocab_size = weight.shape[0] if tp is None else tp.vocab_size  # (None: a shard's total not known)
    check_top_k("k", k, vocab_size, weight)
    resolved = get_backend(backend, hidden_states.device)
    lead = hidden_states.shape[:-1]
    h2 = hidden_states.reshape(-1, hidden_states.shape[-1]).detach()
    inv_temperature, runtime_temperature = split_temperature(temperature)
    params = TopkParams(backend=resolved, inv_temperature=inv_temperature, k=k, softcap=softcap)
    log_probs, token_ids = linear_topk_call(h2, weight.detach(), params, runtime_temperature, tp)
    return log_probs.view(*lead, k), token_ids.view(*lead, k)
