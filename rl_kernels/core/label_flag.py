"""The flag word of the deferred label check (:mod:`rl_kernels.core.label_check`): where a kernel that
meets a label outside [0, vocab_size) writes its call's id. A module of the lowest layer (it
imports torch only), so the kernels (``rl_kernels.ops``) can take the word without importing the
library above them."""
from __future__ import annotations

import torch

_label_flag: torch.Tensor | None = None  # (1,) int32: id of the last call that met a bad label, 0 = none
_label_word = None  # numpy view of _label_flag (a host read without a torch op)


def label_flag(device: torch.device) -> torch.Tensor:
    """The process-wide flag word the kernels write a bad label's call id into: pinned host memory
    (a GPU kernel writes it directly: CUDA maps pinned memory into every device's address space),
    plain host memory under the CPU interpreter. Also a harmless int32 placeholder argument."""
    global _label_flag, _label_word
    if _label_flag is None or (device.type == "cuda" and not _label_flag.is_pinned()):
        _label_flag = torch.zeros(1, dtype=torch.int32, pin_memory=device.type == "cuda")
        _label_word = _label_flag.numpy()
    return _label_flag


def label_word():
    """The flag word as a numpy view (read and cleared without a torch op or a host sync), or None
    before any kernel got the flag."""
    return _label_word
