"""The fused top-K head (``rl_kernels.linear_topk``): the K largest student logits per row and
their log-probs, without the (N x V) logits. No gradient (the outputs are selections; the
differentiable log-probs at these ids come from ``rl_kernels.distill.linear_log_probs_at_ids``),
so the family has no autograd Function: its one backend call is :func:`topk_body`, which
:func:`linear_topk_call` runs directly eagerly and as the ``rl_kernels::linear_topk`` custom op while
torch.compile traces (opaque: no graph break; a temperature that Dynamo holds symbolically travels
as the op's runtime tensor).

The family "linear_topk": its parameter record (``TopkParams``) and its body on the backend's
``select`` (``ops.linear_topk``: one pass over the GEMM tiles keeping each row's candidates in
registers, then the merge of the splits; or ``torch_ops.linear_topk``, float32 logits chunks).
Both give, per row, the exact top-K of the float32 logits in the order (value
descending, id ascending) and the lse, the candidates merged by
``torch_ops.linear_topk.merge_candidates``.

Vocab-parallel (``autograd.vocab_parallel``): each rank selects its shard's top-K with global ids
(its ``vocab_start_index`` added) and its shard's lse; one all_gather of (N, 2K + 1) float32 (the
ids travel as their int32 bits) gives every rank every shard's candidates, merged in rank order by
the same code: bitwise equal outputs on every rank, equal to the unsharded selection (the order
is exact and the candidates of a shard include its part of the global top-K)."""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..core.backends import Backend
from .head_family import OpArgs, kernels, or_empty, rl_op, stage_op, temperature_samples
from .vocab_parallel import gather_topk, group_from_op, merge_lse


class TopkParams(NamedTuple):
    """The fused top-K head's parameters (one record from the public function to the backends)."""

    backend: Backend  # resolved (backends.get_backend)
    inv_temperature: float  # or, in a backend call, a per-row (N,) float32 tensor
    k: int
    softcap: float | None = None  # z = c tanh(h.w / c) / T; None: z = h.w / T


def topk_body(hidden_states, weight, params: TopkParams, tp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_probs (N, k) float32, token_ids (N, k) int64 global ids) of hidden_states (N, H) and
    weight (V, H) (a vocab shard with the layout ``tp``: its rows are the global ids
    tp.start + j, and the shards' candidates are merged over ``tp.process_group``). log_probs =
    value - lse; an empty slot (id -1: fewer than k logits that are neither NaN nor -inf) NaN."""
    n = hidden_states.shape[0]
    if n == 0:
        return (hidden_states.new_empty((0, params.k), dtype=torch.float32),
                hidden_states.new_empty((0, params.k), dtype=torch.int64))
    values, ids, lse = kernels(params.backend, "linear_topk").select(hidden_states, weight, params)
    if tp is not None:
        values, ids, lse_w = gather_topk(tp.process_group, values, torch.where(ids >= 0, ids + tp.start, -1),
                                         lse[:, None], params.k)
        lse, _ = merge_lse(lse_w[:, :, 0])
    log_probs = torch.where(ids >= 0, values - lse[:, None], torch.full((), float("nan"), device=values.device))
    return log_probs, ids


def linear_topk_call(hidden_states, weight, params: TopkParams, temperature=None, tp=None) -> tuple:
    """:func:`topk_body`'s (log_probs, token_ids): directly eagerly, as the ``rl_kernels::linear_topk``
    op while torch.compile traces (``temperature``: None or the runtime temperature of a compiled graph,
    ``head_family.split_temperature``)."""
    if not torch.compiler.is_compiling():
        return topk_body(hidden_states, weight, params, tp)
    return rl_op("linear_topk", temperature)(hidden_states, weight, *OP_ARGS.pack(params, temperature, tp))


# ------------------------------------------------------------------ the op (torch.compile's route)
OP_ARGS = OpArgs(TopkParams)  # the record's fields, the vocab-parallel group, the runtime temperature


@functools.cache
def _op_samples() -> dict:
    """opcheck's samples: CPU, the torch backend; the temperature as a float, 0-d and per row."""
    from ..core.backends import get_backend

    g = torch.Generator().manual_seed(0)
    hidden_states, weight = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g)
    params = TopkParams(get_backend("torch", hidden_states.device), 1 / 0.7, 3)
    return temperature_samples("linear_topk", (hidden_states, weight), OP_ARGS, params, rows=5)


@stage_op("linear_topk", f"(Tensor hidden_states, Tensor weight, {OP_ARGS.schema}) -> (Tensor, Tensor)", _op_samples)
def _topk_op(hidden_states, weight, *args):
    params, group = OP_ARGS.unpack(args)
    tp = group_from_op(*group, -100, weight.shape[0], hidden_states.device)
    return or_empty(topk_body(hidden_states, weight, params, tp), hidden_states, (hidden_states, weight))


@_topk_op.register_fake
def _(hidden_states, weight, *args):
    shape = (hidden_states.shape[0], OP_ARGS.unpack(args, read_temperature=False)[0].k)
    return hidden_states.new_empty(shape, dtype=torch.float32), hidden_states.new_empty(shape, dtype=torch.int64)
