"""Autograd of ``linear_jsd``: the generalized Jensen-Shannon divergence of two linear heads.

The head family "linear_jsd": its parameter record (``JSDParams``), its two bodies on the backend's
``sums`` / ``dlogits`` (``ops.linear_jsd`` or ``torch_ops.linear_jsd``), its Function
(``LinearJSDFunction``: the bodies called directly eagerly, and as the ``rl_kernels::jsd_forward`` /
``jsd_backward`` custom ops while torch.compile traces). Forward: each head's lse (the fused head's forward), then one pass of both GEMMs for
the per-row divergence sums (Triton ``ops.linear_jsd`` or the torch twin ``torch_ops.linear_jsd``);
with a vocab-parallel group, the shard lse and the shard sums are merged over the group. Backward:
dlogits windows of the student recomputed from both heads and consumed by the shared schedule
(``autograd.backward_schedule``); gradients reach the student only.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..core.backends import Backend
from ..core.label_check import raise_label_errors
from .backward_schedule import chunked_backward, full_precision_reduction
from .head_family import (OpArgs, first_order_only, hidden_for_weight_grad, kernels, or_empty, rl_op, stage_op,
                          temperature_samples)
from .linear import HeadParams, head_forward
from .vocab_parallel import all_gather_rows, finish_hidden_grad, group_from_op, merge_lse


class JSDParams(NamedTuple):
    """``linear_jsd``'s parameters, one immutable record from the public function to the launcher."""

    backend: Backend  # resolved (backends.get_backend)
    inv_temperature: float
    beta: float
    may_have_ignored: bool = True  # False: no token is excluded (no ignored-row check in backward)


def jsd_forward(student_hidden, student_weight, teacher_hidden, teacher_weight, valid, params: JSDParams, tp):
    """The forward body: (per-token divergence x T^2 (N,) float32, 0 where not valid; the
    student's lse, the teacher's lse and the g sum (the student's lse when there is none), which the
    backward reads). ``tp``: the vocab-parallel layout (both heads sharded alike) or None."""
    raise_label_errors()  # a bad label that an earlier call's kernel reported (every backend call)
    n = student_hidden.shape[0]
    zeros = torch.zeros(n, dtype=torch.long, device=student_hidden.device)
    head = HeadParams(backend=params.backend, inv_temperature=params.inv_temperature,
                      ignore_index=-100, return_entropy=False)
    lse_s = head_forward(student_hidden, student_weight, zeros, head).lse.contiguous()
    lse_t = head_forward(teacher_hidden, teacher_weight, zeros, head).lse.contiguous()
    if tp is not None:  # shard lse -> global lse of both heads (one all_gather)
        lse_w = all_gather_rows(tp.process_group, torch.stack([lse_s, lse_t]))
        lse_s, lse_t = (merge_lse(lse_w[:, i])[0].contiguous() for i in (0, 1))
    loss, g_sum = kernels(params.backend, "linear_jsd").sums(student_hidden, student_weight, teacher_hidden,
                                                           teacher_weight, lse_s, lse_t, params)
    if tp is not None:  # shard sums -> global sums, added in rank order (one all_gather)
        sums = all_gather_rows(tp.process_group, torch.stack(
            [loss.float(), g_sum.float() if g_sum is not None else torch.zeros_like(loss, dtype=torch.float32)]
        )).sum(0)
        loss = sums[0]
        g_sum = sums[1] if 0.0 < params.beta < 1.0 else (loss if params.beta == 1.0 else None)
    t2 = 1.0 / params.inv_temperature ** 2
    per_token = torch.where(valid, loss.float() * t2, torch.zeros((), device=loss.device))
    return per_token, lse_s, lse_t, g_sum if g_sum is not None else lse_s


def jsd_backward(hs, ws, ht, wt, valid, lse_s, lse_t, g_sum, grad, params: JSDParams, tp, need_dh, need_dw):
    """The backward body: (dh or None, dW or None) of the student from the forward's saved
    statistics (:func:`jsd_forward`) and the per-token upstream gradient ``grad`` (N,)."""
    raise_label_errors()  # as every backend call's body, backward too
    scale = torch.where(valid, grad.float() / params.inv_temperature ** 2,
                        torch.zeros((), device=grad.device)).contiguous()
    g_sum = None if params.beta == 0.0 else g_sum
    dlogits, dz_dtype, width, fp32_products = kernels(params.backend, "linear_jsd").dlogits(
        hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, params)
    reduce_dh = tp is not None and tp.reduce_hidden_grad
    h_dw = hidden_for_weight_grad(hs, ~valid, lse_s) if need_dw and params.may_have_ignored else hs
    with full_precision_reduction():
        dh, dw = chunked_backward(dlogits, hs, ws, dz_dtype, need_dh, need_dw, reduce_dh, h_dw,
                                  width_multiple=width, fp32_products=fp32_products)
    if reduce_dh:
        dh = finish_hidden_grad(dh, tp, hs.dtype)
    return dh, dw


class LinearJSDFunction(torch.autograd.Function):
    """``apply(student_hidden (N, Hs), student_weight (V, Hs), teacher_hidden (N, Ht), teacher_weight
    (V, Ht), valid (N,) bool, params, temperature, tp)`` -> the per-token divergence x T^2 (N,)
    float32, 0 where not ``valid``; gradients to the student's two inputs only. ``temperature``: None
    or the runtime temperature of a compiled graph (``head_family.split_temperature``); ``tp``: the
    vocab-parallel layout (both heads sharded alike) or None. Eagerly the bodies run directly; while
    torch.compile traces, as the stage ops (``rl_op``: the twin with a runtime temperature)."""

    @staticmethod
    def forward(ctx, hs, ws, ht, wt, valid, params: JSDParams, temperature, tp):
        if torch.compiler.is_compiling():
            per_token, lse_s, lse_t, g_sum = rl_op("jsd_forward", temperature)(
                hs, ws, ht, wt, valid, *OP_ARGS.pack(params, temperature, tp))
        else:
            per_token, lse_s, lse_t, g_sum = jsd_forward(hs, ws, ht, wt, valid, params, tp)
        ctx.save_for_backward(hs, ws, ht, wt, valid, lse_s, lse_t, g_sum, temperature)
        ctx.params, ctx.tp, ctx.fn_name = params, tp, "linear_jsd"
        ctx.set_materialize_grads(False)
        return per_token

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        need_dh, need_dw = ctx.needs_input_grad[:2]
        if grad is None or not (need_dh or need_dw):
            return (None,) * 8
        *saved, temperature = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dh, dw = rl_op("jsd_backward", temperature)(*saved, grad, need_dh, need_dw,
                                                        *OP_ARGS.pack(ctx.params, temperature, ctx.tp))
            dh, dw = dh if need_dh else None, dw if need_dw else None
        else:
            dh, dw = jsd_backward(*saved, grad, ctx.params, ctx.tp, need_dh, need_dw)
        return dh, dw, None, None, None, None, None, None


# ------------------------------------------------------------------ the stage ops (torch.compile's route)
# Their trailing arguments: the record's fields, the vocab-parallel group (``GROUP_SCHEMA``), the
# runtime temperature (``head_family.OpArgs``).
OP_ARGS = OpArgs(JSDParams)
_INPUTS = "Tensor student_hidden, Tensor student_weight, Tensor teacher_hidden, Tensor teacher_weight, Tensor valid"


@functools.cache
def _op_samples() -> dict:
    """opcheck's samples: CPU, the torch backend, beta strictly inside (0, 1), one row not valid."""
    from ..core.backends import get_backend

    g = torch.Generator().manual_seed(0)
    hs, ws, ht, wt = (torch.randn(shape, generator=g) for shape in ((5, 8), (11, 8), (5, 6), (11, 6)))
    valid = torch.tensor([True, False, True, True, True])
    params = JSDParams(get_backend("torch", hs.device), 1 / 0.7, 0.3)
    inputs = (hs, ws, ht, wt, valid)
    saved = jsd_forward(*inputs, params, None)[1:]
    return {**temperature_samples("jsd_forward", inputs, OP_ARGS, params),
            **temperature_samples("jsd_backward", (*inputs, *saved, torch.randn(5, generator=g)), OP_ARGS, params,
                                  tail=(True, True))}


@stage_op("jsd_forward", f"({_INPUTS}, {OP_ARGS.schema}) -> (Tensor, Tensor, Tensor, Tensor)", _op_samples)
def _forward_op(hs, ws, ht, wt, valid, *args):
    params, group = OP_ARGS.unpack(args)
    tp = group_from_op(*group, -100, ws.shape[0], hs.device)
    return or_empty(jsd_forward(hs, ws, ht, wt, valid, params, tp), hs, (hs, ws, ht, wt, valid))


@_forward_op.register_fake
def _(hs, *args):
    return tuple(hs.new_empty(hs.shape[0], dtype=torch.float32) for _ in range(4))


@stage_op("jsd_backward", f"({_INPUTS}, Tensor lse_s, Tensor lse_t, Tensor g_sum, Tensor grad, bool need_dh, "
                          f"bool need_dw, {OP_ARGS.schema}) -> (Tensor, Tensor)", _op_samples)
def _backward_op(hs, ws, ht, wt, valid, lse_s, lse_t, g_sum, grad, need_dh, need_dw, *args):
    params, group = OP_ARGS.unpack(args)
    dh, dw = jsd_backward(hs, ws, ht, wt, valid, lse_s, lse_t, g_sum, grad, params, group_from_op(*group),
                          need_dh, need_dw)
    return (dh.contiguous() if need_dh else hs.new_empty(0)), (dw.contiguous() if need_dw else ws.new_empty(0))


@_backward_op.register_fake
def _(hs, ws, *args):
    need_dh, need_dw = args[7:9]
    return hs.new_empty(hs.shape if need_dh else (0,)), ws.new_empty(ws.shape if need_dw else (0,))
