"""The check of verl 0.7.x's fused-forward labels under Ulysses sequence parallelism.

verl 0.7.x's fused forwards have no ``shift_labels``: they roll the labels of their own sequence
shard, so under Ulysses sequence parallelism the label at every shard boundary is wrong (verl
#3512, #3723; verl 0.8.0 passes globally rolled ``shift_labels``). rl-kernels refuses that
combination with :class:`~.patch_state.VerlIntegrationError` rather than serve it, at two
points: when verl 0.7.x's legacy ``DataParallelPPOActor`` is built (its Ulysses size is known
there), and, deferred to the forward itself, for every other caller (the Ulysses world size is
read from verl at that moment).
"""
from __future__ import annotations

from .patch_state import VerlIntegrationError, verl_version


def ulysses_world_size() -> int:
    """verl's current Ulysses sequence-parallel world size (1 when verl has no Ulysses module)."""
    try:
        from verl.utils.ulysses import get_ulysses_sequence_parallel_world_size
    except ImportError:
        return 1
    return get_ulysses_sequence_parallel_world_size()


def refuse_rolled_shard_labels(has_shift_labels: bool, size: int | None = None) -> None:
    """Raise :class:`~.patch_state.VerlIntegrationError` when a fused forward without
    ``shift_labels`` (``has_shift_labels`` False) runs under Ulysses sequence parallelism of
    ``size`` ranks (None: :func:`ulysses_world_size`, read now) greater than one."""
    if has_shift_labels:
        return
    size = ulysses_world_size() if size is None else size
    if size > 1:
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: use_fused_kernels=True with Ulysses sequence parallelism "
            f"(ulysses_sequence_parallel_size={size}) is refused on verl {verl_version()}: its fused forward "
            f"rolls the labels of each sequence shard, so the label at every shard boundary is wrong "
            f"(verl #3512, #3723; fixed in verl 0.8.0 by shift_labels). Use verl>=0.8, "
            f"ulysses_sequence_parallel_size=1, or use_fused_kernels=False (rl-kernels' logits path).")
