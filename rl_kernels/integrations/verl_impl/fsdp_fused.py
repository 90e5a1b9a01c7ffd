"""The FSDP fused path (``use_fused_kernels=True``, ``impl_backend=rl_kernels``) of the verl patch.

``verl.models.transformers.monkey_patch.patch_forward_with_backends`` is wrapped to accept the
backend name :data:`~rl_kernels.integrations.verl_impl.schema.BACKEND_NAME`: it installs verl's own
torch-backend fused forward for the model class (label rolling, ``shift_labels``, ``temperature``,
rmpad shapes and ``CausalLMOutputForPPO`` stay verl's), marks the model (``_rl_kernels_fused``,
with its :class:`~rl_kernels.integrations.lm_heads.HeadTransform`) and wraps the class forward
(:func:`serving_forward`). Inside a marked model's forward, the ``FusedLinearForPPO`` that verl's
forward builds (bare on verl 0.7.x / 0.8.0, with ``impl_backend`` on 0.9.x) is this module's
subclass, which computes the log-probs and entropy with :func:`rl_kernels.linear_log_probs`
(:func:`fused_log_probs_entropy`). The entropy is computed only when verl's ``calculate_entropy``
asks. What else the FSDP engine's micro-batch asks of the head (Σπ², which verl refuses on its fused
path; top-K distillation; a per-sample temperature; the loss rows) comes in the step request that
:mod:`.fsdp_engine` puts in force and lays out; the head delivers its extra outputs there.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import logging

import torch

from ...core._logging import log_once, logger
from ...linear import linear_log_probs
from ...core.validation import check_temperature, row_inv_temperature
from . import settings
from ..lm_heads import HeadTransform, head_transform
from .patch_state import (StepField, VerlIntegrationError, count, entropy_on_request, entropy_placeholder,
                          entropy_wanted, left_to_verl, log_head_precision, loss_row_index, outside_kernels, record,
                          scatter_rows, select_rows, set_attr, step_request)
from .distill_losses import serve_fused_topk
from .ulysses_labels import refuse_rolled_shard_labels
from .schema import BACKEND_NAME, names_rl_kernels
from .signatures import verl_features

_model_names: list[str] = []  # the models patched for rl-kernels in this process (anomaly samples name the last)

_serving = StepField("serving")
"""True while the forward of a model that rl-kernels serves runs (set by :func:`serving_forward`)."""
_head = StepField("head")
"""The :class:`~rl_kernels.integrations.lm_heads.HeadTransform` of the model whose forward runs."""
_model = StepField("model")
"""The model whose forward runs (:func:`full_weight` finds the FSDP2 unit of its lm_head there)."""
_UNSET = object()


def _fsdp2_unit(weight: torch.Tensor, model):
    """``(unit, owner, name)`` where ``weight`` is the sharded parameter ``owner.<name>`` of a module of
    ``model`` whose nearest FSDP2 unit (``fully_shard``, itself or an ancestor) is ``unit``; None when
    ``model`` is None, FSDP2 is not importable or no FSDP2 unit of ``model`` holds ``weight``."""
    if model is None:
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return None
    units = []  # the FSDP2 units above the module being visited (a depth-first walk)

    def visit(module):
        unit_here = isinstance(module, FSDPModule)
        if unit_here:
            units.append(module)
        try:
            for name, param in module.named_parameters(recurse=False):
                if param is weight:
                    return (units[-1], module, name) if units else None
            for child in module.children():
                found = visit(child)
                if found is not None:
                    return found
            return None
        finally:
            if unit_here:
                units.pop()

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None and isinstance(output, FSDPModule):  # verl's untied lm_head unit (apply_fsdp2)
        for name, param in output.named_parameters(recurse=False):
            if param is weight:
                return output, output, name
    return visit(model)


def full_weight(weight: torch.Tensor, dtype: torch.dtype, model=None) -> torch.Tensor:
    """The full lm_head weight ``(vocab_size, H)`` in the compute dtype ``dtype``.

    Under FSDP2 verl shards an untied ``lm_head`` as its own unit (``apply_fsdp2``), and verl's fused
    forward reads ``self.lm_head.weight`` outside that unit's forward: a sharded DTensor (verl's
    text-model fused forward is reported failing there with "mixed torch.Tensor and DTensor", verl
    #5633; its gradient accumulation with ``reduce_dtype`` set, "'FSDPParam' object has no attribute
    '_unsharded_param'", verl #7520: FSDP2's end-of-backward callback runs the unit's post-backward,
    which reads the unsharded parameter that was never gathered).

    * With grad enabled and ``model`` (the served model, set by :func:`serving_forward`) holding
      ``weight`` in one of its FSDP2 units, the unit is gathered with its own ``unshard()`` (its
      all-gather, in ``MixedPrecisionPolicy.param_dtype``) and the unsharded parameter is used:
      autograd accumulates its gradient there, and FSDP2's end-of-backward callback reduces it as
      for any unit (a reduce-scatter averaged over the mesh in ``reduce_dtype``, deferred under
      ``set_requires_gradient_sync(False)``, accumulated in ``reduce_dtype`` across micro-batches)
      and reshards the unit. So: one all-gather per micro-batch, one reduce-scatter per synced
      backward, and the full weight stays gathered from the fused forward to the end of backward
      (autograd saves it for the backward in any case).
    * Otherwise (no grad: log-prob computation; a DTensor that no served FSDP2 unit holds), it is
      gathered with ``full_tensor`` per call, its gradient going back as a partial sum averaged over
      the mesh (a reduce-scatter per backward), as FSDP2 averages gradients.

    Under mixed precision a float32 weight is cast to ``dtype`` (the ``hidden_states`` dtype).
    """
    try:
        from torch.distributed.tensor import DTensor, Partial
    except ImportError:  # torch without DTensor
        DTensor = None
    if DTensor is not None and isinstance(weight, DTensor):
        unit = _fsdp2_unit(weight, model) if torch.is_grad_enabled() and weight.requires_grad else None
        if unit is not None:
            module, owner, name = unit
            log_once(logging.INFO, "rl_kernels: lm_head.weight is a sharded FSDP2 parameter outside its unit's "
                     "forward; the unit is gathered with its own unshard() once per fused call and its "
                     "gradient reduced by FSDP2's post-backward (once per synced backward)")
            module.unshard()
            weight = getattr(owner, name)
            if isinstance(weight, DTensor):  # FSDP2 did not register the unsharded parameter
                raise VerlIntegrationError(f"rl_kernels.integrations.verl: {type(module).__name__}.unshard() left "
                                           f"{name!r} a sharded DTensor {tuple(weight.shape)}; expected the "
                                           "unsharded parameter (this torch's FSDP2 is not supported here)")
        else:
            log_once(logging.INFO, "rl_kernels: lm_head.weight is a sharded DTensor (FSDP2); it is gathered "
                     "with full_tensor() per call and its gradient reduce-scattered (average)")
            weight = weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)
    if weight.dtype != dtype:
        log_once(logging.INFO, f"rl_kernels: lm_head.weight {weight.dtype} is cast to the hidden_states "
                 f"dtype {dtype} (mixed precision) for the fused head")
        weight = weight.to(dtype)
    return weight


def _head_temperature(temperature, head: HeadTransform, labels: torch.Tensor):
    """verl's temperature with the model's logit multiplier folded in (``HeadTransform``): a number,
    or a per-token float tensor shaped like ``labels`` (verl's per-sample temperature laid out by
    :mod:`.fsdp_engine`; its values are checked where :func:`rl_kernels.linear_log_probs` reads
    them). With a multiplier, verl's value is checked with the usual rules first, then the effective
    one (for a tensor: T / multiplier in float64, rounded once by the kernels; one host read each),
    whose error names both."""
    temperature = check_temperature(temperature, labels)
    if head.multiplier == 1.0:
        return temperature
    per_token = isinstance(temperature, torch.Tensor)
    if per_token:
        row_inv_temperature(temperature)
    effective = head.temperature(temperature.double() if per_token else temperature)
    try:
        if per_token:
            row_inv_temperature(effective)
            return effective
        return check_temperature(effective)
    except ValueError as exc:
        shown = "per-sample temperature" if per_token else f"temperature {temperature!r}"
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: {shown} with the model's {head.description}: "
                                   f"effective temperature {'(a row) ' if per_token else ''}"
                                   f"{'' if per_token else repr(effective) + ' '}is unusable ({exc})") from exc


def fused_log_probs_entropy(hidden_states: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                            temperature) -> tuple[torch.Tensor, torch.Tensor]:
    """What verl's ``FusedLinearForPPO.forward`` returns, computed by :func:`rl_kernels.linear_log_probs`:
    ``(log_probs, entropy)``, float32, shaped like ``labels``.

    hidden_states: ``(..., H)``; weight: the lm_head weight ``(vocab_size, H)`` (a sharded FSDP2
    DTensor is gathered, a float32 one under mixed precision cast to ``hidden_states.dtype``, see
    :func:`full_weight`); labels: int64 ``(...)`` (verl's ``input_ids`` rolled, or its ``shift_labels``);
    temperature: a float or a one-element tensor, or a float tensor shaped like ``labels`` (a
    temperature per token: verl's per-sample temperature, laid out by :func:`~.fsdp_engine.lay_out_inputs`), with
    the model's own logit transform (soft-cap, multiplier) applied from the
    :class:`~rl_kernels.integrations.lm_heads.HeadTransform` of the model whose forward runs.
    The entropy is a NaN placeholder when verl's ``calculate_entropy`` did not ask for it. While
    the FSDP engine's step asks for Σπ² (:func:`~.fsdp_engine.asks`), it is computed
    too and delivered to the step request (:meth:`~.patch_state.StepRequest.deliver`). Under
    ``loss_rows_only`` (the request's ``inputs['loss_rows']``) the head runs on the loss rows alone
    and every output goes back to the labels' shape, 0 (and no gradient) elsewhere.
    Raises ValueError / TypeError as :func:`rl_kernels.linear_log_probs`, and VerlIntegrationError when
    the effective temperature is unusable.
    """
    head = _head.get() or HeadTransform()
    if isinstance(temperature, torch.Tensor) and temperature.numel() == 1:
        temperature = temperature.item()
    temperature = _head_temperature(temperature, head, labels)
    weight = full_weight(weight, hidden_states.dtype, _model.get())
    log_head_precision(hidden_states.dtype, "FSDP")
    return_entropy = entropy_wanted.get()
    options = settings.options()
    step = step_request.get()
    topk = step.topk and _serving.get()
    shape, rows = labels.shape, step.inputs.get("loss_rows")
    if step.loss_rows_only and rows is None:
        log_once(logging.WARNING, "rl_kernels: loss_rows_only: the FSDP fused head got no loss-row mask for this "
                 "forward (not run through verl's FSDPEngineWithLMHead.prepare_model_inputs): every row computed")
    index = None
    if rows is not None:  # loss_rows_only: the head runs on the loss rows alone, (1, selected) below
        index = loss_row_index(rows, labels)
        hidden_states, temperature, labels = (select_rows(t, index, labels.numel()).unsqueeze(0) if
                                              isinstance(t, torch.Tensor) else t
                                              for t in (hidden_states, temperature, labels))
        count("loss_rows_skipped_tokens", rows.numel() - index.numel())
    if topk:  # verl's top-K distillation too, from the same fused head call (with Σπ²: refused by fsdp_engine.asks)
        log_probs, entropy = serve_fused_topk(step, hidden_states, weight, labels, temperature=temperature,
                                              softcap=head.softcap, return_entropy=return_entropy,
                                              backend=options.backend, loss_rows=None if index is None
                                              else (index, shape))
        sum_pi_squared = None
    else:
        out = linear_log_probs(hidden_states, weight, labels, temperature=temperature, softcap=head.softcap,
                               return_entropy=return_entropy, return_sum_pi_squared=step.sum_pi_squared,
                               backend=options.backend)
        log_probs, entropy, sum_pi_squared = out.log_probs, out.entropy, out.sum_pi_squared
    record("fused_fsdp_calls", "fused fsdp", labels.numel())
    capture = settings.capture()
    if capture is not None:  # the effective temperature: a number, or the per-token tensor shaped like labels
        capture.check(hidden_states, weight, labels, temperature=temperature,
                      softcap=head.softcap, ignore_index=-100, log_probs=log_probs, entropy=entropy,
                      metadata={"model": _model_names[-1] if _model_names else "unknown",
                                "function": "verl FusedLinearForPPO (FSDP fused path)"})
    if index is not None:  # back to verl's rows: 0 (and no gradient) outside the loss
        log_probs, entropy, sum_pi_squared = (None if t is None else scatter_rows(t.reshape(-1), index, shape)
                                              for t in (log_probs, entropy, sum_pi_squared))
    if sum_pi_squared is not None:
        step.deliver(log_probs, sum_pi_squared=sum_pi_squared)
        count("fused_sum_pi_squared_calls")
    return log_probs, (entropy if return_entropy else entropy_placeholder(log_probs))


def _plain_head() -> bool:
    """Whether the served model's logits are ``lm_head(hidden)``: only then may verl's own fused
    forward, which applies no head transform, compute inputs outside rl-kernels' kernels."""
    head = _head.get()
    return head is None or (head.softcap is None and head.multiplier == 1.0)


def micro_batch_flag(arguments) -> bool:
    """``calculate_entropy`` of the FSDP engine's ``forward_step`` micro-batch (its non-tensor data)."""
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=arguments["micro_batch"], key="calculate_entropy", default=False)


def wrap_entropy_requests(dp_actor) -> str:
    """Install :func:`~.patch_state.entropy_on_request` where this verl decides
    ``calculate_entropy`` (the FSDP engine's ``forward_step``; ``dp_actor``, verl 0.7.x's
    ``verl.workers.actor.dp_actor`` module or None, its ``_forward_micro_batch``); returns what
    was wrapped (for the report) or why nothing was."""
    wrapped = []
    try:
        import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    except ImportError as exc:
        fsdp_impl = None
        log_once(logging.INFO, f"rl_kernels: verl's FSDP engine not importable ({exc})")
    engine = getattr(fsdp_impl, "FSDPEngineWithLMHead", None)
    method = vars(engine).get("forward_step") if engine is not None else None
    if method is not None and "micro_batch" in inspect.signature(method).parameters:
        wrapped.append("FSDPEngineWithLMHead.forward_step")  # (wrapped by fsdp_engine: the step request)
    if dp_actor is not None:
        method = vars(dp_actor.DataParallelPPOActor).get("_forward_micro_batch")
        if method is not None and "calculate_entropy" in inspect.signature(method).parameters:
            default = inspect.signature(method).parameters["calculate_entropy"].default
            set_attr(dp_actor.DataParallelPPOActor, "_forward_micro_batch", entropy_on_request(
                method, lambda arguments: arguments.get("calculate_entropy", default)))
            wrapped.append("DataParallelPPOActor._forward_micro_batch")
    if not wrapped:
        return "entropy always computed (no calculate_entropy hook found in this verl)"
    return "entropy only when verl's calculate_entropy asks (" + ", ".join(wrapped) + ")"


def make_fused_linear_class(base: type) -> type:
    """A subclass of verl's ``FusedLinearForPPO`` (``base``) that routes to
    :func:`fused_log_probs_entropy` inside a served model's forward or when built with
    ``impl_backend='rl_kernels'``."""
    takes_backend = "impl_backend" in inspect.signature(base.__init__).parameters

    class FusedLinearForPPO(base):
        """verl's ``FusedLinearForPPO``, routed to :func:`rl_kernels.linear_log_probs` when it runs
        inside the forward of a model rl-kernels serves (any verl; 0.7.x and 0.8.0 build it bare,
        with no ``impl_backend``) or when built with ``impl_backend='rl_kernels'`` (verl 0.9.x)."""

        def __init__(self, chunk_size: int = 512, impl_backend=_UNSET):
            ours = names_rl_kernels(impl_backend)
            if impl_backend is _UNSET or (ours and not takes_backend):
                super().__init__(chunk_size=chunk_size)
            else:  # verl's own backends (0.9.x) are its business
                super().__init__(chunk_size=chunk_size, impl_backend="torch" if ours else impl_backend)
            if ours:
                self.impl_backend = BACKEND_NAME
            self._rl_kernels = ours

        # verl's parameter names (verl may pass them by keyword): vocab_weights is the lm_head
        # weight, input_ids the labels
        def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
            if not (self._rl_kernels or _serving.get()) or (_plain_head() and left_to_verl(
                    "FusedLinearForPPO.forward", outside_kernels(hidden_states, "hidden_states"))):
                # verl's own (its torch backend when ours): float64 hidden states, ... (drop-in)
                return super().forward(hidden_states, vocab_weights, input_ids, temperature)
            return fused_log_probs_entropy(hidden_states, vocab_weights, input_ids, temperature)

    FusedLinearForPPO.__qualname__ = f"rl_kernels[{base.__qualname__}]"
    FusedLinearForPPO._rl_kernels_base = base
    return FusedLinearForPPO


def serving_forward(forward):
    """verl's fused forward for a model class, which routes the ``FusedLinearForPPO`` it builds to
    rl-kernels for the models marked ``_rl_kernels_fused`` (others run verl's forward unchanged)."""
    if getattr(forward, "_rl_kernels_serving", False):
        return forward
    has_shift_labels = "shift_labels" in inspect.signature(forward).parameters

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if not getattr(self, "_rl_kernels_fused", False):
            return forward(self, *args, **kwargs)
        refuse_rolled_shard_labels(has_shift_labels)
        head = getattr(self, "_rl_kernels_head", None)
        if head is None:  # marked by other means than patch_forward_with_backends: audit now
            head = self._rl_kernels_head = head_transform(self)
        token = step_request.set(dataclasses.replace(step_request.get(), serving=True, head=head, model=self))
        try:
            output = forward(self, *args, **kwargs)
            aux = step_request.get().outputs.get("aux")
            if aux is not None:  # read by verl's FSDP engine
                output.fused_linear_aux = aux
            return output
        finally:
            step_request.reset(token)

    wrapper._rl_kernels_serving = True
    wrapper._rl_kernels_verl_forward = forward
    return wrapper


def _warn_unserved_head(model, backend) -> None:
    """Warn when verl's own fused backend (``triton`` / ``torch`` / ``liger``) is about to serve a
    model whose forward changes the logits after lm_head: verl's fused forward skips that."""
    try:
        head = head_transform(model)
    except VerlIntegrationError as exc:
        why = str(exc).split(": ", 1)[-1]
    else:
        if head.softcap is None and head.multiplier == 1.0:
            return
        why = f"its forward applies {head.description}"
    logger.warning("rl_kernels: verl's fused forward with impl_backend=%r computes hidden @ lm_head.weight.T / T "
                   "for %s and skips what the model's forward does after lm_head: %s. Its log-probs differ from "
                   "the model's own; impl_backend='rl_kernels' applies the transform (or refuses), and "
                   "use_fused_kernels=False uses the model's logits.", backend, type(model).__name__, why)


VERL_FUSED_BACKENDS = ("torch", "triton", "liger")
"""verl's own fused backends (``liger`` on 0.9.x): names rl-kernels leaves to verl."""


def _refuse_misspelt_backend(name) -> None:
    """verl only prints "Skipping monkey patch" for an ``impl_backend`` it does not know, and trains
    with the model's plain forward: a name close to ``rl_kernels`` (``rl_kernel``, ``rl-kernels``)
    is refused here, before the model runs; any other unknown name gets one WARNING."""
    if name is None or name in VERL_FUSED_BACKENDS:
        return
    if difflib.get_close_matches(str(name).lower(), [BACKEND_NAME], n=1, cutoff=0.75):
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: fused_kernel_options.impl_backend={name!r} is "
                                   f"not a backend verl or rl-kernels knows (verl would skip its fused patch and "
                                   f"train without rl-kernels); did you mean impl_backend={BACKEND_NAME!r}?")
    log_once(logging.WARNING, f"rl_kernels: fused_kernel_options.impl_backend={name!r} is not one of verl's "
             f"fused backends {VERL_FUSED_BACKENDS} nor {BACKEND_NAME!r}: verl skips its fused patch, and "
             f"rl-kernels serves nothing on this model's fused path")


def make_patch_forward_with_backends(original):
    """verl's ``patch_forward_with_backends`` (``original``), accepting ``fused_kernels_backend='rl_kernels'``."""
    @functools.wraps(original)
    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if not names_rl_kernels(fused_kernels_backend):
            if use_fused_kernels:
                _refuse_misspelt_backend(fused_kernels_backend)
                model._rl_kernels_fused = False
                _warn_unserved_head(model, fused_kernels_backend)
            return original(model, use_fused_kernels=use_fused_kernels,
                            fused_kernels_backend=fused_kernels_backend)
        cls = model.__class__.__name__
        options = settings.options()
        if not use_fused_kernels:
            log_once(logging.INFO, f"rl_kernels: impl_backend='rl_kernels' with use_fused_kernels=False: "
                     f"{cls} keeps its logits forward; log-probs/entropy come from rl-kernels' from-logits "
                     f"functions" + ("" if options.patch_logits_path else " (disabled by patch_logits_path)"))
            return original(model, use_fused_kernels=False, fused_kernels_backend=None)
        # what the model's own forward does between its last hidden state and its logits (soft-cap,
        # scale), or VerlIntegrationError for a model type that the audit refuses or does not list
        head = head_transform(model)
        # verl's torch-backend forward for this model class (label rolling, shift_labels,
        # temperature, rmpad shapes, CausalLMOutputForPPO stay verl's), wrapped so that the
        # FusedLinearForPPO it builds runs rl-kernels for this model: the model is marked, the
        # wrapper sees the mark (verl 0.7.x/0.8.0 never pass impl_backend to FusedLinearForPPO)
        original(model, use_fused_kernels=True, fused_kernels_backend="torch")
        model.__class__.forward = serving_forward(model.__class__.forward)
        model._rl_kernels_fused = True
        model._rl_kernels_head = head
        model._verl_fused_kernels_backend = BACKEND_NAME
        name = getattr(getattr(model, "config", None), "name_or_path", "") or cls
        _model_names.append(str(name))
        logger.info("rl_kernels: %s.forward computes log_probs and entropy with rl_kernels.linear_log_probs "
                    "(backend=%s) through verl's fused forward (model %s, model type %s: %s)", cls,
                    options.backend, name, getattr(model.config, "model_type", None), head.description)

    patch_forward_with_backends._rl_kernels_original = original
    return patch_forward_with_backends


def patch_fused_path(monkey_patch, experimental_tf, dp_actor) -> str:
    """Install the fused path into verl's ``monkey_patch`` and ``experimental.torch_functional``
    modules (and the entropy hooks, :func:`wrap_entropy_requests`); returns the report text."""
    set_attr(monkey_patch, "patch_forward_with_backends",
             make_patch_forward_with_backends(monkey_patch.patch_forward_with_backends))
    set_attr(experimental_tf, "FusedLinearForPPO", make_fused_linear_class(experimental_tf.FusedLinearForPPO))
    own = "torch/triton/liger" if verl_features().fused_impl_backend else "torch/triton"
    return (f"impl_backend='{BACKEND_NAME}' (verl.models.transformers.monkey_patch."
            f"patch_forward_with_backends, verl.utils.experimental.torch_functional."
            f"FusedLinearForPPO; verl's own {own} backends unchanged; "
            f"{wrap_entropy_requests(dp_actor)})")
