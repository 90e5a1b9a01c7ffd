"""The verl patch as a whole: :func:`patch` applies the parts (FSDP fused path, FSDP logits path,
sum of squared probabilities, Megatron engine, the hooks), rolls all of them back when one does
not fit, and reports what it replaced (:func:`report`, the INFO lines, and the line naming the
engine verl builds: :func:`_report_engine`). :func:`apply_model_config` takes the options of the
model configs verl hands over (:mod:`.hooks`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import sys

from ...core._logging import log_once, logger
from . import settings
from .patch_state import VerlIntegrationError, restore, set_attr, verl_version
from .distill_losses import FSDP_PART as DISTILLATION_FSDP
from .distill_losses import MEGATRON_PART as DISTILLATION_MEGATRON
from .distill_losses import TAIL_PART, patch_distillation, tail_entry
from .fsdp_engine import PER_SAMPLE_TEMPERATURE_PART as PER_SAMPLE_TEMPERATURE
from .fsdp_engine import SUM_PI_SQUARED_PART as FUSED_SUM_PI_SQUARED_PART
from .fsdp_engine import patch_engine as patch_fsdp_engine
from .fsdp_engine import unpatch_engine as unpatch_fsdp_engine
from .fsdp_fused import patch_fused_path
from .hooks import (registry_classmethod, wrap_dp_actor, wrap_engine_new, wrap_legacy_workers,
                    wrap_model_config)
from .logits_path import (LOGITS_FUNCTIONS, REPLACEMENTS, SUM_PI_SQUARED_FUNCTION, patch_logits_path,
                          patch_sum_pi_squared)
from .megatron import patch as patch_megatron
from .megatron_step import DISTILLATION_PART as DISTILLATION_MEGATRON_FUSED
from .megatron_step import TEMPERATURE_PART as MEGATRON_PER_SAMPLE_TEMPERATURE
from .settings import PATCH_TIME_OPTIONS, lock, mark_patched, model_config_options, options
from .signatures import DP_ACTOR_MODULE, check_verl_signature, check_verl_version, verl_features

SERVED_ENGINES = {"verl.workers.engine.fsdp.transformer_impl": "FSDP",
                  "verl.workers.engine.megatron.transformer_impl": "Megatron"}
"""verl engine modules whose engines (and their subclasses: fsdp_turbo, MindSpeed) rl-kernels serves."""

_patched = False
_report: dict = {}           # part ("FSDP fused path", ...) -> (replaced?, what), of the last patch()
_import_config_pending = False  # True from the import until a verl model config arrives (apply_model_config)


# ----------------------------------------------------------------------------- engine report
_WHEN = {"FSDP fused path": " (models with impl_backend=rl_kernels)",
         "FSDP logits path": " (use_fused_kernels=False)", "Megatron logits path": " (use_fused_kernels=False)",
         "Megatron fused path": " (use_fused_kernels=True)",
         FUSED_SUM_PI_SQUARED_PART: " (calculate_sum_pi_squared=True, impl_backend=rl_kernels)",
         "Megatron fused sum_pi_squared": " (calculate_sum_pi_squared=True, use_fused_kernels=True)",
         PER_SAMPLE_TEMPERATURE: " (a temperature tensor, impl_backend=rl_kernels)",
         MEGATRON_PER_SAMPLE_TEMPERATURE: " (a temperature tensor, use_fused_kernels=True)"}


FUSED_ROUTES = {"FSDP": ("FSDPEngineWithLMHead", "prepare_model_inputs"),
                "Megatron": ("MegatronEngineWithLMHead", "forward_step")}
"""family -> (its engine class, the method of it that sends a micro-batch to the fused forward
rl-kernels patches). An engine that overrides that method has a fused route of its own (VeOmni's
``chunk_logprobs``), which no patch of rl-kernels reaches: its fused path is reported as not served."""


def _engine_family(engine_cls):
    for klass in getattr(engine_cls, "__mro__", ()):
        family = SERVED_ENGINES.get(klass.__module__)
        if family is not None:
            return family
    return None


def _switched_off(what: str) -> bool:
    """A report entry of a part the options switched off (``patch_logits_path=False``, ...), the
    user's choice, or of a feature this verl does not have: said at INFO, never a warning."""
    return what.startswith(("not replaced (patch_", "not in this verl"))


def _own_fused_route(engine_cls, family) -> str | None:
    """Why ``engine_cls``'s fused forward is not the one rl-kernels patched (None when it is)."""
    base_name, method = FUSED_ROUTES[family]
    base = next((k for k in engine_cls.__mro__ if k.__name__ == base_name and SERVED_ENGINES.get(k.__module__)
                 == family), None)
    if base is None:
        return f"{engine_cls.__name__} does not derive from {base_name}"
    if getattr(engine_cls, method, None) is getattr(base, method, None):
        return None
    owner = next(k for k in engine_cls.__mro__ if method in vars(k))
    return f"{owner.__name__}.{method} replaces {base_name}'s: the engine's fused forward is its own"


def _report_engine(model_type, backend, engine_cls) -> None:
    """Log once which rl-kernels paths serve the verl engine just chosen, from what :func:`patch`
    actually replaced and whether the engine runs the methods that reach it: INFO when every part
    of its family is served, one WARNING naming what is not otherwise."""
    if model_type != "language_model" or not isinstance(engine_cls, type):
        return  # the critic's value head computes no log-probs
    name = f"verl engine '{backend}' ({engine_cls.__name__})"
    family = _engine_family(engine_cls)
    if family is not None:
        parts = {part: entry for part, entry in _report.items() if part.startswith(family) or
                 part == f"sum_pi_squared ({family})"}
        own_route = _own_fused_route(engine_cls, family)
        if own_route is not None:  # its fused route is its own: nothing rl-kernels does on the fused path reaches it
            for part in [p for p in parts if p.startswith(f"{family} fused")]:
                parts[part] = (False, f"not served ({own_route})")
        done = [part + _WHEN.get(part, "") for part, (ok, _) in parts.items() if ok]
        left = [f"{part}: {what}" for part, (ok, what) in parts.items() if not ok and not _switched_off(what)]
        off = "".join(f"; {part}: {what}" for part, (ok, what) in parts.items() if not ok and _switched_off(what))
        if done and not left:
            log_once(logging.INFO, f"rl_kernels: {name} is served by rl-kernels: {', '.join(done)}{off}")
        elif done:
            log_once(logging.WARNING, f"rl_kernels: {name}: served by rl-kernels: {', '.join(done)}; "
                     f"NOT served (verl's own code): " + "; ".join(left) + off)
        else:
            log_once(logging.WARNING, f"rl_kernels: {name}: rl-kernels replaced nothing it uses ("
                     + "; ".join(left) + off + ")")
        return
    module = sys.modules.get(engine_cls.__module__)
    namespace = vars(module) if module is not None else {}
    import verl.utils.torch_functional as torch_functional
    ours = set(map(id, REPLACEMENTS.values()))
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


def _wrap_engine_registry(engine_base) -> None:
    """``EngineRegistry.get_engine_cls`` reports the engine verl chose (:func:`_report_engine`);
    ``EngineRegistry.new`` hands the engine's model config to :func:`apply_model_config`."""
    registry = engine_base.EngineRegistry
    original = registry_classmethod(registry, "get_engine_cls")

    @functools.wraps(original)
    def get_engine_cls(cls, model_type, backend):
        engine_cls = original(cls, model_type, backend)
        _report_engine(model_type, backend, engine_cls)
        return engine_cls

    get_engine_cls._rl_kernels_original = original
    set_attr(registry, "get_engine_cls", classmethod(get_engine_cls))
    wrap_engine_new(registry, apply_model_config)


# ----------------------------------------------------------------------------- patch / unpatch
def _patch_all(monkey_patch, experimental_tf, torch_functional) -> dict:
    """Apply every patch; returns the report {part: (replaced?, what)}. The caller rolls back on error."""
    report = {}
    current = options()
    dp_actor = None
    if verl_features().legacy_actor:  # verl 0.7.x: the legacy workers' actor,
        dp_actor = importlib.import_module(DP_ACTOR_MODULE)       # imported first: its by-name imports are listed
    try:  # imports verl's engines first, so that their by-name imports are patched and listed below
        import verl.workers.engine.base as engine_base
    except ImportError as exc:
        log_once(logging.INFO, f"rl_kernels: verl.workers.engine not importable ({exc}); the verl engine in "
                 f"use is not reported")
    else:
        _wrap_engine_registry(engine_base)
    report["FSDP fused path"] = (True, patch_fused_path(monkey_patch, experimental_tf, dp_actor))
    report.update(patch_fsdp_engine())
    if dp_actor is not None and report[FUSED_SUM_PI_SQUARED_PART][0]:  # verl 0.7.x: the legacy worker's actor
        report[FUSED_SUM_PI_SQUARED_PART] = (True, report[FUSED_SUM_PI_SQUARED_PART][1] + "; not in the legacy "
                                             "DataParallelPPOActor, whose own refusal stays")
    logits_path = current.patch_logits_path
    if logits_path:
        places = patch_logits_path(torch_functional)
        report["FSDP logits path"] = (True, f"{', '.join(LOGITS_FUNCTIONS)} in verl.utils.torch_functional and "
                                      f"{len(places)} by-name import(s) ({', '.join(places) or 'none loaded yet'})")
    else:
        report["FSDP logits path"] = (False, "not replaced (patch_logits_path=False)")
    sum_pi_squared = logits_path
    if sum_pi_squared:
        places = patch_sum_pi_squared(torch_functional)
        report["sum_pi_squared (FSDP)"] = (True, f"{SUM_PI_SQUARED_FUNCTION} in verl.utils.torch_functional and "
                                           f"{len(places)} by-name import(s) ({', '.join(places) or 'none'})")
    else:
        report["sum_pi_squared (FSDP)"] = (False, "not replaced (patch_logits_path=False)")
    if dp_actor is not None:
        what = wrap_dp_actor(dp_actor, logits_path, sum_pi_squared)
        if logits_path:
            report["FSDP logits path"] = (True, report["FSDP logits path"][1] + "; " + what)
    megatron = patch_megatron(logits_path=logits_path, fused_path=current.patch_megatron_fused,
                              sum_pi_squared=sum_pi_squared)
    off = {"Megatron logits path": (logits_path, "not replaced (patch_logits_path=False)"),
           "Megatron fused path": (current.patch_megatron_fused, "not replaced (patch_megatron_fused=False)"),
           "Megatron fused sum_pi_squared": (current.patch_megatron_fused, "not replaced (patch_megatron_fused=False)"),
           "sum_pi_squared (Megatron)": (sum_pi_squared, report["sum_pi_squared (FSDP)"][1])}
    for part in off:
        switched_on, reason = off[part]
        ok, what = megatron[part]
        report[part] = (ok, what) if switched_on or what.startswith("not patched") else (False, reason)
    if report["Megatron fused path"][0]:
        report[MEGATRON_PER_SAMPLE_TEMPERATURE] = megatron[MEGATRON_PER_SAMPLE_TEMPERATURE]
    if logits_path:
        report.update(patch_distillation())
    else:
        report.update(dict.fromkeys((DISTILLATION_FSDP, DISTILLATION_MEGATRON),
                                    (False, "not replaced (patch_logits_path=False)")))
    report[DISTILLATION_MEGATRON_FUSED] = megatron[DISTILLATION_MEGATRON_FUSED]
    report[TAIL_PART] = tail_entry(report)
    legacy_megatron = "verl.workers.megatron_workers"  # verl 0.7.x's legacy Megatron workers (no engine report)
    if legacy_megatron in sys.modules and not any(ok for ok, _ in megatron.values()):
        log_once(logging.WARNING, f"rl_kernels: verl's legacy Megatron workers ({legacy_megatron}) are not served: "
                 f"their log-probs and entropy are computed by verl's own code ({megatron['Megatron logits path'][1]})")
    try:
        import verl.workers.config.model as model_config_module
    except ImportError as exc:  # a stubbed verl without the worker stack
        log_once(logging.INFO, f"rl_kernels: verl.workers.config.model not importable ({exc}); "
                 f"options come from rl_kernels.integrations.verl.configure() only")
    else:
        wrap_model_config(model_config_module, apply_model_config)
    wrap_legacy_workers(apply_model_config)
    return report


def patch() -> None:
    """Patch verl (idempotent). Raises VerlIntegrationError when verl is missing or older than
    :data:`~.signatures.MIN_VERL`, or when a function it replaces is missing or has none of
    the parameter lists of :data:`~.signatures.SIGNATURES` (nothing stays patched then). Which
    optional parts are patched follows what the installed verl has (:func:`~.signatures.verl_features`),
    never its version string."""
    global _patched, _report
    with lock:
        if _patched:
            return
        version = verl_version()
        check_verl_version(version)
        import verl.models.transformers.monkey_patch as monkey_patch
        import verl.utils.experimental.torch_functional as experimental_tf
        import verl.utils.torch_functional as torch_functional

        check_verl_signature("patch_forward_with_backends", monkey_patch.patch_forward_with_backends)
        check_verl_signature("FusedLinearForPPO.__init__", experimental_tf.FusedLinearForPPO.__init__)
        check_verl_signature("FusedLinearForPPO.forward", experimental_tf.FusedLinearForPPO.forward)
        try:
            report = _patch_all(monkey_patch, experimental_tf, torch_functional)
        except BaseException:
            restore()
            unpatch_fsdp_engine()
            raise
        _report, _patched = report, True
        mark_patched(options())
        logger.info("rl_kernels patched verl %s:\n%s", version, "\n".join(
            f"  {part}: {what}" for part, (_, what) in report.items()))


def report() -> dict:
    """What the last :func:`patch` replaced: ``{part: (replaced?, what)}``, parts "FSDP fused path",
    "FSDP fused sum_pi_squared", "FSDP fused per-sample temperature", "FSDP logits path",
    "sum_pi_squared (FSDP)", "Megatron logits path", "Megatron fused path", "Megatron fused
    sum_pi_squared", "Megatron fused per-sample temperature" (where the Megatron fused path is
    patched), "sum_pi_squared (Megatron)", "distillation (FSDP, VeOmni)", "distillation (FSDP fused
    path)", "distillation (Megatron)", "distillation (Megatron fused path)", "distillation
    loss_mode=forward_kl_topk_tail". Empty while unpatched."""
    return dict(_report) if _patched else {}


def unpatch() -> None:
    """Undo :func:`patch` (idempotent). Models already patched with impl_backend='rl_kernels' keep
    verl's fused forward, whose ``FusedLinearForPPO`` then rejects that backend name."""
    global _patched, _report
    with lock:
        if not _patched:
            return
        restore()
        unpatch_fsdp_engine()
        _patched, _report = False, {}
        mark_patched(None)
        logger.info("rl_kernels: verl patches removed")


def is_patched() -> bool:
    """Whether verl is patched now."""
    return _patched


def expect_import_config() -> None:
    """Called when verl imports the integration: the next model config verl hands over
    (:func:`apply_model_config`) is the one that imported it."""
    global _import_config_pending
    _import_config_pending = True


def apply_model_config(model_config) -> None:
    """Options of a model config verl hands over (a verl ``HFModelConfig``, or the ``model``
    section of a verl 0.7.x legacy worker's config): its ``fused_kernel_options.rl_kernels``
    section is applied with :func:`~.settings.configure` (errors as configure's).

    The first config after verl imported the integration is the one that imported it (verl's
    import carries no config), and the patch was applied with the options in force before it. When
    its section changes what the patch replaces (``patch_logits_path``, ``patch_megatron_fused``),
    verl is patched again with them; nothing of verl has used the patch yet at that point (the
    hooks run before verl builds its model or engine). For later configs such a change is logged
    as configure() does: it takes effect at the next patch()."""
    global _import_config_pending
    with lock:
        first, _import_config_pending = _import_config_pending, False
        section = model_config_options(model_config)
        if section is None:
            return
        if first and _patched:
            current = options()
            new = dataclasses.replace(current, **{k: v for k, v in section.items() if k in PATCH_TIME_OPTIONS})
            changed = [f for f in PATCH_TIME_OPTIONS if getattr(new, f) != getattr(current, f)]
            if changed:
                logger.info("rl_kernels: %s from the model config verl imported rl_kernels.integrations.verl "
                            "with: verl is patched again with them", ", ".join(
                                f"{f}={getattr(new, f)}" for f in changed))
                unpatch()
                try:
                    settings.configure(**section)
                finally:
                    patch()
                return
        settings.configure(**section)
