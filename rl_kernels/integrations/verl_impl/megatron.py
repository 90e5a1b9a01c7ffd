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

Under ``loss_rows_only`` the model's output layer ran on the loss rows only and the logits are 0
elsewhere (:func:`.megatron_step.select_hidden_rows`): each function computes the loss rows and
returns 0 elsewhere (:func:`~.logits_path.on_loss_rows`).

float32 outputs of shape ``logits.shape[:-1]``, differentiable, and none of them writes into the
logits (verl's Megatron cross-entropy does, which is why verl clones the logits first; that
clone stays verl's). Logits outside rl-kernels' kernels (float64, integer, empty, ...), labels in no
vocabulary shard (-100 included) or of another shape, and chunked-entropy logits of fewer than 3
dims go to verl's own function (:func:`~.patch_state.verl_fallback`).

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

**What a micro-batch asks beyond that** (Σπ², which verl's engine refuses with fused kernels;
top-K distillation, which verl's fused forward does not compute; a per-sample temperature, which
verl refuses there; ``loss_rows_only``): the micro-batch's step request, built and carried through
verl's engine by :mod:`.megatron_step` (one wrapper per verl target: ``forward_step``,
``_resolve_fused_temperature``, ``preprocess_thd_engine``, ``postprocess_thd_engine``, the fused
forward factory; the combinations decided in :func:`.megatron_step.step_for`), installed from
:func:`_patch_fused`. :func:`linear_cross_entropy` reads it: the per-token inputs laid out for its
labels, Σπ² and the distillation terms computed in the same pass and delivered to the step, and
with ``loss_rows_only`` the head on the loss rows only.

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
``tests/integrations/test_verl_megatron.py`` checks both cases through verl's own ``fused_output_processor``
(each rank's dh equals the unsharded float64 gradient, or its rows of it).

Skipped, with an INFO line, when ``megatron.core`` is not importable, and not applied (the report
says which functions are missing) when the installed verl lacks any function replaced here:
verl 0.7.x has no ``vocab_parallel_sum_pi_squared``, 0.7.x and 0.8.x no
``vocab_parallel_entropy_with_chunking``; verl 0.9.x and verl's main branch have all of them.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import logging
import numbers

import torch

import rl_kernels

from ...core._logging import log_once, logger
from . import megatron_step, settings
from .patch_state import (VerlIntegrationError, check_chunk_size, check_signature, count, entropy_placeholder,
                          entropy_wanted, log_head_precision, loss_row_index, outside_labels, record, replace_by_name,
                          scatter_rows, select_rows, set_attr, verl_fallback, verl_version)
from .distill_losses import MEGATRON_MODULE as MEGATRON_DISTILLATION_MODULE
from .distill_losses import NOT_IN_THIS_VERL
from .logits_path import capture_logits, on_loss_rows
from .megatron_step import ENGINE, head_inputs, serve_megatron_topk
from .settings import options
from .signatures import has_module

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
    group (the whole vocabulary), written by the group's rank 0 (:func:`~.logits_path.capture_logits`)."""
    capture_logits(f"{function} (Megatron logits path)", logits, labels, log_probs=log_probs, entropy=entropy,
                   process_group=kwargs.get("process_group"))


def _rows(t) -> int:
    return t.shape[:-1].numel()


# ----------------------------------------------------------------------------- logits path
def _vocab_parallel_log_probs_domain(arguments) -> str | None:
    """Calls of ``vocab_parallel_log_probs_from_logits`` that go to verl's own function (the
    differential probe): labels of :func:`~.patch_state.outside_labels` against the whole vocabulary
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


@on_loss_rows(with_labels=True)
@verl_fallback(TENSOR_PARALLEL_MODULE, "vocab_parallel_log_probs_from_logits", _vocab_parallel_log_probs_domain)
def vocab_parallel_log_probs_from_logits(logits, labels):
    """rl-kernels replacement for verl's ``vocab_parallel_log_probs_from_logits`` (float32,
    shape ``labels.shape``; the logits are left untouched)."""
    kwargs = _shard_kwargs(logits)
    out = rl_kernels.log_probs_from_logits(logits, labels, **kwargs)
    record("megatron_logits_log_probs_calls", "logits megatron", labels.numel())
    _capture("vocab_parallel_log_probs_from_logits", logits, kwargs, labels, log_probs=out)
    return out


def _entropy(function: str, logits):
    kwargs = _shard_kwargs(logits)
    out = rl_kernels.entropy_from_logits(logits, **kwargs)
    record("megatron_logits_entropy_calls", "logits megatron", _rows(logits))
    _capture(function, logits, kwargs, entropy=out)
    return out


@on_loss_rows(with_labels=False)
@verl_fallback(TENSOR_PARALLEL_MODULE, "vocab_parallel_entropy")
def vocab_parallel_entropy(vocab_parallel_logits):
    """rl-kernels replacement for verl's ``vocab_parallel_entropy`` (float32, non-destructive)."""
    return _entropy("vocab_parallel_entropy", vocab_parallel_logits)


@on_loss_rows(with_labels=False)
@verl_fallback(TENSOR_PARALLEL_MODULE, "vocab_parallel_entropy_with_chunking",
               _vocab_parallel_chunked_entropy_domain)
def vocab_parallel_entropy_with_chunking(vocab_parallel_logits, chunk_size=2048):
    """rl-kernels replacement for verl's ``vocab_parallel_entropy_with_chunking``; rl-kernels
    always chunks (by elements), so ``chunk_size`` is only validated."""
    check_chunk_size(chunk_size)
    return _entropy("vocab_parallel_entropy_with_chunking", vocab_parallel_logits)


@on_loss_rows(with_labels=False)
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
    kernel pairs them. temperature: a number or a one-element tensor (inside a fused micro-batch
    of verl's Megatron engine with a per-sample temperature, verl's stand-in 1.0: the per-token
    temperature laid out in the step request is used instead, :func:`~.megatron_step.head_inputs`).
    Returns float32 ``(log_probs, entropy)`` shaped like ``labels``. dh over the TP group: see the
    module docstring (``reduce_hidden_grad`` unless ``hidden`` is the output of
    ``gather_from_sequence_parallel_region``).

    Inside a fused micro-batch of verl's Megatron engine it reads the step request
    (:mod:`.megatron_step`, which builds it): no entropy where verl's ``calculate_entropy`` is
    False (NaN returned; verl drops it); Σπ² in the same pass where the step asks it (over the
    whole vocabulary, merged over the TP group like the log-probs); verl's top-K distillation terms
    from the same head where the step carries the teacher's tensors
    (:func:`~.megatron_step.serve_megatron_topk`); with ``loss_rows_only``, the head runs on the
    rows of the laid-out loss mask alone (every TP rank selects the same rows, so the TP
    collectives stay matched, also with 0 rows) and every output is scattered back (0 and no
    gradient outside, counted as ``loss_rows_skipped_tokens``). It delivers its log-probs and those
    per-row outputs to the step (:meth:`~.patch_state.StepRequest.deliver`), where verl's
    ``postprocess_thd_engine`` lays them out.
    """
    if reduction != "none":
        raise ValueError(f"reduction: rl-kernels' linear_cross_entropy returns per-token log-probs and "
                         f"entropy (reduction='none', what verl's Megatron fused forward passes), got "
                         f"{reduction!r}")
    step, inputs = head_inputs(labels)
    temperature = inputs["temperature"] if "temperature" in inputs else _temperature(temperature)
    if _rows(hidden) != labels.numel():
        raise ValueError(f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)}: expected "
                         f"hidden.shape[:-1].numel() == labels.numel()")
    if weight.dtype != hidden.dtype:
        log_once(logging.INFO, f"rl_kernels: output weight {weight.dtype} is cast to the hidden_states "
                 f"dtype {hidden.dtype} for the fused head (Megatron)")
        weight = weight.to(hidden.dtype)
    log_head_precision(hidden.dtype, "Megatron")
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
    rows = labels.numel()
    h2, labels1 = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    per_row = {key: value for key, value in inputs.items() if key != "loss_rows"}
    if isinstance(temperature, torch.Tensor):
        per_row["temperature"] = temperature.reshape(-1)
    index = None
    if "loss_rows" in inputs:  # loss_rows_only: the head runs on the loss rows alone
        index = loss_row_index(inputs["loss_rows"], labels)
        h2, labels1 = h2.index_select(0, index.to(h2.device)), labels1.index_select(0, index.to(labels1.device))
        per_row = {key: select_rows(value, index, rows) for key, value in per_row.items()}
        count("loss_rows_skipped_tokens", rows - index.numel())
    temperature = per_row.pop("temperature", temperature)
    if "teacher_ids" in per_row:  # top-K distillation in the same head (verl's keys)
        log_probs, entropy, outputs = serve_megatron_topk(
            step.distillation, per_row["teacher_log_probs"], per_row["teacher_ids"], per_row["teacher_rows"], h2,
            weight, labels1, temperature=temperature, return_entropy=return_entropy, backend=backend,
            tp_kwargs=kwargs)
    else:
        out = rl_kernels.linear_log_probs(h2, weight, labels1, temperature=temperature, return_entropy=return_entropy,
                                          return_sum_pi_squared=step.sum_pi_squared, backend=backend, **kwargs)
        log_probs, entropy = out.log_probs, out.entropy
        outputs = {"sum_pi_squared": out.sum_pi_squared} if step.sum_pi_squared else {}
    record("fused_megatron_calls", "fused megatron", labels.numel())
    capture = settings.capture()
    if capture is not None:  # the rows computed, the weight gathered over the TP group (written by its rank 0)
        capture.check(h2, weight, labels1, temperature=temperature, ignore_index=-100, log_probs=log_probs,
                      entropy=entropy if return_entropy else None, process_group=kwargs.get("process_group"),
                      metadata={"function": "verl linear_cross_entropy (Megatron fused path)"})
    if index is not None:  # back to verl's rows: 0 (and no gradient) outside the loss
        log_probs, entropy = (None if t is None else scatter_rows(t, index, labels.shape) for t in (log_probs, entropy))
        outputs = {key: scatter_rows(value, index, labels.shape) for key, value in outputs.items()}
    log_probs = log_probs.view(labels.shape)
    entropy = entropy.view(labels.shape) if return_entropy else entropy_placeholder(log_probs)
    if step.engine == ENGINE:  # a fused micro-batch of verl's Megatron engine: its postprocess lays these out
        step.deliver(log_probs, **{key: value.view(labels.shape) for key, value in outputs.items()})
    if step.sum_pi_squared and "sum_pi_squared" in outputs:
        count("fused_sum_pi_squared_calls")
    return log_probs, entropy


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
    "Megatron logits path", "Megatron fused path", "sum_pi_squared (Megatron)" and those of
    :mod:`.megatron_step` ("Megatron fused sum_pi_squared", "Megatron fused per-sample
    temperature", "distillation (Megatron fused path)") of the report (False where the caller's
    switch is off: the caller words those). Raises VerlIntegrationError when a signature differs
    (the caller rolls back). Nothing is patched when ``megatron.core`` is not importable."""
    parts = ("Megatron logits path", "Megatron fused path", "sum_pi_squared (Megatron)") + megatron_step.PARTS
    try:
        import megatron.core.parallel_state  # noqa: F401
        import megatron.core.tensor_parallel as mcore_tp
    except ImportError as exc:
        logger.info("rl_kernels: megatron.core is not importable (%s): verl's Megatron engine is not "
                    "patched", exc)
        return _not_patched(parts, f"not patched (megatron.core not importable: {exc})")
    report = dict.fromkeys(parts, (False, "off"))
    tensor_parallel, missing = _engine_functions()
    if missing:  # a verl whose Megatron engine predates what is replaced here (verl 0.7.x, 0.8.x)
        return _not_patched(parts, f"not patched (this verl has no {', '.join(missing)}: rl-kernels serves the "
                                   f"Megatron engine of a verl that has every function it replaces there)")
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
        report["Megatron fused path"], step_parts = _patch_fused(mcore_tp, logits_path)
    else:  # the engine's forward_step still says (once) that a fused top-K batch gets no distillation outputs
        _, step_parts = megatron_step.install(head=False, logits_path=logits_path)
    report.update(step_parts)
    return report


def _not_patched(parts, why: str) -> dict:
    """Every part not patched for ``why`` (the distillation part: not in a verl without distillation)."""
    report = dict.fromkeys(parts, (False, why))
    if not has_module(MEGATRON_DISTILLATION_MODULE):
        report[megatron_step.DISTILLATION_PART] = (False, NOT_IN_THIS_VERL)
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


def _patch_fused(mcore_tp, logits_path: bool) -> tuple:
    """((replaced?, what) of the fused path, ``{part: (served?, what)}`` of :mod:`.megatron_step`'s
    parts): rl-kernels' head where verl's fused forwards call ``linear_cross_entropy``, then the
    step request's wrappers (:func:`.megatron_step.install`)."""
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
        why = f"not patched ({'; '.join(skipped)})"
        _, parts = megatron_step.install(head=False, logits_path=logits_path)
        return (False, why), {**parts, megatron_step.FUSED_SUM_PI_SQUARED_PART: (False, why),
                              megatron_step.TEMPERATURE_PART: (False, why)}
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
    fused = next((m for m in modules if m.__name__ == FUSED_MODULES[0]), None)
    entropy, parts = megatron_step.install(head=True, fused_module=fused, logits_path=logits_path)
    line = (f"{', '.join(places)} (dh over the TP group summed by gather_from_sequence_parallel_region under "
            f"sequence parallelism, else all-reduced by rl-kernels); {entropy}")
    if skipped:
        line += f"; not importable, not patched: {'; '.join(skipped)}"
    return (True, line), parts
