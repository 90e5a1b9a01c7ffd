"""The verl integration's implementation: every module of it imports without side effects
(nothing of verl is patched until :func:`.patching.patch` is called; the switch that calls it at
import is :mod:`rl_kernels.integrations.verl`, which ``external_lib`` names).

One job per module: :mod:`.patching` (:func:`~.patching.patch`, :func:`~.patching.unpatch`,
:func:`~.patching.report`), :mod:`.settings` (the options in force), :mod:`.schema` (the options'
schema, :class:`~.schema.VerlIntegrationError`, the ``loss_rows_only`` audit rule; imports no
verl), :mod:`.signatures` (verl's parameter lists, feature detection), :mod:`.patch_state` (the
patches' undo log, the step request and its context variable, counters, the drop-in guard),
:mod:`.fsdp_fused` (the FSDP fused head and the model it serves), :mod:`.fsdp_engine` (the FSDP
engine's step request and its three wrappers), :mod:`.logits_path` (the FSDP logits path),
:mod:`.hooks` (where verl hands its model config on), :mod:`.ulysses_labels` (the refusal of verl
0.7.x's rolled shard labels under Ulysses), :mod:`.megatron` (the Megatron engine's heads),
:mod:`.megatron_step` (its step request and five wrappers), :mod:`.distill_losses` (verl's top-K
distillation losses), :mod:`.distill_terms` (verl's distillation math, no engine code),
:mod:`.modes` (the ``forward_kl_topk_tail`` loss mode for verl's registry; imports no verl).
"""
