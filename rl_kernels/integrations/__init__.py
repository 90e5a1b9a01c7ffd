"""Framework integrations. Kernels know nothing of frameworks; each module here knows one.

``rl_kernels.integrations.verl``: importing it patches verl (name it in
``actor_rollout_ref.model.external_lib``); its Megatron-engine part is
``rl_kernels.integrations.verl_megatron``.
"""
