"""Distillation losses on the fused linear head (no N x V logits stored).

``linear_topk_kl``: KL divergence between a teacher given only by its top-K log-probs per token
(for example from an inference server) and the student's full-vocabulary distribution, restricted
to the teacher's K ids:

    z = h W^T / T,  log q_k = z_{id_k} - logsumexp(z)        (student, full-vocabulary softmax)
    forward KL:  T^2 * sum_k p_t,k (log p_t,k - log q_k)
    reverse KL:  T^2 * sum_k q_k (log q_k - log p_t,k)        (over the teacher's K ids)

The logsumexp comes from the fused split-vocab kernels (``rl_kernels.linear_log_probs``' forward
and backward with an lse gradient, d lse / dz = softmax(z)); the K logits z_{id_k} are K dot
products per token (``ops.linear_forward.label_logits``) whose gradients are added as sparse
entries to the same recomputed dlogits windows, so dh and dW come from the head's own matmuls. The T^2 factor keeps gradient magnitudes comparable
across temperatures (Hinton, Vinyals, Dean 2015, "Distilling the Knowledge in a Neural Network",
sec. 2). Restricting the sums to the teacher's K ids is the usual sparse-teacher approximation
when only top-K log-probs are available; with K = V and a renormalized teacher it is the full KL.
"""
from __future__ import annotations

import torch

from .api import _FLOAT_DTYPES, _LABEL_DTYPES, _describe, check_temperature, resolve_backend
from .autograd import HeadParams, LinearLogProbsFunction

KINDS = ("forward", "reverse")
REDUCTIONS = ("none", "sum", "mean", "batchmean")


def _check_inputs(hidden_states, weight, ids, teacher_log_probs, mask):
    for name, t in (("hidden_states", hidden_states), ("weight", weight),
                    ("teacher_token_ids", ids), ("teacher_log_probs", teacher_log_probs)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if hidden_states.dtype not in _FLOAT_DTYPES or hidden_states.dim() < 2:
        raise TypeError(f"hidden_states: expected (..., H) bfloat16/float16/float32, got {_describe(hidden_states)}")
    if weight.dim() != 2 or weight.dtype != hidden_states.dtype or weight.shape[1] != hidden_states.shape[-1]:
        raise ValueError(f"weight: expected (vocab_size, {hidden_states.shape[-1]}) {hidden_states.dtype}, "
                         f"got {_describe(weight)}")
    lead = tuple(hidden_states.shape[:-1])
    if ids.dtype not in _LABEL_DTYPES or ids.dim() != len(lead) + 1 or tuple(ids.shape[:-1]) != lead \
            or ids.shape[-1] == 0:
        raise ValueError(f"teacher_token_ids: expected {lead + ('K',)} int64/int32 with K >= 1, got {_describe(ids)}")
    if teacher_log_probs.dtype not in _FLOAT_DTYPES or teacher_log_probs.shape != ids.shape:
        raise ValueError(f"teacher_log_probs: expected shape {tuple(ids.shape)} (as teacher_token_ids), "
                         f"float, got {_describe(teacher_log_probs)}")
    for name, t in (("weight", weight), ("teacher_token_ids", ids), ("teacher_log_probs", teacher_log_probs)):
        if t.device != hidden_states.device:
            raise ValueError(f"{name}: on {t.device}, but hidden_states is on {hidden_states.device}")
    if mask is not None and (not isinstance(mask, torch.Tensor) or tuple(mask.shape) != lead
                             or mask.device != hidden_states.device):
        raise ValueError(f"mask: expected a bool/0-1 tensor of shape {lead} on {hidden_states.device}, got "
                         + (_describe(mask) if isinstance(mask, torch.Tensor) else type(mask).__name__))
    v = weight.shape[0]
    if ids.numel() and bool(((ids < 0) | (ids >= v)).any()):
        raise ValueError(f"teacher_token_ids: values must lie in [0, vocab_size={v}); got min "
                         f"{int(ids.min())}, max {int(ids.max())}")


def linear_topk_kl(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    teacher_token_ids: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    temperature: float = 1.0,
    kind: str = "forward",
    renormalize_teacher: bool = False,
    reduction: str = "batchmean",
    process_group=None,
    backend: str = "auto",
) -> torch.Tensor:
    """KL divergence to a top-K teacher, student log-probs over the full vocabulary (fused).

    Args:
        hidden_states: (..., H) bfloat16/float16/float32 student final hidden states.
        weight: (vocab_size, H) student lm_head weight, same dtype.
        teacher_token_ids: (..., K) int64/int32 ids in [0, vocab_size) (K >= 1, any K <= V).
        teacher_log_probs: (..., K) float teacher log-probs (nats) at those ids, taken as given:
            they should already be at ``temperature`` (inference servers return the log-probs of
            the distribution they sampled from). No gradient flows to them.
        mask: (...) bool or 0/1; tokens with mask 0 contribute 0 and get no gradient.
        temperature: positive Python number: the student logits are divided by it and the loss
            is multiplied by temperature^2 (Hinton et al. 2015).
        kind: 'forward' = sum_k p_t (log p_t - log q) (mode covering), 'reverse' =
            sum_k q (log q - log p_t) over the K ids (mode seeking).
        renormalize_teacher: log-softmax the teacher log-probs over the K ids first (the K
            probabilities then sum to 1; with K = V and True, the loss is the full KL).
        reduction: 'none' (shape ``...``), 'sum', 'mean' (over tokens with mask 1), 'batchmean'
            (sum / size of the first dim, as ``torch.nn.functional.kl_div``).
        process_group: vocab-parallel student head: not supported yet (NotImplementedError).
        backend: 'auto' | 'triton' | 'torch', as for ``linear_log_probs``.

    Returns:
        float32 loss (nats x T^2): shape ``hidden_states.shape[:-1]`` for 'none', a scalar
        otherwise; differentiable w.r.t. ``hidden_states`` and ``weight``.

    Raises:
        TypeError / ValueError naming the argument for wrong types, dtypes, shapes, devices, ids
        outside [0, vocab_size), or a bad ``kind`` / ``reduction`` / ``temperature``;
        NotImplementedError for ``process_group``; RuntimeError when the backend cannot run.

    Memory: O(N K) besides the fused head's own (``linear_log_probs``' bounds).
    """
    if process_group is not None:
        raise NotImplementedError("process_group: vocab-parallel heads are not supported by "
                                  "linear_topk_kl yet (tensor-parallel issue)")
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(renormalize_teacher, bool):
        raise TypeError(f"renormalize_teacher: expected a bool, got {type(renormalize_teacher).__name__}")
    t = check_temperature(temperature)
    _check_inputs(hidden_states, weight, teacher_token_ids, teacher_log_probs, mask)
    backend = resolve_backend(backend, hidden_states.device)
    lead = hidden_states.shape[:-1]
    h2 = hidden_states.reshape(-1, hidden_states.shape[-1])
    ids = teacher_token_ids.reshape(-1, teacher_token_ids.shape[-1])
    valid = (mask.reshape(-1) != 0) if mask is not None else torch.ones(
        h2.shape[0], dtype=torch.bool, device=h2.device)

    # student lse over the full vocabulary (fused head; rows with mask 0 get no gradient)
    labels = torch.where(valid, ids[:, 0], -100)
    params = HeadParams(backend=backend, inv_temperature=1.0 / t, ignore_index=-100,
                        return_entropy=False, return_lse=True)
    _, lse, z_ids = LinearLogProbsFunction.apply(h2, weight, labels, params, ids)
    log_q = z_ids - lse[:, None]

    log_pt = teacher_log_probs.reshape(ids.shape).detach().float()
    if renormalize_teacher:
        log_pt = torch.log_softmax(log_pt, dim=-1)
    if kind == "forward":
        per_token = (log_pt.exp() * (log_pt - log_q)).sum(-1)
    else:
        per_token = (log_q.exp() * (log_q - log_pt)).sum(-1)
    per_token = torch.where(valid, per_token * (t * t), torch.zeros((), device=per_token.device))
    if reduction == "none":
        return per_token.view(lead)
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        return per_token.sum() / valid.sum()
    return per_token.sum() / (lead[0] if len(lead) else 1)
