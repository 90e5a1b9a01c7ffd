"""The package logger and a log-once helper (every fallback and automatic choice is logged once)."""
from __future__ import annotations

import logging

logger = logging.getLogger("rl_kernels")
_seen: set[str] = set()


def log_once(level: int, message: str) -> None:
    if message not in _seen:
        _seen.add(message)
        logger.log(level, message)
