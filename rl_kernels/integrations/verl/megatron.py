"""verl's Megatron engine on rl-kernels (applied by :func:`rl_kernels.integrations.verl.patch`).

Megatron shards the (padded) vocabulary evenly over the tensor-parallel (TP) group: rank r holds
rows ``[r * V_r, (r + 1) * V_r)`` of the output layer, and the logits it computes are that shard's
columns. The padded rows are real rows of the last shard and their logits are part of the
softmax, in verl's functions and here alike. Every replacement calls rl-kernels with
``process_group=<the TP group>`` and ``vocab_start_index = tp_rank * V_r`` (no collective for the
layout; one all_gather of a few float32 rows per token merges the shards, identical bits on
every rank; :mod:`rl_kernels.autograd.vocab_parallel`). With a TP group of one rank, no process group is passed.

**Logits path** (``use_fused_kernels=False``; ``MegatronEngineWithLMHead._lm_head_logits_processor``
imports these by name from ``verl.utils.megatron.tensor_parallel``; the logits are
``(1, T, V_r)``, already divided by the temperature in place by verl):

* ``vocab_parallel_log_probs_from_logits(logits, labels)`` -> :func:`rl_kernels.log_probs_from_logits`
* ``vocab_parallel_entropy(vocab_parallel_logits)`` and
  ``vocab_parallel_entropy_with_chunking(vocab_parallel_logits, chunk_size=2048)`` ->
  :func:`rl_kernels.entropy_from_logits` (rl-kernels always chunks; ``chunk_size`` is validated)
* ``vocab_parallel_sum_pi_squared(vocab_parallel_logits)`` -> ``rl_kernels.sum_pi_squared_from_logits``

float32 outputs of shape ``logits.shape[:-1]``, differentiable, and none of them writes into the
logits (verl's Megatron cross-entropy does, which is why verl clones the logits first; that
clone stays verl's). Logits outside rl-kernels' kernels (float64, integer, empty, ...), labels in no
vocabulary shard (-100 included) or of another shape, and chunked-entropy logits of fewer than 3
dims go to verl's own function (:func:`~.common.verl_fallback`).

**Fused path** (``use_fused_kernels=True``): ``fused_output_processor`` / ``_fused_GPTModel_forward``
(``verl.models.mcore.model_forward_fused``) and the 1F1B-overlap postprocess
(``verl.models.mcore.model_forward_1f1b_overlap``, which no code of verl 0.8, 0.9 or main calls
today; patched so that it is right if verl calls it) call ``linear_cross_entropy(hidden, weight,
labels, temperature, "none", tp_group)``, imported by name from
``verl.utils.kernel.linear_cross_entropy``; those two bindings are replaced by
:func:`linear_cross_entropy` below (verl's kernel itself, and the FSDP models' use of it, are left
alone). It pairs ``hidden.reshape(-1, H)`` with ``labels.reshape(-1)`` as verl's kernel does
(verl passes ``(T, 1, H)`` and ``(1, T)``) and returns float32 ``(log_probs, entropy)`` shaped like
``labels`` (verl's kernel returns them flat; verl's callers reshape either).

**Σπ² on the fused path** (``calculate_sum_pi_squared=True``, which verl's engine refuses with
fused kernels): ``MegatronEngineWithLMHead.forward_step`` runs with the flag hidden and a request
active; :func:`linear_cross_entropy` computes Σπ² over the whole vocabulary in the same pass, verl's
``postprocess_thd_engine`` lays it out as the log-probs, and it is returned as ``sum_pi_squared``
(:func:`wrap_engine_sum_pi_squared`).

**Hidden-state gradient over the TP group.** Each rank's backward gives the gradient of its
vocab shard only, a *partial* dh; the gradient of the decoder output is the sum over the TP
group, and exactly one thing must form that sum:

* With sequence parallelism verl calls the head on ``gather_from_sequence_parallel_region(hidden)``
  (all-gather forward, reduce-scatter backward): that backward sums the partial dh, so here
  ``reduce_hidden_grad=False``.
* Without it verl passes the decoder output straight in. Megatron's own output layer
  (``ColumnParallelLinear``) would all-reduce dgrad in its backward
  (``copy_to_tensor_model_parallel_region``), but verl bypasses the output layer, and verl 0.9.1's
  ``linear_cross_entropy`` backward (``verl/utils/kernel/kernels.py``,
  ``efficient_entropy_backward``) computes ``d_hidden = d_logits @ weight_shard`` with no
  collective: nothing sums it. So here ``reduce_hidden_grad=True``: the backward all-reduces the
  float32 partials over the group and rounds once.

The decision is made per call, not from the config: ``gather_from_sequence_parallel_region`` is
wrapped where these two modules look it up (``model_forward_fused``'s by-name binding, and
``megatron.core.tensor_parallel``'s, from which the 1F1B postprocess imports it at call time)
so that its output tensor carries ``_rl_kernels_dh_summed = True`` (and the group) when its
backward reduce-scatters (``tensor_parallel_output_grad=True``, the default); the wrapper
changes nothing else. :func:`linear_cross_entropy` uses
``reduce_hidden_grad = not getattr(hidden, "_rl_kernels_dh_summed", False)``.
``tests/test_verl_megatron.py`` checks both cases through verl's own ``fused_output_processor``
(each rank's dh equals the unsharded float64 gradient, or its rows of it).

**Top-K distillation on the fused path** (``distillation_use_topk``, which verl's fused forward does
not compute): while the engine's forward_step has a :class:`~.distill.MegatronTopKRequest` active,
:func:`linear_cross_entropy` also computes verl's Megatron distillation terms from the student's
log-probs at the teacher's ids (vocab-parallel, :func:`~.distill.serve_megatron_topk`); the layout
and the engine hooks are in :mod:`.distill`.

Skipped, with an INFO line, when ``megatron.core`` is not importable, and not applied (the report
says which functions are missing) when the installed verl lacks any function replaced here:
verl 0.7.x has no ``vocab_parallel_sum_pi_squared``, 0.7.x and 0.8.x no
``vocab_parallel_entropy_with_chunking``; verl 0.9.x and verl's main branch have all of them.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import itertools
import logging
import numbers

import torch

import rl_kernels

from ..._logging import log_once, logger
from .common import (VerlIntegrationError, check_chunk_size, check_signature, count,
                     entropy_on_request, entropy_placeholder, entropy_wanted, record, replace_by_name, set_attr,
                     outside_labels, new_step, step_request, verl_fallback, verl_version)
from . import settings
from .distill import megatron_topk_request, serve_megatron_topk
from .logits import capture_logits
from .settings import options
from .temperature import PerSampleTemperature, megatron_row_temperature

LOGITS_FUNCTIONS = ("vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy",
                    "vocab_parallel_entropy_with_chunking")
SUM_PI_SQUARED_FUNCTION = "vocab_parallel_sum_pi_squared"
TENSOR_PARALLEL_MODULE = "verl.utils.megatron.tensor_parallel"
FUSED_MODULES = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")
GATHER = "gather_from_sequence_parallel_region"

# parameter names (with defaults) this patch was written against (verl 0.9.1 and main, megatron-core 0.16.1)
EXPECTED_SIGNATURES = {
    "vocab_parallel_log_probs_from_logits": ["logits", "labels"],
    "vocab_parallel_entropy": ["vocab_parallel_logits"],
    "vocab_parallel_entropy_with_chunking": ["vocab_parallel_logits", "chunk_size=2048"],
    "vocab_parallel_sum_pi_squared": ["vocab_parallel_logits"],
    "LinearCrossEntropy.forward": ["ctx", "hidden", "weight", "labels", "temperature=1.0",
                                   "reduction='none'", "dist_process_group=None"],
    GATHER: ["input_", "tensor_parallel_output_grad=True", "group=None", "output_split_sizes=None",
             "use_global_buffer=False"],
}

def _tensor_parallel():
    """(group, rank): Megatron's TP group (None when it has one rank) and this rank in it."""
    from megatron.core import parallel_state

    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None, 0
    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_tensor_model_parallel_rank()


def _shard_kwargs(logits) -> dict:
    group, rank = _tensor_parallel()
    if group is None:
        return {}
    return {"process_group": group, "vocab_start_index": rank * logits.shape[-1]}


def _capture(function: str, logits, kwargs: dict, labels=None, log_probs=None, entropy=None) -> None:
    """The anomaly capture on a Megatron logits-path call: the anomalous rows gathered over the TP
    group (the whole vocabulary), written by the group's rank 0 (:func:`~.logits.capture_logits`)."""
    capture_logits(f"{function} (Megatron logits path)", logits, labels, log_probs=log_probs, entropy=entropy,
                   process_group=kwargs.get("process_group"))


def _rows(t) -> int:
    return t.shape[:-1].numel()


# ----------------------------------------------------------------------------- logits path
def _vocab_parallel_log_probs_domain(arguments) -> str | None:
    """Calls of ``vocab_parallel_log_probs_from_logits`` that go to verl's own function (the
    differential probe): labels of :func:`~.common.outside_labels` against the whole vocabulary
    (this shard's size times the TP size: a label in no shard, -100 included, gets Megatron's
    -logsumexp there; labels verl's broadcasts). Every rank of the TP group holds the same labels
    and logits shapes, so all ranks decide alike (no rank left in a collective alone)."""
    logits, labels = arguments["logits"], arguments["labels"]
    if not isinstance(logits, torch.Tensor):
        return None
    from megatron.core import parallel_state

    return outside_labels(labels, logits, logits.shape[-1] * parallel_state.get_tensor_model_parallel_world_size())


def _vocab_parallel_chunked_entropy_domain(arguments) -> str | None:
    """verl's ``vocab_parallel_entropy_with_chunking`` chunks dim 1 of (batch, seq, vocab shard)
    logits: fewer dims go to verl's (which raises IndexError)."""
    logits = arguments["vocab_parallel_logits"]
    if isinstance(logits, torch.Tensor) and logits.dim() < 3:
        return f"{logits.dim()}-D logits"
    return None


@verl_fallback(TENSOR_PARALLEL_MODULE, "vocab_parallel_log_probs_from_logits", _vocab_parallel_log_probs_domain)
def vocab_parallel_log_probs_from_logits(logits, labels):
    """rl-kernels replacement for verl's ``vocab_parallel_log_probs_from_logits`` (float32,
    shape ``labels.shape``; the logits are left untouched)."""
    kwargs = _shard_kwargs(logits)
    out = rl_kernels.log_probs_from_logits(logits, labels, **kwargs)
    record("megatron_logits_log_probs_calls", "logits megatron", labels.numel())
    _capture("vocab_parallel_log_probs_from_logits", logits, kwargs, labels, log_probs=out)
    return out


@verl_fallback(TENSOR_PARALLEL_MODULE, "vocab_parallel_entropy")
def vocab_parallel_entropy(vocab_parallel_logits):
    """rl-kernels replacement for verl's ``vocab_parallel_entropy`` (float32, non-destructive)."""
    kwargs = _shard_kwargs(vocab_parallel_logits)
    out = rl_kernels.entropy_from_logits(vocab_parallel_logits, **kwargs)
    record("megatron_logits_entropy_calls", "logits megatron", _rows(vocab_parallel_logits))
    _capture("vocab_parallel_entropy", vocab_parallel_logits, kwargs, entropy=out)
    return out


@verl_fallback(TENSOR_PARALLEL_MODULE, "vocab_parallel_entropy_with_chunking",
               _vocab_parallel_chunked_entropy_domain)
def vocab_parallel_entropy_with_chunking(vocab_parallel_logits, chunk_size=2048):
    """rl-kernels replacement for verl's ``vocab_parallel_entropy_with_chunking``; rl-kernels
    always chunks (by elements), so ``chunk_size`` is only validated."""
    check_chunk_size(chunk_size)
    kwargs = _shard_kwargs(vocab_parallel_logits)
    out = rl_kernels.entropy_from_logits(vocab_parallel_logits, **kwargs)
    record("megatron_logits_entropy_calls", "logits megatron", _rows(vocab_parallel_logits))
    _capture("vocab_parallel_entropy_with_chunking", vocab_parallel_logits, kwargs, entropy=out)
    return out


@verl_fallback(TENSOR_PARALLEL_MODULE, "vocab_parallel_sum_pi_squared")
def vocab_parallel_sum_pi_squared(vocab_parallel_logits):
    """rl-kernels replacement for verl's ``vocab_parallel_sum_pi_squared``: sum over the whole
    vocabulary of softmax(logits)^2 (float32, shape ``logits.shape[:-1]``, differentiable)."""
    out = rl_kernels.sum_pi_squared_from_logits(vocab_parallel_logits, **_shard_kwargs(vocab_parallel_logits))
    record("sum_pi_squared_calls", "sum_pi_squared megatron", _rows(vocab_parallel_logits))
    return out


LOGITS_REPLACEMENTS = {
    "vocab_parallel_log_probs_from_logits": vocab_parallel_log_probs_from_logits,
    "vocab_parallel_entropy": vocab_parallel_entropy,
    "vocab_parallel_entropy_with_chunking": vocab_parallel_entropy_with_chunking,
}


# ----------------------------------------------------------------------------- fused path
def _temperature(temperature) -> float:
    if isinstance(temperature, torch.Tensor):
        if temperature.numel() != 1:
            raise ValueError(f"temperature: the fused path takes one temperature per call, got a tensor "
                             f"of shape {tuple(temperature.shape)}")
        temperature = temperature.item()
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature: expected a float or a 1-element tensor, got {temperature!r}")
    return float(temperature)


@torch.compiler.disable
def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
    """rl-kernels replacement for verl's ``linear_cross_entropy`` in its Megatron fused forwards.

    hidden: ``(..., H)`` (verl: ``(T, 1, H)``); weight: this rank's ``(V_r, H)`` vocab shard;
    labels: global ids, ``labels.numel()`` rows paired with ``hidden.reshape(-1, H)`` as verl's
    kernel pairs them. temperature: a number, a one-element tensor, or verl's per-sample temperature
    as :mod:`.temperature` hands it on (laid out per token there). Returns float32 ``(log_probs,
    entropy)`` shaped like ``labels``. dh over the TP group: see the module docstring
    (``reduce_hidden_grad`` unless ``hidden`` is the output of
    ``gather_from_sequence_parallel_region``). Inside a fused engine forward that verl runs with
    ``calculate_entropy=False`` (:func:`_wrap_engine_entropy_requests`) no entropy is computed and
    the entropy returned is NaN (verl drops it). Inside an engine step that asks for Σπ²
    (:func:`wrap_engine_sum_pi_squared`) it is computed in the same pass (over the whole
    vocabulary, merged over the TP group like the log-probs) and delivered to the step's request.
    Inside an engine step with top-K distillation (:func:`~.distill.megatron_topk_request`) verl's
    distillation terms are computed from the same head (:func:`~.distill.serve_megatron_topk`).
    """
    if reduction != "none":
        raise ValueError(f"reduction: rl-kernels' linear_cross_entropy returns per-token log-probs and "
                         f"entropy (reduction='none', what verl's Megatron fused forward passes), got "
                         f"{reduction!r}")
    if isinstance(temperature, PerSampleTemperature):  # verl's per-sample temperature (:mod:`.temperature`)
        temperature = megatron_row_temperature(temperature, labels)
    else:
        temperature = _temperature(temperature)
    if _rows(hidden) != labels.numel():
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)}: expected "
                         f"hidden.shape[:-1].numel() == labels.numel()")
    if weight.dtype != hidden.dtype:
        log_once(logging.INFO, f"rl_kernels: output weight {weight.dtype} is cast to the hidden_states "
                 f"dtype {hidden.dtype} for the fused head (Megatron)")
        weight = weight.to(hidden.dtype)
    kwargs = {}
    if dist_process_group is not None and torch.distributed.get_world_size(dist_process_group) > 1:
        summed = bool(getattr(hidden, "_rl_kernels_dh_summed", False))
        if summed and getattr(hidden, "_rl_kernels_dh_group", dist_process_group) is not dist_process_group:
            raise ValueError("hidden: the gather_from_sequence_parallel_region that produced it sums dh over "
                             "another group than dist_process_group; rl-kernels cannot tell who sums dh")
        kwargs = {"process_group": dist_process_group,
                  "vocab_start_index": torch.distributed.get_rank(dist_process_group) * weight.shape[0],
                  "reduce_hidden_grad": not summed}
    backend = options().backend  # read per call
    return_entropy = entropy_wanted.get()
    step = step_request.get()
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.reshape(-1)
    topk = megatron_topk_request()
    if topk is not None and topk.teacher is not None and step.sum_pi_squared:
        raise VerlIntegrationError("rl_kernels.integrations.verl: calculate_sum_pi_squared=True together with "
                                   "top-K distillation on the Megatron fused path is not served; use "
                                   "use_fused_kernels=False (verl's logits path) for this run")
    if topk is not None and topk.teacher is not None:  # top-K distillation in the same head (verl's keys)
        log_probs, entropy = serve_megatron_topk(topk, hidden.reshape(-1, hidden.shape[-1]), weight,
                                                 labels.reshape(-1), labels.shape, temperature=temperature,
                                                 return_entropy=return_entropy, backend=backend, tp_kwargs=kwargs)
        out = rl_kernels.LogProbsOutput(log_probs, entropy, None)
    else:
        out = rl_kernels.linear_log_probs(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1),
                                          temperature=temperature, return_entropy=return_entropy,
                                          return_sum_pi_squared=step.sum_pi_squared, backend=backend, **kwargs)
    record("fused_megatron_calls", "fused megatron", labels.numel())
    capture = settings.capture()
    if capture is not None:  # the whole call, its weight gathered over the TP group (written by its rank 0)
        capture.check(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), temperature=temperature,
                      ignore_index=-100, log_probs=out.log_probs, entropy=out.entropy if return_entropy else None,
                      process_group=kwargs.get("process_group"),
                      metadata={"function": "verl linear_cross_entropy (Megatron fused path)"})
    entropy = out.entropy if return_entropy else entropy_placeholder(out.log_probs)
    log_probs = out.log_probs.view(labels.shape)
    if step.sum_pi_squared:
        step.deliver(log_probs, sum_pi_squared=out.sum_pi_squared.view(labels.shape))
        count("fused_sum_pi_squared_calls")
    return log_probs, entropy.view(labels.shape)


linear_cross_entropy._rl_kernels_fused_head = True  # how .distill tells that the fused module's head is this one


LOGIT_TRANSFORM_ATTRIBUTES = ("final_logit_softcapping", "logit_softcapping", "output_logit_softcapping",
                              "logits_soft_cap", "logit_scale", "logits_scaling", "lm_head_multiplier",
                              "output_multiplier", "mup_output_multiplier")
"""Config attributes that, on a model, change the logits after the output layer (Gemma 2, Cohere,
Granite, Falcon-H1, muP conventions). Megatron-Core's ``GPTModel`` (0.16) reads none of them: a config
or a ``GPTModel`` subclass that sets or applies one is refused on the fused path."""


def check_output_layer(model) -> None:
    """Refuse (:class:`VerlIntegrationError`) a Megatron model whose logits are not
    ``output_layer(hidden)``: its config sets a logit transform (:data:`LOGIT_TRANSFORM_ATTRIBUTES`, a
    value other than None / 1), its output layer has a bias, or it is a ``GPTModel`` subclass that
    overrides ``forward`` / ``_postprocess`` (whose logits verl's fused forward would skip). Wraps what
    verl's ``patch_fused_forward`` (engine setup) and the 1F1B-overlap forward receive."""
    from megatron.core.models.gpt import GPTModel

    from verl.utils.megatron_utils import unwrap_model

    gpt = unwrap_model(model)
    if not isinstance(gpt, GPTModel):
        gpt = getattr(gpt, "language_model", gpt)
    if not isinstance(gpt, GPTModel):
        return  # verl itself refuses it ("not supported for fused forward")
    name = type(gpt).__name__
    config = getattr(gpt, "config", None)
    transforms = {a: getattr(config, a) for a in LOGIT_TRANSFORM_ATTRIBUTES
                  if getattr(config, a, None) not in (None, 1, 1.0)}
    if transforms:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: Megatron model {name}: its config sets "
                                   f"{transforms}, which changes the logits after the output layer; the fused path "
                                   f"(output_layer.weight only) is refused. Use use_fused_kernels=False.")
    if getattr(getattr(gpt, "output_layer", None), "bias", None) is not None:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: Megatron model {name}: its output layer has a "
                                   f"bias, which the fused head leaves out; refused. Use use_fused_kernels=False.")
    for klass in type(gpt).__mro__:
        if klass is GPTModel:
            break
        overridden = sorted({"forward", "_postprocess"} & set(vars(klass)))
        if overridden:
            raise VerlIntegrationError(f"rl_kernels.integrations.verl: Megatron model {name} overrides GPTModel."
                                       f"{'/'.join(overridden)} ({klass.__module__}.{klass.__qualname__}); rl-kernels "
                                       f"cannot tell whether its logits are output_layer(hidden); the fused path is "
                                       f"refused. Use use_fused_kernels=False.")


def _checking(fn, model_arg: str):
    """``fn`` with :func:`check_output_layer` run on its ``model_arg`` argument first."""
    position = list(inspect.signature(fn).parameters).index(model_arg)

    @functools.wraps(fn)
    def checked(*args, **kwargs):
        check_output_layer(kwargs[model_arg] if model_arg in kwargs else args[position])
        return fn(*args, **kwargs)

    checked._rl_kernels_original = fn
    return checked


ENGINE_FORWARD_FACTORIES = ("get_mcore_forward_fused_model_engine_fn", "get_mcore_forward_fused_no_padding_fn")
"""verl's factories (in ``verl.models.mcore``) of the Megatron engine's fused forward, which takes
``calculate_entropy``: 0.8 / 0.9 import the first at call time, 0.7.x binds the second by name."""


def _wrap_engine_entropy_requests() -> str:
    """Wrap verl's Megatron engine fused-forward factories (and their by-name imports) so that
    each forward they return runs under :func:`entropy_on_request` with its ``calculate_entropy``
    argument. Returns the report's wording."""
    try:
        mcore = importlib.import_module("verl.models.mcore")
    except ImportError as exc:
        return f"entropy always computed (verl.models.mcore not importable: {exc})"
    wrapped = []
    for name in ENGINE_FORWARD_FACTORIES:
        factory = getattr(mcore, name, None)
        if factory is None:
            continue

        def fused_forward_factory(*args, _factory=factory, **kwargs):
            forward = _factory(*args, **kwargs)
            if not callable(forward) or "calculate_entropy" not in inspect.signature(forward).parameters:
                return forward
            return entropy_on_request(forward, lambda arguments: arguments["calculate_entropy"])

        functools.update_wrapper(fused_forward_factory, factory)
        fused_forward_factory._rl_kernels_original = factory
        replace_by_name(mcore, {name: fused_forward_factory})
        wrapped.append(f"verl.models.mcore.{name}")
    if not wrapped:
        return "entropy always computed (this verl has no Megatron engine fused forward factory)"
    return f"entropy only when verl's calculate_entropy asks ({', '.join(wrapped)})"


POSTPROCESS = "postprocess_thd_engine"
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
FUSED_SUM_PI_SQUARED_PART = "Megatron fused sum_pi_squared"
"""The report's part for Σπ² on the Megatron fused path (:func:`wrap_engine_sum_pi_squared`)."""


def _laying_out_sum_pi_squared(postprocess):
    """verl's ``postprocess_thd_engine`` as its Megatron engine fused forward calls it on the fused
    head's log-probs (packed THD, padded per sequence, split over context parallelism) to give
    the per-sequence nested tensor: when the step's request holds a Σπ² delivered with exactly
    these log-probs, the same call with the same arguments lays out the Σπ² too
    (the step request's ``outputs['sum_pi_squared_laid_out']``)."""
    @functools.wraps(postprocess)
    def postprocess_thd_engine(output, *args, **kwargs):
        result = postprocess(output, *args, **kwargs)
        step = step_request.get()
        if step.sum_pi_squared and "sum_pi_squared_laid_out" not in step.outputs and step.belongs_to(output):
            step.outputs["sum_pi_squared_laid_out"] = postprocess(step.take(output, "sum_pi_squared"), *args, **kwargs)
        return result

    postprocess_thd_engine._rl_kernels_original = postprocess
    return postprocess_thd_engine


def _lifting_forward_step(forward_step):
    """``MegatronEngineWithLMHead.forward_step``, whose Σπ² refusal on the fused path comes before
    the model runs. A micro-batch with ``calculate_sum_pi_squared=True`` and ``use_fused_kernels``
    runs verl's method on a copy of the micro-batch with the flag hidden and a
    step request asking Σπ² (``sum_pi_squared=True``) in force: rl-kernels' fused head computes Σπ² with the
    log-probs, verl's ``postprocess_thd_engine`` lays it out with them (:func:`_laying_out_sum_pi_squared`),
    and it goes into the output as ``sum_pi_squared``, where verl's logits path puts it. On the
    last pipeline stage, when no Σπ² came (a fused forward that is not rl-kernels'), verl's method
    runs again on the micro-batch as verl sent it: verl's own refusal, raised before its model runs."""
    @functools.wraps(forward_step)
    def wrapper(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        from verl.utils import tensordict_utils as tu

        batch = next(batch_iter)
        fused = tu.get_non_tensor_data(batch, key="use_fused_kernels", default=self.engine_config.use_fused_kernels)
        asked = bool(tu.get_non_tensor_data(batch, key="calculate_sum_pi_squared", default=False))
        if not (asked and fused):
            token = new_step(sum_pi_squared=False)
            try:
                return forward_step(self, itertools.chain([batch], batch_iter), model, logits_processor_func,
                                    postprocess_micro_batch_func)
            finally:
                step_request.reset(token)
        hidden = batch.copy()
        tu.assign_non_tensor(hidden, calculate_sum_pi_squared=False)
        token = new_step(sum_pi_squared=True)
        request = step_request.get()
        try:
            output, postprocess = forward_step(self, itertools.chain([hidden], batch_iter), model,
                                               logits_processor_func, postprocess_micro_batch_func)
        finally:
            step_request.reset(token)
        if isinstance(output, dict) and "log_probs" in output:  # the last pipeline stage
            laid_out = request.outputs.get("sum_pi_squared_laid_out")
            if laid_out is None:  # not rl-kernels' head: verl's own step, which refuses before its model runs
                return forward_step(self, iter([batch]), model, logits_processor_func, postprocess_micro_batch_func)
            output["sum_pi_squared"] = laid_out
        return output, postprocess

    wrapper._rl_kernels_original = forward_step
    return wrapper


def wrap_engine_sum_pi_squared(fused_modules) -> tuple:
    """Lift verl's refusal of ``calculate_sum_pi_squared=True`` with ``use_fused_kernels=True`` on
    the Megatron engine (:func:`_lifting_forward_step`), where the fused forward module
    (``model_forward_fused``, among ``fused_modules``) lays out its outputs with a by-name
    ``postprocess_thd_engine`` and the engine's ``forward_step`` has the parameters used here.
    Returns (wrapped?, the report's wording)."""
    fused = next((m for m in fused_modules if m.__name__ == FUSED_MODULES[0]), None)
    try:
        engine_module = importlib.import_module(ENGINE_MODULE)
    except ImportError as exc:
        return False, f"not patched (verl's Megatron engine not importable: {exc})"
    engine = getattr(engine_module, "MegatronEngineWithLMHead", None)
    method = vars(engine).get("forward_step") if engine is not None else None
    expected = ["self", "batch_iter", "model", "logits_processor_func", "postprocess_micro_batch_func"]
    if method is None or list(inspect.signature(method).parameters) != expected:
        return False, (f"not patched (verl's MegatronEngineWithLMHead.forward_step is missing or has other "
                       f"parameters than {expected}): verl's own refusal stays")
    if fused is None or not callable(getattr(fused, POSTPROCESS, None)):
        return False, f"not patched ({FUSED_MODULES[0]} has no {POSTPROCESS}): verl's own refusal stays"
    set_attr(fused, POSTPROCESS, _laying_out_sum_pi_squared(getattr(fused, POSTPROCESS)))
    set_attr(engine, "forward_step", _lifting_forward_step(method))
    return True, (f"calculate_sum_pi_squared=True with use_fused_kernels=True computed by rl-kernels' fused head "
                  f"in the same pass (vocab-parallel over the TP group); verl's refusal lifted "
                  f"(MegatronEngineWithLMHead.forward_step), laid out by verl's {POSTPROCESS} "
                  f"({FUSED_MODULES[0]}.{POSTPROCESS})")


def _make_gather(original):
    """``gather_from_sequence_parallel_region`` that tags its output when its backward sums dh."""
    from megatron.core import parallel_state

    @functools.wraps(original)
    def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None,
                                             output_split_sizes=None, use_global_buffer=False):
        out = original(input_, tensor_parallel_output_grad, group, output_split_sizes, use_global_buffer)
        if tensor_parallel_output_grad and isinstance(out, torch.Tensor):
            # backward: reduce-scatter over `group`, i.e. the partial dh of the ranks is summed
            out._rl_kernels_dh_summed = True
            out._rl_kernels_dh_group = group if group is not None else \
                parallel_state.get_tensor_model_parallel_group()
        return out

    gather_from_sequence_parallel_region._rl_kernels_original = original
    return gather_from_sequence_parallel_region


# ----------------------------------------------------------------------------- patch
def patch(*, logits_path: bool, fused_path: bool, sum_pi_squared: bool) -> dict:
    """Patch verl's Megatron paths. Returns ``{part: (replaced?, what)}`` for the parts
    "Megatron logits path", "Megatron fused path", "Megatron fused sum_pi_squared" and
    "sum_pi_squared (Megatron)" of the report
    (False where the caller's switch is off: the caller words those). Raises VerlIntegrationError
    when a signature differs (the caller rolls back). Nothing is patched when ``megatron.core``
    is not importable."""
    parts = ("Megatron logits path", "Megatron fused path", FUSED_SUM_PI_SQUARED_PART, "sum_pi_squared (Megatron)")
    try:
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.tensor_parallel as mcore_tp
    except ImportError as exc:
        logger.info("rl_kernels: megatron.core is not importable (%s): verl's Megatron engine is not "
                    "patched", exc)
        return dict.fromkeys(parts, (False, f"not patched (megatron.core not importable: {exc})"))
    report = dict.fromkeys(parts, (False, "off"))
    tensor_parallel, missing = _engine_functions()
    if missing:  # a verl whose Megatron engine predates what is replaced here (verl 0.7.x, 0.8.x)
        why = (f"not patched (this verl has no {', '.join(missing)}: rl-kernels serves the Megatron engine "
               f"of a verl that has every function it replaces there)")
        return dict.fromkeys(parts, (False, why))
    if logits_path or sum_pi_squared:
        names = (LOGITS_FUNCTIONS if logits_path else ()) + ((SUM_PI_SQUARED_FUNCTION,) if sum_pi_squared else ())
        for name in names:
            check_signature(name, getattr(tensor_parallel, name), EXPECTED_SIGNATURES[name])
        if logits_path:
            places = replace_by_name(tensor_parallel, LOGITS_REPLACEMENTS)
            report["Megatron logits path"] = (True, f"{', '.join(LOGITS_FUNCTIONS)} in {TENSOR_PARALLEL_MODULE} "
                                              f"and {len(places)} by-name import(s) "
                                              f"({', '.join(places) or 'none loaded yet'})")
        if sum_pi_squared:
            places = replace_by_name(tensor_parallel, {SUM_PI_SQUARED_FUNCTION: vocab_parallel_sum_pi_squared})
            report["sum_pi_squared (Megatron)"] = (True, f"{SUM_PI_SQUARED_FUNCTION} in {TENSOR_PARALLEL_MODULE} "
                                                   f"and {len(places)} by-name import(s) "
                                                   f"({', '.join(places) or 'none loaded yet'})")
    if fused_path:
        report["Megatron fused path"], report[FUSED_SUM_PI_SQUARED_PART] = _patch_fused(mcore_tp)
    return report


def _engine_functions():
    """(verl's ``tensor_parallel`` module or None, the names of the functions this patch replaces
    that the installed verl lacks): the Megatron part is applied only where none is missing."""
    missing = []
    try:
        tensor_parallel = importlib.import_module(TENSOR_PARALLEL_MODULE)
    except ImportError:
        tensor_parallel = None
        missing.append(TENSOR_PARALLEL_MODULE)
    else:
        missing += [f"{TENSOR_PARALLEL_MODULE}.{name}" for name in LOGITS_FUNCTIONS + (SUM_PI_SQUARED_FUNCTION,)
                    if not hasattr(tensor_parallel, name)]
    try:
        lce_module = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    except ImportError:
        missing.append("verl.utils.kernel.linear_cross_entropy")
    else:
        if not hasattr(lce_module, "LinearCrossEntropy"):
            missing.append("verl.utils.kernel.linear_cross_entropy.LinearCrossEntropy")
    return tensor_parallel, missing


def _patch_fused(mcore_tp) -> tuple:
    """((replaced?, what) of the fused path, (replaced?, what) of Σπ² on it)."""
    from verl.utils.kernel import linear_cross_entropy as lce_module

    check_signature("LinearCrossEntropy.forward", lce_module.LinearCrossEntropy.forward,
                    EXPECTED_SIGNATURES["LinearCrossEntropy.forward"])
    original_gather = getattr(mcore_tp, GATHER)
    check_signature(GATHER, original_gather, EXPECTED_SIGNATURES[GATHER], package="megatron-core")
    modules, skipped = [], []
    for name in FUSED_MODULES:
        try:
            modules.append(importlib.import_module(name))
        except ImportError as exc:
            skipped.append(f"{name} ({exc})")
    for mod in modules:
        if getattr(mod, "linear_cross_entropy", None) is not lce_module.linear_cross_entropy:
            raise VerlIntegrationError(f"rl_kernels.integrations.verl: verl {verl_version()} changed "
                                       f"{mod.__name__}: it no longer binds verl.utils.kernel.linear_cross_entropy."
                                       f"linear_cross_entropy by name; update rl-kernels")
    if not modules:
        logger.info("rl_kernels: verl's Megatron fused forwards are not importable (%s): the Megatron "
                    "fused path is not patched", "; ".join(skipped))
        return ((False, f"not patched ({'; '.join(skipped)})"),) * 2
    gather = _make_gather(original_gather)
    places = []
    # models whose logits are not output_layer(hidden) are refused where verl sets up / runs the fused path
    for mod in modules:
        for fn_name in ("patch_fused_forward", "gptmodel_forward_1f1b_overlap"):
            fn = vars(mod).get(fn_name)
            if fn is not None and "model" in inspect.signature(fn).parameters:
                replace_by_name(mod, {fn_name: _checking(fn, "model")})
                places.append(f"{mod.__name__}.{fn_name} (output layer checked)")
    for mod in modules:
        set_attr(mod, "linear_cross_entropy", linear_cross_entropy)
        places.append(f"{mod.__name__}.linear_cross_entropy")
        if getattr(mod, GATHER, None) is original_gather:  # model_forward_fused binds it by name
            set_attr(mod, GATHER, gather, restore_imports=True)
    # the 1F1B-overlap postprocess imports it from megatron.core.tensor_parallel at call time
    set_attr(mcore_tp, GATHER, gather, restore_imports=True)
    line = (f"{', '.join(places)} (dh over the TP group summed by gather_from_sequence_parallel_region under "
            f"sequence parallelism, else all-reduced by rl-kernels); {_wrap_engine_entropy_requests()}")
    if skipped:
        line += f"; not importable, not patched: {'; '.join(skipped)}"
    return (True, line), wrap_engine_sum_pi_squared(modules)
