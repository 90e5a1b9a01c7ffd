"""Triton kernels (one kernel family per file). Importing this package imports Triton."""
from .config import CUDA_CONFIG, INTERPRETER_CONFIG, BwdTile, KernelConfig, default_config, interpreting
from .linear_backward import linear_dlogits
from .linear_forward import linear_split_stats
from .split_combine import split_combine

__all__ = ["CUDA_CONFIG", "INTERPRETER_CONFIG", "BwdTile", "KernelConfig", "default_config", "interpreting",
           "linear_dlogits", "linear_split_stats", "split_combine"]
