"""Torch twin of the fused top-K head (``rl_kernels.ops.linear_topk``), and the merge of top-K
candidates that both backends and the vocab-parallel shards share.

Order everywhere: (value descending, id ascending), so that ties go to the smaller id; NaN and
-inf logits are never selected (a row with fewer than K other logits, possible only with
non-finite inputs, keeps empty slots: id -1).
"""
from __future__ import annotations

import torch

from .linear import capped_logits, per_row

# logits elements per chunk of rows (x 4 bytes in float32: 128 MiB); read at each call
CHUNK_ELEMENTS = 1 << 25


def exact_topk(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) (rows, k) of float ``z`` (rows, V): the k largest by (value descending, id
    ascending), NaN and -inf excluded (their slots: value -inf, id -1). ``torch.topk`` alone
    leaves the order of equal values unspecified: it only finds the k-th value t here; every value
    > t is taken, then the smallest ids among those == t."""
    if z.shape[1] < k:  # (a vocab shard narrower than k) NaN columns: never taken
        z = torch.cat([z, z.new_full((z.shape[0], k - z.shape[1]), float("nan"))], 1)
    rows, v = z.shape
    valid = z > float("-inf")  # (False for NaN)
    zv = torch.where(valid, z, torch.full((), float("-inf"), dtype=z.dtype, device=z.device))
    kth = torch.topk(zv, k, dim=1).values[:, -1:]
    above = valid & (zv > kth)
    tied = valid & (zv == kth)
    need = k - above.sum(1, keepdim=True)
    take = above | (tied & (tied.cumsum(1) <= need))
    col = torch.arange(v, device=z.device)
    key = torch.where(take, col, v)  # the taken ids, then v for what is not
    ids = torch.topk(key, k, dim=1, largest=False).indices  # (ascending keys: the taken ids first, in order)
    ids = torch.where(take.gather(1, ids), ids, -1)
    values = torch.where(ids >= 0, zv.gather(1, ids.clamp_min(0)),
                         torch.full((), float("-inf"), dtype=z.dtype, device=z.device))
    order = torch.sort(values, dim=1, descending=True, stable=True).indices  # ids ascending among ties
    return values.gather(1, order), ids.gather(1, order)


def merge_candidates(values: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) (N, k) from candidates (N, C) (C >= k): the k best by (value descending, id
    ascending), the empty ones (id -1, value -inf) last. Candidate ids are distinct within a row
    (-1 excepted): the splits' or the shards' exact top-k lists. Deterministic (two stable sorts),
    so every rank of a group that merges the same candidates gets the same bits."""
    big = torch.iinfo(torch.int64).max
    by_id = torch.sort(torch.where(ids >= 0, ids, big), dim=1, stable=True).indices
    values, ids = values.gather(1, by_id), ids.gather(1, by_id)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices[:, :k]
    return values.gather(1, order), ids.gather(1, order)


def torch_topk_select(hidden_states: torch.Tensor, weight: torch.Tensor, k: int,
                      params) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values (N, k) float32, ids (N, k) int64 local, lse (N,) float32) of z = hidden_states @
    weight.T * inv_temperature (``capped_logits`` with ``params.softcap``), float32, over row
    chunks of at most ``CHUNK_ELEMENTS`` logits; values and ids by :func:`exact_topk` (slots
    beyond V's valid logits: id -1)."""
    n = hidden_states.shape[0]
    v = weight.shape[0]
    w = weight.float()
    values = torch.empty(n, k, dtype=torch.float32, device=hidden_states.device)
    ids = torch.empty(n, k, dtype=torch.int64, device=hidden_states.device)
    lse = torch.empty(n, dtype=torch.float32, device=hidden_states.device)
    step = max(1, CHUNK_ELEMENTS // max(v, 1))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        z, _ = capped_logits(hidden_states[r0:r1].float() @ w.T, per_row(params.inv_temperature, slice(r0, r1)),
                             params.softcap)
        lse[r0:r1] = torch.logsumexp(z, dim=1)
        values[r0:r1], ids[r0:r1] = exact_topk(z, k)
    return values, ids, lse


def select(hidden_states, weight, params) -> tuple:
    """``ops.linear_topk.select``'s twin: :func:`torch_topk_select` with ``params.k``."""
    return torch_topk_select(hidden_states, weight, params.k, params)
