"""The package logger and a log-once helper (every fallback and automatic choice is logged once)."""
from __future__ import annotations

import logging

import torch

logger = logging.getLogger("rl_kernels")
_seen: set = set()  # the keys of the messages logged (a message's text unless given a key)


def log_once(level: int, message, key=None) -> None:
    """Log ``message`` the first time its ``key`` comes (default: the text itself). ``message``
    may be a function returning the text, called only when it is logged (a call on a hot path
    then builds no string). Nothing while torch.compile traces the caller (a logger call would
    break the graph): the messages that matter there are logged at run time from the custom ops'
    bodies (``rl_kernels.autograd``), which run eagerly."""
    if torch.compiler.is_compiling():
        return
    key = message if key is None else key
    if key not in _seen:
        _seen.add(key)
        logger.log(level, message() if callable(message) else message)
