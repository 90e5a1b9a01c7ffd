"""verl integration: importing this module patches verl to compute log-probs and entropy with rl-kernels.

Turn it on in a verl run with overrides only (see ``integrations/verl/README.md`` and the Hydra group in ``rl_kernels/integrations/conf/``)::

    actor_rollout_ref.model.external_lib=rl_kernels.integrations.verl
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=rl_kernels

Supported: verl 0.7.0 to 0.9.x (:data:`SUPPORTED_VERL`; tested on 0.7.1, 0.8.0 and 0.9.1, see the
table in ``integrations/verl/README.md``). verl 0.8+ imports ``external_lib`` in
``HFModelConfig.__post_init__``, verl 0.7.x's legacy workers (``fsdp_workers``) in ``init_model``;
either way inside every Ray worker, before it builds the model. The import calls :func:`patch`, which

* **FSDP fused path** (``use_fused_kernels=True``): registers a new ``impl_backend`` name,
  ``rl_kernels``. ``verl.models.transformers.monkey_patch.patch_forward_with_backends`` accepts
  it and installs verl's own fused forward for the model class (``dense_common`` for text models,
  the ``qwen2_vl`` / ``qwen3_vl`` / ``glm4v`` / ``qwen3_5`` variants for VLMs), so label rolling,
  ``shift_labels`` precedence (verl #6068), ``temperature``, shapes with rmpad on and off and the
  ``CausalLMOutputForPPO`` output stay verl's. The model is marked (``_rl_kernels_fused``) and
  its class forward wrapped: inside a marked model's forward, the ``FusedLinearForPPO`` that
  verl's forward builds (bare on verl 0.7.x / 0.8.0, with ``impl_backend=<the model's backend>``
  on 0.9.x) goes to :func:`rl_kernels.linear_log_probs`. verl's fused forwards always ask for
  entropy (verl #2608); rl-kernels computes it only when the micro-batch's ``calculate_entropy``
  asks (read in the FSDP engine's ``forward_step``, or verl 0.7.x's
  ``DataParallelPPOActor._forward_micro_batch``), and otherwise hands verl a NaN placeholder, which
  verl drops. A forward without ``shift_labels`` (verl 0.7.x) under Ulysses
  sequence parallelism is refused with :class:`VerlIntegrationError` (labels rolled per shard,
  verl #3512, #3723), at ``DataParallelPPOActor`` construction and at the forward. verl's ``triton``, ``torch`` and ``liger`` backends
  are left untouched, so they stay available for comparison. verl prints "Using Torch backend"
  for such a model (its torch-backend forward is reused); this module then logs the real backend.
* **FSDP logits path** (``use_fused_kernels=False``): replaces ``logprobs_from_logits``,
  ``entropy_from_logits`` and ``entropy_from_logits_with_chunking`` in
  ``verl.utils.torch_functional`` and in every loaded module that imported them by name, with
  :mod:`rl_kernels.logits` (chunked float32; O(N) saved state; float32 outputs, where verl's
  non-flash-attn path returns the logits dtype). Modules imported later get the patched functions
  from ``verl.utils.torch_functional`` itself. Patch before verl's engine is built (verl's import
  of ``external_lib`` does): the FSDP engine caches ``entropy_from_logits`` at construction.
  ``calculate_sum_pi_squared_from_logits`` (the FSDP engine's sum of squared probabilities) goes
  to ``rl_kernels.sum_pi_squared_from_logits`` the same way. On verl 0.7.x the legacy actor,
  ``DataParallelPPOActor``, imports ``logprobs_from_logits`` by name (patched) and caches
  ``torch.compile`` of the entropy / Σπ² functions in ``__init__``: the wrapped ``__init__``
  replaces those caches by rl-kernels' functions.
* **Megatron engine** (:mod:`rl_kernels.integrations.verl_megatron`, verl 0.9.x only, when
  ``megatron.core`` is importable): verl's vocab-parallel from-logits functions (logits path) and the
  ``linear_cross_entropy`` of its Megatron fused forwards (fused path), on the tensor-parallel
  group, with the hidden-state gradient summed exactly once over that group.

:func:`patch` logs, per engine, exactly what it replaced (also :func:`report`); when verl builds
an engine, the engine is named once, with a warning if rl-kernels does not serve it (VeOmni,
torchtitan, Automodel, ...). :func:`call_counts` counts the calls per consumer, and after the
first :data:`SUMMARY_AFTER_CALLS` calls one INFO line says how many tokens went through which path.

Options come from ``actor_rollout_ref.model.fused_kernel_options.rl_kernels`` (a dict; keys in
:class:`VerlOptions`) of the config in scope when verl imports this module (the ``HFModelConfig``,
or the verl 0.7.x legacy worker's ``self.config.model``) and of every later ``HFModelConfig``,
or from :func:`configure`. The patch is idempotent, :func:`unpatch` undoes it, it logs once what
it patched with the verl version, and it raises :class:`VerlIntegrationError` when verl's
functions do not have the signatures of its table for the installed minor release (:data:`SIGNATURES`).
"""
from __future__ import annotations

import dataclasses
import contextvars
import functools
import inspect
import logging
import sys
import threading

import torch

import rl_kernels

from .._logging import log_once, logger
from ..anomaly import AnomalyCapture
from ..validation import check_bool_arg, check_choice, check_float_arg, check_int_arg, check_path_arg, check_temperature
from ..backends import BACKENDS
from ..linear import linear_log_probs
from ..logits import entropy_from_logits as _rk_entropy_from_logits
from ..logits import log_probs_from_logits as _rk_log_probs_from_logits
from . import verl_megatron
from .lm_heads import HeadTransform, head_transform
from ._verl_common import (SUMMARY_AFTER_CALLS, SUPPORTED_VERL, VerlIntegrationError, call_counts,  # noqa: F401
                           check_signature, entropy_on_request, entropy_placeholder, entropy_wanted, record,
                           replace_by_name, restore, set_attr, verl_version)
from ._verl_common import signature as _signature

BACKEND_NAME = "rl_kernels"
"""The ``fused_kernel_options.impl_backend`` value that selects rl-kernels."""

LOGITS_FUNCTIONS = ("logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking")
SUM_PI_SQUARED_FUNCTION = "calculate_sum_pi_squared_from_logits"
SERVED_ENGINES = {"verl.workers.engine.fsdp.transformer_impl": "FSDP",
                  "verl.workers.engine.megatron.transformer_impl": "Megatron"}
"""verl engine modules whose engines (and their subclasses: fsdp_turbo, MindSpeed) rl-kernels serves."""

# parameter names (with defaults) this patch was written against, per verl minor release (the
# installed wheels of verl 0.7.1, 0.8.0 and 0.9.1); a release whose functions differ raises
# VerlIntegrationError and the patch rolls back
_SIGNATURES_0_9 = {
    "patch_forward_with_backends": ["model", "use_fused_kernels=False", "fused_kernels_backend=None"],
    "FusedLinearForPPO.__init__": ["self", "chunk_size=512", "impl_backend='torch'"],
    "FusedLinearForPPO.forward": ["self", "hidden_states", "vocab_weights", "input_ids", "temperature=1.0"],
    "logprobs_from_logits": ["logits", "labels", "inplace_backward=True"],
    "entropy_from_logits": ["logits"],
    "entropy_from_logits_with_chunking": ["logits", "chunk_size=2048"],
    "calculate_sum_pi_squared_from_logits": ["logits"],
    "EngineRegistry.get_engine_cls": ["cls", "model_type", "backend"],
}
# verl 0.8.0: engine workers; FusedLinearForPPO takes no impl_backend (verl builds it bare)
_SIGNATURES_0_8 = {**_SIGNATURES_0_9, "FusedLinearForPPO.__init__": ["self", "chunk_size=512"]}
# verl 0.7.x: also the legacy workers' DataParallelPPOActor (by-name imports, compiled caches)
_SIGNATURES_0_7 = {**_SIGNATURES_0_8,
                   "DataParallelPPOActor.__init__": ["self", "config", "actor_module", "actor_optimizer=None"]}
SIGNATURES = {"0.7": _SIGNATURES_0_7, "0.8": _SIGNATURES_0_8, "0.9": _SIGNATURES_0_9}
"""verl minor release -> {label: expected parameters}."""


def verl_minor(version: str | None = None) -> str:
    """``"0.7"``, ``"0.8"`` or ``"0.9"`` for the installed (or given) verl version."""
    version = version or verl_version()
    return ".".join(version.split(".")[:2])


def _expected_signatures() -> dict:
    return SIGNATURES[verl_minor()]


_CAPTURE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AnomalyCapture)}


@dataclasses.dataclass
class VerlOptions:
    """Options under ``fused_kernel_options.rl_kernels`` (all optional).

    backend: ``auto`` (Triton on CUDA, torch otherwise), ``triton`` or ``torch``, passed to
        :func:`rl_kernels.linear_log_probs` on the fused paths (FSDP and Megatron).
    patch_logits_path: replace verl's from-logits functions (``use_fused_kernels=False`` path:
        FSDP and Megatron engines, and the sum-of-squared-probabilities functions).
    patch_megatron_fused: replace ``linear_cross_entropy`` in verl's Megatron fused forwards
        (``use_fused_kernels=True`` with the Megatron engine); False keeps verl's kernel there.
    anomaly_dir: turn on anomaly capture (:mod:`rl_kernels.anomaly`), writing samples here.
    anomaly_max_count, anomaly_max_bytes: per-process bounds on what capture writes.
    anomaly_max_log_prob: a log-prob above this is an anomaly.
    anomaly_recheck_every: every k-th fused call re-checks sampled rows in float32 (0 = never).
    anomaly_recheck_rows, anomaly_recheck_tolerance: rows per re-check and allowed difference (nats).
    """

    backend: str = "auto"
    patch_logits_path: bool = True
    patch_megatron_fused: bool = True
    anomaly_dir: str | None = None
    # the capture settings' defaults are AnomalyCapture's own (one place)
    anomaly_max_count: int = _CAPTURE_DEFAULTS["max_count"]
    anomaly_max_bytes: int = _CAPTURE_DEFAULTS["max_bytes"]
    anomaly_max_log_prob: float = _CAPTURE_DEFAULTS["max_log_prob"]
    anomaly_recheck_every: int = _CAPTURE_DEFAULTS["recheck_every"]
    anomaly_recheck_rows: int = _CAPTURE_DEFAULTS["recheck_rows"]
    anomaly_recheck_tolerance: float = _CAPTURE_DEFAULTS["recheck_tolerance"]

    def __post_init__(self):
        """Validate every option (type, range, NaN): TypeError / ValueError naming it."""
        def name(field: str) -> str:
            return f"fused_kernel_options.rl_kernels.{field}"

        check_choice(name("backend"), self.backend, BACKENDS)
        check_bool_arg(name("patch_logits_path"), self.patch_logits_path)
        check_bool_arg(name("patch_megatron_fused"), self.patch_megatron_fused)
        if self.anomaly_dir is not None:  # None: no capture
            check_path_arg(name("anomaly_dir"), self.anomaly_dir)
        for field in ("anomaly_max_count", "anomaly_max_bytes", "anomaly_recheck_every",
                      "anomaly_recheck_rows"):
            check_int_arg(name(field), getattr(self, field))
        # log-probs are <= 0: a negative bound would flag every call
        check_float_arg(name("anomaly_max_log_prob"), self.anomaly_max_log_prob)
        check_float_arg(name("anomaly_recheck_tolerance"), self.anomaly_recheck_tolerance,
                        inclusive=False)


_lock = threading.RLock()
_options = VerlOptions()
_capture: AnomalyCapture | None = None
_patched = False
_model_names: list[str] = []
_report: dict = {}           # part ("FSDP fused path", ...) -> (replaced?, what), of the last patch()


def options() -> VerlOptions:
    """The options in effect in this process."""
    return _options


def configure(**kwargs) -> VerlOptions:
    """Set options (keys of :class:`VerlOptions`). Atomic: every value is validated (type, range,
    NaN) and the anomaly capture is built before anything changes, so a call that raises leaves
    the previous options in force. Unknown keys raise ValueError naming them; bad values
    TypeError / ValueError naming the option."""
    global _options, _capture
    fields = {f.name for f in dataclasses.fields(VerlOptions)}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"fused_kernel_options.rl_kernels: unknown option(s) {unknown}; "
                         f"expected some of {sorted(fields)}")
    with _lock:
        new = dataclasses.replace(_options, **kwargs)  # validates (VerlOptions.__post_init__)
        if new == _options:
            return _options
        capture = None
        if new.anomaly_dir:
            settings = {k.removeprefix("anomaly_"): v for k, v in dataclasses.asdict(new).items()
                        if k.startswith("anomaly_") and k != "anomaly_dir"}
            capture = AnomalyCapture(directory=str(new.anomaly_dir), **settings, metadata={
                "verl_version": verl_version(), "source": "rl_kernels.integrations.verl"})
        # nothing above changed the module state; commit
        for field in ("patch_logits_path", "patch_megatron_fused"):
            if _patched and getattr(new, field) != getattr(_options, field):
                logger.warning("rl_kernels: %s=%s arrived after verl was patched; it takes effect at the "
                               "next patch() (call unpatch() and patch())", field, getattr(new, field))
        _options, _capture = new, capture
        logger.info("rl_kernels verl options: %s", new)
    return _options


def _plain(value):
    """OmegaConf / mapping values to plain Python (without importing omegaconf)."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def configure_from_model_config(model_config) -> None:
    """Apply ``model_config.fused_kernel_options['rl_kernels']`` (a verl ``HFModelConfig``, or the
    ``model`` section of a verl 0.7.x legacy worker's config: a DictConfig)."""
    fko = _plain(_get(model_config, "fused_kernel_options") or {})
    section = fko.get(BACKEND_NAME)
    if section is None:
        return
    if not isinstance(section, dict):
        raise ValueError(f"fused_kernel_options.rl_kernels: expected a mapping of options, got {section!r}")
    configure(**section)


def _model_config_in_import_stack():
    """The model config that is importing this module, if any: the ``HFModelConfig`` whose
    ``__post_init__`` imports ``external_lib`` (verl 0.8+ and 0.7's engine workers), or the model
    section (``self.config.model``) of the verl 0.7.x legacy worker (``fsdp_workers``'
    ``ActorRolloutRefWorker`` / ``CriticWorker``, or a subclass of one) whose ``init_model`` imports it."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if type(obj).__name__ == "HFModelConfig" and hasattr(obj, "fused_kernel_options"):
            return obj
        model = getattr(getattr(obj, "config", None), "model", None) if obj is not None else None
        if (model is not None and any(k.__module__.startswith("verl.workers.") for k in type(obj).__mro__)
                and _get(model, "external_lib") is not None and _get(model, "fused_kernel_options") is not None):
            return model
        frame = frame.f_back
    return None


def _get(config, key):
    """``config.key`` / ``config[key]`` / None, for dataclasses, dicts and OmegaConf nodes."""
    try:
        return config.get(key) if hasattr(config, "get") else getattr(config, key, None)
    except Exception:  # noqa: BLE001 - a struct OmegaConf node without the key
        return None


def _check_signature(label: str, fn) -> None:
    check_signature(label, fn, _expected_signatures()[label])


_set = set_attr


# ----------------------------------------------------------------------------- fused path
def _full_weight(weight, dtype):
    """The full lm_head weight in the compute dtype.

    Under FSDP2 verl shards an untied ``lm_head`` as its own unit, and the fused forward reads
    ``self.lm_head.weight`` outside that unit's forward: a sharded DTensor (verl's text-model
    fused forward is reported failing there with "mixed torch.Tensor and DTensor", verl #5633).
    It is gathered with ``full_tensor``; its gradient goes back as a partial sum averaged over the mesh (a
    reduce-scatter), as FSDP2 averages gradients. Under mixed precision the gathered weight is in
    the parameter dtype (float32) while ``hidden_states`` are in the compute dtype: it is cast.
    """
    try:
        from torch.distributed.tensor import DTensor, Partial
    except ImportError:  # torch without DTensor
        DTensor = None
    if DTensor is not None and isinstance(weight, DTensor):
        log_once(logging.INFO, "rl_kernels: lm_head.weight is a sharded DTensor (FSDP2); it is gathered "
                 "with full_tensor() per call and its gradient reduce-scattered (average)")
        weight = weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)
    if weight.dtype != dtype:
        log_once(logging.INFO, f"rl_kernels: lm_head.weight {weight.dtype} is cast to the hidden_states "
                 f"dtype {dtype} (mixed precision) for the fused head")
        weight = weight.to(dtype)
    return weight


def _head_temperature(temperature, head: HeadTransform) -> float:
    """verl's temperature with the model's logit multiplier folded in (``HeadTransform``): verl's
    value is checked with the usual rules first, then the effective one, whose error names both."""
    temperature = check_temperature(temperature)
    if head.multiplier == 1.0:
        return temperature
    effective = head.temperature(temperature)
    try:
        return check_temperature(effective)
    except ValueError as exc:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: temperature {temperature!r} with the model's "
                                   f"{head.description}: effective temperature {effective!r} is unusable ({exc})") from exc


def _fused_log_probs_entropy(hidden_states, vocab_weights, input_ids, temperature):
    if isinstance(temperature, torch.Tensor) and temperature.numel() == 1:
        temperature = temperature.item()
    head = _head.get() or HeadTransform()
    temperature = _head_temperature(temperature, head)
    vocab_weights = _full_weight(vocab_weights, hidden_states.dtype)
    return_entropy = entropy_wanted.get()
    out = linear_log_probs(hidden_states, vocab_weights, input_ids, temperature=temperature,
                           softcap=head.softcap, return_entropy=return_entropy, backend=_options.backend)
    record("fused_fsdp_calls", "fused fsdp", input_ids.numel())
    entropy = out.entropy if return_entropy else entropy_placeholder(out.log_probs)
    if _capture is not None:
        _capture.check(hidden_states, vocab_weights, input_ids, temperature=float(temperature),
                       softcap=head.softcap, ignore_index=-100, log_probs=out.log_probs, entropy=out.entropy,
                       metadata={"model": _model_names[-1] if _model_names else "unknown"})
    return out.log_probs, entropy


def _micro_batch_flag(arguments) -> bool:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=arguments["micro_batch"], key="calculate_entropy", default=False)


def _wrap_entropy_requests(dp_actor) -> str:
    """Install :func:`entropy_on_request` where this verl decides ``calculate_entropy``; returns
    what was wrapped (for the report) or why nothing was."""
    wrapped = []
    try:
        import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    except ImportError as exc:
        fsdp_impl = None
        log_once(logging.INFO, f"rl_kernels: verl's FSDP engine not importable ({exc})")
    engine = getattr(fsdp_impl, "FSDPEngineWithLMHead", None)
    method = vars(engine).get("forward_step") if engine is not None else None
    if method is not None and "micro_batch" in inspect.signature(method).parameters:
        _set(engine, "forward_step", entropy_on_request(method, _micro_batch_flag))
        wrapped.append("FSDPEngineWithLMHead.forward_step")
    if dp_actor is not None:
        method = vars(dp_actor.DataParallelPPOActor).get("_forward_micro_batch")
        if method is not None and "calculate_entropy" in inspect.signature(method).parameters:
            default = inspect.signature(method).parameters["calculate_entropy"].default
            _set(dp_actor.DataParallelPPOActor, "_forward_micro_batch", entropy_on_request(
                method, lambda arguments: arguments.get("calculate_entropy", default)))
            wrapped.append("DataParallelPPOActor._forward_micro_batch")
    if not wrapped:
        return "entropy always computed (no calculate_entropy hook found in this verl)"
    return "entropy only when verl's calculate_entropy asks (" + ", ".join(wrapped) + ")"


_serving = contextvars.ContextVar("rl_kernels_serving", default=False)
"""True while the forward of a model that rl-kernels serves runs (set by :func:`_serving_forward`)."""
_head = contextvars.ContextVar("rl_kernels_head", default=None)
"""The :class:`~rl_kernels.integrations.lm_heads.HeadTransform` of the model whose forward runs."""
_UNSET = object()


def _make_fused_linear_class(base):
    takes_backend = "impl_backend" in inspect.signature(base.__init__).parameters

    class FusedLinearForPPO(base):
        """verl's ``FusedLinearForPPO``, routed to :func:`rl_kernels.linear_log_probs` when it runs
        inside the forward of a model rl-kernels serves (any verl; 0.7.x and 0.8.0 build it bare,
        with no ``impl_backend``) or when built with ``impl_backend='rl_kernels'`` (verl 0.9.x)."""

        def __init__(self, chunk_size: int = 512, impl_backend=_UNSET):
            ours = impl_backend == BACKEND_NAME
            if impl_backend is _UNSET or (ours and not takes_backend):
                super().__init__(chunk_size=chunk_size)
            else:  # verl's own backends (0.9.x) are its business
                super().__init__(chunk_size=chunk_size, impl_backend="torch" if ours else impl_backend)
            if ours:
                self.impl_backend = BACKEND_NAME
            self._rl_kernels = ours

        def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
            if not (self._rl_kernels or _serving.get()):
                return super().forward(hidden_states, vocab_weights, input_ids, temperature)
            return _fused_log_probs_entropy(hidden_states, vocab_weights, input_ids, temperature)

    FusedLinearForPPO.__qualname__ = f"rl_kernels[{base.__qualname__}]"
    FusedLinearForPPO._rl_kernels_base = base
    return FusedLinearForPPO


def _ulysses_world_size() -> int:
    try:
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size
    except ImportError:
        return 1
    return get_ulysses_sequence_parallel_world_size()


def _refuse_ulysses(has_shift_labels: bool, size: int | None = None) -> None:
    """verl 0.7.x's fused forwards roll the labels of their own sequence shard under Ulysses
    sequence parallelism (wrong labels at shard boundaries: verl #3512, #3723; verl 0.8.0 passes
    globally rolled ``shift_labels``). rl-kernels refuses that combination rather than serve it."""
    if has_shift_labels:
        return
    size = _ulysses_world_size() if size is None else size
    if size > 1:
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: use_fused_kernels=True with Ulysses sequence parallelism "
            f"(ulysses_sequence_parallel_size={size}) is refused on verl {verl_version()}: its fused forward "
            f"rolls the labels of each sequence shard, so the label at every shard boundary is wrong "
            f"(verl #3512, #3723; fixed in verl 0.8.0 by shift_labels). Use verl>=0.8, "
            f"ulysses_sequence_parallel_size=1, or use_fused_kernels=False (rl-kernels' logits path).")


def _serving_forward(forward):
    """verl's fused forward for a model class, which routes the ``FusedLinearForPPO`` it builds to
    rl-kernels for the models marked ``_rl_kernels_fused`` (others run verl's forward unchanged)."""
    if getattr(forward, "_rl_kernels_serving", False):
        return forward
    has_shift_labels = "shift_labels" in inspect.signature(forward).parameters

    @functools.wraps(forward)
    def serving_forward(self, *args, **kwargs):
        if not getattr(self, "_rl_kernels_fused", False):
            return forward(self, *args, **kwargs)
        _refuse_ulysses(has_shift_labels)
        head = getattr(self, "_rl_kernels_head", None)
        if head is None:  # marked by other means than patch_forward_with_backends: audit now
            head = self._rl_kernels_head = head_transform(self)
        token, head_token = _serving.set(True), _head.set(head)
        try:
            return forward(self, *args, **kwargs)
        finally:
            _head.reset(head_token)
            _serving.reset(token)

    serving_forward._rl_kernels_serving = True
    serving_forward._rl_kernels_verl_forward = forward
    return serving_forward


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


def _make_patch_forward_with_backends(original):
    @functools.wraps(original)
    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if fused_kernels_backend != BACKEND_NAME:
            if use_fused_kernels:
                model._rl_kernels_fused = False
                _warn_unserved_head(model, fused_kernels_backend)
            return original(model, use_fused_kernels=use_fused_kernels,
                            fused_kernels_backend=fused_kernels_backend)
        cls = model.__class__.__name__
        if not use_fused_kernels:
            log_once(logging.INFO, f"rl_kernels: impl_backend='rl_kernels' with use_fused_kernels=False: "
                     f"{cls} keeps its logits forward; log-probs/entropy come from rl-kernels' from-logits "
                     f"functions" + ("" if _options.patch_logits_path else " (disabled by patch_logits_path)"))
            return original(model, use_fused_kernels=False, fused_kernels_backend=None)
        # what the model's own forward does between its last hidden state and its logits (soft-cap,
        # scale), or VerlIntegrationError for a model type that the audit refuses or does not list
        head = head_transform(model)
        # verl's torch-backend forward for this model class (label rolling, shift_labels,
        # temperature, rmpad shapes, CausalLMOutputForPPO stay verl's), wrapped so that the
        # FusedLinearForPPO it builds runs rl-kernels for this model: the model is marked, the
        # wrapper sees the mark (verl 0.7.x/0.8.0 never pass impl_backend to FusedLinearForPPO)
        original(model, use_fused_kernels=True, fused_kernels_backend="torch")
        model.__class__.forward = _serving_forward(model.__class__.forward)
        model._rl_kernels_fused = True
        model._rl_kernels_head = head
        model._verl_fused_kernels_backend = BACKEND_NAME
        name = getattr(getattr(model, "config", None), "name_or_path", "") or cls
        _model_names.append(str(name))
        logger.info("rl_kernels: %s.forward computes log_probs and entropy with rl_kernels.linear_log_probs "
                    "(backend=%s) through verl's fused forward (model %s, model type %s: %s)", cls,
                    _options.backend, name, getattr(model.config, "model_type", None), head.description)

    patch_forward_with_backends._rl_kernels_original = original
    return patch_forward_with_backends


# ----------------------------------------------------------------------------- logits path
def _viewable_2d(logits) -> bool:
    try:
        logits.view(-1, logits.shape[-1])
    except RuntimeError:
        return False
    return True


@torch.compiler.disable
def logprobs_from_logits(logits, labels, inplace_backward=True):
    """rl-kernels replacement for ``verl.utils.torch_functional.logprobs_from_logits``.

    Same arguments; float32 output of shape ``labels.shape``; ``inplace_backward=True`` writes
    the gradient into the logits' storage as verl's flash-attn path does (verl passes False when
    it also needs the logits for entropy). See :func:`rl_kernels.log_probs_from_logits`.
    """
    if inplace_backward and not _viewable_2d(logits):
        # verl's flash-attn path reshapes such logits (a copy, e.g. verl 0.7.x dp_actor's
        # logits[:, -response_length - 1:-1] slice) and writes the gradient into that copy:
        # the same as not writing in place
        inplace_backward = False
    out = _rk_log_probs_from_logits(logits, labels, inplace_backward=bool(inplace_backward))
    record("logits_log_probs_calls", "logits fsdp", labels.numel())
    return out


@torch.compiler.disable
def entropy_from_logits(logits):
    """rl-kernels replacement for ``verl.utils.torch_functional.entropy_from_logits`` (float32)."""
    out = _rk_entropy_from_logits(logits)
    record("logits_entropy_calls", "logits fsdp", logits.shape[:-1].numel())
    return out


@torch.compiler.disable
def entropy_from_logits_with_chunking(logits, chunk_size=2048):
    """rl-kernels replacement for ``entropy_from_logits_with_chunking``; rl-kernels always chunks
    (by elements, not rows), so ``chunk_size`` is only validated."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    out = _rk_entropy_from_logits(logits)
    record("logits_entropy_calls", "logits fsdp", logits.shape[:-1].numel())
    return out


@torch.compiler.disable
def calculate_sum_pi_squared_from_logits(logits):
    """rl-kernels replacement for ``verl.utils.torch_functional.calculate_sum_pi_squared_from_logits``:
    sum over the vocabulary of softmax(logits)^2 (float32, shape ``logits.shape[:-1]``)."""
    out = rl_kernels.sum_pi_squared_from_logits(logits)
    record("sum_pi_squared_calls", "sum_pi_squared fsdp", logits.shape[:-1].numel())
    return out


_REPLACEMENTS = {
    "logprobs_from_logits": logprobs_from_logits,
    "entropy_from_logits": entropy_from_logits,
    "entropy_from_logits_with_chunking": entropy_from_logits_with_chunking,
}


def _checked(torch_functional, names) -> None:
    for name in names:
        fn = getattr(torch_functional, name, None)
        if fn is None:
            raise VerlIntegrationError(f"rl_kernels.integrations.verl: verl.utils.torch_functional has no "
                                       f"{name} in verl {verl_version()}")
        _check_signature(name, fn)


def _patch_logits_path(torch_functional) -> list[str]:
    """Replace the three functions in ``torch_functional`` and wherever they were imported by name."""
    _checked(torch_functional, LOGITS_FUNCTIONS)
    return replace_by_name(torch_functional, _REPLACEMENTS)


def _sum_pi_squared_available() -> bool:
    if hasattr(rl_kernels, "sum_pi_squared_from_logits"):
        return True
    log_once(logging.INFO, "rl_kernels: this rl-kernels has no sum_pi_squared_from_logits: verl's "
             "sum-of-squared-probabilities functions are not replaced")
    return False


DP_ACTOR_MODULE = "verl.workers.actor.dp_actor"
"""verl 0.7.x's legacy FSDP actor: by-name ``logprobs_from_logits``, and ``torch.compile`` caches of
``entropy_from_logits[_with_chunking]`` / ``calculate_sum_pi_squared_from_logits`` built in
``DataParallelPPOActor.__init__``."""


def _wrap_dp_actor(dp_actor, logits_path: bool, sum_pi_squared: bool) -> str:
    """Wrap ``DataParallelPPOActor.__init__``: the compiled from-logits caches it builds (after verl
    imported ``external_lib``) are replaced by rl-kernels' functions, and fused kernels with Ulysses
    SP are refused at construction on verl 0.7.x (see :func:`_refuse_ulysses`)."""
    cls = dp_actor.DataParallelPPOActor
    original = cls.__init__
    _check_signature("DataParallelPPOActor.__init__", original)

    @functools.wraps(original)
    def __init__(self, config, actor_module, actor_optimizer=None):
        original(self, config, actor_module, actor_optimizer)
        if getattr(self, "use_fused_kernels", False) and getattr(self, "use_ulysses_sp", False) and any(
                getattr(m, "_rl_kernels_fused", False) for m in actor_module.modules()):
            _refuse_ulysses(has_shift_labels=False, size=int(self.ulysses_sequence_parallel_size))
        if logits_path and hasattr(self, "compute_entropy_from_logits"):
            chunking = bool(_get(config, "entropy_from_logits_with_chunking"))
            self.compute_entropy_from_logits = (entropy_from_logits_with_chunking if chunking
                                                else entropy_from_logits)
        if sum_pi_squared and hasattr(self, SUM_PI_SQUARED_FUNCTION):
            setattr(self, SUM_PI_SQUARED_FUNCTION, calculate_sum_pi_squared_from_logits)

    _set(cls, "__init__", __init__)
    return (f"{DP_ACTOR_MODULE}.DataParallelPPOActor.__init__ (compiled entropy"
            + (" / sum_pi_squared" if sum_pi_squared else "") + " caches replaced)")


# ----------------------------------------------------------------------------- engine report
_WHEN = {"FSDP fused path": " (models with impl_backend=rl_kernels)",
         "FSDP logits path": " (use_fused_kernels=False)", "Megatron logits path": " (use_fused_kernels=False)",
         "Megatron fused path": " (use_fused_kernels=True)"}


def _engine_family(engine_cls):
    for klass in getattr(engine_cls, "__mro__", ()):
        family = SERVED_ENGINES.get(klass.__module__)
        if family is not None:
            return family
    return None


def _report_engine(model_type, backend, engine_cls) -> None:
    """Log once which rl-kernels paths serve the verl engine just chosen; warn for one it does not."""
    if model_type != "language_model" or not isinstance(engine_cls, type):
        return  # the critic's value head computes no log-probs
    name = f"verl engine '{backend}' ({engine_cls.__name__})"
    family = _engine_family(engine_cls)
    if family is not None:
        parts = {part: entry for part, entry in _report.items() if part.startswith(family) or
                 part == f"sum_pi_squared ({family})"}
        done = [part + _WHEN.get(part, "") for part, (ok, _) in parts.items() if ok]
        if done:
            log_once(logging.INFO, f"rl_kernels: {name} is served by rl-kernels: {', '.join(done)}"
                     + "".join(f"; {part}: {what}" for part, (ok, what) in parts.items() if not ok))
        else:
            log_once(logging.WARNING, f"rl_kernels: {name}: rl-kernels replaced nothing it uses ("
                     + "; ".join(f"{part}: {what}" for part, (_, what) in parts.items()) + ")")
        return
    module = sys.modules.get(engine_cls.__module__)
    namespace = vars(module) if module is not None else {}
    import verl.utils.torch_functional as torch_functional
    ours = set(map(id, _REPLACEMENTS.values()))
    by_name = sorted(bound for bound, value in namespace.items() if id(value) in ours)
    uses_module = any(value is torch_functional for value in namespace.values())
    if _report.get("FSDP logits path", (False,))[0] and (by_name or uses_module):
        detail = ("only its calls to verl.utils.torch_functional's from-logits functions ("
                  + ", ".join(by_name + (["verl_F.*"] if uses_module else [])) + ") go through rl-kernels; "
                  "its fused path and everything else stay verl's")
    else:
        detail = "its log-probs and entropy are computed by verl's own code"
    log_once(logging.WARNING, f"rl_kernels: {name} is not an engine rl-kernels serves (FSDP: fsdp, fsdp2; "
             f"Megatron: megatron): {detail}")


def _wrap_engine_registry(base) -> None:
    registry = base.EngineRegistry
    original = vars(registry)["get_engine_cls"]
    if not isinstance(original, classmethod):
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: verl {verl_version()} changed "
                                   f"EngineRegistry.get_engine_cls (no longer a classmethod)")
    _check_signature("EngineRegistry.get_engine_cls", original.__func__)

    @functools.wraps(original.__func__)
    def get_engine_cls(cls, model_type, backend):
        engine_cls = original.__func__(cls, model_type, backend)
        _report_engine(model_type, backend, engine_cls)
        return engine_cls

    get_engine_cls._rl_kernels_original = original
    _set(registry, "get_engine_cls", classmethod(get_engine_cls))


# ----------------------------------------------------------------------------- patch / unpatch
def _wrap_model_config(model_config_module) -> None:
    cls = model_config_module.HFModelConfig
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self):
        original(self)
        configure_from_model_config(self)

    _set(cls, "__post_init__", __post_init__)


def _patch_all(monkey_patch, experimental_tf, torch_functional) -> dict:
    """Apply every patch; returns the report {part: (replaced?, what)}. The caller rolls back on error."""
    report = {}
    dp_actor = None
    if "DataParallelPPOActor.__init__" in _expected_signatures():  # verl 0.7.x: the legacy workers' actor,
        import importlib                                           # imported first: its by-name imports are listed
        dp_actor = importlib.import_module(DP_ACTOR_MODULE)
    try:  # imports verl's engines first, so that their by-name imports are patched and listed below
        import verl.workers.engine.base as engine_base
    except ImportError as exc:
        log_once(logging.INFO, f"rl_kernels: verl.workers.engine not importable ({exc}); the verl engine in "
                 f"use is not reported")
    else:
        _wrap_engine_registry(engine_base)
    _set(monkey_patch, "patch_forward_with_backends",
         _make_patch_forward_with_backends(monkey_patch.patch_forward_with_backends))
    _set(experimental_tf, "FusedLinearForPPO", _make_fused_linear_class(experimental_tf.FusedLinearForPPO))
    report["FSDP fused path"] = (True, f"impl_backend='{BACKEND_NAME}' (verl.models.transformers.monkey_patch."
                                 f"patch_forward_with_backends, verl.utils.experimental.torch_functional."
                                 f"FusedLinearForPPO; verl's triton/torch/liger backends unchanged; "
                                 f"{_wrap_entropy_requests(dp_actor)})")
    logits_path = _options.patch_logits_path
    if logits_path:
        places = _patch_logits_path(torch_functional)
        report["FSDP logits path"] = (True, f"{', '.join(LOGITS_FUNCTIONS)} in verl.utils.torch_functional and "
                                      f"{len(places)} by-name import(s) ({', '.join(places) or 'none loaded yet'})")
    else:
        report["FSDP logits path"] = (False, "not replaced (patch_logits_path=False)")
    sum_pi_squared = logits_path and _sum_pi_squared_available()
    if sum_pi_squared:
        _checked(torch_functional, (SUM_PI_SQUARED_FUNCTION,))
        places = replace_by_name(torch_functional, {SUM_PI_SQUARED_FUNCTION: calculate_sum_pi_squared_from_logits})
        report["sum_pi_squared (FSDP)"] = (True, f"{SUM_PI_SQUARED_FUNCTION} in verl.utils.torch_functional and "
                                           f"{len(places)} by-name import(s) ({', '.join(places) or 'none'})")
    else:
        report["sum_pi_squared (FSDP)"] = (False, "not replaced (" + (
            "rl_kernels has no sum_pi_squared_from_logits" if logits_path else "patch_logits_path=False") + ")")
    if dp_actor is not None:
        what = _wrap_dp_actor(dp_actor, logits_path, sum_pi_squared)
        if logits_path:
            report["FSDP logits path"] = (True, report["FSDP logits path"][1] + "; " + what)
    if verl_minor() == "0.9":
        megatron = verl_megatron.patch(logits_path=logits_path, fused_path=_options.patch_megatron_fused,
                                       sum_pi_squared=sum_pi_squared, options=options)
    else:
        why = f"not patched (verl {verl_version()}: rl-kernels serves verl's Megatron engine on verl 0.9.x only)"
        megatron = dict.fromkeys(("Megatron logits path", "Megatron fused path", "sum_pi_squared (Megatron)"),
                                 (False, why))
    off = {"Megatron logits path": (logits_path, "not replaced (patch_logits_path=False)"),
           "Megatron fused path": (_options.patch_megatron_fused, "not replaced (patch_megatron_fused=False)"),
           "sum_pi_squared (Megatron)": (sum_pi_squared, report["sum_pi_squared (FSDP)"][1])}
    for part, (ok, what) in megatron.items():
        switched_on, reason = off[part]
        report[part] = (ok, what) if switched_on or what.startswith("not patched") else (False, reason)
    try:
        import verl.workers.config.model as model_config_module
    except ImportError as exc:  # a stubbed verl without the worker stack
        log_once(logging.INFO, f"rl_kernels: verl.workers.config.model not importable ({exc}); "
                 f"options come from rl_kernels.integrations.verl.configure() only")
    else:
        _wrap_model_config(model_config_module)
    return report


def patch() -> None:
    """Patch verl (idempotent). Raises VerlIntegrationError when verl does not fit (see module doc)."""
    global _patched, _report
    with _lock:
        if _patched:
            return
        version = verl_version()
        if not version.startswith(SUPPORTED_VERL):
            raise VerlIntegrationError(f"rl_kernels.integrations.verl supports verl {SUPPORTED_VERL}, "
                                       f"found verl {version}")
        import verl.models.transformers.monkey_patch as monkey_patch
        import verl.utils.experimental.torch_functional as experimental_tf
        import verl.utils.torch_functional as torch_functional

        _check_signature("patch_forward_with_backends", monkey_patch.patch_forward_with_backends)
        _check_signature("FusedLinearForPPO.__init__", experimental_tf.FusedLinearForPPO.__init__)
        _check_signature("FusedLinearForPPO.forward", experimental_tf.FusedLinearForPPO.forward)
        try:
            report = _patch_all(monkey_patch, experimental_tf, torch_functional)
        except BaseException:
            _restore()
            raise
        _report, _patched = report, True
        logger.info("rl_kernels patched verl %s:\n%s", version, "\n".join(
            f"  {part}: {what}" for part, (_, what) in report.items()))


def report() -> dict:
    """What the last :func:`patch` replaced: ``{part: (replaced?, what)}``, parts "FSDP fused path",
    "FSDP logits path", "sum_pi_squared (FSDP)", "Megatron logits path", "Megatron fused path",
    "sum_pi_squared (Megatron)". Empty while unpatched."""
    return dict(_report) if _patched else {}


def _restore() -> None:
    restore()


def unpatch() -> None:
    """Undo :func:`patch` (idempotent). Models already patched with impl_backend='rl_kernels' keep
    verl's fused forward, whose ``FusedLinearForPPO`` then rejects that backend name."""
    global _patched, _report
    with _lock:
        if not _patched:
            return
        _restore()
        _patched, _report = False, {}
        logger.info("rl_kernels: verl patches removed")


def is_patched() -> bool:
    return _patched


def _on_import() -> None:
    if not logger.hasHandlers():  # make "it is on" visible in verl's Ray workers
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    model_config = _model_config_in_import_stack()
    if model_config is not None:
        configure_from_model_config(model_config)
    patch()


_on_import()
