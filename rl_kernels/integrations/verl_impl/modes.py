"""verl distillation loss modes that rl-kernels adds to verl's registry; patches nothing of verl.

``forward_kl_topk_tail`` (verl RFC #7856, "Tail-aware top-k KL for on-policy distillation"; verl
0.9.1 and verl's main branch do not have it): the forward KL of the two (K+1)-category
distributions of the teacher's top-K ids plus one tail bucket holding the rest of the vocabulary,

    sum_k p_k log(p_k / q_k) + p_tail log(p_tail / q_tail),   p_tail = 1 - sum_k p_k,

non-negative by construction, so verl's ``forward_kl_topk`` clamp at 0 is not applied. The
per-token terms come from rl-kernels' replacement of verl's ``compute_forward_kl_topk`` (logits
paths, FSDP and Megatron) or from rl-kernels' fused heads (:mod:`rl_kernels.integrations.verl_impl.distill_losses`):
the student's log-probs at the teacher's ids and ``log q_tail``, the student's log-mass outside them,
computed directly (no ``1 - Q`` cancellation) by :func:`rl_kernels.topk_log_probs_from_logits` /
:func:`rl_kernels.distill.linear_log_probs_at_ids` with ``return_tail=True``, and the KL by
:func:`rl_kernels.distill.topk_kl_per_token`. As in verl PR #7855, the mode takes no per-entry
clamp: ``distillation.distillation_loss.log_prob_min_clamp=null``, verl's composed default (its
``distillation.yaml``, 0.8.0 and 0.9.1); a clamp set there, or the -10 that ``DistillationLossConfig``
defaults to when built in Python, is refused with a ValueError at the first micro-batch (a clamped tail
bucket is no longer a distribution).

Registration (:func:`register`): verl validates ``loss_mode`` when it builds a
``DistillationLossConfig`` (its ``__post_init__`` calls ``get_distillation_loss_settings``,
``verl/workers/config/distillation.py:104`` in 0.9.1 and main), so the name must be in verl's
registry (``verl/trainer/distillation/losses.py``, ``register_distillation_loss``) before that, in
every process that builds one. Found in verl 0.9.1 and main (1dda039):

* the engine workers: ``ActorRolloutRefWorker.init_model`` builds the ``HFModelConfig`` (which
  imports ``external_lib``: ``verl/workers/config/model.py:149``) at ``engine_workers.py:540``
  (main: 539), before the ``DistillationConfig`` at ``engine_workers.py:596`` (main: 595);
* the trainer process (a Ray actor): ``main_ppo_v0.TaskRunner.run`` builds the ``HFModelConfig``
  at ``main_ppo_v0.py:189`` before ``RayPPOTrainer`` (``ray_trainer.py:934``) and the teacher
  manager (``teacher_model.py:180``) build theirs; the v1 trainer (``trainer.use_v1``, the
  default) builds it in ``_init_tokenizer`` (``ppo/v1/trainer_base.py:703``, main: 650), the
  first step of ``_setup``, before ``trainer_base.py:360`` (main: 345);
* the agent-loop workers: ``AgentLoopWorker.__init__`` builds the ``HFModelConfig`` at
  ``agent_loop.py:505`` before its teacher server manager (``teacher_manager.py:87``);
* NOT the fully-async trainer (experimental): ``FullyAsyncTrainer`` builds its
  ``DistillationConfig`` at ``fully_async_trainer.py:88`` from a tokenizer, with no ``HFModelConfig``
  in that process; nor any process whose ``external_lib`` is not rl-kernels'.

So ``external_lib=rl_kernels.integrations.verl`` alone registers in time on verl's PPO trainers,
and the package calls :func:`register` at its import. For every process, rl-kernels declares this
module as a ``verl.plugins`` entry point: verl 0.9.1 and main load that group at ``import verl``
(``verl/__init__.py:55-76``, unless ``VERL_USE_EXTERNAL_PLUGINS=none``), before anything builds a
config. Loaded there, this module only installs an import hook (no verl module is imported, nothing
is patched): when verl's losses module is imported, the name is registered into it (the entry point
is :mod:`rl_kernels.integrations.verl_plugin`, whose import calls :func:`register`; this module
itself registers nothing when imported). Where entry
points are off (``VERL_USE_EXTERNAL_PLUGINS``), and on verl 0.8.x (which loads no entry points),
``VERL_USE_EXTERNAL_MODULES=rl_kernels.integrations.verl_plugin`` (``verl/__init__.py:49-52``;
0.8.0: ``:38-41``; put it in Ray's ``runtime_env.env_vars`` too) does the same. A verl that
registers the name itself (PR #7855 merged) keeps its own: nothing is registered then.

Installing rl-kernels changes no existing config: a new name is added, no existing one touched.
The registered loss (:func:`forward_kl_topk_tail`) raises :class:`VerlIntegrationError` when the
model output has no tail-aware terms (``tail_loss``): the micro-batch went through verl's own
top-K computation (rl-kernels' patch not imported in that worker, or a path it does not serve),
whose terms are forward_kl_topk's, never silently used as the tail-aware loss.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading

from .schema import VerlIntegrationError

TAIL_MODE = "forward_kl_topk_tail"
LOSSES_MODULE = "verl.trainer.distillation.losses"
TAIL_KEYS = ("tail_loss", "student_tail_mass")
"""The per-token outputs rl-kernels adds for the tail mode (besides verl's forward_kl_topk keys):
the tail bucket's KL term p_tail log(p_tail / q_tail) and the student's probability outside the
teacher's ids (both metrics, no gradient)."""

_lock = threading.RLock()
_status = "not registered yet (verl's distillation losses not imported in this process)"


def status() -> str:
    """Where the tail mode stands in this process's verl registry (one phrase)."""
    return _status


def is_tail_mode(loss_config) -> bool:
    """Whether verl's ``DistillationLossConfig`` (or anything with ``loss_mode``) asks for the tail mode."""
    return getattr(loss_config, "loss_mode", None) == TAIL_MODE


def check_tail_config(loss_config) -> None:
    """ValueError naming ``log_prob_min_clamp`` unless it is None for the tail mode (verl PR #7855's
    rule: a per-entry clamp of the log-probs makes the K slots plus the tail no distribution)."""
    clamp = getattr(loss_config, "log_prob_min_clamp", None)
    if clamp is not None:
        raise ValueError(f"distillation.distillation_loss.log_prob_min_clamp: loss_mode={TAIL_MODE} takes no "
                         f"per-entry clamp (verl PR #7855), got {clamp!r}; set log_prob_min_clamp=null")


def registered_here(module=None) -> bool:
    """Whether the tail mode in verl's registry (``module``: verl's losses module, default the loaded
    one) is rl-kernels' :func:`forward_kl_topk_tail`."""
    module = module if module is not None else sys.modules.get(LOSSES_MODULE)
    registry = getattr(module, "DISTILLATION_LOSS_REGISTRY", None)
    return isinstance(registry, dict) and registry.get(TAIL_MODE) is forward_kl_topk_tail


def _register_into(module) -> str:
    global _status
    with _lock:
        registry = getattr(module, "DISTILLATION_LOSS_REGISTRY", None)
        register_fn = getattr(module, "register_distillation_loss", None)
        settings = getattr(module, "DistillationLossSettings", None)
        if not isinstance(registry, dict) or register_fn is None or settings is None:
            _status = (f"not registered: this verl's {LOSSES_MODULE} has no register_distillation_loss / "
                       f"DistillationLossSettings registry")
        elif registry.get(TAIL_MODE) is forward_kl_topk_tail:
            _status = "registered by rl-kernels"
        elif TAIL_MODE in registry:
            _status = "verl's own (this verl registers it; rl-kernels leaves it as it is)"
        else:
            register_fn(settings(names=[TAIL_MODE], use_topk=True))(forward_kl_topk_tail)
            _status = "registered by rl-kernels"
        return _status


class _RegisteringLoader(importlib.abc.Loader):
    """verl's losses module's own loader; after it has run the module, the tail mode is registered."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register_into(module)

    def __getattr__(self, name):  # get_code, get_source, ... as the original loader has them
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for verl's losses module it wraps the spec the other finders give."""

    def find_spec(self, fullname, path, target=None):
        if fullname != LOSSES_MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


_finder = _Finder()


def register() -> str:
    """Put :data:`TAIL_MODE` into verl's distillation loss registry: now when verl's losses module is
    loaded, else (an import hook, nothing imported here) as soon as it is. Idempotent; returns
    :func:`status`."""
    global _status
    with _lock:
        module = sys.modules.get(LOSSES_MODULE)
        if module is not None and hasattr(module, "DISTILLATION_LOSS_REGISTRY"):
            return _register_into(module)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
            _status = "pending (registered when verl's distillation losses are imported)"
        return _status


def _unpadded(model_output, data, key):
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(model_output[key], data)


def forward_kl_topk_tail(config, distillation_config, model_output: dict, data):
    """verl's distillation loss function for :data:`TAIL_MODE` (registered with ``use_topk=True``):
    the per-token tail-aware KL (bsz, response length) that rl-kernels' logits processor or fused head
    computed, NOT clamped at 0 (it is a KL), with verl's ``forward_kl_topk`` metrics (its own
    function computes them: student / teacher top-K mass, overlap) plus ``distillation/tail_loss``
    and ``distillation/topk_loss`` (the tail bucket's and the K slots' parts of the loss), and
    ``distillation/student_tail_mass`` / ``teacher_tail_mass`` (the probability outside the teacher's
    ids), means over the response tokens. Raises :class:`VerlIntegrationError` when the model output
    has no tail-aware terms (verl's own forward_kl_topk computation ran) and ValueError for a
    ``log_prob_min_clamp``."""
    check_tail_config(distillation_config.distillation_loss)
    missing = [key for key in ("distillation_losses",) + TAIL_KEYS if key not in model_output]
    if missing:
        raise VerlIntegrationError(
            f"rl_kernels: distillation loss_mode={TAIL_MODE}: the model output has no {', '.join(missing)}: this "
            f"micro-batch went through verl's own top-K computation (forward_kl_topk's clamped terms), not "
            f"rl-kernels' tail-aware one. Import rl-kernels' patch in the workers "
            f"(actor_rollout_ref.model.external_lib=rl_kernels.integrations.verl) and use a path it serves "
            f"(logits path, or the fused path with impl_backend=rl_kernels / the Megatron engine); "
            f"`rl-kernels verl-check` says which")
    from verl.trainer.distillation import losses as verl_losses

    # verl's forward_kl_topk for its metrics (mass, overlap; its clamped loss is not used)
    _, metrics = verl_losses.get_distillation_loss_fn("forward_kl_topk")(
        config=config, distillation_config=distillation_config, model_output=model_output, data=data)
    losses = _unpadded(model_output, data, "distillation_losses")
    tail = _unpadded(model_output, data, "tail_loss")
    student_tail = _unpadded(model_output, data, "student_tail_mass")
    teacher_tail = (1.0 - _unpadded(model_output, data, "teacher_mass").double()).clamp(0.0, 1.0)
    mask = data["response_mask"]
    mask = (mask.to_padded_tensor(False) if mask.is_nested else mask).bool()
    metrics.update({
        "distillation/tail_loss": tail[mask].mean().item(),
        "distillation/topk_loss": (losses.detach() - tail)[mask].mean().item(),
        "distillation/student_tail_mass": student_tail[mask].float().mean().item(),
        "distillation/teacher_tail_mass": teacher_tail[mask].mean().item(),
    })
    return losses, metrics

