"""verl integration: importing this module patches verl to compute log-probs and entropy with rl-kernels.

Turn it on in a verl run with overrides only (see ``integrations/verl/README.md`` and ``conf/``)::

    actor_rollout_ref.model.external_lib=rl_kernels.integrations.verl
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=rl_kernels

verl imports ``external_lib`` in ``HFModelConfig.__post_init__`` inside every Ray worker, before
it builds the model; the import calls :func:`patch`, which

* **fused path** (``use_fused_kernels=True``): registers a new ``impl_backend`` name,
  ``rl_kernels``. ``verl.models.transformers.monkey_patch.patch_forward_with_backends`` accepts
  it and installs verl's own fused forward for the model class (``dense_common`` for text models,
  the ``qwen2_vl`` / ``qwen3_vl`` / ``glm4v`` / ``qwen3_5`` variants for VLMs), so label rolling,
  ``shift_labels`` precedence (verl #6068), ``temperature``, shapes with rmpad on and off and the
  ``CausalLMOutputForPPO`` output stay verl's. Those forwards build
  ``FusedLinearForPPO(impl_backend=<the model's backend>)``; the patched class sends the
  ``rl_kernels`` backend to :func:`rl_kernels.linear_log_probs` (entropy is always returned:
  verl's fused forwards always ask for it). verl's ``triton``, ``torch`` and ``liger`` backends
  are left untouched, so they stay available for comparison. verl prints "Using Torch backend"
  for such a model (its torch-backend forward is reused); this module then logs the real backend.
* **logits path** (``use_fused_kernels=False``): replaces ``logprobs_from_logits``,
  ``entropy_from_logits`` and ``entropy_from_logits_with_chunking`` in
  ``verl.utils.torch_functional`` and in every loaded module that imported them by name, with
  :mod:`rl_kernels.logits` (chunked float32; O(N) saved state; float32 outputs, where verl's
  non-flash-attn path returns the logits dtype). Modules imported later get the patched functions
  from ``verl.utils.torch_functional`` itself. Patch before verl's engine is built (verl's import
  of ``external_lib`` does): the FSDP engine caches ``entropy_from_logits`` at construction.

Options come from ``actor_rollout_ref.model.fused_kernel_options.rl_kernels`` (a dict; keys in
:class:`VerlOptions`) of the ``HFModelConfig`` that imports this module and of every later one,
or from :func:`configure`. The patch is idempotent, :func:`unpatch` undoes it, it logs once what
it patched with the verl version, and it raises :class:`VerlIntegrationError` when verl's
functions do not have the signatures it was written for (verl 0.9.x).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import logging
import sys
import threading

import torch

from .._logging import log_once, logger
from ..anomaly import AnomalyCapture, check_bool_arg, check_float_arg, check_int_arg, check_path_arg
from ..api import BACKENDS, linear_log_probs
from ..logits import entropy_from_logits as _rk_entropy_from_logits
from ..logits import log_probs_from_logits as _rk_log_probs_from_logits

BACKEND_NAME = "rl_kernels"
"""The ``fused_kernel_options.impl_backend`` value that selects rl-kernels."""

SUPPORTED_VERL = ("0.9.",)
LOGITS_FUNCTIONS = ("logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking")

# parameter names (with defaults) this patch was written against (verl 0.9.1)
_EXPECTED_SIGNATURES = {
    "patch_forward_with_backends": ["model", "use_fused_kernels=False", "fused_kernels_backend=None"],
    "FusedLinearForPPO.__init__": ["self", "chunk_size=512", "impl_backend='torch'"],
    "FusedLinearForPPO.forward": ["self", "hidden_states", "vocab_weights", "input_ids", "temperature=1.0"],
    "logprobs_from_logits": ["logits", "labels", "inplace_backward=True"],
    "entropy_from_logits": ["logits"],
    "entropy_from_logits_with_chunking": ["logits", "chunk_size=2048"],
}


class VerlIntegrationError(RuntimeError):
    """verl is missing, of an unsupported version, or its functions changed their signatures."""


@dataclasses.dataclass
class VerlOptions:
    """Options under ``fused_kernel_options.rl_kernels`` (all optional).

    backend: ``auto`` (Triton on CUDA, torch otherwise), ``triton`` or ``torch``, passed to
        :func:`rl_kernels.linear_log_probs` on the fused path.
    patch_logits_path: replace verl's from-logits functions (``use_fused_kernels=False`` path).
    anomaly_dir: turn on anomaly capture (:mod:`rl_kernels.anomaly`), writing samples here.
    anomaly_max_count, anomaly_max_bytes: per-process bounds on what capture writes.
    anomaly_max_log_prob: a log-prob above this is an anomaly.
    anomaly_recheck_every: every k-th fused call re-checks sampled rows in float32 (0 = never).
    anomaly_recheck_rows, anomaly_recheck_tolerance: rows per re-check and allowed difference (nats).
    """

    backend: str = "auto"
    patch_logits_path: bool = True
    anomaly_dir: str | None = None
    anomaly_max_count: int = 4
    anomaly_max_bytes: int = 8 << 30
    anomaly_max_log_prob: float = 1e-5
    anomaly_recheck_every: int = 0
    anomaly_recheck_rows: int = 4
    anomaly_recheck_tolerance: float = 1e-3

    def __post_init__(self):
        """Validate every option (type, range, NaN): TypeError / ValueError naming it."""
        def name(field: str) -> str:
            return f"fused_kernel_options.rl_kernels.{field}"

        if not isinstance(self.backend, str) or self.backend not in BACKENDS:
            raise ValueError(f"{name('backend')}: expected one of {BACKENDS}, got {self.backend!r}")
        check_bool_arg(name("patch_logits_path"), self.patch_logits_path)
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
_undo: list = []            # (owner, attribute name, original value), in patch order
_patched = False
_model_names: list[str] = []
_counts = {"fused_calls": 0, "fused_tokens": 0, "logits_log_probs_calls": 0, "logits_entropy_calls": 0}


def verl_version() -> str:
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError as exc:
        raise VerlIntegrationError("rl_kernels.integrations.verl: verl is not installed "
                                   "(pip install 'rl-kernels[verl]')") from exc


def call_counts() -> dict:
    """Calls (and fused tokens) served by rl-kernels in this process since the first patch."""
    return dict(_counts)


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
        if _patched and new.patch_logits_path != _options.patch_logits_path:
            logger.warning("rl_kernels: patch_logits_path=%s arrived after verl was patched; it takes "
                           "effect at the next patch() (call unpatch() and patch())", new.patch_logits_path)
        _options, _capture = new, capture
        logger.info("rl_kernels verl options: %s", new)
    return _options


def _plain(value):
    """OmegaConf / mapping values to plain Python (without importing omegaconf)."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def configure_from_model_config(model_config) -> None:
    """Apply ``model_config.fused_kernel_options['rl_kernels']`` (a verl ``HFModelConfig``)."""
    fko = _plain(getattr(model_config, "fused_kernel_options", None) or {})
    section = fko.get(BACKEND_NAME)
    if section is None:
        return
    if not isinstance(section, dict):
        raise ValueError(f"fused_kernel_options.rl_kernels: expected a mapping of options, got {section!r}")
    configure(**section)


def _model_config_in_import_stack():
    """The verl ``HFModelConfig`` whose ``__post_init__`` is importing this module, if any."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if type(obj).__name__ == "HFModelConfig" and hasattr(obj, "fused_kernel_options"):
            return obj
        frame = frame.f_back
    return None


def _signature(fn) -> list[str]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return out


def _check_signature(label: str, fn) -> None:
    got = _signature(fn)
    if got != _EXPECTED_SIGNATURES[label]:
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: verl {verl_version()} changed {label}: expected parameters "
            f"{_EXPECTED_SIGNATURES[label]}, found {got}. This patch supports verl {SUPPORTED_VERL}; "
            f"pin verl==0.9.1 or update rl-kernels.")


def _set(owner, name, value) -> None:
    _undo.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


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


def _fused_log_probs_entropy(hidden_states, vocab_weights, input_ids, temperature):
    if isinstance(temperature, torch.Tensor) and temperature.numel() == 1:
        temperature = temperature.item()
    vocab_weights = _full_weight(vocab_weights, hidden_states.dtype)
    out = linear_log_probs(hidden_states, vocab_weights, input_ids, temperature=temperature,
                           return_entropy=True, backend=_options.backend)
    _counts["fused_calls"] += 1
    _counts["fused_tokens"] += input_ids.numel()
    if _capture is not None:
        _capture.check(hidden_states, vocab_weights, input_ids, temperature=float(temperature),
                       ignore_index=-100, log_probs=out.log_probs, entropy=out.entropy,
                       metadata={"model": _model_names[-1] if _model_names else "unknown"})
    return out.log_probs, out.entropy


def _make_fused_linear_class(base):
    class FusedLinearForPPO(base):
        """verl's ``FusedLinearForPPO`` plus ``impl_backend='rl_kernels'`` (rl_kernels.linear_log_probs)."""

        def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
            if impl_backend == BACKEND_NAME:
                super().__init__(chunk_size=chunk_size, impl_backend="torch")
                self.impl_backend = BACKEND_NAME
            else:
                super().__init__(chunk_size=chunk_size, impl_backend=impl_backend)

        def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
            if self.impl_backend != BACKEND_NAME:
                return super().forward(hidden_states, vocab_weights, input_ids, temperature)
            return _fused_log_probs_entropy(hidden_states, vocab_weights, input_ids, temperature)

    FusedLinearForPPO.__qualname__ = f"rl_kernels[{base.__qualname__}]"
    FusedLinearForPPO._rl_kernels_base = base
    return FusedLinearForPPO


def _make_patch_forward_with_backends(original):
    @functools.wraps(original)
    def patch_forward_with_backends(model, use_fused_kernels=False, fused_kernels_backend=None):
        if fused_kernels_backend != BACKEND_NAME:
            return original(model, use_fused_kernels=use_fused_kernels,
                            fused_kernels_backend=fused_kernels_backend)
        cls = model.__class__.__name__
        if not use_fused_kernels:
            log_once(logging.INFO, f"rl_kernels: impl_backend='rl_kernels' with use_fused_kernels=False: "
                     f"{cls} keeps its logits forward; log-probs/entropy come from rl-kernels' from-logits "
                     f"functions" + ("" if _options.patch_logits_path else " (disabled by patch_logits_path)"))
            return original(model, use_fused_kernels=False, fused_kernels_backend=None)
        # verl's torch-backend forward for this model class; it builds FusedLinearForPPO with
        # the model's backend name, which the patched class routes to rl-kernels
        original(model, use_fused_kernels=True, fused_kernels_backend="torch")
        model._verl_fused_kernels_backend = BACKEND_NAME
        name = getattr(getattr(model, "config", None), "name_or_path", "") or cls
        _model_names.append(str(name))
        logger.info("rl_kernels: %s.forward computes log_probs and entropy with rl_kernels.linear_log_probs "
                    "(backend=%s) through verl's fused forward (model %s)", cls, _options.backend, name)

    patch_forward_with_backends._rl_kernels_original = original
    return patch_forward_with_backends


# ----------------------------------------------------------------------------- logits path
@torch.compiler.disable
def logprobs_from_logits(logits, labels, inplace_backward=True):
    """rl-kernels replacement for ``verl.utils.torch_functional.logprobs_from_logits``.

    Same arguments; float32 output of shape ``labels.shape``; ``inplace_backward=True`` writes
    the gradient into the logits' storage as verl's flash-attn path does (verl passes False when
    it also needs the logits for entropy). See :func:`rl_kernels.log_probs_from_logits`.
    """
    _counts["logits_log_probs_calls"] += 1
    return _rk_log_probs_from_logits(logits, labels, inplace_backward=bool(inplace_backward))


@torch.compiler.disable
def entropy_from_logits(logits):
    """rl-kernels replacement for ``verl.utils.torch_functional.entropy_from_logits`` (float32)."""
    _counts["logits_entropy_calls"] += 1
    return _rk_entropy_from_logits(logits)


@torch.compiler.disable
def entropy_from_logits_with_chunking(logits, chunk_size=2048):
    """rl-kernels replacement for ``entropy_from_logits_with_chunking``; rl-kernels always chunks
    (by elements, not rows), so ``chunk_size`` is only validated."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    _counts["logits_entropy_calls"] += 1
    return _rk_entropy_from_logits(logits)


_REPLACEMENTS = {
    "logprobs_from_logits": logprobs_from_logits,
    "entropy_from_logits": entropy_from_logits,
    "entropy_from_logits_with_chunking": entropy_from_logits_with_chunking,
}


def _patch_logits_path(torch_functional) -> list[str]:
    """Replace the three functions in ``torch_functional`` and wherever they were imported by name."""
    originals = {}
    for name in LOGITS_FUNCTIONS:
        fn = getattr(torch_functional, name, None)
        if fn is None:
            raise VerlIntegrationError(f"rl_kernels.integrations.verl: verl.utils.torch_functional has no "
                                       f"{name} in verl {verl_version()}")
        _check_signature(name, fn)
        originals[name] = fn
    places = []
    for mod_name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict) or mod is torch_functional:
            continue
        for name, fn in originals.items():
            if namespace.get(name) is fn:
                _set(mod, name, _REPLACEMENTS[name])
                places.append(f"{mod_name}.{name}")
    for name in LOGITS_FUNCTIONS:
        _set(torch_functional, name, _REPLACEMENTS[name])
    return places


# ----------------------------------------------------------------------------- patch / unpatch
def _wrap_model_config(model_config_module) -> None:
    cls = model_config_module.HFModelConfig
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self):
        original(self)
        configure_from_model_config(self)

    _set(cls, "__post_init__", __post_init__)


def patch() -> None:
    """Patch verl (idempotent). Raises VerlIntegrationError when verl does not fit (see module doc)."""
    global _patched
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
            _set(monkey_patch, "patch_forward_with_backends",
                 _make_patch_forward_with_backends(monkey_patch.patch_forward_with_backends))
            _set(experimental_tf, "FusedLinearForPPO", _make_fused_linear_class(experimental_tf.FusedLinearForPPO))
            places = _patch_logits_path(torch_functional) if _options.patch_logits_path else []
            try:
                import verl.workers.config.model as model_config_module
            except ImportError as exc:  # a stubbed verl without the worker stack
                log_once(logging.INFO, f"rl_kernels: verl.workers.config.model not importable ({exc}); "
                         f"options come from rl_kernels.integrations.verl.configure() only")
            else:
                _wrap_model_config(model_config_module)
        except BaseException:
            _restore()
            raise
        _patched = True
        logger.info("rl_kernels patched verl %s: fused path impl_backend='%s' "
                    "(verl.models.transformers.monkey_patch.patch_forward_with_backends, "
                    "verl.utils.experimental.torch_functional.FusedLinearForPPO); logits path: %s",
                    version, BACKEND_NAME,
                    (f"{', '.join(LOGITS_FUNCTIONS)} in verl.utils.torch_functional and {len(places)} "
                     f"by-name import(s) ({', '.join(places) or 'none loaded yet'})")
                    if _options.patch_logits_path else "off (patch_logits_path=False)")


def _restore() -> None:
    originals = {}
    while _undo:
        owner, name, value = _undo.pop()
        if name in _REPLACEMENTS and getattr(owner, name) is _REPLACEMENTS[name]:
            originals[name] = value
        setattr(owner, name, value)
    # modules imported while patched took the replacements from verl.utils.torch_functional
    for mod in list(sys.modules.values()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, original in originals.items():
            if namespace.get(name) is _REPLACEMENTS[name]:
                setattr(mod, name, original)


def unpatch() -> None:
    """Undo :func:`patch` (idempotent). Models already patched with impl_backend='rl_kernels' keep
    verl's fused forward, whose ``FusedLinearForPPO`` then rejects that backend name."""
    global _patched
    with _lock:
        if not _patched:
            return
        _restore()
        _patched = False
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
