"""verl's top-K distillation math, the same on every path of the integration (the logits paths of
both engines and both fused heads): the per-token forward-KL terms of ``forward_kl_topk``
(:func:`topk_terms`, verl's FSDP and Megatron definitions), those of ``forward_kl_topk_tail``
(:func:`tail_terms`, verl RFC #7856), verl's overlap metrics (:func:`overlap_metrics`,
arXiv:2604.13016) and the padding rows' ids of the tail mode (:func:`distinct_on_padding`).

Tensors in, tensors out: this module imports no verl and no engine code of the integration, so
that each path (:mod:`.distill_losses` for the logits paths and the FSDP fused head, :mod:`.megatron`'s
fused head) computes the same terms from its own layout.
"""
from __future__ import annotations

import torch

from ...distill import topk_kl_per_token


def distinct_on_padding(teacher_ids, rows):
    """``teacher_ids`` with the padding rows' ids (``rows`` 0: rows verl's layout added, whose outputs
    it drops) replaced by 0..K-1: the library's tail log-mass needs distinct ids in each row, and those
    rows hold K zeros. Token rows are left as they are (a repeated id there is refused by the library)."""
    if rows is None:
        return teacher_ids
    filler = torch.arange(teacher_ids.shape[-1], device=teacher_ids.device, dtype=teacher_ids.dtype)
    return torch.where(rows.to(teacher_ids.device).bool()[..., None], teacher_ids, filler)


OVERLAP_KEYS = ("overlap_count", "overlap_token_advantage")
"""verl's top-K overlap metrics (arXiv:2604.13016), the model-output keys its ``forward_kl_topk`` loss
reads (optional: it logs ``distillation/overlap_ratio`` and ``distillation/overlap_token_advantage``
when both are there)."""


def overlap_metrics(teacher_ids, student_ids, slot_t, slot_q) -> dict:
    """verl's overlap metrics per token, on every path (logits and fused): ``overlap_count``, how many
    of the teacher's ids ``teacher_ids`` (..., K) are among the student's top-K ids ``student_ids``
    (..., K) (int64), and ``overlap_token_advantage``, the mean over those ids of -p_t (log p_t -
    log q) from the teacher's and the student's log-probs at the teacher's ids ``slot_t`` / ``slot_q``
    (..., K) as the loss mode takes them (forward_kl_topk: after ``log_prob_min_clamp``; the tail mode:
    unclamped), 0 where there is none. No gradient; the advantage in the dtype of the terms."""
    with torch.no_grad():
        in_student_topk = (teacher_ids[..., :, None] == student_ids[..., None, :]).any(-1)
        overlap_count = in_student_topk.sum(-1)
        # (a product with the 0/1 selection, as verl's: a non-finite term outside it gives NaN there too)
        advantage = (-(slot_t.exp() * (slot_t - slot_q)) * in_student_topk).sum(-1)
        advantage = advantage / overlap_count.clamp_min(1)
        advantage = torch.where(overlap_count > 0, advantage, torch.zeros((), device=advantage.device))
    return dict(zip(OVERLAP_KEYS, (overlap_count, advantage)))


def topk_terms(log_q, teacher_log_probs, clamp, *, clamp_masses: bool = False) -> tuple:
    """verl's per-token top-K forward KL terms from the student's log-probs at the teacher's ids
    (``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk``, both of rl-kernels' paths):
    ``log_q`` (..., K) float32, ``teacher_log_probs`` (..., K), ``clamp`` verl's
    ``log_prob_min_clamp`` (None: no clamp) -> ``(distillation_losses, student_mass, teacher_mass,
    log_q, teacher_log_probs)``: the masses sum exp over the K slots before the clamp, both sides
    are then clamped below at ``clamp``, the loss is sum_k p_k (log p_k - log q_k) in float32 (the
    clamped log-probs are returned for the overlap metrics). ``clamp_masses``: the masses sum exp of
    the clamped log-probs instead, as verl's Megatron loss defines them
    (``verl.trainer.distillation.megatron.losses._VocabParallelKLDivergence``)."""
    if not clamp_masses:
        student_mass = log_q.exp().sum(-1)
        teacher_mass = teacher_log_probs.exp().sum(-1)
    if clamp is not None:
        log_q = log_q.clamp_min(clamp)
        teacher_log_probs = teacher_log_probs.clamp_min(clamp)
    if clamp_masses:
        student_mass = log_q.exp().sum(-1)
        teacher_mass = teacher_log_probs.float().exp().sum(-1)
    log_p = teacher_log_probs.float()
    distillation_losses = (log_p.exp() * (log_p - log_q)).sum(-1)  # forward KL over the K ids (float32)
    return distillation_losses, student_mass, teacher_mass, log_q, teacher_log_probs


def tail_terms(log_q, tail_log_probs, teacher_log_probs) -> dict:
    """The per-token outputs of ``loss_mode=forward_kl_topk_tail`` from the student's log-probs at the
    teacher's ids ``log_q`` (..., K) float32 and its log-mass outside them ``tail_log_probs`` (...)
    (both differentiable), and the teacher's ``teacher_log_probs`` (..., K): ``distillation_losses``,
    the tail-aware KL of :func:`rl_kernels.distill.topk_kl_per_token` (the (K+1)-category forward
    KL, no clamp); ``student_mass`` / ``teacher_mass``, the K slots' probability (as verl's
    forward_kl_topk, no clamp: the mode takes none); ``tail_loss``, the tail bucket's term (the loss
    minus the K slots' sum); ``student_tail_mass``, exp of ``tail_log_probs``. float32; all but the
    loss without gradient."""
    k = log_q.shape[-1]
    lead = log_q.shape[:-1]
    teacher = teacher_log_probs.detach().float().reshape(-1, k)
    losses = topk_kl_per_token(log_q.reshape(-1, k), teacher, kind="forward",
                               tail_log_probs=tail_log_probs.reshape(-1)).view(lead)
    with torch.no_grad():
        slots = topk_kl_per_token(log_q.detach().reshape(-1, k), teacher, kind="forward").view(lead)
    return {"distillation_losses": losses,
            "student_mass": log_q.detach().exp().sum(-1),
            "teacher_mass": teacher.exp().sum(-1).view(lead),
            "tail_loss": losses.detach() - slots,
            "student_tail_mass": tail_log_probs.detach().float().exp()}
