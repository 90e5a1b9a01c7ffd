"""Test support: a CPU platform for verl, so verl's own Ray workers run on CI's CPU-only machine.

verl 0.9.1 registers only accelerator platforms (nvidia, huawei, amd) and falls back to 'nvidia'
(NCCL, .cuda()) when none is present. Loaded in the Ray workers through verl's own plugin hook
(``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform`` with ``VERL_PLATFORM=cpu``), this registers a
'cpu' platform with gloo. It is test scaffolding, not part of rl-kernels.
"""
from contextlib import contextmanager
from types import SimpleNamespace

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _zero(*args, **kwargs):
    return 0


def _none(*args, **kwargs):
    return None


class _CPUDeviceModule(SimpleNamespace):
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


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPUDeviceModule()

    def is_available(self):
        return True

    def current_device(self):
        # verl passes this to .to(device=...); an index would mean an accelerator
        return "cpu"

    def device_count(self):
        return 1

    def set_device(self, device_index):
        return None

    def synchronize(self, device_index=None):
        return None

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        return None

    def empty_cache(self):
        return None

    def get_device_capability(self, device_index=0):
        return (None, None)

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "VERL_CPU_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        return None

    def profiler_stop(self):
        return None

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None
