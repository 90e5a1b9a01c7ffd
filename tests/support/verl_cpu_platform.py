"""Test support: a CPU platform for verl, so verl's own Ray workers run on CI's CPU-only machine.

verl 0.9.1 registers only accelerator platforms (nvidia, huawei, amd) and falls back to 'nvidia'
(NCCL, .cuda()) when none is present. Loaded in the Ray workers through verl's own plugin hook
(``VERL_USE_EXTERNAL_MODULES=verl_cpu_platform`` with ``VERL_PLATFORM=cpu``), this registers a
'cpu' platform with gloo. It is test scaffolding, not part of rl-kernels; see :mod:`verl_cpu`.
"""
from contextlib import contextmanager

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

from verl_cpu import CPUDeviceModule


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = CPUDeviceModule()

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
