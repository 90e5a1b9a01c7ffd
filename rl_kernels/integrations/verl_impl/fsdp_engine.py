"""verl's FSDP engine (``FSDPEngineWithLMHead``, verl 0.8+) around rl-kernels' fused head: each of
its three methods that a fused micro-batch passes through is wrapped once, here.

* ``forward_step`` (:func:`_forward_step`): puts one fresh step request in force per micro-batch
  (:func:`~.patch_state.new_step`) with what it asks of the head, read from its non-tensor data by
  :func:`asks`, the one place where the supported combinations are decided: ``entropy`` (verl's
  ``calculate_entropy``), ``sum_pi_squared`` (Σπ² on the fused path, which verl refuses there),
  top-K distillation (the micro-batch with the teacher's tensors and the loss function that
  carries verl's distillation config), ``loss_rows_only``.
* ``prepare_model_inputs`` (:func:`_prepare_model_inputs`): the per-token inputs the request asks
  for (a per-sample temperature, which verl's method refuses on the fused path; the loss-row mask)
  laid out by :func:`lay_out_inputs` with ONE more call of verl's own method on a stand-in
  micro-batch (logits path: its per-token temperature; the loss mask as ``input_ids``: its rolled
  labels), so the roll, the static pad and the Ulysses pad-and-slice are verl's.
* ``prepare_model_outputs`` (:func:`_prepare_model_outputs`): what the head delivered beside verl's
  log-probs laid out back by :func:`lay_out_outputs`: Σπ² as verl lays out its fused log-probs (one
  more call of verl's method on a stand-in output, verl's refusal lifted where the head delivered
  it), the distillation outputs verl's engine does not read from ``fused_linear_aux`` (tail mode,
  overlap metrics) with the engine's ``_gather_and_unpad_packed``; a fused top-K micro-batch that got
  no distillation outputs gets one WARNING.

The head itself (:func:`~.fsdp_fused.fused_log_probs_entropy`) reads the request and its laid-out
inputs, selects the loss rows, and delivers its outputs to the request.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import types

import torch

from ...core._logging import log_once
from . import settings
from .patch_state import (VerlIntegrationError, check_loss_rows_audit, count, loss_mask_by_token, micro_batch_with,
                          new_step, refuse_loss_rows, set_attr, step_request, with_step)
from .distill_losses import FUSED_PART as DISTILLATION_PART
from .distill_losses import OVERLAP_KEYS, fused_distillation_entry
from .schema import refused_together

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
ENGINE_CLASS = "FSDPEngineWithLMHead"
SUM_PI_SQUARED_PART = "FSDP fused sum_pi_squared"
"""The report's part for Σπ² on the FSDP fused path."""
PER_SAMPLE_TEMPERATURE_PART = "FSDP fused per-sample temperature"
"""The report's part for a per-sample temperature on the FSDP fused path."""
PARAMETERS = {"forward_step": ["self", "micro_batch", "loss_function", "forward_only"],
              "prepare_model_inputs": ["self", "micro_batch"],
              "prepare_model_outputs": ["self", "output", "output_args", "micro_batch", "logits_processor_func"]}
"""The parameters of verl's methods wrapped here (a verl whose methods differ is not served)."""
STAND_IN = 1.0
"""The number verl's ``prepare_model_inputs`` sees in place of a per-sample temperature tensor."""

_served = {"sum_pi_squared": False, "topk": False, "temperature": False}  # set by patch_engine


def _flag(micro_batch, key: str, default=False):
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=micro_batch, key=key, default=default)


def serves_fused(engine) -> bool:
    """Whether the engine's model (``engine.module``: FSDP-wrapped or not) is one rl-kernels
    serves on the fused path (``impl_backend=rl_kernels``)."""
    module = getattr(engine, "module", None)
    return isinstance(module, torch.nn.Module) and any(
        getattr(m, "_rl_kernels_fused", False) for m in module.modules())


# ----------------------------------------------------------------------------- what a step asks
def asks(engine, micro_batch, loss_function) -> dict:
    """The step request's fields for one micro-batch of ``engine`` (the one place where the FSDP
    fused path decides what it serves and which combinations):

    * ``entropy``: verl's ``calculate_entropy``;
    * ``sum_pi_squared``: ``calculate_sum_pi_squared`` on the fused path (served: verl's refusal
      lifted where the head delivers it);
    * ``topk`` / ``micro_batch`` / ``loss_function``: top-K distillation on the fused path with
      remove-padding and the teacher's tensors in the micro-batch (verl's engine reads
      ``fused_linear_aux`` only with remove-padding);
    * ``loss_rows_only``: the option, on the fused path of a model rl-kernels serves (elsewhere one
      WARNING: every row computed); refused for the losses outside its audit
      (:func:`~.patch_state.check_loss_rows_audit`).

    Combinations are served or refused by the one table of :func:`~.schema.refused_together`
    (the message names both features; Σπ² with top-K on the fused path, ``loss_rows_only`` with
    top-K on the logits path), read here for each micro-batch."""
    fused = bool(_flag(micro_batch, "use_fused_kernels"))
    fields = {"entropy": bool(_flag(micro_batch, "calculate_entropy")),
              "sum_pi_squared": _served["sum_pi_squared"] and fused and bool(_flag(micro_batch,
                                                                                   "calculate_sum_pi_squared")),
              "topk": False, "micro_batch": micro_batch, "loss_function": loss_function, "loss_rows_only": False}
    keys = micro_batch.keys()
    if _served["topk"] and fused and _flag(micro_batch, "distillation_use_topk") \
            and _flag(micro_batch, "use_remove_padding", True) and "teacher_ids" in keys and "teacher_logprobs" in keys:
        fields["topk"] = True
    rows = settings.options().loss_rows_only
    rows_served = rows and (serves_fused(engine) if fused else
                            settings.options().patch_logits_path and output_layer(engine) is not None)
    asked = {name for name, on in (("sum_pi_squared", fields["sum_pi_squared"]), ("loss_rows_only", rows_served),
                                   ("topk", fields["topk"] or not fused and _flag(micro_batch, "distillation_use_topk")))
             if on}
    why = refused_together(asked, "FSDP fused" if fused else "FSDP logits")
    if why is not None:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: {why}")
    if rows_served:
        check_loss_rows_audit(loss_function)
        fields["loss_rows_only"] = True
    elif rows:
        log_once(logging.WARNING, "rl_kernels: loss_rows_only=true is not served on this FSDP engine's path (" + (
            "a fused backend of verl's own" if fused else "the logits path with patch_logits_path=false, or a "
            "model without an output layer rl-kernels finds") + "): the LM head computes every row")
    return fields


def output_layer(engine):
    """The output layer (``get_output_embeddings()``, an ``nn.Module``) of the engine's model, FSDP-
    or otherwise wrapped; None where the model has none."""
    module = getattr(engine, "module", None)
    if not isinstance(module, torch.nn.Module):
        return None
    for inner in module.modules():
        get = getattr(inner, "get_output_embeddings", None)
        if callable(get):
            layer = get()
            if isinstance(layer, torch.nn.Module):
                return layer
    return None


def _select_logits_rows(layer, args):
    """Forward pre-hook of the model's output layer (installed by :func:`lay_out_inputs`): inside an
    FSDP engine step that asks ``loss_rows_only`` on the logits path, its hidden states
    ``(1, logits_rows_total, H)`` become the loss rows alone, so the model makes no logits for the
    others (once per step); VerlIntegrationError for hidden states of another shape (never a
    selection of other rows)."""
    inputs = step_request.get().inputs
    index = inputs.get("logits_rows")
    if index is None or inputs.get("logits_rows_made"):
        if index is not None:
            raise VerlIntegrationError("rl_kernels.integrations.verl: loss_rows_only on the logits path: the model's "
                                       "output layer ran twice in one forward; set "
                                       "fused_kernel_options.rl_kernels.loss_rows_only=false for this model")
        return None
    hidden, total = args[0], inputs["logits_rows_total"]
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or tuple(hidden.shape[:2]) != (1, total):
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: loss_rows_only on the logits path: the model's output layer got hidden "
            f"states {tuple(getattr(hidden, 'shape', ()))}, not the (1, {total}, H) of this step's labels; set "
            f"fused_kernel_options.rl_kernels.loss_rows_only=false for this model")
    inputs["logits_rows_made"] = True
    return (hidden.index_select(1, index.to(hidden.device)),) + tuple(args[1:])


def _forward_step(method):
    """The engine's ``forward_step`` with a fresh step request per micro-batch (:func:`asks`)."""
    return with_step(method, lambda arguments: new_step(**asks(arguments["self"], arguments["micro_batch"],
                                                                 arguments.get("loss_function"))))


# ----------------------------------------------------------------------------- per-token inputs
def _per_sample(micro_batch) -> bool:
    """A per-sample temperature (a float tensor ``(bsz,)``) on the fused path."""
    return _served["temperature"] and bool(_flag(micro_batch, "use_fused_kernels")) and \
        "temperature" in micro_batch.keys() and isinstance(micro_batch["temperature"], torch.Tensor)


def per_token_temperature(logits_args: dict, model_inputs: dict) -> torch.Tensor | None:
    """verl's logits-path temperature (``logits_args``: the output arguments of its
    ``prepare_model_inputs`` with ``use_fused_kernels`` off) shaped like the fused forward's labels:
    the per-token ``temperature_rmpad`` as ``(1, local tokens)`` (remove-padding), or the per-sample
    ``temperature`` ``(bsz,)`` broadcast over ``model_inputs['input_ids']`` ``(bsz, seq)``. None when
    this verl has neither entry."""
    if "temperature_rmpad" in logits_args:
        return logits_args["temperature_rmpad"].reshape(1, -1)
    temperature = logits_args.get("temperature")
    input_ids = model_inputs.get("input_ids")
    if isinstance(temperature, torch.Tensor) and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 \
            and temperature.shape == input_ids.shape[:1]:
        return temperature[:, None].expand(input_ids.shape)
    return None


def lay_out_inputs(original, engine, micro_batch):
    """verl's ``prepare_model_inputs`` (``original``) for a micro-batch whose request asks per-token
    inputs of a model rl-kernels serves: ``(model_inputs, output_args)`` as verl's method returns
    them for the fused forward (with a per-sample temperature: for the stand-in number
    :data:`STAND_IN`, then the model's ``temperature`` input is the per-token layout), and the
    step request's ``inputs['loss_rows']`` (bool, the labels' rows of this rank) under
    ``loss_rows_only``. Both come from ONE more call of verl's method on a copy of the micro-batch
    with ``use_fused_kernels`` off (its logits-path per-token temperature) and, under
    ``loss_rows_only``, :func:`~.patch_state.loss_mask_by_token` as its ``input_ids`` (whose rolled labels,
    ``input_ids_rmpad_rolled``, are then the loss mask of each label row; pads 0).
    VerlIntegrationError for ``loss_rows_only`` without remove-padding."""
    step = step_request.get()
    per_sample = _per_sample(micro_batch)
    model_inputs, output_args = original(engine, micro_batch_with(micro_batch, temperature=STAND_IN)
                                         if per_sample else micro_batch)
    stand_in = micro_batch_with(micro_batch, use_fused_kernels=False)
    if step.loss_rows_only:
        if not _flag(micro_batch, "use_remove_padding", True):
            refuse_loss_rows("use_remove_padding=False is not served (the padded layout)",
                             "set use_remove_padding=True or fused_kernel_options.rl_kernels.loss_rows_only=false")
        stand_in["input_ids"] = loss_mask_by_token(micro_batch)
    _, logits_args = original(engine, stand_in)
    if step.loss_rows_only:
        rows = logits_args["input_ids_rmpad_rolled"].ne(0)
        if _flag(micro_batch, "use_fused_kernels"):
            step.inputs["loss_rows"] = rows
        else:  # the logits path: the model's output layer makes the loss rows' logits only
            layer = output_layer(engine)
            if not getattr(layer, "_rl_kernels_selects_rows", False):
                layer.register_forward_pre_hook(_select_logits_rows)
                layer._rl_kernels_selects_rows = True
            index = rows.nonzero().squeeze(1)
            step.inputs.update(logits_rows=index, logits_rows_total=rows.numel())
            output_args["temperature_rmpad"] = output_args["temperature_rmpad"].index_select(
                0, index.to(output_args["temperature_rmpad"].device))
            count("loss_rows_skipped_tokens", rows.numel() - index.numel())
    if per_sample:
        temperature = per_token_temperature(logits_args, model_inputs)
        if temperature is None or "temperature" not in model_inputs:
            log_once(logging.WARNING, "rl_kernels: this verl's FSDPEngineWithLMHead.prepare_model_inputs lays "
                     "the per-sample temperature out under keys rl-kernels does not know: verl's refusal stays")
            return original(engine, micro_batch)
        model_inputs["temperature"] = temperature
        output_args.update({k: v for k, v in logits_args.items() if "temperature" in k})
    return model_inputs, output_args


def _prepare_model_inputs(original):
    @functools.wraps(original)
    def prepare_model_inputs(self, micro_batch, *args, **kwargs):
        rows = step_request.get().loss_rows_only
        if args or kwargs or not (_per_sample(micro_batch) or rows) \
                or not (serves_fused(self) or rows and not _flag(micro_batch, "use_fused_kernels")):
            return original(self, micro_batch, *args, **kwargs)
        return lay_out_inputs(original, self, micro_batch)

    prepare_model_inputs._rl_kernels_original = original
    return prepare_model_inputs


# ----------------------------------------------------------------------------- per-row outputs
def lay_out_outputs(original, engine, output, output_args, micro_batch, logits_processor_func) -> dict:
    """verl's ``prepare_model_outputs`` (``original``) with what the step's head delivered laid out
    into its result.

    * Σπ², where the request asks it and the head delivered it with ``output.log_probs``: verl's
      method runs with the flag hidden (``calculate_sum_pi_squared=False`` on a copy of the
      micro-batch), then once more on a stand-in output carrying the Σπ² as its ``log_probs``, with
      only that output asked: verl's own code lays it out as it lays out the fused log-probs, the
      layout of its logits-path Σπ² (rmpad squeeze, Ulysses gather and unpad, jagged per sequence;
      without rmpad, the valid columns of each row). Otherwise verl's method runs as it is, its
      refusal included.
    * The distillation outputs verl's engine does not read from ``fused_linear_aux`` (the tail
      mode's, the overlap metrics: ``outputs['extra']``): the engine's ``_gather_and_unpad_packed``
      (Ulysses gather, padding dropped), then per sequence (``input_ids``' offsets), as verl lays out
      the aux outputs. VerlIntegrationError where this verl has no ``_gather_and_unpad_packed`` /
      ``pad_size`` (for the overlap metrics alone: one WARNING, none logged).
    * A fused top-K micro-batch whose result has no ``distillation_losses`` (a fused forward that is
      not rl-kernels', remove-padding off, an engine that reads no ``fused_linear_aux``): one WARNING
      saying so; verl's loss then finds none."""
    step = step_request.get()
    if "logits_rows" in step.inputs and not step.inputs.get("logits_rows_made"):
        raise VerlIntegrationError("rl_kernels.integrations.verl: loss_rows_only on the logits path: the model's "
                                   "forward did not run its output layer (get_output_embeddings()) on the step's "
                                   "hidden states; set fused_kernel_options.rl_kernels.loss_rows_only=false for "
                                   "this model")
    sum_pi_squared = step.sum_pi_squared and "sum_pi_squared" in step.outputs and \
        _flag(micro_batch, "calculate_sum_pi_squared") and _flag(micro_batch, "use_fused_kernels")
    if not sum_pi_squared:
        model_output = original(engine, output, output_args, micro_batch, logits_processor_func)
    else:
        values = step.take(output.log_probs, "sum_pi_squared")
        model_output = original(engine, output, output_args,
                                micro_batch_with(micro_batch, calculate_sum_pi_squared=False), logits_processor_func)
        # entropy: any tensor of the log-probs' shape (verl 0.8.0 squeezes it even when not asked)
        stand_in = types.SimpleNamespace(log_probs=values, entropy=values, fused_linear_aux=None)
        only_log_probs = micro_batch_with(micro_batch, calculate_sum_pi_squared=False, calculate_entropy=False,
                                          distillation_use_topk=False, distillation_only=False)
        model_output["sum_pi_squared"] = original(engine, stand_in, output_args, only_log_probs,
                                                  logits_processor_func)["log_probs"]
    extra = step.outputs.get("extra")
    if extra and isinstance(model_output, dict) and "distillation_losses" in model_output:
        gather = getattr(engine, "_gather_and_unpad_packed", None)
        if gather is None or not isinstance(output_args, dict) or "pad_size" not in output_args:
            if not set(extra) <= set(OVERLAP_KEYS):
                raise VerlIntegrationError(
                    f"rl_kernels: top-K distillation on the FSDP fused path: this verl's engine has no "
                    f"_gather_and_unpad_packed / pad_size to lay out {', '.join(extra)}; use use_fused_kernels=False")
            log_once(logging.WARNING, "rl_kernels: top-K distillation on the FSDP fused path: this verl's engine has "
                     "no _gather_and_unpad_packed / pad_size to lay out the overlap metrics; verl's loss logs none")
        else:
            offsets = micro_batch["input_ids"].offsets()
            for key, value in extra.items():
                model_output[key] = torch.nested.nested_tensor_from_jagged(
                    gather(value.squeeze(0), output_args["pad_size"]), offsets)
    if _flag(micro_batch, "distillation_use_topk") and _flag(micro_batch, "use_fused_kernels") \
            and isinstance(model_output, dict) and "distillation_losses" not in model_output:
        if not _flag(micro_batch, "use_remove_padding", True):
            why = "use_remove_padding=False (verl's engine reads fused_linear_aux only with remove-padding)"
        elif step.outputs.get("aux") is not None:
            why = "this verl's engine did not take the fused_linear_aux that rl-kernels computed"
        else:
            why = ("the model's fused forward is not rl-kernels' (verl's own fused backends compute no "
                   "distillation outputs; set fused_kernel_options.impl_backend=rl_kernels)")
        log_once(logging.WARNING, "rl_kernels: top-K distillation on verl's FSDP fused path is not served: "
                 f"{why}; verl's loss will find no distillation_losses. Use use_fused_kernels=False "
                 "(verl's logits path) or impl_backend=rl_kernels with use_remove_padding=True")
    return model_output


def _prepare_model_outputs(original):
    @functools.wraps(original)
    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        return lay_out_outputs(original, self, output, output_args, micro_batch, logits_processor_func)

    prepare_model_outputs._rl_kernels_original = original
    return prepare_model_outputs


# ----------------------------------------------------------------------------- the patch
def patch_engine() -> dict[str, tuple[bool, str]]:
    """Wrap the FSDP engine's three methods (each where this verl has it with its :data:`PARAMETERS`)
    and return the report entries of what they serve: Σπ² on the fused path (where verl's actor config
    has ``calculate_sum_pi_squared``), the per-sample temperature, top-K distillation on the fused
    path (:func:`~.distill_losses.fused_distillation_entry`: where this verl has distillation and its
    engine reads ``fused_linear_aux``)."""
    try:
        import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    except ImportError as exc:
        why = f"not patched (verl's FSDP engine not importable: {exc})"
        return {SUM_PI_SQUARED_PART: (False, why), PER_SAMPLE_TEMPERATURE_PART: (False, why),
                DISTILLATION_PART: fused_distillation_entry(None)}
    engine = getattr(fsdp_impl, ENGINE_CLASS, None)
    methods = {name: vars(engine).get(name) if isinstance(engine, type) else None for name in PARAMETERS}
    fits = {name: method is not None and list(inspect.signature(method).parameters) == PARAMETERS[name]
            for name, method in methods.items()}

    def unfit(*names) -> str:
        return (f"not patched (verl's {ENGINE_CLASS}." + " / ".join(names) + " missing or with other parameters "
                f"than {[PARAMETERS[n] for n in names]}): verl's own code and refusals stay")

    report = {}
    from verl.workers.config.actor import ActorConfig

    if "calculate_sum_pi_squared" not in {f.name for f in dataclasses.fields(ActorConfig)}:
        report[SUM_PI_SQUARED_PART] = (False, "not in this verl (its engine's ActorConfig has no "
                                       "calculate_sum_pi_squared; a legacy actor's own refusal with fused kernels stays)")
    elif not (fits["forward_step"] and fits["prepare_model_outputs"]):
        report[SUM_PI_SQUARED_PART] = (False, unfit("forward_step", "prepare_model_outputs"))
    else:
        _served["sum_pi_squared"] = True
        report[SUM_PI_SQUARED_PART] = (True, (
            "calculate_sum_pi_squared=True with use_fused_kernels=True computed by rl-kernels' fused head in the "
            "same pass; verl's refusal lifted where that head ran (FSDPEngineWithLMHead.forward_step, "
            "prepare_model_outputs), verl's error stays elsewhere (impl_backend not rl_kernels, VeOmni)"))
    if fits["prepare_model_inputs"]:
        _served["temperature"] = True
        report[PER_SAMPLE_TEMPERATURE_PART] = (True, (
            f"a temperature tensor (bsz,) on the FSDP fused path of models with impl_backend='rl_kernels' "
            f"({ENGINE_CLASS}.prepare_model_inputs: verl's refusal lifted there, kept for other models)"))
    else:
        report[PER_SAMPLE_TEMPERATURE_PART] = (False, unfit("prepare_model_inputs"))
    report[DISTILLATION_PART] = fused_distillation_entry(
        methods["prepare_model_outputs"] if fits["forward_step"] and fits["prepare_model_outputs"] else None)
    _served["topk"] = report[DISTILLATION_PART][0]
    wrappers = {"forward_step": _forward_step, "prepare_model_inputs": _prepare_model_inputs,
                "prepare_model_outputs": _prepare_model_outputs}
    for name, wrap in wrappers.items():
        if fits[name]:
            set_attr(engine, name, wrap(methods[name]))
    return report


def unpatch_engine() -> None:
    """Forget what :func:`patch_engine` served (the methods come back with the undo log)."""
    _served.update(dict.fromkeys(_served, False))
