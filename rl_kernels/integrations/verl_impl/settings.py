"""Options of the verl integration in force: :func:`configure`, :func:`options`, and reading them
from the verl config objects that verl hands over (:func:`configure_from_model_config`). What the
options are (:class:`VerlOptions`, :data:`BACKEND_NAME`, :func:`validated_options`) is defined in
:mod:`rl_kernels.integrations.verl_impl.schema`, which patches nothing on import.

The options in force and the anomaly capture built from them are process-wide state, read per
call by the fused paths (``backend``, ``overlap_metrics``), by every served path (the capture) and at
:func:`~.patching.patch` time by the patch (``patch_logits_path``, ``patch_megatron_fused``).
"""
from __future__ import annotations

import dataclasses
import os
import threading

from ...core._logging import logger
from ..anomaly import AnomalyCapture
from .patch_state import verl_version
from .schema import BACKEND_NAME, VerlOptions, validated_options

PATCH_TIME_OPTIONS = ("patch_logits_path", "patch_megatron_fused")
"""Options that decide what :func:`~.patching.patch` replaces (the others are read per call)."""

lock = threading.RLock()
"""Guards the options and the patch state (:mod:`.patching` takes it too)."""
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
    """Called by :mod:`.patching`: the options a patch was applied with (None: unpatched)."""
    global _patched_with
    _patched_with = applied


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
        if new_capture is not None:
            _log_capture_directory(str(new.anomaly_dir), new_capture.directory)
    return _options


def _log_capture_directory(given: str, directory: str) -> None:
    """Say where this process's anomaly capture writes; a WARNING when ``anomaly_dir`` was relative
    (each Ray worker resolves it against its own working directory)."""
    if os.path.isabs(os.path.expanduser(given)):
        logger.info("rl_kernels: anomaly capture on (every path rl-kernels serves): samples go to %s", directory)
        return
    logger.warning("rl_kernels: anomaly_dir=%r is relative: this process writes to %s (its working directory); "
                   "other workers resolve it against theirs (another node, a Ray job's working_dir copy). Give "
                   "an absolute path", given, directory)


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
