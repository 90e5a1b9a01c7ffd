"""Framework integrations. Kernels know nothing of frameworks; each module here knows one.

``rl_kernels.integrations.verl``, a package: importing it, or any module of it, patches verl (name
it in ``actor_rollout_ref.model.external_lib``); its ``__init__`` lists its parts.
``verl_schema`` holds what must be importable without patching (the verl options' schema and
the error type), ``lm_heads`` each model type's head transform, ``anomaly`` the opt-in anomaly
capture, ``verl_modes`` the ``forward_kl_topk_tail`` loss mode for verl's registry and
``verl_plugin`` its ``verl.plugins`` entry point (both patch nothing on import).
"""
