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
as the one N x V tensor of backward. verl's Megatron distillation
(``verl.trainer.distillation.megatron.losses.compute_forward_kl_topk``: this rank's vocab-parallel
logits shard, verl's own autograd Function with TP all-reduces) is replaced the same way (issue 45):
the teacher's tensors laid out by verl's ``preprocess_thd_engine`` / ``preprocess_bshd_engine`` as
verl's function lays them out, the student's log-probs from
:func:`rl_kernels.topk_log_probs_from_logits` with ``process_group=<the TP group>`` (identical bits
on every rank, each rank its shard's gradient), verl's Megatron definitions (masses after the clamp,
float32) and its overlap metrics (the student's top K over the group: one all_gather of K
candidates per rank).

``loss_mode=forward_kl_topk_tail`` (:mod:`rl_kernels.integrations.verl_impl.modes`, registered in verl's
registry) is computed by the same replacements, on both engines: the student's log-probs at the
teacher's ids and its log-mass outside them (``return_tail=True``), :func:`tail_terms`; outputs
``distillation_losses`` (the (K+1)-category KL), ``student_mass``, ``teacher_mass``, the overlap
metrics, ``tail_loss`` and ``student_tail_mass``. It takes no ``log_prob_min_clamp`` (ValueError),
and a call outside rl-kernels' kernels raises (verl has no tail-aware function to hand it to).

On the FSDP fused path (``use_fused_kernels=True``, ``impl_backend=rl_kernels``, remove-padding),
:func:`patch_fused_distillation` makes the served model's forward fill the ``fused_linear_aux``
that verl's FSDP engine reads (``distillation_losses``, ``student_mass``, ``teacher_mass``, with
the same :func:`topk_terms` as above) from one fused head call that also gives verl's log-probs
(:func:`serve_fused_topk`): no N x V tensor in forward or backward. On verl's Megatron fused path
(whose fused forward computes no distillation outputs), :mod:`.megatron_step` makes rl-kernels'
fused head compute them, vocab-parallel, as verl's Megatron logits path defines them, and puts
them into the engine's forward_step output (:func:`.megatron_step.serve_megatron_topk`). Both fused routes
serve the tail mode too (``linear_log_probs_at_ids(return_tail=True)``; on the FSDP route the two tail
outputs, which verl's engine does not read from ``fused_linear_aux``, are laid out by
:func:`~.fsdp_engine.lay_out_outputs` with the engine's own ``_gather_and_unpad_packed``). Both fused routes give
verl's overlap metrics too (the same :func:`overlap_metrics` as the logits paths; the student's top K
selected in the fused head's own forward, ``linear_log_probs_at_ids(top_k=K)``, :func:`overlap_top_k`: no
logits, no pass of its own), laid out as the other outputs, unless the option ``overlap_metrics`` is off.
"""
from __future__ import annotations

import importlib
import inspect
import logging
from typing import NamedTuple

import torch

from ...core._logging import log_once
from ...distill import linear_log_probs_at_ids
from ...core.validation import MAX_TOPK
from ...logits import topk_log_probs_from_logits
from . import modes
from .patch_state import (VerlIntegrationError, check_signature, left_to_verl, outside_kernels, record, replace_by_name,
                          save_logits_for_backward, scatter_rows, select_rows)
from .distill_terms import OVERLAP_KEYS, distinct_on_padding, overlap_metrics, tail_terms, topk_terms  # noqa: F401
from .modes import TAIL_MODE, check_tail_config, is_tail_mode
from .settings import options
from .signatures import has_module

FSDP_MODULE = "verl.trainer.distillation.fsdp.losses"
MEGATRON_MODULE = "verl.trainer.distillation.megatron.losses"
FUNCTION = "compute_forward_kl_topk"
PARAMETERS = ["student_logits", "teacher_topk_log_probs", "teacher_topk_ids", "config", "data_format"]
"""The parameters of verl's ``compute_forward_kl_topk`` (verl 0.9.1 and main) that the replacement handles."""

FSDP_PART = "distillation (FSDP, VeOmni)"
FUSED_PART = "distillation (FSDP fused path)"
MEGATRON_PART = "distillation (Megatron)"
MEGATRON_FUSED_PART = "distillation (Megatron fused path)"
TAIL_PART = f"distillation loss_mode={TAIL_MODE}"
NOT_IN_THIS_VERL = "not in this verl (no verl.trainer.distillation: verl 0.7.x)"


def tail_entry(report: dict) -> tuple[bool, str]:
    """The report entry of ``loss_mode=forward_kl_topk_tail``: where verl's registry stands
    (:func:`rl_kernels.integrations.verl_impl.modes.status`, after :func:`~rl_kernels.integrations.verl_impl.modes.register`)
    and which of the four distillation parts of ``report`` serve it (served where they are)."""
    status = modes.register()
    if status.startswith(("not registered", "verl's own")):
        return False, f"not served: verl's registry: {status}"
    parts = {FSDP_PART: "FSDP / VeOmni logits path", FUSED_PART: "FSDP fused path (impl_backend=rl_kernels)",
             MEGATRON_PART: "Megatron logits path", MEGATRON_FUSED_PART: "Megatron fused path"}
    ok = {part: bool(report.get(part, (False,))[0]) for part in parts}
    if ok[FUSED_PART]:  # the tail outputs are laid out with the engine's own helper (verl 0.9.1, main; not 0.8.0)
        ok[FUSED_PART] = _engine_lays_out_extra()
    served = [name for part, name in parts.items() if ok[part]]
    left = [name for part, name in parts.items() if not ok[part]]
    if not served:
        return False, f"not served on any path (verl's registry: {status})"
    what = (f"served on the {', '.join(served)} (the (K+1)-category KL, no clamp at 0; log_prob_min_clamp=null "
            f"required); verl's registry: {status}")
    if left:
        what += f"; NOT on the {', '.join(left)}: such a micro-batch raises in the loss"
    return True, what


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
    """Replace verl's Megatron ``compute_forward_kl_topk`` (vocab-parallel logits shards) by
    rl-kernels' (:func:`replacement` with ``megatron=True``) where verl's Megatron losses import and
    the function has :data:`PARAMETERS`. Returns the report entry (replaced?, what)."""
    if not has_module(MEGATRON_MODULE):
        return False, NOT_IN_THIS_VERL
    try:
        megatron_losses = importlib.import_module(MEGATRON_MODULE)
    except ImportError as exc:  # megatron-core missing: verl's Megatron engine cannot run here either
        return False, f"not replaced: {MEGATRON_MODULE} not importable here ({exc})"
    current = getattr(megatron_losses, FUNCTION, None)
    if current is None:
        return False, f"not replaced (this verl's {MEGATRON_MODULE} has no {FUNCTION})"
    what = (f"{FUNCTION} in {MEGATRON_MODULE}: the student's top-K log-probs from "
            f"rl_kernels.topk_log_probs_from_logits on this rank's vocab shard over the TP group (verl's Megatron "
            f"definitions: log_prob_min_clamp on both sides, masses after it; float32; no N x V_r log-softmax kept "
            f"for backward); {TAIL_MODE} too")
    if getattr(current, "_rl_kernels_original", None) is None:
        check_signature(f"{MEGATRON_MODULE}.{FUNCTION}", current, PARAMETERS)
        places = replace_by_name(megatron_losses, {FUNCTION: replacement(megatron_losses, current, megatron=True)})
        if places:
            what += f"; {len(places)} by-name import(s) ({', '.join(places)})"
    return True, what


def patch_distillation() -> dict[str, tuple[bool, str]]:
    """Replace verl's ``compute_forward_kl_topk`` of the FSDP / VeOmni distillation losses and of the
    Megatron ones by :func:`replacement` (through :func:`~.patch_state.replace_by_name`, so
    :func:`~.patch_state.restore` undoes it). Returns the report entries ``{FSDP_PART: (replaced?, what),
    MEGATRON_PART: (replaced?, what)}``; a verl without distillation (0.7.x) gets ``(False, "not in
    this verl ...")``, one whose module lacks the function ``(False, "not replaced ...")``. Raises
    VerlIntegrationError when the function has other parameters than :data:`PARAMETERS`. Idempotent:
    a second call while patched changes nothing."""
    fsdp, why = _import_fsdp_losses()
    if fsdp is None:
        return {FSDP_PART: (False, why), MEGATRON_PART: _megatron_entry()}
    current = getattr(fsdp, FUNCTION, None)
    if current is None:  # an optional part: reported, the rest is patched
        return {FSDP_PART: (False, f"not replaced (this verl's {FSDP_MODULE} has no {FUNCTION})"),
                MEGATRON_PART: _megatron_entry()}
    what = (f"{FUNCTION} in {FSDP_MODULE}: the student's top-K log-probs from rl_kernels.topk_log_probs_from_logits "
            f"(float32; no N x V log_softmax kept for backward); {TAIL_MODE} too")
    if getattr(current, "_rl_kernels_original", None) is not None:  # already ours
        return {FSDP_PART: (True, what), MEGATRON_PART: _megatron_entry()}
    check_signature(f"{FSDP_MODULE}.{FUNCTION}", current, PARAMETERS)
    places = replace_by_name(fsdp, {FUNCTION: replacement(fsdp, current, megatron=False)})
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


def replacement(module, original, *, megatron: bool):
    """rl-kernels' ``compute_forward_kl_topk`` for verl's FSDP / VeOmni (``megatron=False``) or
    Megatron (``megatron=True``) loss module ``module`` (its own helpers for the teacher's layout,
    read per call), with verl's ``original`` for the calls outside rl-kernels' kernels: student
    logits outside them (float64, ...: logged once, counted) or a layout this path does not take
    (verl's own function then runs and asserts as verl's does). With ``loss_mode=forward_kl_topk_tail``
    there is no verl function to hand a call to: such a call raises instead. Public for the benchmark
    (``scripts/distill_bench.py``), which times it against ``original`` without patching verl."""
    label = f"{module.__name__}.{FUNCTION}"
    path = "distillation megatron" if megatron else "distillation fsdp"

    @torch.compiler.disable
    def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format):
        """rl-kernels replacement for verl's ``compute_forward_kl_topk``: the same arguments and outputs
        (see :mod:`rl_kernels.integrations.verl_impl.distill_losses`), and the tail-aware terms of
        ``loss_mode=forward_kl_topk_tail``."""
        loss_config = getattr(config, "distillation_loss", None)
        tail = is_tail_mode(loss_config)
        why = outside_kernels(student_logits)
        if tail:
            check_tail_config(loss_config)
            if why is not None:
                raise VerlIntegrationError(f"rl_kernels: distillation loss_mode={TAIL_MODE} got {why}, outside "
                                           f"rl-kernels' kernels (bfloat16 / float16 / float32 student logits), and "
                                           f"verl has no tail-aware computation to hand it to")
        elif left_to_verl(label, why):
            return original(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format)
        teacher = _teacher_layout(module, teacher_topk_log_probs, teacher_topk_ids, data_format, megatron)
        if teacher is None or not isinstance(student_logits, torch.Tensor) or student_logits.dim() != 3 \
                or not teacher[0].shape[:2] == teacher[1].shape[:2] == student_logits.shape[:2]:
            if tail:
                raise VerlIntegrationError(
                    f"rl_kernels: distillation loss_mode={TAIL_MODE}: the teacher's top-K tensors (nested, one row "
                    f"per token) do not match the student logits {tuple(getattr(student_logits, 'shape', ()))}")
            log_once(logging.WARNING, "rl_kernels: verl's compute_forward_kl_topk got inputs rl-kernels does not "
                     "serve (teacher tensors not nested, student_logits not 3-D, or mismatched shapes): verl's "
                     "own function runs them")
            return original(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format)
        out = logits_topk_outputs(student_logits, teacher[0], teacher[1], loss_config, megatron=megatron,
                                  rows=teacher[2])
        record("distillation_calls", path, student_logits.shape[0] * student_logits.shape[1])
        return out

    compute_forward_kl_topk._rl_kernels_original = original
    compute_forward_kl_topk._rl_kernels_fallback = (module.__name__, FUNCTION)
    return compute_forward_kl_topk


def _teacher_layout(module, teacher_log_probs, teacher_ids, data_format, megatron: bool):
    """The teacher's (log-probs, ids) laid out as this rank's student logits, with verl's own helpers
    as verl's function lays them out: FSDP, the packed tokens (1, total, K) sliced for this Ulysses
    rank; Megatron, ``preprocess_thd_engine`` / ``preprocess_bshd_engine`` (context-parallel split),
    and, third, which of those rows are tokens (False: padding those helpers added, :func:`_token_rows`).
    None for tensors that are not nested (verl's function asserts against them)."""
    if not (isinstance(teacher_log_probs, torch.Tensor) and isinstance(teacher_ids, torch.Tensor)
            and teacher_log_probs.is_nested and teacher_ids.is_nested):
        return None
    if megatron:
        preprocess = module.preprocess_thd_engine if data_format == "thd" else module.preprocess_bshd_engine
        return tuple(preprocess(t, pre_process=True)[0] for t in (teacher_log_probs, teacher_ids,
                                                                   _token_rows(teacher_ids)))
    teacher_log_probs = teacher_log_probs.values().unsqueeze(0)  # the packed tokens, as the student's (1, total, V)
    teacher_ids = teacher_ids.values().unsqueeze(0)
    rows = torch.ones(teacher_ids.shape[:2], dtype=torch.int8, device=teacher_ids.device)
    world_size, slice_input = _ulysses(module)
    if world_size() > 1:  # this rank's slice of the sequence, as verl slices the student's input (zero padding)
        teacher_log_probs = slice_input(teacher_log_probs, dim=1)
        teacher_ids = slice_input(teacher_ids, dim=1)
        rows = slice_input(rows, dim=1)
    return teacher_log_probs, teacher_ids, rows


def _token_rows(nested_ids):
    """A nested (B, j) int8 tensor of ones beside the teacher's nested (B, j, K) ids: laid out with the
    same helper and arguments, its zeros are the padding rows the helper adds."""
    values = torch.ones(nested_ids.values().shape[0], dtype=torch.int8, device=nested_ids.values().device)
    return torch.nested.nested_tensor_from_jagged(values, offsets=nested_ids.offsets())


def _tensor_parallel(logits) -> dict:
    """The vocab-parallel arguments for this rank's logits shard (Megatron's TP group; empty with one rank)."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return {}
    return {"process_group": parallel_state.get_tensor_model_parallel_group(),
            "vocab_start_index": parallel_state.get_tensor_model_parallel_rank() * logits.shape[-1]}


def _student_top_ids(logits, k: int, tp: dict):
    """The student's top-``k`` ids (global) from its logits, without gradient; over the TP group from
    each rank's shard candidates (one all_gather of k values and ids per token: the same bits on
    every rank)."""
    with torch.no_grad():
        if not tp:
            return torch.topk(logits, k=k, dim=-1).indices
        group = tp["process_group"]
        values, ids = torch.topk(logits.float(), k=min(k, logits.shape[-1]), dim=-1)
        ids = ids + tp["vocab_start_index"]
        world = torch.distributed.get_world_size(group)
        all_values = [torch.empty_like(values) for _ in range(world)]
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        torch.distributed.all_gather(all_values, values.contiguous(), group=group)
        torch.distributed.all_gather(all_ids, ids.contiguous(), group=group)
        values, ids = torch.cat(all_values, -1), torch.cat(all_ids, -1)
        return ids.gather(-1, torch.topk(values, k=k, dim=-1).indices)


def logits_topk_outputs(student_logits, teacher_log_probs, teacher_ids, loss_config, *, megatron: bool,
                        rows=None) -> dict:
    """verl's ``compute_forward_kl_topk`` outputs ((B, T) each) from the student logits (this rank's
    vocab shard for ``megatron``) and the teacher's tensors laid out as them, the student's log-probs
    at the teacher's ids from :func:`rl_kernels.topk_log_probs_from_logits`. forward_kl_topk: verl's
    FSDP definitions (:func:`topk_terms`; student_mass in the logits' dtype) or its Megatron ones
    (masses after the clamp, float32). forward_kl_topk_tail: :func:`tail_terms` (float32). The overlap
    metrics as verl defines them: the teacher's ids among the student's top K, and the mean of -p_t
    (log p_t - log q) over them (0 where there is none; the clamped values where a clamp is set).
    ``rows``: which rows are tokens (:func:`_teacher_layout`; None: all)."""
    tp = _tensor_parallel(student_logits) if megatron else {}
    k = teacher_ids.shape[-1]
    backend = options().backend
    if student_logits.requires_grad:
        save_logits_for_backward(student_logits)  # (verl's in-place log-probs backward must not overwrite them)
    if is_tail_mode(loss_config):
        log_q, tail_log_probs = topk_log_probs_from_logits(student_logits, distinct_on_padding(teacher_ids, rows),
                                                           backend=backend, return_tail=True, **tp)
        out = tail_terms(log_q, tail_log_probs, teacher_log_probs)
        slot_q, slot_t = log_q, teacher_log_probs.float()
    else:
        log_q = topk_log_probs_from_logits(student_logits, teacher_ids, backend=backend, **tp)
        losses, student_mass, teacher_mass, slot_q, slot_t = topk_terms(
            log_q, teacher_log_probs, loss_config.log_prob_min_clamp, clamp_masses=megatron)
        if megatron:  # verl's Megatron outputs are float32 (its teacher side is cast after the clamp)
            slot_t = slot_t.float()
            out = {"distillation_losses": losses, "student_mass": student_mass.detach(), "teacher_mass": teacher_mass}
        else:  # verl's FSDP dtypes: its student log-probs are in the logits' dtype (ours float32, rounded once)
            out = {"distillation_losses": losses, "student_mass": student_mass.to(student_logits.dtype),
                   "teacher_mass": teacher_mass}
    overlap = overlap_metrics(teacher_ids, _student_top_ids(student_logits, k, tp), slot_t, slot_q)
    if not megatron and not is_tail_mode(loss_config):
        overlap[OVERLAP_KEYS[1]] = overlap[OVERLAP_KEYS[1]].to(
            torch.promote_types(teacher_log_probs.dtype, student_logits.dtype))
    out.update(overlap)
    return out


def overlap_top_k(teacher_ids, path: str) -> int:
    """The K of the student's top K that verl's overlap metrics need on a fused path (the teacher's K:
    ``teacher_ids`` (..., K)), for ``linear_log_probs_at_ids(top_k=K)``, which selects them in the fused
    head's own forward: 0 where the option ``overlap_metrics`` is off, or where K exceeds what the
    kernels select (one WARNING: verl's loss then logs none)."""
    k = teacher_ids.shape[-1]
    on = options().overlap_metrics
    if not on or k > MAX_TOPK:
        if on:
            log_once(logging.WARNING, f"rl_kernels: top-K distillation on the {path}: the overlap metrics are not "
                     f"computed with topk={k} (the fused head selects at most {MAX_TOPK}); verl's loss logs "
                     f"none (verl's logits path, use_fused_kernels=False, computes them)")
        else:
            log_once(logging.INFO, f"rl_kernels: top-K distillation on the {path}: overlap metrics off "
                     f"(fused_kernel_options.rl_kernels.overlap_metrics=false)")
        return 0
    log_once(logging.INFO, f"rl_kernels: top-K distillation on the {path}: overlap metrics from the student's top "
             f"K, selected in the fused head's forward (fused_kernel_options.rl_kernels.overlap_metrics=false "
             f"turns them off)")
    return k




# ----------------------------------------------------------------------------- the FSDP fused path
# verl's FSDP engine (0.9.1 and main) reads, on a fused micro-batch with distillation_use_topk and
# remove-padding, ``output.fused_linear_aux.{distillation_losses, student_mass, teacher_mass}``
# ((1, tokens of this rank) each) from the model's forward, gathers them over the Ulysses group and
# unpads them as it does the log-probs. Only VeOmni's own fused forward fills it; verl's FSDP fused
# forwards hand the model no teacher tensors. rl-kernels' served forward fills it: the FSDP engine's
# forward_step makes the micro-batch (teacher tensors) and verl's distillation config (the clamp)
# known to the fused head (the step request, :mod:`.fsdp_engine`), which computes verl's PPO
# log-probs and the student's log-probs at the teacher's ids in one fused call
# (:func:`serve_fused_topk`); :func:`~.fsdp_fused.serving_forward` attaches the result.

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
ENGINE_CLASS = "FSDPEngineWithLMHead"


def _engine_lays_out_extra() -> bool:
    """Whether verl's FSDP engine has ``_gather_and_unpad_packed`` (verl 0.9.1, main; not 0.8.0), with
    which :func:`~.fsdp_engine.lay_out_outputs` lays out the outputs it does not read from ``fused_linear_aux``
    (the tail mode's, the overlap metrics)."""
    try:
        engine = getattr(importlib.import_module(ENGINE_MODULE), ENGINE_CLASS, None)
    except ImportError:
        return False
    return hasattr(engine, "_gather_and_unpad_packed")


class FusedLinearAux(NamedTuple):
    """What verl's FSDP engine reads from ``output.fused_linear_aux`` on a top-K distillation
    micro-batch: (1, n) float32 each, n the tokens of this rank (Ulysses padding included). The
    masses are metrics only (no gradient), as verl's loss uses them."""

    distillation_losses: torch.Tensor
    student_mass: torch.Tensor
    teacher_mass: torch.Tensor


def _flag(micro_batch, key: str, default=False):
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def _loss_config(loss_function):
    """verl's ``DistillationLossConfig`` (its ``log_prob_min_clamp``, ``loss_mode``), from the
    ``distillation_config`` that verl's worker binds into the loss function it hands the engine
    (``partial(distillation_ppo_loss, ..., distillation_config=...)``); VerlIntegrationError when the
    loss function carries none."""
    config = (getattr(loss_function, "keywords", None) or {}).get("distillation_config")
    loss_config = getattr(config, "distillation_loss", None)
    if loss_config is None or not hasattr(loss_config, "log_prob_min_clamp"):
        raise VerlIntegrationError(
            "rl_kernels.integrations.verl: top-K distillation on the fused path needs verl's distillation config "
            "(its log_prob_min_clamp), which verl's worker binds into the engine's loss function as "
            f"distillation_config=...; the loss function here ({loss_function!r}) carries none. Use "
            "use_fused_kernels=False (verl's logits path) for this run.")
    if is_tail_mode(loss_config):
        check_tail_config(loss_config)
    return loss_config


def serve_fused_topk(step, hidden_states, weight, labels, *, temperature: float, softcap,
                     return_entropy: bool, backend: str, loss_rows=None) -> tuple:
    """The fused head of a served model's forward on a top-K distillation micro-batch: verl's
    ``(log_probs, entropy or None)`` at ``labels`` (1, n), and the step request's ``outputs['aux']``
    (``step``: :class:`~.patch_state.StepRequest`, its ``micro_batch`` holding the teacher's tensors and
    its ``loss_function`` verl's distillation config) set to verl's distillation outputs (:func:`topk_terms`, as verl's logits path defines them) from the
    student's log-probs at the teacher's ids, all from one call of
    :func:`rl_kernels.distill.linear_log_probs_at_ids` (no N x V tensor in forward or backward).
    ``outputs['extra']``: the tail mode's other outputs, and verl's overlap metrics
    (the student's top K selected in the same call, :func:`overlap_top_k`, unless the option
    ``overlap_metrics`` is off), which :func:`~.fsdp_engine.lay_out_outputs` lays out.
    The teacher's packed (1, total, K) tensors are sliced for this Ulysses rank with verl's helpers,
    as verl's logits path slices them. ``loss_rows``: ``(index, shape)`` under the option
    ``loss_rows_only``, where ``hidden_states`` / ``labels`` hold this rank's rows at ``index`` only
    (of ``shape``, the rank's labels): the teacher's rows are selected the same way and every
    per-row output goes back to ``shape``, 0 outside. VerlIntegrationError for a soft-capped model (the gathered
    logits' gradient under a cap is not implemented), a loss function without verl's distillation
    config, or teacher tensors that do not match the student's tokens."""
    if softcap is not None:
        raise VerlIntegrationError(
            "rl_kernels.integrations.verl: top-K distillation on the fused path with a soft-capped model "
            f"(softcap={softcap}) is not served (the gradient of the logits at the teacher's ids under a cap "
            "is not implemented); use use_fused_kernels=False (verl's logits path) for this model")
    loss_config = _loss_config(step.loss_function)
    fsdp, why = _import_fsdp_losses()
    if fsdp is None:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: top-K distillation on the fused path: {why}")
    teacher_log_probs = step.micro_batch["teacher_logprobs"].values().unsqueeze(0)  # (1, total, K)
    teacher_ids = step.micro_batch["teacher_ids"].values().unsqueeze(0)
    rows = torch.ones(teacher_ids.shape[:2], dtype=torch.int8)
    world_size, slice_input = _ulysses(fsdp)
    if world_size() > 1:  # this rank's slice (padded as verl pads the student's inputs)
        teacher_log_probs = slice_input(teacher_log_probs, dim=1)
        teacher_ids = slice_input(teacher_ids, dim=1)
        rows = slice_input(rows, dim=1)
    device = hidden_states.device
    teacher_log_probs = teacher_log_probs.to(device, non_blocking=True)
    teacher_ids = teacher_ids.to(device, non_blocking=True)
    if loss_rows is not None and tuple(teacher_ids.shape[:-1]) == tuple(loss_rows[1]):
        index, rank_rows = loss_rows[0], teacher_ids.shape[1]
        teacher_log_probs, teacher_ids, rows = (select_rows(t, index, rank_rows).unsqueeze(0)
                                                for t in (teacher_log_probs, teacher_ids, rows))
    if tuple(teacher_ids.shape[:-1]) != tuple(labels.shape) or teacher_ids.shape != teacher_log_probs.shape:
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: top-K distillation on the fused path: the teacher's top-K tensors "
            f"(ids {tuple(teacher_ids.shape)}, log-probs {tuple(teacher_log_probs.shape)}) do not match the "
            f"student's tokens {tuple(labels.shape)} on this rank")
    # (the student's top K for the overlap metrics, where verl's engine can lay them out)
    top_k = overlap_top_k(teacher_ids, "FSDP fused path") if _engine_lays_out_extra() else 0
    if is_tail_mode(loss_config):
        log_probs, entropy, log_q, tail_log_probs, *student_top = linear_log_probs_at_ids(
            hidden_states, weight, labels, distinct_on_padding(teacher_ids, rows), temperature=temperature,
            return_entropy=return_entropy, backend=backend, return_tail=True, top_k=top_k)
        terms = tail_terms(log_q, tail_log_probs, teacher_log_probs)
        aux = FusedLinearAux(*(terms.pop(key) for key in FusedLinearAux._fields))
        slot_t, slot_q = teacher_log_probs.float(), log_q
    else:
        log_probs, entropy, log_q, *student_top = linear_log_probs_at_ids(
            hidden_states, weight, labels, teacher_ids, temperature=temperature, return_entropy=return_entropy,
            backend=backend, top_k=top_k)
        losses, student_mass, teacher_mass, slot_q, slot_t = topk_terms(log_q, teacher_log_probs,
                                                                        loss_config.log_prob_min_clamp)
        aux = FusedLinearAux(losses, student_mass.detach(), teacher_mass.float())
        terms = {}
    if top_k:  # (float32 advantage, as the aux outputs of this path)
        terms.update(overlap_metrics(teacher_ids, student_top[1], slot_t, slot_q))
    if loss_rows is not None:  # back to the rank's rows, 0 outside the loss
        index, shape = loss_rows
        aux = FusedLinearAux(*(scatter_rows(t.reshape(-1), index, shape) for t in aux))
        terms = {key: scatter_rows(t.reshape(-1), index, shape) for key, t in terms.items()}
    step.outputs.update(aux=aux, extra=terms or None)
    record("distillation_calls", "distillation fused fsdp", labels.numel())
    return log_probs, entropy




MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
MEGATRON_ENGINE_CLASS = "MegatronEngineWithLMHead"
MEGATRON_FUSED_MODULE = "verl.models.mcore.model_forward_fused"
STEP_PARAMETERS = ["self", "batch_iter", "model", "logits_processor_func", "postprocess_micro_batch_func"]

# ----------------------------------------------------------------------------- the Megatron fused path
# verl's Megatron engine computes top-K distillation only on its logits path; its fused forward
# (``model_forward_fused.fused_forward_model_engine``) returns only log_probs / entropy. rl-kernels
# serves it there from the step request of the engine's micro-batch: :mod:`.megatron_step` (the
# teacher's tensors laid out by verl's ``preprocess_thd_engine``, the terms computed by
# :func:`.megatron_step.serve_megatron_topk` in rl-kernels' fused head and laid out by verl's
# ``postprocess_thd_engine`` into forward_step's output). The constants above name what it wraps.


_OVERLAP = ("verl's overlap metrics (overlap_count, overlap_token_advantage) from the student's top K, selected "
            "in the fused head's forward, unless "
            "fused_kernel_options.rl_kernels.overlap_metrics=false (read per call)")


def fused_distillation_entry(prepare) -> tuple[bool, str]:
    """The report entry (served?, what) of top-K distillation on the FSDP fused path, whose
    micro-batches :mod:`.fsdp_engine` serves where this verl has distillation and its FSDP engine's
    ``prepare_model_outputs`` (``prepare``: None where the engine's methods are not served) reads
    ``fused_linear_aux`` (read from its source: a feature, not a version)."""
    fsdp, why = _import_fsdp_losses()
    if fsdp is None:
        return False, why
    if prepare is None:
        return False, f"not served (this verl's {ENGINE_CLASS} has no forward_step / prepare_model_inputs / " \
                      f"prepare_model_outputs with the parameters rl-kernels handles)"
    try:
        reads_aux = "fused_linear_aux" in inspect.getsource(prepare)
    except (OSError, TypeError):
        reads_aux = False
    if not reads_aux:
        return False, (f"not served: this verl's {ENGINE_CLASS}.prepare_model_outputs reads no fused_linear_aux "
                       f"from a fused forward, so its loss finds no distillation_losses (a WARNING at the first "
                       f"such micro-batch); verl's logits path (use_fused_kernels=False) is served")
    if _engine_lays_out_extra():
        overlap = f"{_OVERLAP}, laid out by the engine's _gather_and_unpad_packed (verl's engine reads none)"
    else:
        overlap = (f"verl's overlap metrics are not computed on this path (this verl's {ENGINE_CLASS} has no "
                   f"_gather_and_unpad_packed to lay them out, and reads none)")
    return True, (f"models with impl_backend=rl_kernels and use_remove_padding=True fill fused_linear_aux "
                  f"(distillation_losses, student_mass, teacher_mass, read by {ENGINE_CLASS}.prepare_model_outputs) "
                  f"from one rl_kernels.distill.linear_log_probs_at_ids call with verl's log-probs (no N x V "
                  f"tensor); {overlap}; {TAIL_MODE} too (its tail outputs laid out by the engine's "
                  f"_gather_and_unpad_packed); a WARNING where a fused micro-batch is not served")
