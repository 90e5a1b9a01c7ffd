"""Autograd of ``linear_jsd``: the generalized Jensen-Shannon divergence of two linear heads.

The head family "linear_jsd": its parameter record (``JSDParams``), its two bodies on the backend's
``sums`` / ``dlogits`` (``ops.linear_jsd`` or ``torch_ops.linear_jsd``) and their declaration (``FAMILY``, an
``autograd.head_family.HeadFamily``: the Function and the ``rl_kernels::jsd_forward`` / ``jsd_backward``
custom ops). Forward: each head's lse (the fused head's forward), then one pass of both GEMMs for
the per-row divergence sums (Triton ``ops.linear_jsd`` or the torch twin ``torch_ops.linear_jsd``);
with a vocab-parallel group, the shard lse and the shard sums are merged over the group. Backward:
dlogits windows of the student recomputed from both heads and consumed by the shared schedule
(``autograd.backward_schedule``); gradients reach the student only.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.backends import Backend
from ..core.label_check import raise_label_errors
from .backward_schedule import chunked_backward, full_precision_reduction
from .head_family import HeadFamily, Out, hidden_for_weight_grad, kernels
from .linear import HeadParams, head_forward
from .vocab_parallel import all_gather_rows, finish_hidden_grad, merge_lse


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


def _op_examples() -> list:
    """opcheck's inputs (``HeadFamily``): CPU, the torch backend, beta strictly inside (0, 1)."""
    from ..core.backends import get_backend

    g = torch.Generator().manual_seed(0)
    hs, ws, ht, wt = (torch.randn(shape, generator=g) for shape in ((5, 8), (11, 8), (5, 6), (11, 6)))
    valid = torch.tensor([True, False, True, True, True])
    return [((hs, ws, ht, wt, valid), JSDParams(get_backend("torch", hs.device), 1 / 0.7, 0.3))]


_ROWS = ("student_hidden[0]",)  # (N,) float32: every slot
# Inputs: student_hidden (N, Hs), student_weight (V, Hs), teacher_hidden (N, Ht), teacher_weight
# (V, Ht), valid (N,) bool; output: the per-token divergence x T^2, 0 where not valid; gradients to
# the student's two inputs only.
FAMILY = HeadFamily(
    JSDParams, "Tensor student_hidden, Tensor student_weight, Tensor teacher_hidden, Tensor teacher_weight, "
               "Tensor valid",
    outputs=(Out("per_token", _ROWS), Out("lse_s", _ROWS, saved=True, output=False),
             Out("lse_t", _ROWS, saved=True, output=False), Out("g_sum", _ROWS, saved=True, output=False)),
    forward=jsd_forward, backward=jsd_backward, grads=("student_hidden", "student_weight"),
    forward_op="jsd_forward", backward_op="jsd_backward", name="linear_jsd", vocab=("student_weight", 0),
    examples=_op_examples)
