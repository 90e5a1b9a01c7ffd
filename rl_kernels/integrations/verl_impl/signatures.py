"""Which verl this is, by its features, never by its version string.

* :data:`SIGNATURES`: every verl function the FSDP patches replace or wrap, with the parameter
  lists rl-kernels handles (one per variant met in a verl release). :func:`check_verl_signature`
  raises :class:`~.patch_state.VerlIntegrationError` naming the function, the accepted and the
  found parameters when the installed verl has none of them; the patch then rolls back.
* :func:`verl_features`: the optional parts of verl the patches serve where they exist (verl 0.7.x's
  legacy ``DataParallelPPOActor``; ``impl_backend`` on ``FusedLinearForPPO``; the Megatron
  engine's vocab-parallel functions; the top-K distillation loss), read from the installed modules.
* :data:`MIN_VERL`: the oldest verl with the API these patches were written against; an older one
  is refused. Versions compare as numbers (``packaging.version``): a newer release or a
  development build (``0.10.0.dev0``) is accepted when its functions fit.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import NamedTuple

# .patch_state first: without verl its import raises the ImportError naming verl, not packaging's
from .patch_state import VerlIntegrationError, check_signature, verl_version  # isort: skip
from packaging.version import InvalidVersion, Version  # noqa: E402 - after .patch_state

MIN_VERL = Version("0.7.0")
"""The oldest verl the patches handle (its ``external_lib`` hook, fused forwards and engines)."""

_FUSED_INIT_WITH_BACKEND = ["self", "chunk_size=512", "impl_backend='torch'"]   # verl 0.9.x
_FUSED_INIT_BARE = ["self", "chunk_size=512"]                                    # verl 0.7.x, 0.8.x, main (0.10.0.dev0)
SIGNATURES = {
    "patch_forward_with_backends": (["model", "use_fused_kernels=False", "fused_kernels_backend=None"],),
    "FusedLinearForPPO.__init__": (_FUSED_INIT_WITH_BACKEND, _FUSED_INIT_BARE),
    "FusedLinearForPPO.forward": (["self", "hidden_states", "vocab_weights", "input_ids", "temperature=1.0"],),
    "logprobs_from_logits": (["logits", "labels", "inplace_backward=True"],),
    "entropy_from_logits": (["logits"],),
    "entropy_from_logits_with_chunking": (["logits", "chunk_size=2048"],),
    "calculate_sum_pi_squared_from_logits": (["logits"],),   # where verl has it (0.8+)
    "EngineRegistry.get_engine_cls": (["cls", "model_type", "backend"],),
    "EngineRegistry.new": (["cls", "model_type", "backend"],),  # and *args, **kwargs (model_config=...)
    "DataParallelPPOActor.__init__": (["self", "config", "actor_module", "actor_optimizer=None"],),  # legacy workers
}
"""label -> the parameter lists (names, ``name=default`` where there is a default) rl-kernels
handles, read from the installed wheels of verl 0.7.1, 0.8.0, 0.9.1 and from verl's main branch."""

DP_ACTOR_MODULE = "verl.workers.actor.dp_actor"
"""verl 0.7.x's legacy FSDP actor module (absent from verl 0.8 on): by-name ``logprobs_from_logits``,
and ``torch.compile`` caches of ``entropy_from_logits[_with_chunking]`` /
``calculate_sum_pi_squared_from_logits`` built in ``DataParallelPPOActor.__init__``."""


class VerlFeatures(NamedTuple):
    """What the installed verl has, of what the patches serve (see :func:`verl_features`)."""

    legacy_actor: bool        # verl.workers.actor.dp_actor (legacy workers: verl 0.7.x)
    fused_impl_backend: bool  # FusedLinearForPPO(impl_backend=...): verl's torch/triton/liger backends (0.9.x)
    distillation: bool        # verl.trainer.distillation (top-K distillation loss: 0.8.0 on)


def has_module(name: str) -> bool:
    """Whether ``name`` is importable (a missing parent package counts as no), without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package that is missing
        return False


@functools.cache
def verl_features() -> VerlFeatures:
    """The installed verl's optional parts, read once per process from its modules (no version
    string). Raises VerlIntegrationError when verl is not installed."""
    verl_version()  # a missing verl: the one clear error
    import verl.utils.experimental.torch_functional as experimental_tf

    return VerlFeatures(
        legacy_actor=has_module(DP_ACTOR_MODULE),
        fused_impl_backend=check_verl_signature("FusedLinearForPPO.__init__", experimental_tf.FusedLinearForPPO.__init__)
        == _FUSED_INIT_WITH_BACKEND,
        distillation=has_module("verl.trainer.distillation.fsdp.losses"))


def check_verl_version(version: str | None = None) -> Version:
    """The installed (or given) verl version as a number; VerlIntegrationError when it is older
    than :data:`MIN_VERL` or not a version at all."""
    version = version or verl_version()
    try:
        parsed = Version(version)
    except InvalidVersion as exc:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: verl reports version {version!r}, which is "
                                   f"not a version number") from exc
    if parsed < MIN_VERL:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: verl {version} is older than {MIN_VERL}, the "
                                   f"oldest verl whose API these patches handle; install verl>={MIN_VERL}")
    return parsed


def check_verl_signature(label: str, fn) -> list[str]:
    """``fn``'s parameters when they are one of those :data:`SIGNATURES` lists under ``label``;
    else VerlIntegrationError naming the function, the accepted and the found parameters."""
    return check_signature(label, fn, SIGNATURES[label])
