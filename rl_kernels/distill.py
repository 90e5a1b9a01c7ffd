"""Distillation losses on the fused linear head (no N x V logits stored).

``linear_jsd``: generalized Jensen-Shannon divergence between a student head and a teacher head
in the same process (``ops.linear_jsd`` for the math and kernels); both heads' logits are
recomputed tile by tile, gradients reach the student only.

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

import dataclasses
import numbers

from .api import (_FLOAT_DTYPES, _LABEL_DTYPES, _describe, check_hidden_size, check_labels, check_temperature,
                  check_tensor_arg, resolve_backend)
from .autograd import (HeadParams, LinearLogProbsFunction, _chunked_backward, _full_precision_reduction,
                       first_order_only, head_forward, hidden_for_weight_grad)
from .torch_backend import torch_jsd_dlogits, torch_jsd_sums

KINDS = ("forward", "reverse")
REDUCTIONS = ("none", "sum", "mean", "batchmean")


def _check_inputs(hidden_states, weight, ids, teacher_log_probs, mask, vocab_size=None):
    for name, t in (("hidden_states", hidden_states), ("weight", weight),
                    ("teacher_token_ids", ids), ("teacher_log_probs", teacher_log_probs)):
        check_tensor_arg(name, t)
    if hidden_states.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden_states: expected bfloat16, float16 or float32, got {_describe(hidden_states)}")
    if hidden_states.dim() < 2:
        raise ValueError(f"hidden_states: expected shape (..., H) with at least one token dim (e.g. "
                         f"(N, H)), got {_describe(hidden_states)}")
    check_hidden_size(hidden_states, "hidden_states")
    if weight.dim() != 2 or weight.dtype != hidden_states.dtype or weight.shape[1] != hidden_states.shape[-1] \
            or weight.shape[0] == 0:
        raise ValueError(f"weight: expected (vocab_size >= 1, {hidden_states.shape[-1]}) {hidden_states.dtype}, "
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
    if mask is not None and mask.dtype != torch.bool and mask.numel() and bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError(f"mask: expected bool or 0/1 values, got other values ({_describe(mask)}; e.g. "
                         f"{mask[(mask != 0) & (mask != 1)].reshape(-1)[0].item()!r})")
    v = weight.shape[0] if vocab_size is None else vocab_size
    if ids.numel() and bool(((ids < 0) | (ids >= v)).any()):
        raise ValueError(f"teacher_token_ids: values must lie in [0, vocab_size={v}); got min "
                         f"{int(ids.min())}, max {int(ids.max())}")
    bad = torch.isnan(teacher_log_probs) | (teacher_log_probs == float("inf"))
    if teacher_log_probs.numel() and bool(bad.any()):
        first = bad.reshape(-1).nonzero()[0, 0].item()
        raise ValueError(f"teacher_log_probs: {int(bad.sum())} entries are NaN or +inf (log-probs lie in "
                         f"[-inf, 0]; -inf marks a zero-probability slot); first at flat position "
                         f"{first}: {teacher_log_probs.reshape(-1)[first].item()}")


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
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """KL divergence to a top-K teacher, student log-probs over the full vocabulary (fused).

    Args:
        hidden_states: (..., H) bfloat16/float16/float32 student final hidden states.
        weight: (vocab_size, H) student lm_head weight, same dtype.
        teacher_token_ids: (..., K) int64/int32 ids in [0, vocab_size) (K >= 1, any K <= V).
        teacher_log_probs: (..., K) float teacher log-probs (nats) at those ids, taken as given:
            they should already be at ``temperature`` (inference servers return the log-probs of
            the distribution they sampled from). No gradient flows to them. -inf marks a
            zero-probability slot (a token the server filtered): it is out of the teacher's
            support and adds exactly 0 to the loss and the gradient, for both kinds (forward:
            0 log 0 = 0, the ``xlogy`` convention; reverse: the slot is left out, like an id
            outside the top K); ``renormalize_teacher`` renormalizes over the other slots. NaN
            or +inf entries raise ValueError.
        mask: (...) bool or 0/1; tokens with mask 0 contribute 0 and get no gradient.
        temperature: positive Python number: the student logits are divided by it and the loss
            is multiplied by temperature^2 (Hinton et al. 2015).
        kind: 'forward' = sum_k p_t (log p_t - log q) (mode covering), 'reverse' =
            sum_k q (log q - log p_t) over the K ids (mode seeking).
        renormalize_teacher: log-softmax the teacher log-probs over the K ids first (the K
            probabilities then sum to 1; with K = V and True, the loss is the full KL).
        reduction: 'none' (shape ``...``), 'sum', 'mean' (over tokens with mask 1), 'batchmean'
            (sum / size of the first dim, as ``torch.nn.functional.kl_div``).
        process_group: vocab-parallel student head, as for ``linear_log_probs``: ``weight`` is
            this rank's contiguous vocab shard, ``teacher_token_ids`` are global ids; the
            student's lse and the K logits are merged after one all_gather of (N, 1 + 2K)
            float32 (``rl_kernels.parallel``), so every rank returns the same loss. Backward:
            this shard's dW and a partial dh (Megatron convention, see ``rl_kernels.parallel``).
        vocab_start_index: global id of the shard's first row; None derives it from the group.
        reduce_hidden_grad: with ``process_group``, all-reduce dh over the group in backward.
        backend: 'auto' | 'triton' | 'torch', as for ``linear_log_probs``.

    Returns:
        float32 loss (nats x T^2): shape ``hidden_states.shape[:-1]`` for 'none', a scalar
        otherwise; differentiable w.r.t. ``hidden_states`` and ``weight``.

    Raises:
        TypeError / ValueError naming the argument for wrong types, dtypes, shapes (H = 0
        included), devices, ids outside [0, vocab_size), NaN / +inf teacher log-probs, or a bad
        ``kind`` / ``reduction`` / ``temperature``; RuntimeError on double backward;
        an id held by no shard (or several) with ``process_group``; RuntimeError when the
        backend cannot run or ``torch.distributed`` is not initialized.

    Memory: O(N K) besides the fused head's own (``linear_log_probs``' bounds).
    """
    if kind not in KINDS:
        raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    if not isinstance(renormalize_teacher, bool):
        raise TypeError(f"renormalize_teacher: expected a bool, got {type(renormalize_teacher).__name__}")
    t = check_temperature(temperature)
    tp = None
    if process_group is not None:
        from .parallel import ParallelParams, shard_layout

        if not isinstance(reduce_hidden_grad, bool):
            raise TypeError(f"reduce_hidden_grad: expected a bool, got {type(reduce_hidden_grad).__name__}")
        # global ids: only >= 0 here; the upper bound once the layout is known
        _check_inputs(hidden_states, weight, teacher_token_ids, teacher_log_probs, mask,
                      vocab_size=torch.iinfo(torch.int64).max)
        start, total = shard_layout(process_group, weight.shape[0], vocab_start_index, weight.device, -100)
        if total is not None and bool((teacher_token_ids >= total).any()):
            raise ValueError(f"teacher_token_ids: values must lie in [0, vocab_size={total}) (the sharded "
                             f"vocabulary); got max {int(teacher_token_ids.max())}")
        tp = ParallelParams(process_group, start, total, reduce_hidden_grad)
    elif vocab_start_index is not None or reduce_hidden_grad:
        raise ValueError("vocab_start_index / reduce_hidden_grad: only meaningful with process_group")
    else:
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
                        return_entropy=False, return_lse=tp is None, name="linear_topk_kl",
                        may_have_ignored=mask is not None)
    if tp is not None:
        from .parallel import VocabParallelLseGatherFunction

        lse, z_ids = VocabParallelLseGatherFunction.apply(h2, weight, valid, ids, params, tp)
    else:
        _, lse, z_ids = LinearLogProbsFunction.apply(h2, weight, labels, params, ids)
    log_q = z_ids - lse[:, None]

    log_pt = teacher_log_probs.reshape(ids.shape).detach().float()
    # slots with teacher log-prob -inf (zero probability: filtered by the server) are out of the
    # teacher's support and contribute exactly 0 to the sum, forward and reverse alike
    support = log_pt > float("-inf")
    if renormalize_teacher:  # over the supported slots; a token with none keeps all -inf
        log_pt = torch.where(support.any(-1, keepdim=True), torch.log_softmax(log_pt, dim=-1), log_pt)
    zero = torch.zeros((), device=log_q.device)
    log_pt = torch.where(support, log_pt, zero)  # any finite value: those terms are selected out
    if kind == "forward":
        terms = log_pt.exp() * (log_pt - log_q)
    else:
        terms = log_q.exp() * (log_q - log_pt)
    per_token = torch.where(support, terms, zero).sum(-1)
    per_token = torch.where(valid, per_token * (t * t), zero)
    return _reduce(per_token, valid, lead, reduction)


def _reduce(per_token, valid, lead, reduction):
    if reduction == "none":
        return per_token.view(lead)
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        return per_token.sum() / valid.sum()
    return per_token.sum() / (lead[0] if len(lead) else 1)


@dataclasses.dataclass(frozen=True)
class JSDParams:
    backend: str  # resolved: "triton" or "torch"
    inv_temperature: float
    beta: float
    tp: object = None  # parallel.ParallelParams for vocab-sharded heads
    may_have_ignored: bool = True  # False: no token is excluded (no ignored-row check in backward)


class LinearJSDFunction(torch.autograd.Function):
    """Inputs: student_hidden (N, Hs), student_weight (V, Hs), teacher_hidden (N, Ht),
    teacher_weight (V, Ht), valid (N,) bool, JSDParams. Output: (N,) float32 per-token divergence
    x T^2, 0 where not valid. Gradients to the student's two inputs only."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, teacher_hidden, teacher_weight, valid, params):
        n = student_hidden.shape[0]
        zeros = torch.zeros(n, dtype=torch.long, device=student_hidden.device)
        head = HeadParams(backend=params.backend, inv_temperature=params.inv_temperature,
                          ignore_index=-100, return_entropy=False)
        lse_s = head_forward(student_hidden, student_weight, zeros, head)[2].contiguous()
        lse_t = head_forward(teacher_hidden, teacher_weight, zeros, head)[2].contiguous()
        tp = params.tp
        if tp is not None:  # shard lse -> global lse of both heads (one all_gather)
            from .parallel import _all_gather, _merge_lse

            lse_w = _all_gather(tp.process_group, torch.stack([lse_s, lse_t]))
            lse_s, lse_t = (_merge_lse(lse_w[:, i])[0].contiguous() for i in (0, 1))
        args = (student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t,
                params.inv_temperature, params.beta)
        if params.backend == "triton" and n:
            from .ops import default_config
            from .ops.linear_jsd import jsd_split_sums

            cfg = default_config(student_hidden.device, student_hidden.dtype)
            loss, g_sum = jsd_split_sums(*args, cfg, cfg.jsd_fwd)
        else:
            loss, g_sum = torch_jsd_sums(*args)
        if tp is not None:  # shard sums -> global sums, added in rank order (one all_gather)
            from .parallel import _all_gather

            sums = _all_gather(tp.process_group, torch.stack(
                [loss.float(), g_sum.float() if g_sum is not None else torch.zeros_like(loss, dtype=torch.float32)]
            )).sum(0)
            loss = sums[0]
            g_sum = sums[1] if 0.0 < params.beta < 1.0 else (loss if params.beta == 1.0 else None)
        t2 = 1.0 / params.inv_temperature ** 2
        ctx.save_for_backward(student_hidden, student_weight, teacher_hidden, teacher_weight,
                              lse_s, lse_t, g_sum if g_sum is not None else lse_s, valid)
        ctx.params, ctx.fn_name = params, "linear_jsd"
        return torch.where(valid, loss.float() * t2, torch.zeros((), device=loss.device))

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        hs, ws, ht, wt, lse_s, lse_t, g_sum, valid = ctx.saved_tensors
        params: JSDParams = ctx.params
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad is None or not (need_dh or need_dw):
            return None, None, None, None, None, None
        scale = torch.where(valid, grad.float() / params.inv_temperature ** 2,
                            torch.zeros((), device=grad.device)).contiguous()
        g_sum = None if params.beta == 0.0 else g_sum
        if params.backend == "triton":
            from .ops import default_config
            from .ops.linear_jsd import jsd_dlogits

            cfg = default_config(hs.device, hs.dtype)
            dz_dtype = hs.dtype

            def dlogits(rows, cols, out):
                return jsd_dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, rows, cols,
                                   params.inv_temperature, params.beta, out, cfg, cfg.jsd_bwd)
        else:
            dz_dtype = torch.float32

            def dlogits(rows, cols, out):
                return torch_jsd_dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, rows, cols,
                                         params.inv_temperature, params.beta, out)
        reduce_dh = params.tp is not None and params.tp.reduce_hidden_grad
        h_dw = hidden_for_weight_grad(hs, ~valid, lse_s) if need_dw and params.may_have_ignored else hs
        with _full_precision_reduction():
            dh, dw = _chunked_backward(dlogits, hs, ws, dz_dtype, need_dh, need_dw, reduce_dh, h_dw)
        if reduce_dh:
            from .parallel import finish_hidden_grad

            dh = finish_hidden_grad(dh, params.tp, hs.dtype)
        return dh, dw, None, None, None, None


def _check_head(hidden, weight, hname, wname, lead=None, dtype=None, device=None):
    for name, t in ((hname, hidden), (wname, weight)):
        check_tensor_arg(name, t)
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{hname}: expected bfloat16, float16 or float32, got {_describe(hidden)}")
    if hidden.dim() < 2:
        raise ValueError(f"{hname}: expected shape (..., H) with at least one token dim (e.g. (N, H)), "
                         f"got {_describe(hidden)}")
    check_hidden_size(hidden, hname)
    if lead is not None and tuple(hidden.shape[:-1]) != lead:
        raise ValueError(f"{hname}: expected leading shape {lead} (as student_hidden), got {_describe(hidden)}")
    if dtype is not None and hidden.dtype != dtype:
        raise TypeError(f"{hname}: dtype {hidden.dtype} differs from student_hidden's {dtype}; cast one of them")
    if device is not None and hidden.device != device:
        raise ValueError(f"{hname}: on {hidden.device}, but student_hidden is on {device}")
    if weight.dim() != 2 or weight.dtype != hidden.dtype or weight.shape[1] != hidden.shape[-1] \
            or weight.device != hidden.device or weight.shape[0] == 0:
        raise ValueError(f"{wname}: expected (vocab_size >= 1, {hidden.shape[-1]}) {hidden.dtype} on "
                         f"{hidden.device}, got {_describe(weight)}")


def linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    process_group=None,
    vocab_start_index: int | None = None,
    reduce_hidden_grad: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence between a student and a teacher linear head (fused).

    With q = softmax(student_hidden @ student_weight.T / T), p = softmax(teacher_hidden @
    teacher_weight.T / T) and M = beta p + (1 - beta) q, per token:

        JSD_beta = beta KL(p || M) + (1 - beta) KL(q || M)      (0 < beta < 1)
        beta = 0: KL(p || q) (forward KL),  beta = 1: KL(q || p) (reverse KL)

    (Agarwal et al. 2024, "On-Policy Distillation of Language Models" (GKD), generalized JSD;
    beta = 0 / 1 are the KL limits, the convention of Liger-Kernel's JSD.) The result is
    multiplied by T^2, as in ``linear_topk_kl`` (Hinton et al. 2015); divide by temperature**2
    for the unscaled value that Liger / TRL report. Neither head's N x V logits are stored: both
    are recomputed tile by tile (``rl_kernels.ops.linear_jsd``).

    Args:
        student_hidden: (..., Hs) bfloat16/float16/float32. Differentiable.
        student_weight: (vocab_size, Hs), same dtype and device. Differentiable.
        teacher_hidden: (..., Ht) with the student's leading shape and dtype (Ht may differ).
            No gradient flows to it.
        teacher_weight: (vocab_size, Ht), the student's vocab_size. No gradient flows to it.
        beta: Python number in [0, 1] (weight of the teacher in M).
        temperature: positive Python number dividing both heads' logits; the loss is x T^2.
        labels: optional int64/int32 of the leading shape; positions equal to ``ignore_index``
            are excluded (0 loss, no gradient). Other values are not used.
        ignore_index: int, see ``labels``.
        reduction: 'mean' (default: sum / number of tokens not ignored), 'sum', 'none' (the
            leading shape), 'batchmean' (sum / size of the first dim).
        process_group: vocab-parallel heads, as for ``linear_log_probs``: both weights are this
            rank's shard of the same vocab rows. Two all_gathers of (2, N) float32 (the heads'
            lse, then the shard sums) give every rank the same loss; backward gives the student
            shard's dW and a partial dh (``rl_kernels.parallel``).
        vocab_start_index: global id of the shards' first row; None derives it from the group.
        reduce_hidden_grad: with ``process_group``, all-reduce dh over the group in backward.
        backend: 'auto' | 'triton' | 'torch', as for ``linear_log_probs``.

    Returns:
        float32 loss in nats x T^2 (shape per ``reduction``), differentiable w.r.t.
        ``student_hidden`` and ``student_weight``.

    Raises:
        TypeError / ValueError naming the argument for wrong types, dtypes, shapes (vocab sizes
        that differ and H = 0 included), devices, ``beta`` outside [0, 1], a bad ``reduction`` or
        ``temperature``; RuntimeError when the backend cannot run, ``process_group`` is given
        without an initialized ``torch.distributed``, or on double backward. A token whose hidden
        states are non-finite gets a non-finite loss; an excluded token (``labels`` ==
        ``ignore_index``) contributes exactly nothing to the gradients, even when non-finite.

    Cost: two fused forward passes (lse of each head), one pass of both GEMMs for the divergence,
    and a backward recomputing both GEMM tiles per dlogits window (memory bounds as
    ``linear_log_probs``' backward). Extra memory O(N).
    """
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not 0.0 <= float(beta) <= 1.0:
        raise ValueError(f"beta: expected a Python number in [0, 1], got {beta!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    t = check_temperature(temperature)
    _check_head(student_hidden, student_weight, "student_hidden", "student_weight")
    lead = tuple(student_hidden.shape[:-1])
    _check_head(teacher_hidden, teacher_weight, "teacher_hidden", "teacher_weight", lead,
                student_hidden.dtype, student_hidden.device)
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(f"teacher_weight: vocab_size {teacher_weight.shape[0]} differs from "
                         f"student_weight's {student_weight.shape[0]}; the heads must share a vocabulary")
    has_ignored = False
    if labels is not None:
        # (only a mask: with process_group the ids are global, their values are not checked)
        has_ignored = check_labels(labels, student_hidden, "student_hidden", student_weight.shape[0],
                                   ignore_index, check_values=process_group is None, report_ignored=True)
    tp = None
    if process_group is not None:
        from .parallel import ParallelParams, shard_layout

        if not isinstance(reduce_hidden_grad, bool):
            raise TypeError(f"reduce_hidden_grad: expected a bool, got {type(reduce_hidden_grad).__name__}")
        start, total = shard_layout(process_group, student_weight.shape[0], vocab_start_index,
                                    student_weight.device, ignore_index)
        tp = ParallelParams(process_group, start, total, reduce_hidden_grad)
    elif vocab_start_index is not None or reduce_hidden_grad:
        raise ValueError("vocab_start_index / reduce_hidden_grad: only meaningful with process_group")
    backend = resolve_backend(backend, student_hidden.device)
    hs = student_hidden.reshape(-1, student_hidden.shape[-1])
    ht = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    valid = (labels.reshape(-1) != ignore_index) if labels is not None else torch.ones(
        hs.shape[0], dtype=torch.bool, device=hs.device)
    params = JSDParams(backend=backend, inv_temperature=1.0 / t, beta=float(beta), tp=tp,
                       may_have_ignored=has_ignored is not False)
    per_token = LinearJSDFunction.apply(hs, student_weight, ht, teacher_weight.detach(), valid, params)
    return _reduce(per_token, valid, lead, reduction)
