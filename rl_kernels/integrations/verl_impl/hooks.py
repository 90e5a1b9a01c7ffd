"""Hooks in verl's workers, engines and legacy actor: where verl hands over its model config
(the integration's options, :mod:`.settings`), and verl 0.7.x's legacy ``DataParallelPPOActor``.

**Where the options come from.** verl imports ``external_lib`` from inside a call that holds
the model config: ``HFModelConfig.__post_init__`` (verl 0.8+, and 0.7.x's engine workers), or a
verl 0.7.x legacy worker's ``init_model`` (``self.config.model``). The import itself carries only
the module name, so the options of that config are read at the next point where verl passes the
config on, before anything consumes the patch:

* ``EngineRegistry.new(..., model_config=...)``, which builds every training engine
  (:func:`wrap_engine_new`), and ``HFModelConfig.__post_init__`` for every later model config
  (:func:`wrap_model_config`);
* on verl 0.7.x's legacy workers (``verl.workers.fsdp_workers`` / ``megatron_workers``, when loaded),
  the ``_build_model_optimizer`` / ``_build_critic_model_optimizer`` that ``init_model`` calls right
  after the import (:func:`wrap_legacy_workers`).

Each hook calls ``on_config(model_config)`` (:func:`rl_kernels.integrations.verl_impl.patching.apply_model_config`).
"""
from __future__ import annotations

import functools
import sys

from .patch_state import VerlIntegrationError, set_attr, verl_version
from .ulysses_labels import refuse_rolled_shard_labels
from .logits_path import SUM_PI_SQUARED_FUNCTION, calculate_sum_pi_squared_from_logits, entropy_from_logits
from .logits_path import entropy_from_logits_with_chunking
from .settings import config_value
from .signatures import DP_ACTOR_MODULE, check_verl_signature

LEGACY_WORKERS = {
    "verl.workers.fsdp_workers": {"ActorRolloutRefWorker": "_build_model_optimizer",
                                  "CriticWorker": "_build_critic_model_optimizer"},
    "verl.workers.megatron_workers": {"ActorRolloutRefWorker": "_build_model_optimizer",
                                      "CriticWorker": "_build_critic_model_optimizer"},
}
"""verl 0.7.x's legacy worker modules -> {class: the method its ``init_model`` calls after
importing ``external_lib``}, which reads ``self.config.model``."""


def wrap_dp_actor(dp_actor, logits_path: bool, sum_pi_squared: bool) -> str:
    """Wrap ``DataParallelPPOActor.__init__`` (``dp_actor``: verl 0.7.x's ``verl.workers.actor.dp_actor``
    module): the compiled from-logits caches it builds (after verl imported ``external_lib``) are
    replaced by rl-kernels' functions, and fused kernels with Ulysses SP are refused at
    construction (see :mod:`.ulysses_labels`). Returns the report text."""
    cls = dp_actor.DataParallelPPOActor
    original = cls.__init__
    check_verl_signature("DataParallelPPOActor.__init__", original)

    @functools.wraps(original)
    def __init__(self, config, actor_module, actor_optimizer=None):
        original(self, config, actor_module, actor_optimizer)
        if getattr(self, "use_fused_kernels", False) and getattr(self, "use_ulysses_sp", False) and any(
                getattr(m, "_rl_kernels_fused", False) for m in actor_module.modules()):
            refuse_rolled_shard_labels(has_shift_labels=False, size=int(self.ulysses_sequence_parallel_size))
        if logits_path and hasattr(self, "compute_entropy_from_logits"):
            chunking = bool(config_value(config, "entropy_from_logits_with_chunking"))
            self.compute_entropy_from_logits = (entropy_from_logits_with_chunking if chunking
                                                else entropy_from_logits)
        if sum_pi_squared and hasattr(self, SUM_PI_SQUARED_FUNCTION):
            setattr(self, SUM_PI_SQUARED_FUNCTION, calculate_sum_pi_squared_from_logits)

    set_attr(cls, "__init__", __init__)
    return (f"{DP_ACTOR_MODULE}.DataParallelPPOActor.__init__ (compiled entropy"
            + (" / sum_pi_squared" if sum_pi_squared else "") + " caches replaced)")


def wrap_model_config(model_config_module, on_config) -> None:
    """``HFModelConfig.__post_init__`` (of ``verl.workers.config.model``) calls ``on_config(self)`` after verl's."""
    cls = model_config_module.HFModelConfig
    original = cls.__post_init__

    @functools.wraps(original)
    def __post_init__(self):
        original(self)
        on_config(self)

    set_attr(cls, "__post_init__", __post_init__)


def registry_classmethod(registry, name: str):
    """The function behind verl's ``EngineRegistry.<name>`` classmethod, its signature checked
    against :data:`signatures.SIGNATURES`; VerlIntegrationError when verl changed it."""
    original = vars(registry)[name]
    if not isinstance(original, classmethod):
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: verl {verl_version()} changed "
                                   f"EngineRegistry.{name} (no longer a classmethod)")
    check_verl_signature(f"EngineRegistry.{name}", original.__func__)
    return original.__func__


def wrap_engine_new(registry, on_config) -> None:
    """``EngineRegistry.new`` (``registry``) calls ``on_config(model_config)`` with the
    ``model_config`` keyword verl builds the engine with, before the engine is built."""
    original = registry_classmethod(registry, "new")

    @functools.wraps(original)
    def new(cls, model_type, backend, *args, **kwargs):
        model_config = kwargs.get("model_config")
        if model_config is not None:
            on_config(model_config)
        return original(cls, model_type, backend, *args, **kwargs)

    set_attr(registry, "new", classmethod(new))


def wrap_legacy_workers(on_config) -> list[str]:
    """verl 0.7.x's legacy workers (:data:`LEGACY_WORKERS`, those already loaded): the method
    ``init_model`` calls after importing ``external_lib`` calls ``on_config(self.config.model)``
    first. Returns the methods wrapped."""
    wrapped = []
    for module_name, methods in LEGACY_WORKERS.items():
        module = sys.modules.get(module_name)
        for class_name, method_name in methods.items():
            cls = getattr(module, class_name, None)
            original = vars(cls).get(method_name) if isinstance(cls, type) else None
            if original is None:
                continue

            def wrapper(self, *args, _original=original, **kwargs):
                model_config = config_value(getattr(self, "config", None), "model")
                if model_config is not None:
                    on_config(model_config)
                return _original(self, *args, **kwargs)

            set_attr(cls, method_name, functools.wraps(original)(wrapper))
            wrapped.append(f"{module_name}.{class_name}.{method_name}")
    return wrapped
