"""verl integration: importing this module patches verl to compute log-probs and entropy with rl-kernels.

Turn it on in a verl run with overrides only (see ``integrations/verl/README.md`` and the Hydra group in the repository's ``conf/``, shipped as ``rl_kernels.integrations.conf``)::

    actor_rollout_ref.model.external_lib=rl_kernels.integrations.verl
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=rl_kernels

Supported: verl 0.7.0 and newer whose functions have the parameters the patches handle
(:data:`SIGNATURES`; detected by feature, never by version string: :func:`verl_features`). Tested
on 0.7.1, 0.8.0, 0.9.1 and verl's main branch (0.10.0.dev0), see the table in
``integrations/verl/README.md``. verl 0.8+ imports ``external_lib`` in
``HFModelConfig.__post_init__``, verl 0.7.x's legacy workers (``fsdp_workers``) in ``init_model``:
in the actor / rollout / reference workers, before they build the model (a config built in the
driver and pickled, as the critic's ``HFModelConfig`` and ``sft_trainer_ray``'s are, imports it
in the driver only: the critic computes no log-probs; for SFT, import this module in the workers
yourself). The import calls :func:`patch`, which

* **FSDP fused path** (``use_fused_kernels=True``): registers a new ``impl_backend`` name,
  ``rl_kernels``. ``verl.models.transformers.monkey_patch.patch_forward_with_backends`` accepts
  it and installs verl's own fused forward for the model class (``dense_common`` for text models,
  the ``qwen2_vl`` / ``qwen3_vl`` / ``glm4v`` / ``qwen3_5`` variants for VLMs), so label rolling,
  ``shift_labels`` precedence (verl #6068), ``temperature``, shapes with rmpad on and off and the
  ``CausalLMOutputForPPO`` output stay verl's. The model is marked (``_rl_kernels_fused``) and
  its class forward wrapped: inside a marked model's forward, the ``FusedLinearForPPO`` that
  verl's forward builds (bare on verl 0.7.x / 0.8.0, with ``impl_backend=<the model's backend>``
  on 0.9.x) goes to :func:`rl_kernels.linear_log_probs`. verl's fused forwards always ask for
  entropy (verl #2608); rl-kernels computes it only when the micro-batch's ``calculate_entropy``
  asks (read in the FSDP engine's ``forward_step``, or verl 0.7.x's
  ``DataParallelPPOActor._forward_micro_batch``), and otherwise hands verl a NaN placeholder, which
  verl drops. A per-sample temperature (a float tensor ``(bsz,)``, which verl's FSDP engine
  refuses on its fused path) is served for such a model: laid out per token as verl's logits path
  lays it out, and divided per row in the fused head (:mod:`.fsdp_engine`). A forward without
  ``shift_labels`` (verl 0.7.x) under Ulysses
  sequence parallelism is refused with :class:`VerlIntegrationError` (labels rolled per shard,
  verl #3512, #3723), at ``DataParallelPPOActor`` construction and at the forward. verl's ``triton``, ``torch`` and ``liger`` backends
  are left untouched, so they stay available for comparison. verl prints "Using Torch backend"
  for such a model (its torch-backend forward is reused); this module then logs the real backend.
* **FSDP logits path** (``use_fused_kernels=False``): replaces ``logprobs_from_logits``,
  ``entropy_from_logits`` and ``entropy_from_logits_with_chunking`` in
  ``verl.utils.torch_functional`` and in every loaded module that imported them by name, with
  :mod:`rl_kernels.logits` (chunked float32; O(N) saved state; float32 outputs, where verl's
  non-flash-attn path returns the logits dtype). Modules imported later get the patched functions
  from ``verl.utils.torch_functional`` itself. Patch before verl's engine is built (verl's import
  of ``external_lib`` does): the FSDP engine caches ``entropy_from_logits`` at construction.
  ``calculate_sum_pi_squared_from_logits`` (the FSDP engine's sum of squared probabilities) goes
  to ``rl_kernels.sum_pi_squared_from_logits`` the same way. On verl 0.7.x the legacy actor,
  ``DataParallelPPOActor``, imports ``logprobs_from_logits`` by name (patched) and caches
  ``torch.compile`` of the entropy / Σπ² functions in ``__init__``: the wrapped ``__init__``
  replaces those caches by rl-kernels' functions.
* **Megatron engine** (:mod:`rl_kernels.integrations.verl_impl.megatron`, where verl has every function
  replaced there: 0.9.x and main, not 0.7.x / 0.8.x; when ``megatron.core`` is importable): verl's vocab-parallel from-logits functions (logits path) and the
  ``linear_cross_entropy`` of its Megatron fused forwards (fused path), on the tensor-parallel
  group, with the hidden-state gradient summed exactly once over that group. On the fused path
  each micro-batch's step request (Σπ², top-K distillation, a per-sample temperature, which verl
  refuses there, and ``loss_rows_only``) is built in one place and carried by one wrapper per
  verl target (:mod:`.megatron_step`: ``forward_step``, ``_resolve_fused_temperature``,
  ``preprocess_thd_engine``, ``postprocess_thd_engine``, the fused forward factory; the supported
  combinations decided in :func:`.megatron_step.step_for`).
* **Top-K distillation** (:mod:`.distill_losses`, verl 0.8+): verl's ``compute_forward_kl_topk`` of its
  FSDP / VeOmni and Megatron losses (logits paths; Megatron vocab-parallel over the TP group) and
  the fused heads of both engines compute verl's top-K terms with rl-kernels, and the
  ``forward_kl_topk_tail`` loss mode (verl RFC #7856), which the import also registers in verl's
  registry (:mod:`rl_kernels.integrations.verl_impl.modes`; for processes that never import this module,
  the ``verl.plugins`` entry point :mod:`rl_kernels.integrations.verl_plugin`).
* **Σπ² on the fused paths** (``calculate_sum_pi_squared=True`` with ``use_fused_kernels=True``,
  which verl refuses): where verl's engine step asks for it, rl-kernels' fused head (FSDP with
  ``impl_backend=rl_kernels``, Megatron) computes it in the same pass, and the refusal is lifted for
  that step only when the head delivered it; verl's own code lays it out where its logits path puts
  it (:func:`.fsdp_engine.lay_out_outputs`, :mod:`.megatron_step`).
* **Loss rows only** (the option ``loss_rows_only``, off by default; verl #7686): the fused heads
  and the logits paths' output layers of both engines run on the rows whose ``loss_mask`` is 1
  only, the others getting 0 and no gradient (:func:`.fsdp_engine.lay_out_inputs`,
  :mod:`.megatron_step`; the audit of who reads which rows in docs/verl.md).

:func:`patch` logs, per engine, exactly what it replaced (also :func:`report`); when verl builds
an engine, the engine is named once, with a warning if rl-kernels does not serve it (VeOmni,
torchtitan, Automodel, ...). :func:`call_counts` counts the calls per consumer, and after the
first :data:`SUMMARY_AFTER_CALLS` calls one INFO line says how many tokens went through which path.

Options come from ``actor_rollout_ref.model.fused_kernel_options.rl_kernels`` (a dict; keys in
:class:`VerlOptions`) of the model config that imports this module (the ``HFModelConfig``, or the
verl 0.7.x legacy worker's ``self.config.model``: read where verl next hands that config on, before
it builds the model or engine; see :mod:`rl_kernels.integrations.verl_impl.hooks`) and of every later
``HFModelConfig``, or from :func:`configure`. The patch is idempotent, :func:`unpatch` undoes it, it logs once what
it patched with the verl version, and it raises :class:`VerlIntegrationError`, naming the function
and its expected and found parameters, when a verl function it replaces is missing or has none of
the parameter lists of its table (:data:`SIGNATURES`).

Layout, and what patches on import. This module is the only one that patches (one call of
:func:`patch` at its import); everything it re-exports lives in the package
:mod:`rl_kernels.integrations.verl_impl`, whose modules import without side effects (importing one
neither patches verl nor imports this module; ``tests/repo/test_layers.py`` checks both): the list of its
modules is in its ``__init__``. verl's ``verl.plugins`` entry point is the other switch,
:mod:`rl_kernels.integrations.verl_plugin` (it registers a loss mode, patches nothing).
"""
from __future__ import annotations

import logging


from ..core._logging import logger
from .verl_impl import patch_state  # noqa: F401 - first: without verl its import raises the ImportError naming verl
from .verl_impl import patching, settings
from .verl_impl.patch_state import (SUMMARY_AFTER_CALLS, call_counts, entropy_on_request, entropy_wanted,  # noqa: F401
                                    verl_version)
from .verl_impl.fsdp_fused import fused_log_probs_entropy, micro_batch_flag  # noqa: F401
from .verl_impl.logits_path import (LOGITS_FUNCTIONS, SUM_PI_SQUARED_FUNCTION,  # noqa: F401
                                    calculate_sum_pi_squared_from_logits, entropy_from_logits,
                                    entropy_from_logits_with_chunking, logprobs_from_logits)
from .verl_impl.patching import SERVED_ENGINES, apply_model_config, is_patched, patch, report, unpatch  # noqa: F401
from .verl_impl.schema import BACKEND_NAME, VerlIntegrationError, VerlOptions  # noqa: F401
from .verl_impl.settings import configure, configure_from_model_config, options  # noqa: F401
from .verl_impl.signatures import DP_ACTOR_MODULE, MIN_VERL, SIGNATURES, VerlFeatures, verl_features  # noqa: F401

def __getattr__(name):
    """``_capture``: the anomaly capture in force (live; :func:`rl_kernels.integrations.verl_impl.settings.capture`)."""
    if name == "_capture":
        return settings.capture()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _HandlerUntilRootHandles(logging.StreamHandler):
    """Prints rl-kernels' records while no handler of the root logger does: once verl (or the
    user) configures root logging, the records propagate there and this handler stays silent, so
    that every line is printed once."""

    def emit(self, record):
        if logger.propagate and logging.getLogger().handlers:
            return
        super().emit(record)


def _on_import() -> None:
    if not logger.hasHandlers():  # make "it is on" visible in verl's Ray workers
        handler = _HandlerUntilRootHandles()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    patch()
    patching.expect_import_config()


_on_import()
