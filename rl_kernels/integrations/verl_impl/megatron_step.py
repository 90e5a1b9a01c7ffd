"""verl's Megatron engine fused path on one step request: one wrapper per verl target (issue 53).

rl-kernels' fused head on verl's Megatron engine is :func:`.megatron.linear_cross_entropy` (it
replaces verl's ``linear_cross_entropy`` where ``model_forward_fused`` calls it). What a micro-batch
asks of it beyond verl's log-probs and entropy (Σπ², top-K distillation, a per-sample temperature,
the loss rows only) lives in the micro-batch's :class:`~.patch_state.StepRequest`, built in ONE place,
:func:`step_for` (which also decides the supported combinations), and carried through verl's code
by five wrappers, one per verl target, installed together by :func:`install`:

1. ``MegatronEngineWithLMHead.forward_step`` (:func:`_forward_step`): puts a fresh step request in
   force per micro-batch (:func:`~.patch_state.new_step` with the fields of :func:`step_for`: ``engine``,
   ``sum_pi_squared``, ``distillation``; and in ``inputs['by_token']`` the per-token tensors to lay
   out, in verl's ``input_ids`` layout: the teacher's top-K log-probs / ids and their token rows,
   the loss-row mask of ``loss_rows_only``). Lifts verl's Σπ² refusal (verl's method runs on a copy
   of the micro-batch with the flag hidden; where no Σπ² came back, verl's method runs again on
   the micro-batch as verl sent it: verl's own refusal) and, on the last pipeline stage, puts the
   laid-out per-row outputs into verl's output dict (``sum_pi_squared``; the distillation terms
   under verl's keys, without ``log_probs`` for ``distillation_only``).
2. ``transformer_impl._resolve_fused_temperature`` (:func:`make_resolve_fused_temperature`): verl
   calls it inside ``forward_step``; a tensor of unequal temperatures, each value first checked by
   verl's own function, is recorded in the step's ``inputs['temperature_per_sample']`` and verl
   gets its stand-in number 1.0 (:data:`STAND_IN`); elsewhere verl's function as it is.
3. ``preprocess_thd_engine`` as ``model_forward_fused`` binds it (and ``model_forward``, the
   logits path's, where ``loss_rows_only`` is served there; :func:`_laying_out_inputs`): the call that packs
   the labels (``need_roll=True``: TP / CP alignment pads, the CP split, the roll) lays out every
   per-token input of the step with the same arguments, into ``step.inputs`` (``(1, T_local)`` or
   ``(1, T_local, K)``, this rank's label rows): the teacher's tensors and the per-sample temperature
   unrolled (a token's value goes with its own row, as its hidden state; the temperature pads 1),
   the loss-row mask rolled like the labels (pads 0).
4. ``model_forward_fused.postprocess_thd_engine`` (:func:`_laying_out_outputs`): called on the log-probs
   the head delivered to the step (:meth:`~.patch_state.StepRequest.deliver`), it lays out every other
   per-row output delivered with them (Σπ², the distillation terms) with the same arguments into
   ``step.outputs['laid_out']``.
5. the engine fused-forward factory ``verl.models.mcore.get_mcore_forward_fused_model_engine_fn``
   (and verl 0.7.x's ``get_mcore_forward_fused_no_padding_fn`` where it exists, a second name;
   :func:`_fused_forward_factory`): the forward it returns runs under
   :func:`~.patch_state.entropy_on_request` with its ``calculate_entropy``, and raises when a per-sample
   temperature was asked and the model's last stage computed its log-probs without rl-kernels'
   head (never verl's stand-in 1.0 silently).

On the logits path (``use_fused_kernels=False``) the request carries ``loss_rows_only`` only: the
model's output layer runs on the loss rows (:func:`select_hidden_rows`, :func:`scatter_logits_rows`,
hooks installed by wrapper 1 for the step), and verl's from-logits functions, which are
rl-kernels' (:mod:`.megatron`), compute those rows.

The head reads the step through :func:`head_inputs` (the laid-out inputs for its labels; a
per-sample temperature that was not laid out raises there) and serves top-K distillation with
:func:`serve_megatron_topk`. verl's distillation math (:mod:`.distill_terms`, :mod:`.distill_losses`) is
imported from here; nothing here imports :mod:`.megatron` (which imports this module).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import logging
from typing import NamedTuple

import torch

from ...core._logging import log_once
from ...distill import linear_log_probs_at_ids
from .patch_state import (VerlIntegrationError, check_loss_rows_audit, count, entropy_on_request, loss_mask_by_token,
                          new_step, record, refuse_loss_rows, replace_by_name, set_attr, step_request)
from .distill_losses import (_OVERLAP, MEGATRON_ENGINE_CLASS, MEGATRON_ENGINE_MODULE, MEGATRON_FUSED_MODULE,
                             MEGATRON_FUSED_PART, MEGATRON_MODULE, NOT_IN_THIS_VERL, STEP_PARAMETERS, _flag,
                             _loss_config, _token_rows, overlap_top_k)
from .distill_terms import distinct_on_padding, overlap_metrics, tail_terms, topk_terms
from .modes import TAIL_MODE, is_tail_mode
from .schema import refused_together
from .settings import options
from .signatures import has_module

ENGINE = "megatron"
"""``StepRequest.engine`` while the Megatron engine's forward_step runs a fused micro-batch."""
FUSED_SUM_PI_SQUARED_PART = "Megatron fused sum_pi_squared"
TEMPERATURE_PART = "Megatron fused per-sample temperature"
DISTILLATION_PART = MEGATRON_FUSED_PART
PARTS = (FUSED_SUM_PI_SQUARED_PART, TEMPERATURE_PART, DISTILLATION_PART)
"""The report's parts of this module (:func:`install`), beside :mod:`.megatron`'s."""
STAND_IN = 1.0
"""The number verl's Megatron engine passes on in place of a per-sample temperature."""
ENGINE_FORWARD_FACTORIES = ("get_mcore_forward_fused_model_engine_fn", "get_mcore_forward_fused_no_padding_fn")
"""verl's factories (in ``verl.models.mcore``) of the Megatron engine's fused forward, which takes
``calculate_entropy``: 0.8 / 0.9 import the first at call time, 0.7.x binds the second by name."""
PREPROCESS, POSTPROCESS = "preprocess_thd_engine", "postprocess_thd_engine"
LOGITS_FORWARD_MODULE = "verl.models.mcore.model_forward"
"""verl's Megatron engine logits-path forwards (``gptmodel_forward_model_engine``), which bind
``preprocess_thd_engine`` by name."""
RESOLVE = "_resolve_fused_temperature"
class Served(NamedTuple):
    """What :func:`install` serves on the fused path (the head installed and each wrapper in place)."""

    sum_pi_squared: bool = False
    distillation: bool = False
    temperature: bool = False
    logits_rows: bool = False
    """``loss_rows_only`` on the logits path: verl's from-logits functions are rl-kernels' and the
    logits forward's ``preprocess_thd_engine`` is wrapped (the loss-row mask laid out)."""


# ----------------------------------------------------------------------------- the step request
def step_for(batch, loss_function, fused: bool, served: Served, engine=None) -> tuple[dict, dict]:
    """The step request of one Megatron engine micro-batch: ``(fields, by_token)``, the
    :class:`~.patch_state.StepRequest` fields to put in force and the per-token tensors
    (``name -> (nested tensor in the input_ids layout, rolled like the labels?)``) that
    :func:`_laying_out_inputs` lays out for the head. The one place where the combinations are
    decided; on the fused path (``use_fused_kernels``):

    =====================  =========================================================================
    Σπ²                    served (verl's refusal lifted); with top-K distillation: refused (below)
    top-K distillation     served where verl has distillation (else verl's output, one WARNING)
    per-sample temperature served with every other feature (recorded at verl's
                           ``_resolve_fused_temperature``, laid out per token)
    ``loss_rows_only``     served with every other feature (the head runs on the loss rows)
    =====================  =========================================================================

    Combinations are served or refused by the one table of :func:`~.schema.refused_together` (Σπ²
    with top-K distillation on the fused path, ``loss_rows_only`` with it on the logits path: one
    VerlIntegrationError naming both, before the model runs). On the logits path (``use_fused_kernels=False``) verl computes
    everything; the request then only carries ``loss_rows_only`` (the model's output layer runs on
    the loss rows: :func:`select_hidden_rows`), refused with MTP training (a second output-layer call on other rows) and the
    padded layout (``use_remove_padding=False``), each naming the option. ``loss_rows_only``
    refuses the losses (:func:`~.patch_state.check_loss_rows_audit`) and micro-batches
    (:func:`~.patch_state.loss_mask_by_token`) the audit of docs/verl.md does not cover."""
    fields = {"engine": None, "sum_pi_squared": False, "distillation": None, "loss_rows_only": False}
    by_token = {}
    topk = bool(_flag(batch, "distillation_use_topk"))
    rows = options().loss_rows_only and (fused or served.logits_rows)
    asked = {name for name, on in (("sum_pi_squared", fused and _flag(batch, "calculate_sum_pi_squared")),
                                   ("topk", topk), ("loss_rows_only", rows)) if on}
    why = refused_together(asked, "Megatron fused" if fused else "Megatron logits")
    if why is not None:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: {why}")
    if options().loss_rows_only and not rows:
        log_once(logging.WARNING, "rl_kernels: loss_rows_only=true is not served on this Megatron engine's logits "
                 "path (verl's from-logits functions or its logits forward are not rl-kernels' here: "
                 "patch_logits_path=False, or this verl lays out no tensors by name): the LM head computes every row")
    elif rows:  # the option is read per micro-batch
        check_loss_rows_audit(loss_function)
        if not fused:
            off = "set fused_kernel_options.rl_kernels.loss_rows_only=false"
            config = getattr(engine, "engine_config", None)
            if config is not None and not getattr(config, "use_remove_padding", True):
                refuse_loss_rows("use_remove_padding=False is not served (the padded layout)", off)
            mtp = getattr(getattr(engine, "model_config", None), "mtp", None)
            if getattr(mtp, "enable", False) and getattr(mtp, "enable_train", False):
                refuse_loss_rows("MTP training runs the output layer on other rows too", off)
        fields["loss_rows_only"] = True
        by_token["loss_rows"] = (loss_mask_by_token(batch), True)
    if not fused:
        return fields, by_token
    fields["engine"] = ENGINE
    fields["sum_pi_squared"] = "sum_pi_squared" in asked and served.sum_pi_squared
    keys = batch.keys()
    if topk and served.distillation and "teacher_ids" in keys and "teacher_logprobs" in keys:
        fields["distillation"] = _loss_config(loss_function)
        by_token.update(teacher_log_probs=(batch["teacher_logprobs"], False),
                        teacher_ids=(batch["teacher_ids"], False),
                        teacher_rows=(_token_rows(batch["teacher_ids"]), False))
    return fields, by_token


def _forward_step(method, served: Served):
    """``MegatronEngineWithLMHead.forward_step`` with the micro-batch's step request in force (see
    the module docstring, wrapper 1)."""

    @functools.wraps(method)
    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        from verl.utils import tensordict_utils as tu

        batch = next(batch_iter)
        fused = bool(_flag(batch, "use_fused_kernels", self.engine_config.use_fused_kernels))
        fields, by_token = step_for(batch, logits_processor_func, fused, served, self)
        sent = batch
        if fields["sum_pi_squared"]:  # verl's refusal comes before the model runs: the flag hidden from it
            sent = batch.copy()
            tu.assign_non_tensor(sent, calculate_sum_pi_squared=False)
        token = new_step(**fields)
        step = step_request.get()
        step.inputs["by_token"] = by_token
        hooks = _output_layer_hooks(model) if step.loss_rows_only and not fused else ()
        try:
            output, postprocess = method(self, itertools.chain([sent], batch_iter), model, logits_processor_func,
                                         postprocess_micro_batch_func)
        finally:
            step_request.reset(token)
            for hook in hooks:
                hook.remove()
        if hooks and not step.inputs.get("logits_rows_made"):
            raise VerlIntegrationError("rl_kernels.integrations.verl: loss_rows_only on the Megatron logits path: the "
                                       "model's forward did not run its output_layer on the step's hidden states; "
                                       "set fused_kernel_options.rl_kernels.loss_rows_only=false for this model")
        if not (isinstance(output, dict) and "log_probs" in output):  # not the last pipeline stage
            return output, postprocess
        laid_out = step.outputs.get("laid_out", {})
        if step.sum_pi_squared:
            if "sum_pi_squared" not in laid_out:  # not rl-kernels' head: verl's own step, which refuses first
                return method(self, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
            output["sum_pi_squared"] = laid_out["sum_pi_squared"]
        if fused and _flag(batch, "distillation_use_topk"):
            terms = {key: value for key, value in laid_out.items() if key != "sum_pi_squared"}
            if step.distillation is not None and terms:
                output.update(terms)
                if _flag(batch, "distillation_only"):
                    del output["log_probs"]
            else:
                log_once(logging.WARNING, "rl_kernels: top-K distillation on verl's Megatron fused path is not "
                         "served here (the fused forward is not rl-kernels', or the micro-batch has no teacher "
                         "tensors): verl's fused forward computes no distillation outputs (verl's loss then finds "
                         "no distillation_losses); use use_fused_kernels=False (verl's Megatron logits path)")
        return output, postprocess

    forward_step._rl_kernels_original = method
    return forward_step


def make_resolve_fused_temperature(original):
    """verl's ``_resolve_fused_temperature`` (Megatron engine), which verl's ``forward_step`` calls
    for the fused forward: inside a fused micro-batch's step request, a tensor of unequal
    temperatures is recorded in the step's ``inputs['temperature_per_sample']`` (float32, one per
    sample) and verl gets :data:`STAND_IN` instead of its "uniform temperature" error; anything else
    (a number, a uniform tensor, a call outside the engine's forward_step) goes to verl's function.

    verl's own checks of each value still run, first, with verl's message: verl's function is
    called on each distinct value of the tensor alone (a one-element tensor of its dtype and device:
    uniform, so verl's uniform test passes and only its checks of the value run), so a NaN / inf
    raises verl's ValueError("temperature must contain finite values"), and the per-sample
    temperature holds what verl's function makes of each value (verl clamps a value <= 0 to its
    floor, 1e-8 in verl 0.9.1 and main, as its logits path does: ``temperature[temperature <= 0]
    = 1e-8``). No verl check is copied: a check verl adds applies here too."""
    @functools.wraps(original)
    def _resolve_fused_temperature(temperature):
        step = step_request.get()
        if step.engine == ENGINE and isinstance(temperature, torch.Tensor) and temperature.dim() == 1 \
                and temperature.numel() > 1:
            values = temperature.detach()
            if not bool((values == values[0]).all()):
                distinct, where = torch.unique(values, return_inverse=True)  # NaN entries: each its own
                resolved = [float(original(value.reshape(1))) for value in distinct]
                step.inputs["temperature_per_sample"] = torch.tensor(resolved, dtype=torch.float32,
                                                                     device=values.device)[where]
                return STAND_IN
        return original(temperature)

    _resolve_fused_temperature._rl_kernels_original = original
    return _resolve_fused_temperature


# ----------------------------------------------------------------------------- layouts
def _laying_out_inputs(preprocess):
    """The fused module's ``preprocess_thd_engine`` (wrapper 3 of the module docstring): the first
    call of a fused step that packs the labels (``need_roll=True``) lays out the step's per-token
    inputs with the same arguments into ``step.inputs`` (``inputs['laid_out']`` marks it done). On
    the logits path (``loss_rows_only`` only), the step's first call (verl's packing of the
    ``input_ids``, before the model runs) lays out the loss-row mask with its arguments, rolled as
    verl then packs the labels."""
    sig = inspect.signature(preprocess)
    first = next(iter(sig.parameters))

    @functools.wraps(preprocess)
    def preprocess_thd_engine(*args, **kwargs):
        result = preprocess(*args, **kwargs)
        step = step_request.get()
        if step.inputs.get("laid_out") or not (step.engine == ENGINE or step.loss_rows_only):
            return result
        arguments = dict(sig.bind(*args, **kwargs).arguments)
        if step.engine == ENGINE and not arguments.get("need_roll"):
            return result
        labels = arguments.pop(first)
        rolled = dict(arguments, pre_process=True, need_roll=True)
        unrolled = dict(rolled, need_roll=False)
        laid_out = {name: preprocess(nested.to(labels.device), **(rolled if roll else unrolled))[0]
                    for name, (nested, roll) in step.inputs.get("by_token", {}).items()}
        per_sample = step.inputs.get("temperature_per_sample")
        if per_sample is not None:
            from verl.utils import torch_functional as verl_F

            per_token = verl_F.expand_as_nested(per_sample.to(labels.device), labels)
            # the packing pads with 0: pack T - 1 and add 1 back, in float64, where both are exact for
            # any float32 T >= 2^-28 (in float32, T - 1 would round for T < 0.5)
            shifted = torch.nested.nested_tensor_from_jagged(per_token.values().double() - 1.0, per_token.offsets())
            laid_out["temperature"] = (preprocess(shifted, **unrolled)[0] + 1.0).float()
        step.inputs.update(laid_out, laid_out=True)
        return result

    preprocess_thd_engine._rl_kernels_original = preprocess
    return preprocess_thd_engine


def _laying_out_outputs(postprocess):
    """The fused module's ``postprocess_thd_engine`` (wrapper 4 of the module docstring): called on
    the log-probs the head delivered to the step, it lays out each other delivered output with
    the same arguments into ``step.outputs['laid_out']`` (per-sequence nested tensors, as verl's)."""
    @functools.wraps(postprocess)
    def postprocess_thd_engine(output, *args, **kwargs):
        result = postprocess(output, *args, **kwargs)
        step = step_request.get()
        if step.engine == ENGINE and "laid_out" not in step.outputs and step.belongs_to(output):
            keys = [key for key in step.outputs if key not in ("log_probs", "calls")]
            step.outputs["laid_out"] = {key: postprocess(step.take(output, key), *args, **kwargs) for key in keys}
        return result

    postprocess_thd_engine._rl_kernels_original = postprocess
    return postprocess_thd_engine


def _fused_forward_factory(factory):
    """verl's engine fused-forward factory (wrapper 5 of the module docstring): the forward it
    returns (where it takes ``calculate_entropy``) runs under :func:`~.patch_state.entropy_on_request`
    and checks that a per-sample temperature of the step reached rl-kernels' head."""
    @functools.wraps(factory)
    def fused_forward_factory(*args, **kwargs):
        forward = factory(*args, **kwargs)
        if not callable(forward) or "calculate_entropy" not in inspect.signature(forward).parameters:
            return forward
        return entropy_on_request(_checking_temperature(forward), lambda arguments: arguments["calculate_entropy"])

    fused_forward_factory._rl_kernels_original = factory
    return fused_forward_factory


def _checking_temperature(forward):
    """The engine's fused forward, raising VerlIntegrationError when the step asked a per-sample
    temperature and the model's last stage computed log-probs without rl-kernels' head (which
    delivers to the step on every call, :func:`.megatron.linear_cross_entropy`)."""
    sig = inspect.signature(forward)

    @functools.wraps(forward)
    def fused_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        step = step_request.get()
        if step.engine == ENGINE and "temperature_per_sample" in step.inputs and not step.outputs.get("calls"):
            from verl.utils.megatron_utils import unwrap_model

            model = sig.bind(*args, **kwargs).arguments.get("model")
            if getattr(unwrap_model(model), "post_process", True):
                raise VerlIntegrationError("rl_kernels.integrations.verl: a per-sample temperature on verl's Megatron "
                                           "fused path did not reach rl-kernels' fused head; use_fused_kernels=False "
                                           "serves it")
        return out

    return fused_forward


# ----------------------------------------------------------------------------- logits path: loss rows
def _output_layer_hooks(model) -> tuple:
    """For a logits-path step with ``loss_rows_only``: :func:`select_hidden_rows` and
    :func:`scatter_logits_rows` on the model's ``output_layer`` (the last pipeline stage's), removed
    after the step; none on another stage. VerlIntegrationError for a last stage without an
    ``output_layer`` module (the rows cannot be selected)."""
    from verl.utils.megatron_utils import unwrap_model

    inner = unwrap_model(model)
    if not getattr(inner, "post_process", True):
        return ()
    layer = getattr(inner, "output_layer", None)
    if not isinstance(layer, torch.nn.Module):
        refuse_loss_rows(f"the model ({type(inner).__name__}) has no output_layer module to run on the loss rows",
                         "set fused_kernel_options.rl_kernels.loss_rows_only=false for this model")
    return layer.register_forward_pre_hook(select_hidden_rows), layer.register_forward_hook(scatter_logits_rows)


def select_hidden_rows(layer, args):
    """Forward pre-hook of the output layer (a ``ColumnParallelLinear``) in a logits-path step with
    ``loss_rows_only``: its hidden states ``(S, 1, H)`` become the rows whose loss mask
    (``inputs['loss_rows']``, laid out as the labels) is 1, so the layer's GEMMs (forward, and both
    of its backward) run on those rows only. With sequence parallelism (``layer.sequence_parallel``)
    each TP rank holds ``S / tp`` rows and the layer all-gathers them: every rank selects its own
    rows' loss rows, padded to the largest count of the group (every rank holds the whole mask, so
    all agree with no collective; a pad row's logits are dropped, so it gets no gradient).
    :func:`scatter_logits_rows` puts the logits back at their rows. VerlIntegrationError for hidden
    states of another shape, or a second call in the step."""
    inputs = step_request.get().inputs
    mask = inputs.get("loss_rows")
    if mask is None or inputs.get("logits_rows_made"):
        refuse_loss_rows("the loss-row mask was not laid out for this output layer call" if mask is None else
                         "the model's output layer ran twice in one forward",
                         "set fused_kernel_options.rl_kernels.loss_rows_only=false for this model")
    hidden, total = args[0], mask.numel()
    shards, rank = 1, 0
    if getattr(layer, "sequence_parallel", False):
        from megatron.core import parallel_state

        shards = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or hidden.shape[0] * shards != total:
        refuse_loss_rows(f"the model's output layer got hidden states {tuple(getattr(hidden, 'shape', ()))}, not "
                         f"({total} // {shards}, batch, H) of this step's labels",
                         "set fused_kernel_options.rl_kernels.loss_rows_only=false for this model")
    per_shard = mask.reshape(shards, -1).to(hidden.device)
    counts = per_shard.sum(1)
    width = max(int(counts.max()), 1)
    # each shard's loss rows first, in order (a stable sort of "not a loss row"), the first `width` taken
    index = torch.sort((~per_shard).to(torch.int8), dim=1, stable=True).indices[:, :width]
    kept = torch.arange(width, device=hidden.device) < counts[:, None]
    rows = per_shard.shape[1]
    inputs.update(logits_rows=mask.reshape(-1).nonzero().squeeze(1), logits_rows_total=total, logits_rows_made=True,
                  logits_rows_from=kept.reshape(-1).nonzero().squeeze(1),
                  logits_rows_to=(index + rows * torch.arange(shards, device=hidden.device)[:, None])[kept])
    count("loss_rows_skipped_tokens", total - int(counts.sum()))
    return (hidden.index_select(0, index[rank]),) + tuple(args[1:])


def scatter_logits_rows(layer, args, output):
    """Forward hook of the output layer after :func:`select_hidden_rows`: the loss rows' logits
    ``(rows, 1, V_r)`` back at their rows of ``(S, 1, V_r)``, 0 elsewhere (verl's engine asserts
    the logits have the labels' rows); differentiable in the loss rows' logits."""
    inputs = step_request.get().inputs
    logits = output[0] if isinstance(output, tuple) else output
    full = logits.new_zeros((inputs["logits_rows_total"], *logits.shape[1:])).index_copy(
        0, inputs["logits_rows_to"], logits.index_select(0, inputs["logits_rows_from"]))
    return (full, *output[1:]) if isinstance(output, tuple) else full


# ----------------------------------------------------------------------------- the head's side
def head_inputs(labels: torch.Tensor) -> tuple:
    """``(step, inputs)``: the step request in force and, inside a fused Megatron micro-batch, its
    laid-out per-row inputs for the fused head's ``labels`` (each with ``labels.numel()`` rows:
    ``temperature`` (N,), ``teacher_log_probs`` / ``teacher_ids`` (N, K), ``teacher_rows`` (N,),
    ``loss_rows`` (the mask, as laid out)); outside one, no inputs. VerlIntegrationError where the
    step asked a per-sample temperature that is not laid out for these labels (never verl's stand-in
    1.0 silently) or the teacher's tensors do not match them."""
    step = step_request.get()
    if step.engine != ENGINE:
        return step, {}
    inputs, n, out = step.inputs, labels.numel(), {}
    if "temperature_per_sample" in inputs:
        per_token = inputs.get("temperature")
        if per_token is None or per_token.numel() != n:
            raise VerlIntegrationError("rl_kernels.integrations.verl: a per-sample temperature reached the Megatron "
                                       "fused head outside the engine forward rl-kernels lays it out in (labels "
                                       f"{tuple(labels.shape)}); use_fused_kernels=False serves it")
        out["temperature"] = per_token.reshape(n)
    if step.distillation is not None and "teacher_ids" in inputs:
        teacher_log_probs, teacher_ids = inputs["teacher_log_probs"], inputs["teacher_ids"]
        if tuple(teacher_ids.shape[:-1]) != tuple(labels.shape) or teacher_ids.shape != teacher_log_probs.shape:
            raise VerlIntegrationError(
                f"rl_kernels.integrations.verl: top-K distillation on the Megatron fused path: the teacher's top-K "
                f"tensors as laid out (ids {tuple(teacher_ids.shape)}, log-probs {tuple(teacher_log_probs.shape)}) "
                f"do not match the student's tokens {tuple(labels.shape)} on this rank")
        k = teacher_ids.shape[-1]
        out.update(teacher_log_probs=teacher_log_probs.reshape(n, k), teacher_ids=teacher_ids.reshape(n, k).long(),
                   teacher_rows=inputs["teacher_rows"].reshape(n))
    if "loss_rows" in inputs:
        out["loss_rows"] = inputs["loss_rows"]
    elif "loss_rows" in inputs.get("by_token", {}):
        log_once(logging.WARNING, "rl_kernels: loss_rows_only: the loss-row mask was not laid out for this Megatron "
                 "fused head call (verl's fused forward packed no labels through preprocess_thd_engine): every row "
                 "is computed")
    return step, out


def serve_megatron_topk(loss_config, teacher_log_probs, teacher_ids, teacher_rows, h2, weight, labels1, *,
                        temperature, return_entropy: bool, backend: str, tp_kwargs: dict) -> tuple:
    """The Megatron fused head on a top-K distillation micro-batch: ``(log_probs, entropy or None,
    terms)`` at ``labels1`` (N,) from ``h2`` (N, H) and this rank's weight shard (``tp_kwargs``: the
    vocab-parallel arguments of ``rl_kernels.linear_log_probs``, empty with one TP rank), the
    teacher's laid-out ``teacher_log_probs`` / ``teacher_ids`` (N, K) and ``teacher_rows`` (N,: 0 on
    the layout's padding rows); ``terms``: verl's Megatron distillation terms ((N,) each,
    :func:`~.distill_terms.topk_terms` with ``clamp_masses``, or :func:`~.distill_terms.tail_terms`
    for ``forward_kl_topk_tail``, per ``loss_config``) from the student's log-probs at the teacher's
    ids (and its tail log-mass), and verl's overlap metrics unless the option ``overlap_metrics`` is
    off (the student's top K over the TP group, selected in the same forward:
    :func:`~.distill_losses.overlap_top_k`): one :func:`rl_kernels.distill.linear_log_probs_at_ids` call,
    or, for the entropy on a vocab shard (not implemented with gathered logits), ``linear_log_probs``
    and a second pass for the ids. No N x V tensor."""
    import rl_kernels

    teacher_ids = ids = teacher_ids.to(h2.device)
    teacher_log_probs = teacher_log_probs.to(h2.device)
    tail = is_tail_mode(loss_config)
    extra = {"return_tail": True} if tail else {}
    top_k = overlap_top_k(teacher_ids, "Megatron fused path")
    if tail:  # (verl's layout pads with rows of K zero ids)
        ids = distinct_on_padding(ids, teacher_rows.to(h2.device))
    if return_entropy and tp_kwargs:
        out = rl_kernels.linear_log_probs(h2, weight, labels1, temperature=temperature, return_entropy=True,
                                          backend=backend, **tp_kwargs)
        log_probs, entropy = out.log_probs, out.entropy
        # (labels: only which rows count, as in the one-call branch below; the ids give the columns)
        row_labels = torch.where(labels1 != -100, ids[:, 0], -100)
        _, _, *student = linear_log_probs_at_ids(h2, weight, row_labels, ids, temperature=temperature,
                                                 backend=backend, top_k=top_k, **tp_kwargs, **extra)
    else:
        log_probs, entropy, *student = linear_log_probs_at_ids(h2, weight, labels1, ids, temperature=temperature,
                                                               return_entropy=return_entropy, backend=backend,
                                                               top_k=top_k, **tp_kwargs, **extra)
    if tail:
        terms = tail_terms(student[0], student[1], teacher_log_probs)
        slot_t, slot_q = teacher_log_probs.float(), student[0]
    else:
        losses, student_mass, teacher_mass, slot_q, slot_t = topk_terms(
            student[0], teacher_log_probs, loss_config.log_prob_min_clamp, clamp_masses=True)
        terms = {"distillation_losses": losses, "student_mass": student_mass.detach(),  # metrics only, as verl's
                 "teacher_mass": teacher_mass}
        slot_t = slot_t.float()  # (verl's Megatron teacher side is cast after the clamp)
    if top_k:
        terms.update(overlap_metrics(teacher_ids, student[-1], slot_t, slot_q))
    record("distillation_calls", "distillation fused megatron", labels1.numel())
    return log_probs, entropy, terms


# ----------------------------------------------------------------------------- install
_NO_HEAD = ("not served: verl's Megatron fused forward computes no top-K distillation outputs, and rl-kernels' "
            "fused head is not installed there")


def install(head: bool, fused_module=None, logits_path: bool = False) -> tuple[str, dict]:
    """Install the five wrappers of the module docstring, each once, where rl-kernels' head is
    installed in verl's Megatron fused forward (``head``: :mod:`.megatron` replaced its
    ``linear_cross_entropy``; ``fused_module``: ``model_forward_fused``). Returns (the wording for
    the "Megatron fused path" report line about the entropy, ``{part: (served?, what)}`` for
    :data:`PARTS`). Without the head, only the forward_step wrapper (one WARNING at the first fused
    top-K batch, as verl's fused forward computes no distillation outputs). ``logits_path``: verl's
    from-logits functions are rl-kernels' (:mod:`.megatron`); then the layout wrapper goes on the
    logits forward's binding of ``preprocess_thd_engine`` too (``verl.models.mcore.model_forward``:
    ``loss_rows_only`` there, :attr:`Served.logits_rows`)."""
    has_distillation = has_module(MEGATRON_MODULE)
    try:
        engine_module = importlib.import_module(MEGATRON_ENGINE_MODULE)
    except ImportError as exc:
        why = f"not patched (verl's Megatron engine not importable: {exc})"
        return why, {FUSED_SUM_PI_SQUARED_PART: (False, why), TEMPERATURE_PART: (False, why), DISTILLATION_PART: (
            False, f"{_NO_HEAD} (not importable here: {exc})" if has_distillation else NOT_IN_THIS_VERL)}
    engine = getattr(engine_module, MEGATRON_ENGINE_CLASS, None)
    method = vars(engine).get("forward_step") if engine is not None else None
    if method is None or list(inspect.signature(method).parameters) != STEP_PARAMETERS:
        why = (f"not patched (verl's {MEGATRON_ENGINE_CLASS}.forward_step is missing or has other parameters than "
               f"{STEP_PARAMETERS}): verl's own refusal stays")
        return _wrap_factories(head), {FUSED_SUM_PI_SQUARED_PART: (False, why), TEMPERATURE_PART: (False, why),
                                       DISTILLATION_PART: (False, why if has_distillation else NOT_IN_THIS_VERL)}
    layouts = fused_module is not None and all(callable(getattr(fused_module, name, None))
                                               for name in (PREPROCESS, POSTPROCESS))
    logits_module = None
    if logits_path:
        try:
            logits_module = importlib.import_module(LOGITS_FORWARD_MODULE)
        except ImportError:  # loss_rows_only then warns at the first logits-path step
            pass
    logits_rows = callable(getattr(logits_module, PREPROCESS, None))
    layout = None
    if logits_rows or head and layouts:  # one wrapper, on each binding the engine's forwards call
        original = getattr(fused_module if head and layouts else logits_module, PREPROCESS)
        layout = _laying_out_inputs(original)
        for module in (logits_module if logits_rows else None, fused_module if head and layouts else None):
            if module is not None and getattr(module, PREPROCESS) is original:
                set_attr(module, PREPROCESS, layout)
    if not (head and layouts):
        set_attr(engine, "forward_step", _forward_step(method, Served(logits_rows=logits_rows)))
        why = f"not patched ({MEGATRON_FUSED_MODULE} has no {PREPROCESS} / {POSTPROCESS}): verl's own refusal stays"
        return _wrap_factories(head), {
            FUSED_SUM_PI_SQUARED_PART: (False, why), TEMPERATURE_PART: (False, why),
            DISTILLATION_PART: (False, _NO_HEAD + " (patch_megatron_fused=False, or this verl's fused module lays "
                                "out no tensors by name); a WARNING at the first fused top-K batch")
            if has_distillation else (False, NOT_IN_THIS_VERL)}
    resolve = vars(engine_module).get(RESOLVE)
    served = Served(sum_pi_squared=True, distillation=has_distillation, temperature=resolve is not None,
                    logits_rows=logits_rows)
    set_attr(fused_module, POSTPROCESS, _laying_out_outputs(getattr(fused_module, POSTPROCESS)))
    set_attr(engine, "forward_step", _forward_step(method, served))
    if resolve is not None:
        set_attr(engine_module, RESOLVE, make_resolve_fused_temperature(resolve))
    entropy = _wrap_factories(head)
    parts = {FUSED_SUM_PI_SQUARED_PART: (True, (
        f"calculate_sum_pi_squared=True with use_fused_kernels=True computed by rl-kernels' fused head in the same "
        f"pass (vocab-parallel over the TP group); verl's refusal lifted ({MEGATRON_ENGINE_CLASS}.forward_step), "
        f"laid out by verl's {POSTPROCESS} ({MEGATRON_FUSED_MODULE}.{POSTPROCESS})"))}
    names = (f"{MEGATRON_ENGINE_MODULE}.{RESOLVE}", f"verl.models.mcore.{ENGINE_FORWARD_FACTORIES[0]}",
             f"{MEGATRON_FUSED_MODULE}.{PREPROCESS}")
    parts[TEMPERATURE_PART] = (True, "a temperature tensor of unequal values (" + ", ".join(names) + "): laid out "
                               "per token as the labels are packed, divided per row in rl-kernels' "
                               "linear_cross_entropy") if served.temperature else \
        (False, f"not served (this verl has no {MEGATRON_ENGINE_MODULE}.{RESOLVE}: verl's own refusal stays)")
    parts[DISTILLATION_PART] = (True, (
        f"rl-kernels' Megatron fused head computes verl's distillation_losses, student_mass and teacher_mass "
        f"(verl's Megatron definitions, log_prob_min_clamp) from the student's log-probs at the teacher's ids, "
        f"vocab-parallel over the TP group, laid out by verl's {PREPROCESS} / {POSTPROCESS} "
        f"({MEGATRON_FUSED_MODULE}) into {MEGATRON_ENGINE_CLASS}.forward_step's output (no N x V tensor); "
        f"distillation_only drops log_probs as verl's logits path; {_OVERLAP}, over the TP group; {TAIL_MODE} too; "
        f"a WARNING where a fused top-K batch is not served")) if has_distillation else (False, NOT_IN_THIS_VERL)
    return entropy, parts


def _wrap_factories(head: bool) -> str:
    """Wrap verl's Megatron engine fused-forward factories (and their by-name imports) with
    :func:`_fused_forward_factory` where rl-kernels' ``head`` is installed. Returns the report's
    wording."""
    if not head:
        return "entropy always computed (rl-kernels' fused head is not installed)"
    try:
        mcore = importlib.import_module("verl.models.mcore")
    except ImportError as exc:
        return f"entropy always computed (verl.models.mcore not importable: {exc})"
    wrapped = []
    for name in ENGINE_FORWARD_FACTORIES:
        factory = getattr(mcore, name, None)
        if factory is None:
            continue
        replace_by_name(mcore, {name: _fused_forward_factory(factory)})
        wrapped.append(f"verl.models.mcore.{name}")
    if not wrapped:
        return "entropy always computed (this verl has no Megatron engine fused forward factory)"
    return f"entropy only when verl's calculate_entropy asks ({', '.join(wrapped)})"
