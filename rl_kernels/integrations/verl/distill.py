"""verl's top-K distillation loss on the logits path (issue 34): rl-kernels' student log-probs in
place of verl's full-vocabulary ``log_softmax``.

verl (0.8.0 on: 0.8.x, 0.9.x and its main branch) computes the top-K distillation loss in the logits processor of
the FSDP (and VeOmni) engines: ``verl.trainer.distillation.losses.compute_topk_loss`` calls
``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk(student_logits,
teacher_topk_log_probs, teacher_topk_ids, config, data_format)`` as a module attribute. verl's
function runs ``F.log_softmax`` over the whole vocabulary (an N x V buffer kept for backward) and
gathers it at the teacher's ids (or, with ``use_chunked_topk``, a chunked float32 logsumexp).

:func:`patch_distillation` replaces that module attribute (and any by-name import of it) with
:func:`compute_forward_kl_topk` below, which returns what verl's returns (the same keys, shapes
and dtypes; verl's nested-tensor handling and Ulysses slicing through verl's own helpers;
``log_prob_min_clamp`` on both sides; the overlap metrics as verl defines them, with the
student's top-K ids from ``torch.topk`` of the logits, without gradient, as verl's
``use_chunked_topk`` path takes them) but takes the student's log-probs at the teacher's ids from
:func:`rl_kernels.topk_log_probs_from_logits`: float32, no N x V tensor in forward, the gradient
as the one N x V tensor of backward. verl's Megatron distillation (vocab-parallel logits shards,
``verl.trainer.distillation.megatron.losses``) stays verl's.
"""
from __future__ import annotations

import functools
import importlib
import logging

import torch

from ..._logging import log_once
from ...logits import topk_log_probs_from_logits
from .common import check_signature, record, replace_by_name, set_attr, verl_fallback
from .settings import options
from .signatures import has_module

FSDP_MODULE = "verl.trainer.distillation.fsdp.losses"
MEGATRON_MODULE = "verl.trainer.distillation.megatron.losses"
FUNCTION = "compute_forward_kl_topk"
PARAMETERS = ["student_logits", "teacher_topk_log_probs", "teacher_topk_ids", "config", "data_format"]
"""The parameters of verl's ``compute_forward_kl_topk`` (verl 0.9.1 and main) that the replacement handles."""

FSDP_PART = "distillation (FSDP, VeOmni)"
MEGATRON_PART = "distillation (Megatron)"
NOT_IN_THIS_VERL = "not in this verl (no verl.trainer.distillation: verl 0.7.x)"


def _import_fsdp_losses():
    """(module, None) when verl's FSDP distillation losses import; (None, why) when this verl has
    no such module or it fails to import."""
    try:
        return importlib.import_module(FSDP_MODULE), None
    except ModuleNotFoundError as exc:
        if exc.name and FSDP_MODULE.startswith(exc.name):  # the module or one of its packages
            return None, NOT_IN_THIS_VERL
        return None, f"not replaced: {FSDP_MODULE} failed to import ({exc})"
    except ImportError as exc:
        return None, f"not replaced: {FSDP_MODULE} failed to import ({exc})"


def _megatron_entry() -> tuple[bool, str]:
    """The Megatron part's report entry. Where verl's Megatron losses import, their
    ``compute_forward_kl_topk`` is wrapped to say once, at its first call, that verl's own code runs
    it (the wrapper changes nothing else)."""
    if not has_module(MEGATRON_MODULE):
        return False, NOT_IN_THIS_VERL
    why = ("not replaced: verl's Megatron top-K loss (verl/trainer/distillation/megatron/losses.py) takes this "
           "rank's vocab-parallel logits shard, with its own tensor-parallel all-reduces in a custom autograd "
           "Function; it stays verl's")
    try:
        megatron_losses = importlib.import_module(MEGATRON_MODULE)
    except ImportError as exc:  # megatron-core missing: verl's Megatron engine cannot run here either
        return False, f"{why} (not importable here: {exc})"
    original = getattr(megatron_losses, FUNCTION, None)
    if original is not None and getattr(original, "_rl_kernels_original", None) is None:
        set_attr(megatron_losses, FUNCTION, _said_once(original))
    return False, why + " (a WARNING at its first call)"


def _said_once(original):
    """``original``, logging at its first call that verl's own Megatron distillation loss runs."""

    @functools.wraps(original)
    def compute_forward_kl_topk(*args, **kwargs):
        log_once(logging.WARNING, "rl_kernels: verl's Megatron top-K distillation loss is not served by "
                 "rl-kernels: verl's own code computes it (vocab-parallel logits shards)")
        return original(*args, **kwargs)

    compute_forward_kl_topk._rl_kernels_original = original
    return compute_forward_kl_topk


def patch_distillation() -> dict[str, tuple[bool, str]]:
    """Replace verl's ``compute_forward_kl_topk`` of the FSDP / VeOmni distillation losses by
    :func:`compute_forward_kl_topk` (through :func:`~.common.replace_by_name`, so
    :func:`~.common.restore` undoes it). Returns the report entries ``{FSDP_PART:
    (replaced?, what), MEGATRON_PART: (False, why)}``; a verl without distillation (0.7.x)
    gets ``(False, "not in this verl ...")`` for both, one whose module lacks the function
    ``(False, "not replaced ...")``. Raises VerlIntegrationError when the function has other
    parameters than :data:`PARAMETERS`. Idempotent:
    a second call while patched changes nothing."""
    fsdp, why = _import_fsdp_losses()
    if fsdp is None:
        return {FSDP_PART: (False, why), MEGATRON_PART: _megatron_entry()}
    current = getattr(fsdp, FUNCTION, None)
    if current is None:  # an optional part: reported, the rest is patched
        return {FSDP_PART: (False, f"not replaced (this verl's {FSDP_MODULE} has no {FUNCTION})"),
                MEGATRON_PART: _megatron_entry()}
    what = (f"{FUNCTION} in {FSDP_MODULE}: the student's top-K log-probs from rl_kernels.topk_log_probs_from_logits "
            f"(float32; no N x V log_softmax kept for backward)")
    if getattr(current, "_rl_kernels_original", None) is not None:  # already ours
        return {FSDP_PART: (True, what), MEGATRON_PART: _megatron_entry()}
    check_signature(f"{FSDP_MODULE}.{FUNCTION}", current, PARAMETERS)
    places = replace_by_name(fsdp, {FUNCTION: _replacement(fsdp, current)})
    if places:
        what += f"; {len(places)} by-name import(s) ({', '.join(places)})"
    return {FSDP_PART: (True, what), MEGATRON_PART: _megatron_entry()}


def _ulysses(fsdp):
    """verl's Ulysses helpers as verl's loss module sees them (its own names, read per call), else
    from ``verl.utils.ulysses``."""
    world_size = getattr(fsdp, "get_ulysses_sequence_parallel_world_size", None)
    slice_input = getattr(fsdp, "slice_input_tensor", None)
    if world_size is None or slice_input is None:
        import verl.utils.ulysses as ulysses

        world_size, slice_input = ulysses.get_ulysses_sequence_parallel_world_size, ulysses.slice_input_tensor
    return world_size, slice_input


def _replacement(fsdp, original):
    """:func:`compute_forward_kl_topk` bound to verl's loss module (Ulysses helpers) and verl's
    original function (which runs the calls this one does not serve)."""

    @torch.compiler.disable
    def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format):
        """rl-kernels replacement for verl's ``compute_forward_kl_topk`` (FSDP / VeOmni): the same
        arguments and outputs (see :mod:`rl_kernels.integrations.verl.distill`)."""
        out = _forward_kl_topk(fsdp, student_logits, teacher_topk_log_probs, teacher_topk_ids, config)
        if out is None:  # not a layout this path serves: verl's own function (and its checks)
            log_once(logging.WARNING, "rl_kernels: verl's compute_forward_kl_topk got inputs rl-kernels does not "
                     "serve (teacher tensors not nested, student_logits not 3-D, or mismatched shapes): verl's "
                     "own function runs them")
            return original(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format)
        record("distillation_calls", "distillation fsdp", student_logits.shape[0] * student_logits.shape[1])
        return out

    compute_forward_kl_topk._rl_kernels_original = original
    return verl_fallback(FSDP_MODULE, FUNCTION)(compute_forward_kl_topk)  # float64 student logits: verl's


def _forward_kl_topk(fsdp, student_logits, teacher_log_probs, teacher_ids, config) -> dict | None:
    """verl's outputs with the student's log-probs from rl-kernels; None for inputs verl's
    function asserts against (it then runs and raises as verl does)."""
    tensors = (student_logits, teacher_log_probs, teacher_ids)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or not teacher_log_probs.is_nested \
            or not teacher_ids.is_nested or student_logits.dim() != 3:
        return None
    # the packed tokens of every sequence: (1, total_nnz, K), as the student's (1, total_nnz, V)
    teacher_log_probs = teacher_log_probs.values().unsqueeze(0)
    teacher_ids = teacher_ids.values().unsqueeze(0)
    world_size, slice_input = _ulysses(fsdp)
    if world_size() > 1:  # this rank's slice of the sequence, as verl slices the student's input
        teacher_log_probs = slice_input(teacher_log_probs, dim=1)
        teacher_ids = slice_input(teacher_ids, dim=1)
    if not teacher_log_probs.shape[:2] == teacher_ids.shape[:2] == student_logits.shape[:2]:
        return None
    loss_config = config.distillation_loss
    k = teacher_ids.shape[-1]
    log_q = topk_log_probs_from_logits(student_logits, teacher_ids, backend=options().backend)
    with torch.no_grad():  # the student's own top K (the overlap metric): the logits' order is log q's
        student_ids = torch.topk(student_logits, k=k, dim=-1).indices
    student_mass = log_q.exp().sum(-1)
    teacher_mass = teacher_log_probs.exp().sum(-1)
    clamp = loss_config.log_prob_min_clamp
    if clamp is not None:
        log_q = log_q.clamp_min(clamp)
        teacher_log_probs = teacher_log_probs.clamp_min(clamp)
    log_p = teacher_log_probs.float()
    distillation_losses = (log_p.exp() * (log_p - log_q)).sum(-1)  # forward KL over the K ids (float32)

    # the teacher's ids that are among the student's top K, and the mean of -p_t (log p_t - log q)
    # over them (0 where there is none): verl's overlap diagnostics
    in_student_topk = (teacher_ids[..., :, None] == student_ids[..., None, :]).any(-1)
    overlap_count = in_student_topk.sum(-1)
    # (a product with the 0/1 selection, as verl's: a non-finite term outside it gives NaN there too)
    advantage = (-(teacher_log_probs.exp() * (teacher_log_probs - log_q)) * in_student_topk).sum(-1)
    advantage = advantage / overlap_count.clamp_min(1)
    advantage = torch.where(overlap_count > 0, advantage, torch.zeros((), device=advantage.device))
    # verl's dtypes: its student log-probs are in the logits' dtype (ours float32, rounded here once)
    return {
        "distillation_losses": distillation_losses,
        "student_mass": student_mass.to(student_logits.dtype),
        "teacher_mass": teacher_mass,
        "overlap_count": overlap_count,
        "overlap_token_advantage": advantage.to(torch.promote_types(teacher_log_probs.dtype, student_logits.dtype)),
    }
