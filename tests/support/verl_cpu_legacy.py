"""Test support: verl 0.7.x / 0.8.x's device helpers on CPU (these releases have no platform plugin).
It is test scaffolding, not part of rl-kernels; see :mod:`verl_cpu`.

Loaded in the Ray workers through verl's own hook (``VERL_USE_EXTERNAL_MODULES=verl_cpu_legacy``),
which ``verl/__init__.py`` imports after ``verl.utils.device`` and before any worker module:

* ``verl.utils.device.get_torch_device`` returns :class:`verl_cpu.CPUDeviceModule`: ``torch.cpu``
  (what it returns without CUDA) has no ``empty_cache``, ``max_memory_allocated``, ...; verl calls
  them around every step. Modules that imported it by name before this runs (``verl.protocol``)
  get the replacement too.
* ``verl.utils.attention_utils``'s padding helpers are verl's pure-torch ones
  (:func:`verl_cpu.use_torch_padding`: flash_attn has no CPU build).
"""
import sys

import verl.utils.device as device

from verl_cpu import CPUDeviceModule, use_torch_padding

_DEVICE_MODULE = CPUDeviceModule()


def get_torch_device():
    return _DEVICE_MODULE


_original = device.get_torch_device
for _module in list(sys.modules.values()):
    if getattr(_module, "__name__", "").startswith("verl") and getattr(_module, "get_torch_device", None) is _original:
        _module.get_torch_device = get_torch_device

use_torch_padding()
