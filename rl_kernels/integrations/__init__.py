"""Framework integrations. Kernels know nothing of frameworks; each module here knows one.

``rl_kernels.integrations.verl``: importing it patches verl (name it in
``actor_rollout_ref.model.external_lib``). Its parts, one job each: ``verl_patch`` (patch, unpatch,
report), ``verl_options``, ``verl_signatures``, ``verl_fsdp_fused``, ``verl_logits``, ``verl_hooks``,
``verl_label_check``, ``verl_megatron`` (the Megatron engine) and ``_verl_common``.
"""
