"""Per-sample temperature on verl's fused paths, FSDP and Megatron engines (issue 44).

verl's FSDP engine takes a micro-batch's ``temperature`` as a Python number or as a float tensor
``(bsz,)``, one temperature per sample. Its logits path divides each token's logits by its
sample's temperature (the per-token ``temperature_rmpad`` of remove-padding: packed, padded to
``pad_to_length`` and Ulysses-sliced like the tokens, pad 1; or ``(bsz,)`` broadcast over the
padded sequence without remove-padding); its fused path refuses the tensor
(``FSDPEngineWithLMHead.prepare_model_inputs``: "use_fused_kernels does not support per sample
temperature yet").

:func:`make_prepare_model_inputs` wraps that method. For a micro-batch with a tensor temperature
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
temperature"). Where the Megatron fused path is patched, :mod:`.megatron_step` serves a tensor of
unequal temperatures from the step request: verl's function checks each value, the tensor is
recorded in the step's inputs (verl gets its stand-in 1.0), laid out per token as the labels are
packed and divided per row by rl-kernels' head, which never uses the stand-in silently.
"""
from __future__ import annotations

import functools
import logging

import torch

from ..._logging import log_once
from .common import micro_batch_with, set_attr

PART = "FSDP fused per-sample temperature"
"""This part's name in :func:`~.patching.report` (and in the line naming the FSDP engine)."""
ROUTE = ("FSDPEngineWithLMHead", "prepare_model_inputs")
"""The verl method wrapped (in ``verl.workers.engine.fsdp.transformer_impl``)."""
STAND_IN = 1.0
"""The number verl's method sees in place of the tensor for the fused inputs (replaced after)."""


def serves_fused(engine) -> bool:
    """Whether the engine's model (``engine.module``: FSDP-wrapped or not) is one rl-kernels
    serves on the fused path (``impl_backend=rl_kernels``)."""
    module = getattr(engine, "module", None)
    return isinstance(module, torch.nn.Module) and any(
        getattr(m, "_rl_kernels_fused", False) for m in module.modules())


def _asks_per_sample(micro_batch) -> bool:
    from verl.utils import tensordict_utils as tu

    if not tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False):
        return False
    try:
        temperature = micro_batch["temperature"]
    except KeyError:
        return False
    return isinstance(temperature, torch.Tensor)


def per_token_temperature(logits_args: dict, model_inputs: dict) -> torch.Tensor | None:
    """verl's logits-path temperature (``logits_args``: the output arguments of its
    ``prepare_model_inputs`` with ``use_fused_kernels`` off) shaped like the fused forward's labels:
    the per-token ``temperature_rmpad`` as ``(1, local tokens)`` (remove-padding), or the per-sample
    ``temperature`` ``(bsz,)`` broadcast over ``model_inputs['input_ids']`` ``(bsz, seq)``. None when
    this verl has neither entry."""
    if "temperature_rmpad" in logits_args:
        return logits_args["temperature_rmpad"].reshape(1, -1)
    temperature = logits_args.get("temperature")
    input_ids = model_inputs.get("input_ids")
    if isinstance(temperature, torch.Tensor) and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 \
            and temperature.shape == input_ids.shape[:1]:
        return temperature[:, None].expand(input_ids.shape)
    return None


def make_prepare_model_inputs(original):
    """``FSDPEngineWithLMHead.prepare_model_inputs`` (``original``) serving a per-sample temperature
    on the fused path for the models rl-kernels serves (see the module docstring)."""
    @functools.wraps(original)
    def prepare_model_inputs(self, micro_batch, *args, **kwargs):
        if args or kwargs or not _asks_per_sample(micro_batch) or not serves_fused(self):
            return original(self, micro_batch, *args, **kwargs)
        model_inputs, output_args = original(self, micro_batch_with(micro_batch, temperature=STAND_IN))
        _, logits_args = original(self, micro_batch_with(micro_batch, use_fused_kernels=False))
        temperature = per_token_temperature(logits_args, model_inputs)
        if temperature is None or "temperature" not in model_inputs:
            log_once(logging.WARNING, "rl_kernels: this verl's FSDPEngineWithLMHead.prepare_model_inputs lays "
                     "the per-sample temperature out under keys rl-kernels does not know: verl's refusal stays")
            return original(self, micro_batch)
        model_inputs["temperature"] = temperature
        output_args.update({k: v for k, v in logits_args.items() if "temperature" in k})
        return model_inputs, output_args

    prepare_model_inputs._rl_kernels_original = original
    return prepare_model_inputs


def serve_per_sample_temperature() -> tuple[bool, str]:
    """Wrap verl's FSDP engine's ``prepare_model_inputs`` (:func:`make_prepare_model_inputs`);
    returns the report entry (served?, what)."""
    try:
        import verl.workers.engine.fsdp.transformer_impl as fsdp_impl
    except ImportError as exc:
        return False, f"not served (verl's FSDP engine not importable: {exc})"
    cls_name, method_name = ROUTE
    engine = getattr(fsdp_impl, cls_name, None)
    method = vars(engine).get(method_name) if isinstance(engine, type) else None
    if method is None:
        return False, f"not served (no {cls_name}.{method_name} in this verl)"
    set_attr(engine, method_name, make_prepare_model_inputs(method))
    return True, (f"a temperature tensor (bsz,) on the FSDP fused path of models with impl_backend='rl_kernels' "
                  f"({cls_name}.{method_name}: verl's refusal lifted there, kept for other models)")
