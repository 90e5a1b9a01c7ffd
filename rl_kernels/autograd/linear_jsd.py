"""Autograd of ``linear_jsd``: the generalized Jensen-Shannon divergence of two linear heads.

The head family "linear_jsd": its parameter record (``JSDParams``), two backend implementations
(``TritonJSD``, ``TorchJSD``) and Function. Forward: each head's lse (the fused head's forward),
then one pass of both GEMMs for the per-row divergence sums (Triton ``ops.linear_jsd`` or the
torch twin ``torch_ops.linear_jsd``); with a vocab-parallel group, the shard lse and the shard
sums are merged over the group. Backward:
dlogits windows of the student recomputed from both heads and consumed by the shared schedule
(``autograd.backward_schedule``); gradients reach the student only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends import Backend, implements
from ..label_check import raise_label_errors
from ..torch_ops.linear_jsd import torch_jsd_dlogits, torch_jsd_sums
from .backward_schedule import chunked_backward, full_precision_reduction
from .common import (OpArgs, custom_op_pair, fake_grads, first_order_only, grads_or_empty, hidden_for_weight_grad,
                     rl_op)
from .linear import HeadParams, head_forward
from .vocab_parallel import all_gather_rows, finish_hidden_grad, group_from_op, merge_lse


class JSDParams(NamedTuple):
    """``linear_jsd``'s parameters, one immutable record from the public function to the launcher."""

    backend: Backend  # resolved (backends.get_backend)
    inv_temperature: float
    beta: float
    tp: object = None  # vocab_parallel.ParallelParams for vocab-sharded heads
    may_have_ignored: bool = True  # False: no token is excluded (no ignored-row check in backward)


@implements("linear_jsd", "triton")
class TritonJSD:
    """The two-head divergence on the Triton kernels (``ops.linear_jsd``)."""

    @staticmethod
    def sums(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t, params: JSDParams):
        """Per-row (loss sum, g sum or None), float32 (N,): see ``ops.linear_jsd.jsd_split_sums``."""
        args = (student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t, params)
        if not student_hidden.shape[0]:
            return torch_jsd_sums(*args)
        from ..ops import default_config
        from ..ops.linear_jsd import jsd_split_sums

        cfg = default_config(student_hidden.device, student_hidden.dtype)
        return jsd_split_sums(*args, cfg, cfg.jsd_fwd)

    @staticmethod
    def dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, params: JSDParams):
        """(window function, dlogits dtype, column-width multiple) for ``chunked_backward``."""
        from ..ops import default_config
        from ..ops.linear_jsd import jsd_dlogits

        cfg = default_config(hs.device, hs.dtype)

        def window(rows, cols, out):
            return jsd_dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, rows, cols, out, params, cfg, cfg.jsd_bwd)
        return window, hs.dtype, cfg.jsd_bwd.block_n


@implements("linear_jsd", "torch")
class TorchJSD:
    """The two-head divergence's torch twin (``torch_ops.linear_jsd``)."""

    @staticmethod
    def sums(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t, params: JSDParams):
        return torch_jsd_sums(student_hidden, student_weight, teacher_hidden, teacher_weight, lse_s, lse_t, params)

    @staticmethod
    def dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, params: JSDParams):
        def window(rows, cols, out):
            return torch_jsd_dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum, scale, rows, cols, out, params)
        return window, torch.float32, 1


def jsd_forward(student_hidden, student_weight, teacher_hidden, teacher_weight, valid, params: JSDParams):
    """The forward without autograd: (per-token divergence x T^2 (N,) float32, 0 where not valid;
    the student's lse, the teacher's lse and the g sum (the student's lse when there is none),
    which the backward reads)."""
    raise_label_errors()  # a bad label that an earlier call's kernel reported (every backend call)
    n = student_hidden.shape[0]
    zeros = torch.zeros(n, dtype=torch.long, device=student_hidden.device)
    head = HeadParams(backend=params.backend, inv_temperature=params.inv_temperature,
                      ignore_index=-100, return_entropy=False)
    lse_s = head_forward(student_hidden, student_weight, zeros, head).lse.contiguous()
    lse_t = head_forward(teacher_hidden, teacher_weight, zeros, head).lse.contiguous()
    tp = params.tp
    if tp is not None:  # shard lse -> global lse of both heads (one all_gather)
        lse_w = all_gather_rows(tp.process_group, torch.stack([lse_s, lse_t]))
        lse_s, lse_t = (merge_lse(lse_w[:, i])[0].contiguous() for i in (0, 1))
    loss, g_sum = params.backend.family("linear_jsd").sums(student_hidden, student_weight, teacher_hidden,
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


def jsd_backward(hs, ws, ht, wt, lse_s, lse_t, g_sum, valid, grad, params: JSDParams, need_dh, need_dw):
    """(dh or None, dW or None) of the student from the forward's saved statistics
    (:func:`jsd_forward`) and the per-token upstream gradient ``grad`` (N,)."""
    raise_label_errors()  # as every backend call's body, backward too
    scale = torch.where(valid, grad.float() / params.inv_temperature ** 2,
                        torch.zeros((), device=grad.device)).contiguous()
    g_sum = None if params.beta == 0.0 else g_sum
    dlogits, dz_dtype, width = params.backend.family("linear_jsd").dlogits(hs, ws, ht, wt, lse_s, lse_t, g_sum,
                                                                           scale, params)
    reduce_dh = params.tp is not None and params.tp.reduce_hidden_grad
    h_dw = hidden_for_weight_grad(hs, ~valid, lse_s) if need_dw and params.may_have_ignored else hs
    with full_precision_reduction():
        dh, dw = chunked_backward(dlogits, hs, ws, dz_dtype, need_dh, need_dw, reduce_dh, h_dw,
                                  width_multiple=width)
    if reduce_dh:
        dh = finish_hidden_grad(dh, params.tp, hs.dtype)
    return dh, dw


class LinearJSDFunction(torch.autograd.Function):
    """Inputs: student_hidden (N, Hs), student_weight (V, Hs), teacher_hidden (N, Ht),
    teacher_weight (V, Ht), valid (N,) bool, JSDParams, runtime temperature (None, or the 0-d
    tensor of a compiled graph). Output: (N,) float32 per-token divergence x T^2, 0 where not
    valid. Gradients to the student's two inputs only. The family's one route, eager and under
    ``torch.compile(fullgraph=True)``: its backend calls are the ``rl_kernels::jsd_forward`` /
    ``jsd_backward`` custom ops while the compiler traces (a process group travels by name, its
    layout derived in the op's body), :func:`jsd_forward` / :func:`jsd_backward` directly
    otherwise."""

    @staticmethod
    def forward(ctx, student_hidden, student_weight, teacher_hidden, teacher_weight, valid, params, temperature=None):
        if torch.compiler.is_compiling():
            out = rl_op("jsd_forward", temperature)(student_hidden, student_weight, teacher_hidden, teacher_weight,
                                                    valid, *OP_ARGS.pack(params, temperature, params.tp))
        else:
            out = jsd_forward(student_hidden, student_weight, teacher_hidden, teacher_weight, valid, params)
        per_token, lse_s, lse_t, g_sum = out
        ctx.save_for_backward(student_hidden, student_weight, teacher_hidden, teacher_weight,
                              lse_s, lse_t, g_sum, valid, temperature)
        ctx.params, ctx.fn_name = params, "linear_jsd"
        return per_token

    @staticmethod
    @first_order_only
    def backward(ctx, grad):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad is None or not (need_dh or need_dw):
            return None, None, None, None, None, None, None
        *saved, temperature = ctx.saved_tensors
        if torch.compiler.is_compiling():
            dh, dw = rl_op("jsd_backward", temperature)(*saved, grad.float().contiguous(), need_dh, need_dw,
                                                        *OP_ARGS.pack(ctx.params, temperature, ctx.params.tp))
            return dh if need_dh else None, dw if need_dw else None, None, None, None, None, None
        dh, dw = jsd_backward(*saved, grad, ctx.params, need_dh, need_dw)
        return dh, dw, None, None, None, None, None


# ------------------------------------------------------------------ the backend calls as custom ops
# What torch.compile sees of the family (see the same section of ``autograd/linear.py``): its
# forward and backward as torch.library custom ops, not differentiable themselves (the Function is
# the autograd); their trailing arguments are the parameter record, the vocab-parallel layout (a
# process group travels by name) and the runtime temperature (``OP_ARGS``, ``autograd.common.OpArgs``).

OP_ARGS = OpArgs(JSDParams, skip=("tp",))  # (the layout travels as the group's values)


def _unpacked(args, local_vocab=None, device=None) -> JSDParams:
    """The record back from an op's trailing arguments, its layout derived again
    (``autograd.vocab_parallel.group_from_op``: ``local_vocab`` and ``device`` given for the
    forward, with its all_gather when ``vocab_start_index`` is None)."""
    params, group = OP_ARGS.unpack(args)
    return params._replace(tp=group_from_op(*group, -100, local_vocab, device))


@custom_op_pair(
    "rl_kernels::jsd_forward",
    schema="(Tensor student_hidden, Tensor student_weight, Tensor teacher_hidden, Tensor teacher_weight, "
           "Tensor valid, " + OP_ARGS.schema + ") -> (Tensor, Tensor, Tensor, Tensor)")
def _jsd_forward_op(hs, ws, ht, wt, valid, *args):
    """-> (per-token divergence x T^2, student lse, teacher lse, g sum), (N,) float32 each."""
    per_token, lse_s, lse_t, g_sum = jsd_forward(hs, ws, ht, wt, valid, _unpacked(args, ws.shape[0], hs.device))
    return per_token, lse_s, lse_t, g_sum.clone() if g_sum is lse_s else g_sum


@_jsd_forward_op.register_fake
def _(hs, *rest):
    return tuple(hs.new_empty(hs.shape[0], dtype=torch.float32) for _ in range(4))


@custom_op_pair(
    "rl_kernels::jsd_backward",
    schema="(Tensor student_hidden, Tensor student_weight, Tensor teacher_hidden, Tensor teacher_weight, "
           "Tensor lse_s, Tensor lse_t, Tensor g_sum, Tensor valid, Tensor grad, bool need_dh, bool need_dw, "
           + OP_ARGS.schema + ") -> (Tensor, Tensor)")
def _jsd_backward_op(hs, ws, ht, wt, lse_s, lse_t, g_sum, valid, grad, need_dh, need_dw, *args):
    """-> (dh, dW) of the student in the input dtypes, empty where not needed."""
    dh, dw = jsd_backward(hs, ws, ht, wt, lse_s, lse_t, g_sum, valid, grad, _unpacked(args), need_dh, need_dw)
    return grads_or_empty(dh, dw, hs, ws)


@_jsd_backward_op.register_fake
def _(hs, ws, ht, wt, lse_s, lse_t, g_sum, valid, grad, need_dh, need_dw, *params):
    return fake_grads(hs, ws, need_dh, need_dw)
