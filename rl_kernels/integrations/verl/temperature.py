"""Per-sample temperature on verl's fused paths, FSDP and Megatron engines (issue 44).

verl's FSDP engine takes a micro-batch's ``temperature`` as a Python number or as a float tensor
``(bsz,)``, one temperature per sample. Its logits path divides each token's logits by its
sample's temperature (the per-token ``temperature_rmpad`` of remove-padding: packed, padded to
``pad_to_length`` and Ulysses-sliced like the tokens, pad 1; or ``(bsz,)`` broadcast over the
padded sequence without remove-padding); its fused path refuses the tensor
(``FSDPEngineWithLMHead.prepare_model_inputs``: "use_fused_kernels does not support per sample
temperature yet").

:mod:`.fsdp_engine` wraps that method (:func:`~.fsdp_engine.lay_out_inputs`). For a micro-batch with a tensor temperature
and ``use_fused_kernels`` on, whose engine's model rl-kernels serves (marked ``_rl_kernels_fused``
by :mod:`.fsdp_fused`), it lifts the refusal: verl's method runs once on a shallow copy of the
micro-batch whose temperature is a stand-in number (the fused model inputs: ``shift_labels``,
``return_dict``, ...) and once on a copy with ``use_fused_kernels`` off (verl's own per-token
layout of the temperature for its logits path); the model's ``temperature`` input then becomes that
layout, shaped like the fused forward's labels (``(1, local tokens)`` with remove-padding,
``(bsz, seq)`` without), and :func:`.fsdp_fused.fused_log_probs_entropy` hands it to
:func:`rl_kernels.linear_log_probs` as a per-row temperature (with the model's own logit transform).
The output arguments keep verl's logits-path temperature entries. Everything else (a number, the
logits path, a model served by verl's own fused backends, an engine that overrides the method,
a verl whose logits path lays the temperature out under other keys) runs verl's method as it is,
so verl's refusal stays there.

**Megatron engine.** verl's ``MegatronEngineWithLMHead.forward_step`` asks
``_resolve_fused_temperature`` for one number ("Megatron fused kernels require a uniform
temperature") and hands it to the engine fused forward (``get_mcore_forward_fused_model_engine_fn``,
verl's ``fused_forward_model_engine``), which packs the labels (``preprocess_thd_engine``: TP / CP
alignment pads, the CP split, the roll) and reaches rl-kernels' ``linear_cross_entropy``
(:mod:`.megatron`). Where the Megatron fused path is patched, :func:`serve_megatron_per_sample_temperature`
wraps the three: a tensor of unequal temperatures becomes a :class:`PerSampleTemperature` (the
number 1.0 to verl's code, carrying the tensor); while the fused forward runs with it, the packing
of the labels also packs the per-token temperature with the same arguments but unrolled (each
token's temperature with its own row, as its hidden state; pads 1), and
:func:`megatron_row_temperature` gives it to the fused head. The forward raises
VerlIntegrationError when the model's last stage computed log-probs without it, and the head when
it gets the stand-in anywhere else: never the stand-in 1.0 silently. A uniform tensor and a number
go to verl's function.
"""
from __future__ import annotations

import functools
import inspect

import torch

from .common import StepField, VerlIntegrationError, replace_by_name, set_attr

STAND_IN = 1.0
"""The number verl's code sees in place of a per-sample temperature tensor (replaced after)."""


# ----------------------------------------------------------------------------- Megatron engine
MEGATRON_PART = "Megatron fused per-sample temperature"
"""This part's name in :func:`~.patching.report` (where the Megatron fused path is patched)."""

_megatron_call = StepField("megatron_temperature")
"""The :class:`PerSampleTemperature` of the Megatron engine's fused forward that runs."""


class PerSampleTemperature(float):
    """What verl's Megatron engine hands its fused forward in place of a per-sample temperature
    (:func:`make_resolve_fused_temperature`): the number 1.0, which verl's code passes on as it
    is, carrying the ``(bsz,)`` float32 temperature (``per_sample``), its per-token layout once the
    labels are packed (``per_token``) and whether the fused head used it (``consumed``). Read
    only by :func:`megatron_row_temperature`; nothing else of rl-kernels or verl computes with it."""

    def __new__(cls, per_sample: torch.Tensor):
        self = super().__new__(cls, STAND_IN)
        self.per_sample, self.per_token, self.consumed = per_sample, None, False
        return self


def make_resolve_fused_temperature(original):
    """verl's ``_resolve_fused_temperature`` (Megatron engine): a tensor of unequal temperatures
    becomes a :class:`PerSampleTemperature` instead of verl's "uniform temperature" error; others
    go to verl's function.

    verl's own checks of each value still run, first, with verl's message: verl's function is
    called on each distinct value of the tensor alone (a one-element tensor of its dtype and device:
    uniform, so verl's uniform test passes and only its checks of the value run), so a NaN / inf
    raises verl's ValueError("temperature must contain finite values"), and the per-sample
    temperature holds what verl's function makes of each value (verl clamps a value <= 0 to its
    floor, 1e-8 in verl 0.9.1 and main, as its logits path does: ``temperature[temperature <= 0]
    = 1e-8``). No verl check is copied: a check verl adds applies here too."""
    @functools.wraps(original)
    def _resolve_fused_temperature(temperature):
        if isinstance(temperature, torch.Tensor) and temperature.dim() == 1 and temperature.numel() > 1:
            values = temperature.detach()
            if not bool((values == values[0]).all()):
                distinct, where = torch.unique(values, return_inverse=True)  # NaN entries: each its own
                resolved = [float(original(value.reshape(1))) for value in distinct]
                return PerSampleTemperature(torch.tensor(resolved, dtype=torch.float32, device=values.device)[where])
        return original(temperature)

    _resolve_fused_temperature._rl_kernels_original = original
    return _resolve_fused_temperature


def make_preprocess_thd_engine(original):
    """verl's ``preprocess_thd_engine`` as ``model_forward_fused`` binds it: while a per-sample
    fused forward runs, the call that packs the labels (``need_roll=True``) also packs the
    per-token temperature with the same arguments, unrolled (``need_roll=False``: a token's
    temperature goes with its own row, as its hidden state does), pads 1."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def preprocess_thd_engine(*args, **kwargs):
        out = original(*args, **kwargs)
        call = _megatron_call.get()
        if call is None:
            return out
        arguments = signature.bind(*args, **kwargs).arguments
        if not arguments.get("need_roll", False):
            return out
        from verl.utils import torch_functional as verl_F

        labels = arguments.pop("input_ids")
        arguments["need_roll"] = False
        per_token = verl_F.expand_as_nested(call.per_sample.to(labels.device), labels)
        # the packing pads with 0: pack T - 1 and add 1 back, in float64, where both are exact for
        # any float32 T >= 2^-28 (in float32, T - 1 would round for T < 0.5)
        shifted = per_token.values().double() - 1.0
        packed = original(torch.nested.nested_tensor_from_jagged(shifted, per_token.offsets()), **arguments)[0]
        call.per_token = (packed + 1.0).float()
        return out

    preprocess_thd_engine._rl_kernels_original = original
    return preprocess_thd_engine


def make_fused_forward(forward):
    """The Megatron engine's fused forward (what ``get_mcore_forward_fused_model_engine_fn``
    returns): called with a :class:`PerSampleTemperature`, it runs with that temperature active
    (:data:`_megatron_call`), and raises when the model's last stage computed its log-probs
    without it."""
    @functools.wraps(forward)
    def fused_forward(*args, **kwargs):
        call = kwargs.get("temperature")
        if not isinstance(call, PerSampleTemperature):
            return forward(*args, **kwargs)
        token = _megatron_call.set(call)
        try:
            out = forward(*args, **kwargs)
        finally:
            _megatron_call.reset(token)
        from verl.utils.megatron_utils import unwrap_model

        if getattr(unwrap_model(kwargs.get("model")), "post_process", True) and not call.consumed:
            raise VerlIntegrationError("rl_kernels.integrations.verl: a per-sample temperature on verl's Megatron "
                                       "fused path did not reach rl-kernels' fused head; use_fused_kernels=False "
                                       "serves it")
        return out

    fused_forward._rl_kernels_original = forward
    return fused_forward


def megatron_row_temperature(temperature: PerSampleTemperature, labels: torch.Tensor) -> torch.Tensor:
    """The per-token temperature of the fused head's ``labels`` (verl's packed ``labels_rmpad``),
    for :func:`.megatron.linear_cross_entropy`: laid out by :func:`make_preprocess_thd_engine`.
    VerlIntegrationError where it was not (a fused forward that rl-kernels did not wrap)."""
    per_token = temperature.per_token
    if per_token is None or _megatron_call.get() is not temperature or per_token.numel() != labels.numel():
        raise VerlIntegrationError("rl_kernels.integrations.verl: a per-sample temperature reached the Megatron fused "
                                   "head outside the engine forward rl-kernels lays it out in (labels "
                                   f"{tuple(labels.shape)}); use_fused_kernels=False serves it")
    temperature.consumed = True
    return per_token.reshape(labels.shape)


def serve_megatron_per_sample_temperature() -> tuple[bool, str]:
    """Wrap verl's Megatron engine's ``_resolve_fused_temperature``, the engine fused forward
    factory and ``model_forward_fused.preprocess_thd_engine``; returns the report entry. Call after
    the Megatron fused path is patched (rl-kernels' ``linear_cross_entropy`` reads the layout)."""
    try:
        import verl.models.mcore as mcore
        import verl.models.mcore.model_forward_fused as fused
        import verl.workers.engine.megatron.transformer_impl as engine
    except ImportError as exc:
        return False, f"not served (verl's Megatron engine not importable: {exc})"
    names = {"verl.workers.engine.megatron.transformer_impl._resolve_fused_temperature":
             vars(engine).get("_resolve_fused_temperature"),
             "verl.models.mcore.get_mcore_forward_fused_model_engine_fn":
             getattr(mcore, "get_mcore_forward_fused_model_engine_fn", None),
             "verl.models.mcore.model_forward_fused.preprocess_thd_engine": vars(fused).get("preprocess_thd_engine")}
    missing = [name for name, fn in names.items() if fn is None]
    if missing:
        return False, f"not served (this verl has no {', '.join(missing)}: verl's own refusal stays)"
    set_attr(engine, "_resolve_fused_temperature",
             make_resolve_fused_temperature(engine._resolve_fused_temperature))
    set_attr(fused, "preprocess_thd_engine", make_preprocess_thd_engine(fused.preprocess_thd_engine))
    factory = mcore.get_mcore_forward_fused_model_engine_fn

    @functools.wraps(factory)
    def get_mcore_forward_fused_model_engine_fn(*args, **kwargs):
        forward = factory(*args, **kwargs)
        return make_fused_forward(forward) if callable(forward) else forward

    get_mcore_forward_fused_model_engine_fn._rl_kernels_original = factory
    replace_by_name(mcore, {"get_mcore_forward_fused_model_engine_fn": get_mcore_forward_fused_model_engine_fn})
    return True, ("a temperature tensor of unequal values (" + ", ".join(names) + "): laid out per token as "
                  "the labels are packed, divided per row in rl-kernels' linear_cross_entropy")
