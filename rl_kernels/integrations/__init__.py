"""Framework integrations. Kernels know nothing of frameworks; each module here knows one.

``rl_kernels.integrations.verl``: importing it patches verl (name it in
``actor_rollout_ref.model.external_lib``); ``verl_plugin``: verl's ``verl.plugins`` entry point (its
import registers the ``forward_kl_topk_tail`` loss mode, patches nothing). Everything else of the
verl integration is the package ``verl_impl``, whose modules import without side effects (its
``__init__`` lists them). ``lm_heads`` holds each model type's head transform, ``anomaly`` the
opt-in anomaly capture.
"""
