"""How verl's Megatron actor would call rl_kernels on a vocab-parallel lm_head (example).

verl 0.9's Megatron fused path (``actor_rollout_ref.model.use_fused_kernels=True`` with the
Megatron strategy) computes log-probs and entropy in ``fused_output_processor``
(``verl/models/mcore/model_forward_fused.py``) with ``verl.utils.kernel.linear_cross_entropy``
and the tensor-parallel group. The function below is a drop-in for that processor: same keyword
arguments, same ``CausalLMOutputForPPO`` result, with ``rl_kernels.linear_log_probs`` on the
rank's vocab shard.

Not imported by the package and not run in CI (it needs Megatron-Core and a TP group); the math
it relies on, sharded vs unsharded with uneven shards, is tested in ``tests/test_parallel.py``
(gloo, 2 and 3 ranks) and ``scripts/diag/tp_bench.py`` (NCCL). To use it, assign it over verl's
processor before the model is built, e.g. in a module named by ``external_lib``:

    import verl.models.mcore.model_forward_fused as fused
    from megatron_vocab_parallel import rl_kernels_output_processor
    fused.fused_output_processor = rl_kernels_output_processor
"""
from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from verl.utils.model import CausalLMOutputForPPO

import rl_kernels


def rl_kernels_output_processor(*, hidden_states, output_layer, output_weight, labels, context,
                                config, true_vocab_size: int | None = None, **_ignored):
    """Log-probs and entropy of the Megatron head, the vocabulary sharded over the TP group.

    hidden_states: (T, B, H) decoder output (sequence-sharded when ``config.sequence_parallel``);
    labels: (B, T) global token ids; ``output_weight`` / ``output_layer.weight``: this rank's
    (V_padded / tp, H) shard. ``true_vocab_size``: the tokenizer's vocabulary when Megatron padded
    the vocabulary (``make_vocab_size_divisible_by``): the padding rows are sliced off the shard so
    that they carry no probability (verl #2656 / #2899); they then get no gradient.
    """
    if config.sequence_parallel:
        # backward of this region reduce-scatters dh over the TP group: it sums our partial dh
        hidden_states = gather_from_sequence_parallel_region(hidden_states)
    weight = output_weight if output_weight is not None else output_layer.weight
    tp_group = parallel_state.get_tensor_model_parallel_group()
    start = parallel_state.get_tensor_model_parallel_rank() * weight.shape[0]  # Megatron: equal shards
    if true_vocab_size is not None:
        keep = min(weight.shape[0], true_vocab_size - start)
        if keep < 1:
            raise ValueError(f"true_vocab_size: {true_vocab_size} leaves no real row in the shard "
                             f"starting at {start}; use fewer tensor-parallel ranks")
        weight = weight[:keep]
    out = rl_kernels.linear_log_probs(
        hidden_states.transpose(0, 1),  # (B, T, H), like labels; any strides are accepted
        weight,
        labels,
        temperature=float(context.temperature),
        process_group=tp_group,
        vocab_start_index=start,  # no collective for the layout
        # without sequence parallelism nothing else sums dh over the TP group (verl 0.9.1's
        # linear_cross_entropy does not all-reduce it either): let the backward do it
        reduce_hidden_grad=not config.sequence_parallel,
    )
    return CausalLMOutputForPPO(loss=None, logits=None, past_key_values=None,
                                hidden_states=hidden_states, attentions=None,
                                log_probs=out.log_probs, entropy=out.entropy)

