"""The parts of the verl integration that patch nothing when imported: what rl-kernels reads from a
verl config (the backend name :data:`BACKEND_NAME`, the options :class:`VerlOptions` and their
validation :func:`validated_options`) and the integration's error type
(:class:`VerlIntegrationError`).

The integration itself is the package :mod:`rl_kernels.integrations.verl`, and importing it or any
module of it (Python runs a package's ``__init__`` first) patches verl. What must not patch
imports this module instead: ``rl-kernels verl-check`` (:mod:`rl_kernels.tools.verl_check`, which
validates a composed config's options in the driver), :mod:`rl_kernels.integrations.lm_heads`, and
a process that unpickles a :class:`VerlIntegrationError` raised in a Ray worker (verl's driver).
"""
from __future__ import annotations

import dataclasses
import difflib

from ...core.backends import BACKENDS
from ...core.validation import check_bool_arg, check_choice, check_float_arg, check_int_arg, check_path_arg
from ..anomaly import AnomalyCapture

BACKEND_NAME = "rl_kernels"
"""The ``fused_kernel_options.impl_backend`` value that selects rl-kernels (and the key of its
options section, ``fused_kernel_options.rl_kernels``)."""


class VerlIntegrationError(RuntimeError):
    """verl is missing or older than 0.7.0, or a verl function the patch touches is missing or has
    parameters it does not handle."""


def names_rl_kernels(name) -> bool:
    """Whether verl's ``impl_backend`` / ``fused_kernels_backend`` value is the name this
    integration registers (verl's own kernel choice, not one of rl-kernels' backends)."""
    return name == BACKEND_NAME


_CAPTURE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AnomalyCapture)}


@dataclasses.dataclass
class VerlOptions:
    """Options under ``fused_kernel_options.rl_kernels`` (all optional).

    backend: ``auto`` (Triton on CUDA, torch otherwise), ``triton`` or ``torch``, passed to
        :func:`rl_kernels.linear_log_probs` on the fused paths (FSDP and Megatron).
    patch_logits_path: replace verl's from-logits functions (``use_fused_kernels=False`` path:
        FSDP and Megatron engines, and the sum-of-squared-probabilities functions).
    patch_megatron_fused: replace ``linear_cross_entropy`` in verl's Megatron fused forwards
        (``use_fused_kernels=True`` with the Megatron engine); False keeps verl's kernel there.
    overlap_metrics: on the fused top-K distillation paths (FSDP and Megatron), compute verl's
        overlap metrics (``overlap_count``, ``overlap_token_advantage``) from the student's top K,
        selected in the fused head's own forward (``linear_log_probs_at_ids(top_k=K)``); False leaves
        them out there (verl's loss then logs none). verl's logits path
        computes them always, with or without rl-kernels.
    loss_rows_only: run the LM head only on the rows whose loss mask is 1 (verl #7686: a long
        agentic trajectory's prompt, tool-output and observation tokens never reach the loss), on
        the fused paths (FSDP with ``impl_backend=rl_kernels`` and remove-padding, Megatron) and the
        logits paths (remove-padding: the model's output layer gets the loss rows only): a row
        with loss mask 0 gets log-prob 0, entropy 0, Σπ² 0, no distillation term and no gradient,
        and does not enter the head's GEMMs. Every built-in verl consumer of these outputs reads
        them through ``response_mask`` (audit in docs/verl.md); a micro-batch outside the audit
        (``loss_mask`` in the SFT layout, ``return_model_output``, a ``response_mask`` with a 1
        where ``loss_mask`` has 0; top-K distillation on a logits path; MTP training on the Megatron
        logits path) raises, naming what to turn off. On the Megatron logits path verl's logits keep
        every row (0 outside the loss rows): the GEMMs shrink, not the logits' memory.
    anomaly_dir: turn on anomaly capture (:mod:`rl_kernels.integrations.anomaly`) on every path
        rl-kernels serves (fused and logits, FSDP and Megatron), writing samples here (an absolute
        path: a relative one is resolved by each worker against its own working directory).
    anomaly_max_count, anomaly_max_bytes: per-process bounds on what capture writes.
    anomaly_max_log_prob: a log-prob above this is an anomaly.
    anomaly_recheck_every: every k-th checked call re-checks sampled rows in float32 (0 = never).
    anomaly_recheck_rows, anomaly_recheck_tolerance: rows per re-check and allowed difference (nats).
    """

    backend: str = "auto"
    patch_logits_path: bool = True
    patch_megatron_fused: bool = True
    overlap_metrics: bool = True
    loss_rows_only: bool = False
    anomaly_dir: str | None = None
    # the capture settings' defaults are AnomalyCapture's own (one place)
    anomaly_max_count: int = _CAPTURE_DEFAULTS["max_count"]
    anomaly_max_bytes: int = _CAPTURE_DEFAULTS["max_bytes"]
    anomaly_max_log_prob: float = _CAPTURE_DEFAULTS["max_log_prob"]
    anomaly_recheck_every: int = _CAPTURE_DEFAULTS["recheck_every"]
    anomaly_recheck_rows: int = _CAPTURE_DEFAULTS["recheck_rows"]
    anomaly_recheck_tolerance: float = _CAPTURE_DEFAULTS["recheck_tolerance"]

    def __post_init__(self):
        """Validate every option (type, range, NaN): TypeError / ValueError naming it."""
        def name(field: str) -> str:
            return f"fused_kernel_options.rl_kernels.{field}"

        check_choice(name("backend"), self.backend, BACKENDS)
        check_bool_arg(name("patch_logits_path"), self.patch_logits_path)
        check_bool_arg(name("patch_megatron_fused"), self.patch_megatron_fused)
        check_bool_arg(name("overlap_metrics"), self.overlap_metrics)
        check_bool_arg(name("loss_rows_only"), self.loss_rows_only)
        if self.anomaly_dir is not None:  # None: no capture
            check_path_arg(name("anomaly_dir"), self.anomaly_dir)
        for field in ("anomaly_max_count", "anomaly_max_bytes", "anomaly_recheck_every",
                      "anomaly_recheck_rows"):
            check_int_arg(name(field), getattr(self, field))
        # log-probs are <= 0: a negative bound would flag every call
        check_float_arg(name("anomaly_max_log_prob"), self.anomaly_max_log_prob)
        check_float_arg(name("anomaly_recheck_tolerance"), self.anomaly_recheck_tolerance,
                        inclusive=False)


def validated_options(section: dict, base: VerlOptions | None = None) -> VerlOptions:
    """``base`` (default: the defaults) with the options of ``section`` (keys of :class:`VerlOptions`),
    every value validated; changes nothing. Unknown keys raise ValueError naming them (with the
    closest known one); bad values TypeError / ValueError naming the option."""
    fields = [f.name for f in dataclasses.fields(VerlOptions)]
    unknown = sorted(set(section) - set(fields))
    if unknown:
        near = {k: difflib.get_close_matches(str(k), fields, n=1) for k in unknown}
        hints = "".join(f"; did you mean {m[0]!r} for {k!r}?" for k, m in near.items() if m)
        raise ValueError(f"fused_kernel_options.rl_kernels: unknown option(s) {unknown}; "
                         f"expected some of {sorted(fields)}{hints}")
    return dataclasses.replace(base or VerlOptions(), **section)  # validates (VerlOptions.__post_init__)


# ----------------------------------------------------------------------------- loss_rows_only's audit
LOSS_ROWS_POLICY_LOSS_MODES = ("vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov",
                               "geo_mean", "dro", "cispo", "bypass_mode")
"""verl's policy losses audited for ``loss_rows_only`` (docs/verl.md, "Loss rows only"): each reads
the log-probs and entropy through ``response_mask`` only."""
LOSS_ROWS_DISTILLATION_LOSS_MODES = ("forward_kl_topk", "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
                                     "forward_kl_topk_tail")
"""verl's distillation losses (and rl-kernels' tail mode) audited for ``loss_rows_only``."""


def loss_rows_refusal(*, policy_loss_mode=None, use_prefix_grouper=False, distillation_enabled=False,
                      distillation_loss_mode=None, use_policy_gradient=False,
                      distillation_policy_loss_mode=None) -> str | None:
    """Why ``loss_rows_only`` may not be served with these verl settings (one line naming the key
    and the fix), or None: a policy / distillation loss outside the audit of docs/verl.md (it may read
    log-probs outside ``loss_mask``), or ``use_prefix_grouper`` (it changes the packed row layout).
    Read from verl's config objects by the integration at each engine step, and from the composed
    config by ``rl-kernels verl-check``."""
    off = "set fused_kernel_options.rl_kernels.loss_rows_only=false"
    if use_prefix_grouper:
        return ("loss_rows_only: actor.use_prefix_grouper=True changes the packed row layout and is not audited; "
                f"set one of them off ({off})")
    checks = [("actor.policy_loss.loss_mode", policy_loss_mode, LOSS_ROWS_POLICY_LOSS_MODES)]
    if distillation_enabled:
        checks.append(("distillation.distillation_loss.loss_mode", distillation_loss_mode,
                       LOSS_ROWS_DISTILLATION_LOSS_MODES))
        if use_policy_gradient:
            checks.append(("distillation.distillation_loss.policy_loss_mode", distillation_policy_loss_mode,
                           LOSS_ROWS_POLICY_LOSS_MODES))
    for key, mode, audited in checks:
        if mode is not None and mode not in audited:
            return (f"loss_rows_only: {key}={mode} is not one audited for loss_rows_only (it may read log-probs "
                    f"outside loss_mask); audited: {', '.join(audited)}; {off}")
    return None


# ----------------------------------------------------------------------------- combinations
FEATURES = {"sum_pi_squared": "calculate_sum_pi_squared=True", "topk": "top-K distillation",
            "loss_rows_only": "loss_rows_only"}
"""The features a verl step may ask of rl-kernels' heads together, by the name a message gives them
(the per-sample temperature is served with every other feature and every path, so it is not here)."""
REFUSED_TOGETHER = (
    ("sum_pi_squared", "topk", ("FSDP fused", "Megatron fused"),
     "verl refuses Σπ² on its fused paths too; use use_fused_kernels=False (verl's logits path) for this run"),
    ("loss_rows_only", "topk", ("FSDP logits", "Megatron logits"),
     "verl's distillation reads the logits of every row there; use the fused path (+rl_kernels=fused) or set "
     "fused_kernel_options.rl_kernels.loss_rows_only=false"),
)
"""The combinations rl-kernels refuses: ``(feature, feature, paths, why and the fix)``. Every other
combination of :data:`FEATURES` is served on every path that serves each feature. Read by the
engine steps (FSDP ``fsdp_engine.asks``, Megatron ``megatron_step.step_for``) and by
``rl-kernels verl-check``, through :func:`refused_together`."""


def refused_together(asked, path: str) -> str | None:
    """The one message refusing two of the ``asked`` features (names of :data:`FEATURES`) together on
    ``path`` (``"FSDP fused"``, ``"FSDP logits"``, ``"Megatron fused"``, ``"Megatron logits"``),
    naming both (:data:`REFUSED_TOGETHER`), or None where the combination is served."""
    for first, second, paths, why in REFUSED_TOGETHER:
        if path in paths and first in asked and second in asked:
            return f"{FEATURES[first]} together with {FEATURES[second]} on the {path} path is not served: {why}"
    return None
