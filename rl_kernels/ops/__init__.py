"""Triton kernels (one kernel family per file). Importing this package imports Triton."""
from .config import (CLASSES, CONFIG_CLASS_ENV, CUDA_CONFIG, INTERPRETER, INTERPRETER_CONFIG, BwdTile, ConfigClass,
                     KernelConfig, LogitsConfig, config_class, default_config, device_class, forced_config, interpreting,
                     logits_config)
from .linear import linear_dlogits, linear_split_stats, split_combine
from .logits import logits_backward, logits_forward, use_two_level

__all__ = ["CLASSES", "CONFIG_CLASS_ENV", "CUDA_CONFIG", "INTERPRETER", "INTERPRETER_CONFIG", "BwdTile", "ConfigClass",
           "KernelConfig", "LogitsConfig", "config_class", "default_config", "device_class", "forced_config",
           "interpreting", "linear_dlogits", "linear_split_stats", "logits_backward", "logits_config",
           "logits_forward", "split_combine", "use_two_level"]
