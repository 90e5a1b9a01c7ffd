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

On the FSDP fused path (``use_fused_kernels=True``, ``impl_backend=rl_kernels``, remove-padding),
:func:`patch_fused_distillation` makes the served model's forward fill the ``fused_linear_aux``
that verl's FSDP engine reads (``distillation_losses``, ``student_mass``, ``teacher_mass``, with
the same :func:`topk_terms` as above) from one fused head call that also gives verl's log-probs
(:func:`serve_fused_topk`): no N x V tensor in forward or backward. verl's Megatron fused path
computes no distillation outputs and is not served: one WARNING at its first top-K batch.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
import inspect
import logging
from typing import NamedTuple

import torch

from ..._logging import log_once
from ...distill import linear_log_probs_at_ids
from ...logits import topk_log_probs_from_logits
from .common import VerlIntegrationError, check_signature, record, replace_by_name, set_attr, verl_fallback
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
    distillation_losses, student_mass, teacher_mass, log_q, teacher_log_probs = topk_terms(
        log_q, teacher_log_probs, loss_config.log_prob_min_clamp)

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


def topk_terms(log_q, teacher_log_probs, clamp) -> tuple:
    """verl's per-token top-K forward KL terms from the student's log-probs at the teacher's ids
    (``verl.trainer.distillation.fsdp.losses.compute_forward_kl_topk``, both of rl-kernels' paths):
    ``log_q`` (..., K) float32, ``teacher_log_probs`` (..., K), ``clamp`` verl's
    ``log_prob_min_clamp`` (None: no clamp) -> ``(distillation_losses, student_mass, teacher_mass,
    log_q, teacher_log_probs)``: the masses sum exp over the K slots before the clamp, both sides
    are then clamped below at ``clamp``, the loss is sum_k p_k (log p_k - log q_k) in float32 (the
    clamped log-probs are returned for the overlap metrics)."""
    student_mass = log_q.exp().sum(-1)
    teacher_mass = teacher_log_probs.exp().sum(-1)
    if clamp is not None:
        log_q = log_q.clamp_min(clamp)
        teacher_log_probs = teacher_log_probs.clamp_min(clamp)
    log_p = teacher_log_probs.float()
    distillation_losses = (log_p.exp() * (log_p - log_q)).sum(-1)  # forward KL over the K ids (float32)
    return distillation_losses, student_mass, teacher_mass, log_q, teacher_log_probs



# ----------------------------------------------------------------------------- the FSDP fused path
# verl's FSDP engine (0.9.1 and main) reads, on a fused micro-batch with distillation_use_topk and
# remove-padding, ``output.fused_linear_aux.{distillation_losses, student_mass, teacher_mass}``
# ((1, tokens of this rank) each) from the model's forward, gathers them over the Ulysses group and
# unpads them as it does the log-probs. Only VeOmni's own fused forward fills it; verl's FSDP fused
# forwards hand the model no teacher tensors. rl-kernels' served forward fills it: the FSDP engine's
# forward_step makes the micro-batch (teacher tensors) and verl's distillation config (the clamp)
# known to the fused head (a context variable, :func:`topk_request`), which computes verl's PPO
# log-probs and the student's log-probs at the teacher's ids in one fused call
# (:func:`serve_fused_topk`); :func:`~.fsdp_fused.serving_forward` attaches the result.

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
ENGINE_CLASS = "FSDPEngineWithLMHead"


class FusedLinearAux(NamedTuple):
    """What verl's FSDP engine reads from ``output.fused_linear_aux`` on a top-K distillation
    micro-batch: (1, n) float32 each, n the tokens of this rank (Ulysses padding included). The
    masses are metrics only (no gradient), as verl's loss uses them."""

    distillation_losses: torch.Tensor
    student_mass: torch.Tensor
    teacher_mass: torch.Tensor


@dataclasses.dataclass
class TopKRequest:
    """A fused top-K distillation micro-batch of the FSDP engine: verl's micro-batch (its nested
    ``teacher_ids`` / ``teacher_logprobs``), the loss function verl's engine got (which carries
    verl's ``distillation_config``), and the outputs once the fused head has computed them."""

    micro_batch: object
    loss_function: object
    aux: FusedLinearAux | None = None


_request = contextvars.ContextVar("rl_kernels_topk_request", default=None)


def topk_request() -> TopKRequest | None:
    """The fused top-K distillation request of the FSDP engine's forward_step that runs now, or None."""
    return _request.get()


def _flag(micro_batch, key: str, default=False):
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def _wants_fused_topk(micro_batch) -> bool:
    return bool(_flag(micro_batch, "distillation_use_topk") and _flag(micro_batch, "use_fused_kernels"))


def _request_for(micro_batch, loss_function) -> TopKRequest | None:
    """A request for a fused, remove-padding micro-batch with top-K distillation and the teacher's
    tensors; None otherwise (verl's engine reads fused_linear_aux only with remove-padding)."""
    if not _wants_fused_topk(micro_batch) or not _flag(micro_batch, "use_remove_padding", True):
        return None
    keys = micro_batch.keys()
    if "teacher_ids" not in keys or "teacher_logprobs" not in keys:
        return None
    return TopKRequest(micro_batch, loss_function)


def fused_topk_on_request(method):
    """Wrap the FSDP engine's ``forward_step(self, micro_batch, loss_function, forward_only)``: while
    it runs, :func:`topk_request` is the micro-batch's request (or None)."""
    sig = inspect.signature(method)

    @functools.wraps(method)
    def forward_step(*args, **kwargs):
        arguments = sig.bind(*args, **kwargs).arguments
        token = _request.set(_request_for(arguments["micro_batch"], arguments.get("loss_function")))
        try:
            return method(*args, **kwargs)
        finally:
            _request.reset(token)

    forward_step._rl_kernels_original = method
    return forward_step


def _clamp(loss_function):
    """verl's ``log_prob_min_clamp``, from the ``distillation_config`` that verl's worker binds into
    the loss function it hands the engine (``partial(distillation_ppo_loss, ...,
    distillation_config=...)``); VerlIntegrationError when the loss function carries none."""
    config = (getattr(loss_function, "keywords", None) or {}).get("distillation_config")
    loss_config = getattr(config, "distillation_loss", None)
    if loss_config is None or not hasattr(loss_config, "log_prob_min_clamp"):
        raise VerlIntegrationError(
            "rl_kernels.integrations.verl: top-K distillation on the fused path needs verl's distillation config "
            "(its log_prob_min_clamp), which verl's worker binds into the engine's loss function as "
            f"distillation_config=...; the loss function here ({loss_function!r}) carries none. Use "
            "use_fused_kernels=False (verl's logits path) for this run.")
    return loss_config.log_prob_min_clamp


def serve_fused_topk(request: TopKRequest, hidden_states, weight, labels, *, temperature: float, softcap,
                     return_entropy: bool, backend: str) -> tuple:
    """The fused head of a served model's forward on a top-K distillation micro-batch: verl's
    ``(log_probs, entropy or None)`` at ``labels`` (1, n), and ``request.aux`` set to verl's
    distillation outputs (:func:`topk_terms`, as verl's logits path defines them) from the
    student's log-probs at the teacher's ids, all from one call of
    :func:`rl_kernels.distill.linear_log_probs_at_ids` (no N x V tensor in forward or backward).
    The teacher's packed (1, total, K) tensors are sliced for this Ulysses rank with verl's helpers,
    as verl's logits path slices them. VerlIntegrationError for a soft-capped model (the gathered
    logits' gradient under a cap is not implemented), a loss function without verl's distillation
    config, or teacher tensors that do not match the student's tokens."""
    if softcap is not None:
        raise VerlIntegrationError(
            "rl_kernels.integrations.verl: top-K distillation on the fused path with a soft-capped model "
            f"(softcap={softcap}) is not served (the gradient of the logits at the teacher's ids under a cap "
            "is not implemented); use use_fused_kernels=False (verl's logits path) for this model")
    clamp = _clamp(request.loss_function)
    fsdp, why = _import_fsdp_losses()
    if fsdp is None:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: top-K distillation on the fused path: {why}")
    teacher_log_probs = request.micro_batch["teacher_logprobs"].values().unsqueeze(0)  # (1, total, K)
    teacher_ids = request.micro_batch["teacher_ids"].values().unsqueeze(0)
    world_size, slice_input = _ulysses(fsdp)
    if world_size() > 1:  # this rank's slice (padded as verl pads the student's inputs)
        teacher_log_probs = slice_input(teacher_log_probs, dim=1)
        teacher_ids = slice_input(teacher_ids, dim=1)
    device = hidden_states.device
    teacher_log_probs = teacher_log_probs.to(device, non_blocking=True)
    teacher_ids = teacher_ids.to(device, non_blocking=True)
    if tuple(teacher_ids.shape[:-1]) != tuple(labels.shape) or teacher_ids.shape != teacher_log_probs.shape:
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: top-K distillation on the fused path: the teacher's top-K tensors "
            f"(ids {tuple(teacher_ids.shape)}, log-probs {tuple(teacher_log_probs.shape)}) do not match the "
            f"student's tokens {tuple(labels.shape)} on this rank")
    log_probs, entropy, log_q = linear_log_probs_at_ids(hidden_states, weight, labels, teacher_ids,
                                                        temperature=temperature, return_entropy=return_entropy,
                                                        backend=backend)
    losses, student_mass, teacher_mass, _, _ = topk_terms(log_q, teacher_log_probs, clamp)
    request.aux = FusedLinearAux(losses, student_mass.detach(), teacher_mass.float())
    record("distillation_calls", "distillation fused fsdp", labels.numel())
    return log_probs, entropy


def _checked_outputs(method):
    """Wrap the FSDP engine's ``prepare_model_outputs``: a fused top-K distillation micro-batch
    whose model output comes back without ``distillation_losses`` (a fused forward that is not
    rl-kernels', remove-padding off, or an engine that reads no ``fused_linear_aux``) gets one
    WARNING saying so; verl's own code then runs on (its loss finds no ``distillation_losses``)."""
    sig = inspect.signature(method)

    @functools.wraps(method)
    def prepare_model_outputs(*args, **kwargs):
        model_output = method(*args, **kwargs)
        micro_batch = sig.bind(*args, **kwargs).arguments.get("micro_batch")
        if micro_batch is not None and _wants_fused_topk(micro_batch) and isinstance(model_output, dict) \
                and "distillation_losses" not in model_output:
            request = topk_request()
            if not _flag(micro_batch, "use_remove_padding", True):
                why = "use_remove_padding=False (verl's engine reads fused_linear_aux only with remove-padding)"
            elif request is not None and request.aux is not None:
                why = "this verl's engine did not take the fused_linear_aux that rl-kernels computed"
            else:
                why = ("the model's fused forward is not rl-kernels' (verl's own fused backends compute no "
                       "distillation outputs; set fused_kernel_options.impl_backend=rl_kernels)")
            log_once(logging.WARNING, "rl_kernels: top-K distillation on verl's FSDP fused path is not served: "
                     f"{why}; verl's loss will find no distillation_losses. Use use_fused_kernels=False "
                     "(verl's logits path) or impl_backend=rl_kernels with use_remove_padding=True")
        return model_output

    prepare_model_outputs._rl_kernels_original = method
    return prepare_model_outputs


def patch_fused_distillation() -> dict[str, tuple[bool, str]]:
    """Top-K distillation on the fused paths: the report entries ``{FUSED_PART: (served?, what),
    MEGATRON_FUSED_PART: (False, why)}`` (:func:`_patch_fsdp_fused`, :func:`_megatron_fused_entry`)."""
    return {FUSED_PART: _patch_fsdp_fused(), MEGATRON_FUSED_PART: _megatron_fused_entry()}


MEGATRON_ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
MEGATRON_ENGINE_CLASS = "MegatronEngineWithLMHead"


def _megatron_fused_entry() -> tuple[bool, str]:
    """verl's Megatron fused forward computes no top-K distillation outputs (its loss then finds no
    ``distillation_losses``), and rl-kernels does not add them there: where verl's Megatron engine
    imports, its ``forward_backward_batch`` is wrapped to log one WARNING at the first fused batch
    with ``distillation_use_topk`` (nothing else changes)."""
    if not has_module(MEGATRON_MODULE):
        return False, NOT_IN_THIS_VERL
    why = ("not served: verl's Megatron fused forward computes no top-K distillation outputs and rl-kernels adds "
           "none there (vocab-parallel, context-parallel layout); verl's own behaviour")
    try:
        impl = importlib.import_module(MEGATRON_ENGINE_MODULE)
    except ImportError as exc:  # megatron-core missing: verl's Megatron engine cannot run here either
        return False, f"{why} (not importable here: {exc})"
    engine = getattr(impl, MEGATRON_ENGINE_CLASS, None)
    owner = next((k for k in getattr(engine, "__mro__", ()) if "forward_backward_batch" in vars(k)), None)
    method = vars(owner)["forward_backward_batch"] if owner is not None else None
    if method is None or "data" not in inspect.signature(method).parameters:
        return False, why
    set_attr(owner, "forward_backward_batch", _megatron_said_once(method))  # where it is defined
    return False, why + " (a WARNING at the first fused top-K batch)"


def _megatron_said_once(method):
    sig = inspect.signature(method)

    @functools.wraps(method)
    def forward_backward_batch(*args, **kwargs):
        arguments = sig.bind(*args, **kwargs).arguments
        data, engine = arguments["data"], arguments.get("self")
        default = bool(getattr(getattr(engine, "engine_config", None), "use_fused_kernels", False))
        if _flag(data, "distillation_use_topk") and _flag(data, "use_fused_kernels", default):
            log_once(logging.WARNING, "rl_kernels: top-K distillation on verl's Megatron fused path is not served "
                     "by rl-kernels: verl's Megatron fused forward computes no distillation outputs (verl's loss "
                     "then finds no distillation_losses); use use_fused_kernels=False (verl's Megatron logits path)")
        return method(*args, **kwargs)

    forward_backward_batch._rl_kernels_original = method
    return forward_backward_batch


def _patch_fsdp_fused() -> tuple[bool, str]:
    """Serve top-K distillation on the FSDP fused path (:func:`fused_topk_on_request` on the
    engine's ``forward_step``, :func:`_checked_outputs` on its ``prepare_model_outputs``) where
    this verl has distillation and its FSDP engine reads ``fused_linear_aux`` (read from the
    engine's source: a feature, not a version). Returns the report entry (served?, what)."""
    fsdp, why = _import_fsdp_losses()
    if fsdp is None:
        return False, why
    try:
        impl = importlib.import_module(ENGINE_MODULE)
    except ImportError as exc:
        return False, f"not served (verl's FSDP engine not importable: {exc})"
    engine = getattr(impl, ENGINE_CLASS, None)
    step = vars(engine).get("forward_step") if engine is not None else None
    prepare = vars(engine).get("prepare_model_outputs") if engine is not None else None
    if step is None or prepare is None or "micro_batch" not in inspect.signature(step).parameters \
            or "micro_batch" not in inspect.signature(prepare).parameters:
        return False, f"not served (this verl's {ENGINE_CLASS} has no forward_step / prepare_model_outputs " \
                      f"taking micro_batch)"
    try:
        reads_aux = "fused_linear_aux" in inspect.getsource(prepare)
    except (OSError, TypeError):
        reads_aux = False
    set_attr(engine, "prepare_model_outputs", _checked_outputs(prepare))
    if not reads_aux:
        return False, (f"not served: this verl's {ENGINE_CLASS}.prepare_model_outputs reads no fused_linear_aux "
                       f"from a fused forward, so its loss finds no distillation_losses (a WARNING at the first "
                       f"such micro-batch); verl's logits path (use_fused_kernels=False) is served")
    set_attr(engine, "forward_step", fused_topk_on_request(step))
    return True, (f"models with impl_backend=rl_kernels and use_remove_padding=True fill fused_linear_aux "
                  f"(distillation_losses, student_mass, teacher_mass, read by {ENGINE_CLASS}.prepare_model_outputs) "
                  f"from one rl_kernels.distill.linear_log_probs_at_ids call with verl's log-probs (no N x V "
                  f"tensor); verl's overlap metrics are not computed on this path (verl's engine reads none); "
                  f"a WARNING where a fused micro-batch is not served")
