"""Options of the verl integration: :class:`VerlOptions`, :func:`configure`, and reading them from
the verl config objects that verl hands over (:func:`configure_from_model_config`).

The options in force and the anomaly capture built from them are process-wide state, read per
call by the fused paths (``backend``, the capture) and at :func:`~.verl_patch.patch` time by the
patch (``patch_logits_path``, ``patch_megatron_fused``).
"""
from __future__ import annotations

import dataclasses
import difflib
import threading

from .._logging import logger
from .anomaly import AnomalyCapture
from ..backends import BACKENDS
from ..validation import check_bool_arg, check_choice, check_float_arg, check_int_arg, check_path_arg
from ._verl_common import verl_version

BACKEND_NAME = "rl_kernels"
"""The ``fused_kernel_options.impl_backend`` value that selects rl-kernels (and the key of its
options section, ``fused_kernel_options.rl_kernels``)."""

PATCH_TIME_OPTIONS = ("patch_logits_path", "patch_megatron_fused")
"""Options that decide what :func:`~.verl_patch.patch` replaces (the others are read per call)."""

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
    anomaly_dir: turn on anomaly capture (:mod:`rl_kernels.integrations.anomaly`), writing samples here.
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


lock = threading.RLock()
"""Guards the options and the patch state (:mod:`.verl_patch` takes it too)."""
_options = VerlOptions()
_capture: AnomalyCapture | None = None
_patched_with: VerlOptions | None = None  # the options verl.patch() applied; None while unpatched


def options() -> VerlOptions:
    """The options in effect in this process."""
    return _options


def capture() -> AnomalyCapture | None:
    """The anomaly capture built from the options (None: ``anomaly_dir`` unset)."""
    return _capture


def mark_patched(applied: VerlOptions | None) -> None:
    """Called by :mod:`.verl_patch`: the options a patch was applied with (None: unpatched)."""
    global _patched_with
    _patched_with = applied


def validated_options(section: dict, base: VerlOptions | None = None) -> VerlOptions:
    """``base`` (default: the defaults) with the options of ``section`` (keys of :class:`VerlOptions`),
    every value validated; changes nothing. Unknown keys raise ValueError naming them (with the
    closest known one); bad values TypeError / ValueError naming the option."""
    fields = [f.name for f in dataclasses.fields(VerlOptions)]
    unknown = sorted(set(section) - set(fields))
    if unknown:
        near = {k: difflib.get_close_matches(str(k), fields, n=1) for k in unknown}
        hints = "".join(f"; did you mean {m[0]!r} for {k!r}?" for k, m in near.items() if m)
        raise ValueError(f"fused_kernel_options.rl_kernels: unknown option(s) {unknown}; "
                         f"expected some of {sorted(fields)}{hints}")
    return dataclasses.replace(base or VerlOptions(), **section)  # validates (VerlOptions.__post_init__)


def configure(**kwargs) -> VerlOptions:
    """Set options (keys of :class:`VerlOptions`). Atomic: every value is validated (type, range,
    NaN) and the anomaly capture is built before anything changes, so a call that raises leaves
    the previous options in force. Unknown keys raise ValueError naming them; bad values
    TypeError / ValueError naming the option."""
    global _options, _capture
    with lock:
        new = validated_options(kwargs, _options)
        if new == _options:
            return _options
        new_capture = None
        if new.anomaly_dir:
            settings = {k.removeprefix("anomaly_"): v for k, v in dataclasses.asdict(new).items()
                        if k.startswith("anomaly_") and k != "anomaly_dir"}
            new_capture = AnomalyCapture(directory=str(new.anomaly_dir), **settings, metadata={
                "verl_version": verl_version(), "source": "rl_kernels.integrations.verl"})
        # nothing above changed the module state; commit
        for field in PATCH_TIME_OPTIONS:
            if _patched_with is not None and getattr(new, field) != getattr(_options, field):
                logger.warning("rl_kernels: %s=%s arrived after verl was patched; it takes effect at the "
                               "next patch() (call unpatch() and patch())", field, getattr(new, field))
        _options, _capture = new, new_capture
        logger.info("rl_kernels verl options: %s", new)
    return _options


def _plain(value):
    """OmegaConf / mapping values to plain Python (without importing omegaconf)."""
    if hasattr(value, "items"):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def config_value(config, key):
    """``config.key`` / ``config[key]`` / None, for dataclasses, dicts and OmegaConf nodes."""
    try:
        return config.get(key) if hasattr(config, "get") else getattr(config, key, None)
    except Exception:  # noqa: BLE001 - a struct OmegaConf node without the key
        return None


def model_config_options(model_config) -> dict | None:
    """``model_config.fused_kernel_options['rl_kernels']`` as a plain dict (None when absent) of a
    verl ``HFModelConfig`` or the ``model`` section of a verl 0.7.x legacy worker's config (a
    DictConfig). Raises ValueError when the section is not a mapping."""
    section = _plain(config_value(model_config, "fused_kernel_options") or {}).get(BACKEND_NAME)
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"fused_kernel_options.rl_kernels: expected a mapping of options, got {section!r}")
    return section


def configure_from_model_config(model_config) -> None:
    """Apply ``model_config.fused_kernel_options['rl_kernels']`` (a verl ``HFModelConfig``, or the
    ``model`` section of a verl 0.7.x legacy worker's config: a DictConfig) with :func:`configure`.
    Errors as :func:`configure`'s, and ValueError when the section is not a mapping."""
    section = model_config_options(model_config)
    if section is not None:
        configure(**section)
