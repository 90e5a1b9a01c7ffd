"""Test support: verl's own Ray workers (``ActorRolloutRefWorker``) on CI's CPU-only machine, on
each tested verl release. It is test scaffolding, not part of rl-kernels.

What each release needs to run its worker on CPU:

* every release: the process group is gloo, created before verl creates one
  (:func:`worker_class`): verl asks for ``cpu:gloo,<device>:<nccl|gloo>`` (torch rejects
  ``cpu:gloo,cpu:nccl`` without NCCL and ``cpu:gloo,cpu:gloo`` as a duplicate), and verl 0.7.x's
  legacy worker does so in ``__init__``, before any remote call could create one.
* verl 0.9.x: a CPU platform (:mod:`verl_cpu_platform`) through verl's platform plugin hook.
* verl 0.7.x / 0.8.x, which have no platform plugin (:mod:`verl_cpu_legacy`):
  ``verl.utils.device`` already answers ``cpu`` for the device name without CUDA, but its device
  module is ``torch.cpu``, which lacks the memory queries and cache calls verl makes on an
  accelerator module: it becomes :class:`CPUDeviceModule`. Their padding helpers
  (``verl.utils.attention_utils``) import ``flash_attn``, which has no CPU build:
  :func:`use_torch_padding` points them at verl's own pure-torch copies
  (``verl.utils.npu_flash_attn_utils``, einops), in the workers and in the driver (verl 0.9.x
  falls back to pure torch by itself).
* verl 0.8.x registers its FSDP engine for ``cuda`` and ``npu`` only: :func:`worker_class`
  registers the same class for ``cpu`` too, through verl's own ``EngineRegistry.register``.
* verl 0.7.x's legacy worker offloads the reference policy's FSDP2 parameters with
  ``CPUOffloadPolicy(pin_memory=True)`` whatever the config says, and pinning memory needs an
  accelerator: :func:`worker_class` makes ``CPUOffloadPolicy`` in that module build the same
  policy unpinned (:func:`_unpinned_reference_offload`).

:mod:`verl_cpu_platform` / :mod:`verl_cpu_legacy` are loaded in the workers through verl's
``VERL_USE_EXTERNAL_MODULES`` hook (:func:`worker_env`), which ``import verl`` reads before any
worker module is imported. The rest is config overrides, in the test.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from types import SimpleNamespace

import torch


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def verl_version() -> str:
    return importlib.metadata.version("verl")


def legacy_workers() -> bool:
    """The legacy FSDP workers (``verl.workers.fsdp_workers``, DataProto batches): verl 0.7.x."""
    return _has_module("verl.workers.fsdp_workers")


def platform_plugin() -> bool:
    """verl's platform plugin hook (``verl.plugin.platform``, ``VERL_PLATFORM``): verl 0.9 on."""
    return _has_module("verl.plugin.platform")


def _zero(*args, **kwargs):
    return 0


def _none(*args, **kwargs):
    return None


class CPUDeviceModule(SimpleNamespace):
    """torch.cpu plus the memory queries verl calls on an accelerator module (all 0 here)."""

    def __getattr__(self, name):
        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        if name.startswith(("memory_", "max_memory", "reset_")) or name in ("mem_get_info",):
            return (lambda *a, **k: (0, 0)) if name == "mem_get_info" else _zero
        if name in ("get_device_name", "get_device_capability"):  # the actor's train step asks
            return (lambda *a, **k: "cpu") if name == "get_device_name" else (lambda *a, **k: (0, 0))
        if name in ("empty_cache", "ipc_collect", "set_device", "manual_seed", "manual_seed_all"):
            return _none
        raise AttributeError(name)


def worker_env() -> dict:
    """Environment variables for the Ray workers (``runtime_env``) of the installed verl."""
    if platform_plugin():
        return {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_MODULES": "verl_cpu_platform",
                "VERL_ENGINE_DEVICE": "cuda", "VERL_ENGINE_VENDOR": "nvidia"}
    return {"VERL_USE_EXTERNAL_MODULES": "verl_cpu_legacy"}


def _torch_padding_functions():
    from verl.utils import npu_flash_attn_utils as helpers

    return helpers.index_first_axis, helpers.pad_input, helpers.rearrange, helpers.unpad_input


def use_torch_padding(monkeypatch=None) -> None:
    """verl 0.7.x / 0.8.x without flash_attn: ``verl.utils.attention_utils``'s dispatch returns
    verl's pure-torch padding helpers. ``monkeypatch``: undone with it (in the driver)."""
    import verl.utils.attention_utils as attention_utils

    if hasattr(attention_utils, "_fallback_pad_input") or _has_module("flash_attn"):
        return  # verl falls back to pure torch by itself (0.9 on), or flash_attn is there
    (monkeypatch.setattr if monkeypatch is not None else setattr)(
        attention_utils, "_get_attention_functions", _torch_padding_functions)


def _unpinned_reference_offload():
    """verl 0.7.x: ``verl.workers.fsdp_workers.CPUOffloadPolicy(pin_memory=True)`` -> the policy
    with ``pin_memory=False`` (the offload itself stays: parameters on CPU, as on a GPU host)."""
    import verl.workers.fsdp_workers as fsdp_workers

    policy = fsdp_workers.CPUOffloadPolicy
    if getattr(policy, "_unpinned", False):
        return

    def unpinned(pin_memory=True, **kwargs):
        return policy(pin_memory=False, **kwargs)

    unpinned._unpinned = True
    fsdp_workers.CPUOffloadPolicy = unpinned


def _register_engines_for_cpu():
    """verl 0.8.x: its FSDP engine for language models, registered for ``cpu`` too."""
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp import FSDPEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(FSDPEngineWithLMHead)


def worker_class():
    """verl's ``ActorRolloutRefWorker`` of the installed release (0.7.x: ``fsdp_workers``, 0.8+:
    ``engine_workers``), subclassed only to create the gloo process group first (see above)."""
    if legacy_workers():
        from verl.workers.fsdp_workers import ActorRolloutRefWorker as base
    else:
        from verl.workers.engine_workers import ActorRolloutRefWorker as base

    def __init__(self, *args, **kwargs):
        import torch.distributed as dist

        if not platform_plugin() and not legacy_workers():  # engine workers without a CPU platform (0.8.x)
            _register_engines_for_cpu()
        if legacy_workers():
            _unpinned_reference_offload()

        if not dist.is_initialized():  # Ray's env for the worker: RANK, WORLD_SIZE, MASTER_ADDR/PORT
            dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        base.__init__(self, *args, **kwargs)

    return type(base.__name__, (base,), {"__init__": __init__, "__module__": __name__})
