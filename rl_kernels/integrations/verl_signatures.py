"""The verl functions the FSDP patches were written against: their parameters per verl minor
release (:data:`SIGNATURES`), checked before anything is replaced. A release whose functions
differ raises :class:`~._verl_common.VerlIntegrationError` and the patch rolls back.
"""
from __future__ import annotations

from ._verl_common import check_signature, verl_version

# parameter names (with defaults), from the installed wheels of verl 0.7.1, 0.8.0 and 0.9.1
_SIGNATURES_0_9 = {
    "patch_forward_with_backends": ["model", "use_fused_kernels=False", "fused_kernels_backend=None"],
    "FusedLinearForPPO.__init__": ["self", "chunk_size=512", "impl_backend='torch'"],
    "FusedLinearForPPO.forward": ["self", "hidden_states", "vocab_weights", "input_ids", "temperature=1.0"],
    "logprobs_from_logits": ["logits", "labels", "inplace_backward=True"],
    "entropy_from_logits": ["logits"],
    "entropy_from_logits_with_chunking": ["logits", "chunk_size=2048"],
    "calculate_sum_pi_squared_from_logits": ["logits"],
    "EngineRegistry.get_engine_cls": ["cls", "model_type", "backend"],
    "EngineRegistry.new": ["cls", "model_type", "backend"],  # and *args, **kwargs (model_config=...)
}
# verl 0.8.0: engine workers; FusedLinearForPPO takes no impl_backend (verl builds it bare)
_SIGNATURES_0_8 = {**_SIGNATURES_0_9, "FusedLinearForPPO.__init__": ["self", "chunk_size=512"]}
# verl 0.7.x: also the legacy workers' DataParallelPPOActor (by-name imports, compiled caches)
_SIGNATURES_0_7 = {**_SIGNATURES_0_8,
                   "DataParallelPPOActor.__init__": ["self", "config", "actor_module", "actor_optimizer=None"]}
SIGNATURES = {"0.7": _SIGNATURES_0_7, "0.8": _SIGNATURES_0_8, "0.9": _SIGNATURES_0_9}
"""verl minor release -> {label: expected parameters}."""


def verl_minor(version: str | None = None) -> str:
    """``"0.7"``, ``"0.8"`` or ``"0.9"`` for the installed (or given) verl version."""
    version = version or verl_version()
    return ".".join(version.split(".")[:2])


def expected_signatures() -> dict:
    """{label: expected parameters} for the installed verl minor release."""
    return SIGNATURES[verl_minor()]


def check_verl_signature(label: str, fn) -> None:
    """Raise VerlIntegrationError unless ``fn`` has the parameters :data:`SIGNATURES` lists under
    ``label`` for the installed verl."""
    check_signature(label, fn, expected_signatures()[label])
