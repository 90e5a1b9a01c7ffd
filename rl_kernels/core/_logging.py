"""The package logger and a log-once helper (every fallback and automatic choice is logged once)."""
from __future__ import annotations

import logging

logger = logging.getLogger("rl_kernels")
_seen: set = set()  # the keys of the messages logged (a message's text unless given a key)


def log_once(level: int, message, key=None) -> None:
    """Log ``message`` the first time its ``key`` comes (default: the text itself). ``message``
    may be a function returning the text, called only when it is logged (a call on a hot path
    then builds no string). Call it only from code that runs eagerly: the backend calls' bodies
    (under torch.compile inside the custom ops), launchers, set-up and patching. The library's
    code that Dynamo traces (the public functions, the Functions' routing) does not log, since a
    logger call there would break the graph; e.g. the choice of ``backend='auto'`` is logged by
    ``Backend.family`` as a body runs, not where the public function resolves it."""
    key = message if key is None else key
    if key not in _seen:
        _seen.add(key)
        logger.log(level, message() if callable(message) else message)
