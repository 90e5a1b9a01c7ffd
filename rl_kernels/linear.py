"""Public API of the fused linear head: ``linear_log_probs`` (log-probs, entropy and sum of
squared probabilities of softmax(hidden_states @ weight.T / temperature), logits never stored) and
``linear_topk`` (the K most probable tokens of each row and their log-probs, logits never stored)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .autograd.common import split_temperature
from .autograd.linear import HeadParams, linear_head
from .autograd.linear_topk import TopkParams, linear_topk_call
from .autograd.vocab_parallel import parallel_params
from .backends import get_backend
from .validation import (check_bool_arg, check_head_inputs, check_hidden_weight, check_softcap, check_temperature,
                         describe, public_signature, raise_extra_positional)

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
    """Log-probability of ``labels`` and entropy of softmax(hidden_states @ weight.T / temperature),
    without materializing the (tokens x vocab) logits.

    With z_v = (h . w_v) / T:  log p(y) = z_y - logsumexp(z),  entropy = -sum_v p_v log p_v.
    With ``softcap`` c:  z_v = c tanh((h . w_v) / c) / T  (the final-logit soft-capping of
    Gemma 2, "Gemma 2: Improving Open Language Models at a Practical Size", 2024, section 2:
    the cap is applied to the model's logits, then the temperature).

    Args:
        hidden_states: (..., H) bfloat16, float16 or float32, any strides (e.g. (B, T, H) or the
            (total_nnz, H) of remove-padding). Differentiable.
        weight: (V, H) like ``lm_head.weight``, same dtype and device. Differentiable.
        labels: int64/int32 with shape ``hidden_states.shape[:-1]``; each in [0, V) or
            ``ignore_index``.
        temperature: positive finite Python number (int accepted); logits are divided by it. Or a
            float tensor shaped like ``labels`` on their device: row i's logits are divided by its
            own temperature (verl's per-sample temperature), forward and backward, vocab-parallel
            and compiled alike (a runtime input of the graph); its values are checked (positive,
            finite, in ``TEMPERATURE_RANGE``) with one host read, and it gets no gradient.
            A constant multiplier s of the logits (Cohere's ``logit_scale``, Granite's
            ``1 / logits_scaling``) is the same as ``temperature=T / s``; one of the hidden
            state inside the cap is the same as ``softcap=c / s, temperature=T / s``.
        softcap: None (default: no cap) or a positive finite Python number c: each logit h . w
            becomes c tanh(h . w / c) before the division by the temperature, forward and
            backward (the backward multiplies by 1 - tanh^2). 1 / c and c / T must be normal
            float32 numbers. A logit that is +-inf before the cap gives NaN (not +-c), so a
            non-finite hidden row stays non-finite.
        ignore_index: label value whose position gets log-prob 0, entropy 0 and zero gradient.
        return_entropy: when False, entropy is not computed and returned as None.
        return_sum_pi_squared: also return sum_v p_v^2 (the collision probability used by verl's
            optimal-token-baseline estimators): one more accumulator in the same GEMM tiles,
            merged by the same split tree; differentiable (d/dz_v = 2 p_v (p_v - sum p^2)).
        backend: "auto" (Triton on CUDA, torch elsewhere; the choice is logged once), "triton"
            (CUDA, or the CPU interpreter when TRITON_INTERPRET=1 was set before import), "torch".
        process_group: a ``torch.distributed`` group over which the vocabulary is sharded
            (Megatron-style vocab-parallel ``lm_head``; ``rl_kernels.autograd.vocab_parallel``). ``weight`` is
            then this rank's contiguous shard (V_r, H) (shards may differ in size, ordered by
            group rank), ``labels`` are global ids and ``ignore_index`` must be negative. One
            all_gather of four (N,) float32 rows merges the shards; every rank returns the same
            bits. Backward gives this shard's dW and this rank's partial dh.
        vocab_start_index: global id of ``weight``'s first row; None derives it (and the total
            vocab_size, for the label check) from the group with one small all_gather.
        reduce_hidden_grad: with ``process_group``, all-reduce (sum) dh over the group in the
            backward. Leave False under Megatron's ``ColumnParallelLinear`` convention, where
            the head's input region all-reduces it (``rl_kernels.autograd.vocab_parallel``).

    Returns:
        ``LogProbsOutput(log_probs, entropy, sum_pi_squared)``: float32 tensors shaped like
        ``labels``, in nats (sum_pi_squared: a probability; None unless asked). Rows whose label
        is ``ignore_index`` get 0 for all three.
        Logits are accumulated and kept in float32 on every backend. A row whose hidden state
        holds NaN/inf gets a non-finite log-prob and entropy; other rows are unaffected (in the
        backward, such a row's gradient reaches every dW row, as in any matmul). A row whose
        label is ``ignore_index`` contributes exactly nothing to dW and dh, even when its hidden
        state is non-finite (it is selected out, not multiplied by 0).

    Raises:
        TypeError: a non-tensor input, unsupported dtype, ``weight``/``hidden_states`` dtype
            mismatch, non-integer ``ignore_index``, non-number ``temperature`` or ``softcap``.
        ValueError: shape mismatch (a per-row ``temperature`` included), hidden size H = 0, labels outside [0, V) other than
            ``ignore_index`` (on CUDA with the Triton backend found by the kernel without a host
            sync: that row's log-prob and gradients are NaN, and the error is raised by the next
            rl_kernels call or backward; ``RL_KERNELS_SYNC_LABEL_CHECK=1`` raises in the call), an ``ignore_index`` that does not fit the labels' dtype, a
            temperature <= 0, non-finite or outside ``TEMPERATURE_RANGE`` (1/T must be a normal
            float32: about [2.9e-39, 8.5e37]), a ``softcap`` <= 0, non-finite, or whose inverse or
            ratio to the temperature is not a normal float32, inputs on different devices,
            unknown backend.
        RuntimeError: backend "triton" on CPU without TRITON_INTERPRET=1, or without triton;
            ``process_group`` without an initialized ``torch.distributed``; differentiating the
            gradient again (``create_graph=True`` gives correct first derivatives, whose own
            backward raises "double backward is not supported by rl_kernels.linear_log_probs").

    Formula: with p = softmax(z), log p(y) = z_y - logsumexp(z) and H = log s - b / s where
    s = sum exp(z - m), b = sum exp(z - m)(z - m), m = max z (no lse - E[z] cancellation);
    gradients d log p/dz = onehot - p, dH/dz = -p (log p + H) (Shannon entropy; softmax
    derivative), divided by T for the raw logits h.w (times 1 - tanh^2(h.w / c) under a cap).
    Bug cases covered: verl #2656/#2899 (padded vocab columns), verl PR #7439 (all-negative
    logits), verl #6913 (3-D hidden keeps its gradient).
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


MAX_TOPK = 128  # the largest k of ``linear_topk`` (the kernel's candidate list lives in registers)


@public_signature
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
    """The k largest logits of each row, as log-probs and token ids, without materializing the
    (tokens x vocab) logits: the student's top-K of the top-K overlap metrics of on-policy
    distillation ("Rethinking On-Policy Distillation", arXiv:2604.13016: student top-K vs teacher
    top-K).

    With z_v = (h . w_v) / T (with ``softcap`` c: z_v = c tanh((h . w_v) / c) / T, as
    ``linear_log_probs``): the k ids v with the largest z_v, in the order (z descending, id
    ascending), i.e. ``torch.topk`` of the logits with ties broken by the smaller id, and their
    log-probs log p_v = z_v - logsumexp(z). The logits are float32 sums of the products (as in
    ``linear_log_probs``); the selection is exact on those float32 values (two logits closer than
    their float32 rounding may rank otherwise than in float64).

    Args:
        hidden_states: (..., H) bfloat16, float16 or float32, any strides.
        weight: (V, H) like ``lm_head.weight``, same dtype and device.
        temperature: positive finite Python number, or a float tensor of shape
            ``hidden_states.shape[:-1]`` (one per row), as for ``linear_log_probs``. It scales
            the log-probs, not the order of the ids (without a cap, and with one).
        softcap: None or a positive finite number c (Gemma-2 logit soft-capping), as for
            ``linear_log_probs``.
        k: int, 1 <= k <= min(128, vocab_size). Required (keyword-only, like every argument after
            the tensors; None, the default, raises).
        backend: "auto" (Triton on CUDA, else torch), "triton" or "torch"; both give the same
            ids (up to float32 near-ties between their logits' roundings).
        process_group: a ``torch.distributed`` group over which the vocabulary is sharded
            (``weight`` is this rank's contiguous shard, ordered by group rank, as for
            ``linear_log_probs``). Each rank selects its shard's top-k; one all_gather of
            (N, 2k + 1) float32 merges them identically on every rank: every rank returns the same
            bits, the ids global.
        vocab_start_index: global id of ``weight``'s first row; None derives it (and the total
            vocab_size, which k is checked against) from the group with one small all_gather.

    Returns:
        ``(log_probs, token_ids)``: log_probs (..., k) float32 in nats, sorted descending;
        token_ids (..., k) int64 global ids. Neither requires grad (no gradient flows: for
        differentiable log-probs at these ids, pass ``token_ids`` to
        ``rl_kernels.distill.linear_log_probs_at_ids``).
        Non-finite input: a NaN or -inf logit is never selected, and a row whose logits hold NaN
        (a non-finite hidden row: every logit of the row) gets NaN log-probs (its logsumexp is
        NaN), its ids being the top-k of its other logits; slots that nothing fills (fewer than k
        logits that are neither NaN nor -inf in the row, e.g. an all-NaN row) get id -1 and
        log-prob NaN. Other rows are unaffected.

    Raises:
        TypeError: a non-tensor input, unsupported dtype, ``weight``/``hidden_states`` dtype
            mismatch, ``k`` not an int (None, the default, or a bool included), non-number
            ``temperature`` or ``softcap``.
        ValueError: a shape mismatch, H = 0, ``k`` outside [1, min(128, vocab_size)] (the whole
            vocabulary with ``process_group``, when known), a temperature or softcap outside the
            ranges of ``linear_log_probs``, inputs on different devices, an unknown backend,
            ``vocab_start_index`` without ``process_group``.
        RuntimeError: backend "triton" on CPU without TRITON_INTERPRET=1, or without triton;
            ``process_group`` without an initialized ``torch.distributed``.

    Formula: log p_v = z_v - logsumexp(z) (softmax); the kernel keeps each row's running top-k
    (exact order above) and (max z, sum exp(z - max)) over the GEMM tiles, merged over vocab splits
    and shards (``rl_kernels.ops.linear_topk``).
    """
    if extra_positional:  # a keyword-only argument given by position
        raise_extra_positional(linear_topk, extra_positional)
    check_hidden_weight(hidden_states, weight)
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k: expected an int in [1, min({MAX_TOPK}, vocab_size)], got "
                        + ("None (k is required: linear_topk(hidden_states, weight, k=64))" if k is None
                           else type(k).__name__))
    rows = hidden_states.select(-1, 0)  # (the leading shape and device, for a per-row temperature)
    temperature = check_temperature(temperature, rows, "hidden_states.shape[:-1]")
    softcap = check_softcap(softcap, temperature)
    tp = parallel_params(process_group, vocab_start_index, False, -100, weight.shape[0], hidden_states.device)
    vocab_size = weight.shape[0] if tp is None else tp.vocab_size  # (None: a shard's total not known)
    top = MAX_TOPK if vocab_size is None else min(MAX_TOPK, vocab_size)
    if not 1 <= k <= top:
        raise ValueError(f"k: expected an int in [1, min({MAX_TOPK}, vocab_size)] = [1, {top}], got {k}"
                         + (f" (weight {describe(weight)})" if vocab_size is not None and k > vocab_size else ""))
    resolved = get_backend(backend, hidden_states.device)
    lead = hidden_states.shape[:-1]
    h2 = hidden_states.reshape(-1, hidden_states.shape[-1]).detach()
    inv_temperature, runtime_temperature = split_temperature(temperature)
    params = TopkParams(backend=resolved, inv_temperature=inv_temperature, k=k, softcap=softcap)
    log_probs, token_ids = linear_topk_call(h2, weight.detach(), params, runtime_temperature, tp)
    return log_probs.view(*lead, k), token_ids.view(*lead, k)
