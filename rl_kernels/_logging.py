"""The package logger and a log-once helper (every fallback and automatic choice is logged once)."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("rl_kernels")
_seen: set = set()  # messages logged (and keys of messages logged without building them)


def log_once(level: int, message: str) -> None:
    """Log ``message`` the first time it comes. Nothing while torch.compile traces the caller (a
    logger call would break the graph): the messages that matter there are logged at run time
    from the custom ops' bodies (``rl_kernels.autograd``), which run eagerly."""
    if torch.compiler.is_compiling():
        return
    if message not in _seen:
        _seen.add(message)
        logger.log(level, message)
