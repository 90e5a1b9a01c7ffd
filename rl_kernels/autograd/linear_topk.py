"""The fused top-K head (``rl_kernels.linear_topk``): the K largest student logits per row and
their log-probs, without the (N x V) logits. No gradient (the outputs are selections; the
differentiable log-probs at these ids come from ``rl_kernels.distill.linear_log_probs_at_ids``),
so the family has no autograd Function: its one backend call is :func:`topk_body`, run directly
eagerly and as the ``rl_kernels::linear_topk`` custom op while torch.compile traces (opaque: no
graph break; a temperature that Dynamo holds symbolically travels as the op's runtime tensor):
``FAMILY.forward_call``, declared with ``autograd.head_family.HeadFamily``.

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

from typing import NamedTuple

import torch

from ..core.backends import Backend
from .head_family import HeadFamily, Out, kernels
from .vocab_parallel import gather_topk, merge_lse


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


def _op_examples() -> list:
    """opcheck's inputs (``HeadFamily``): CPU, the torch backend."""
    from ..core.backends import get_backend

    g = torch.Generator().manual_seed(0)
    hidden_states, weight = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g)
    return [((hidden_states, weight), TopkParams(get_backend("torch", hidden_states.device), 1 / 0.7, 3))]


# Inputs: hidden_states (N, H), weight (V, H) (a vocab shard with a layout); outputs: log_probs (N, k)
# float32 and token_ids (N, k) int64 (:func:`topk_body`); no backward.
FAMILY = HeadFamily(
    TopkParams, "Tensor hidden_states, Tensor weight",
    outputs=(Out("log_probs", ("hidden_states[0]", "k")), Out("token_ids", ("hidden_states[0]", "k"), torch.int64)),
    forward=topk_body, forward_op="linear_topk", name="linear_topk", vocab=("weight", 0), examples=_op_examples,
    row_temperature=True)
