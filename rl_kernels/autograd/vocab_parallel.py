"""Vocab tensor parallelism: log-probs / entropy of a vocabulary sharded over a process group
(the convention of every public function's ``process_group`` argument). This module holds what the
families share: the layout (``parallel_params``), the collectives and the merge of the shards'
statistics; each family's own Function runs its shard (``autograd.linear.vp_forward``,
``autograd.logits.vp_forward``, the JSD's sums in ``autograd.linear_jsd``).

Rank r of the group holds the contiguous vocab rows [start_r, start_r + V_r) of the head (or of
the logits); shards may differ in size and are ordered by group rank. Every rank runs the
single-GPU kernels on its shard and gets, per token, its shard's statistics
    lse_r = logsumexp_{v in shard} z_v,   H_r = entropy of the shard's own softmax,
    z_y,r = the label logit where the label falls in the shard (else 0), owned_r in {0, 1}.
One collective (an all_gather of these four (N,) float32 rows) gives every rank the same (W, 4, N)
tensor, merged in rank order by the same code, so all ranks return bitwise identical results:
    lse = log sum_r exp(lse_r),  w_r = exp(lse_r - lse),  H = sum_r w_r (H_r - log w_r),
    log p_y = z_y - lse  with z_y = the owner's z_y,r.
(The entropy merge is the chain rule of entropy over the partition of the vocabulary into
shards: H = H(w) + sum_r w_r H_r; Cover & Thomas, "Elements of Information Theory", thm 2.5.1.)
A non-ignored label owned by no rank, or by two, raises ValueError (no garbage).

Backward, on each rank, from the merged lse and H: dz on the shard is the single-GPU gradient
with global statistics (d log p_y/dz = onehot(y) - p, dH/dz = -p (log p + H), p = exp(z - lse)),
so dW is the local shard's gradient and dh = dz W_shard is this rank's *partial* sum. The full dh
is the sum over the group. Megatron convention (Megatron-LM ``ColumnParallelLinear``): the input
of the vocab-parallel head passes through ``copy_to_tensor_model_parallel_region`` (identity
forward, all-reduce backward), or, with sequence parallelism, through
``gather_from_sequence_parallel_region`` (all-gather forward, reduce-scatter backward); either
region sums the ranks' partial dh, so the loss function returns the partial dh (rounded to the
input dtype, as Megatron's own vocab-parallel cross-entropy does). verl's Megatron fused path
(``verl/models/mcore/model_forward_fused.py``) calls the head on the output of
``gather_from_sequence_parallel_region`` when ``sequence_parallel`` is on: keep
``reduce_hidden_grad=False`` there. Without sequence parallelism that path passes the decoder
output straight in, and nothing else sums dh over the tensor-parallel group: pass
``reduce_hidden_grad=True``, and the backward all-reduces the float32 partials over the group and
rounds once (the unsharded head's accuracy; twice the bytes of a 16-bit all-reduce). The verl
integration (``rl_kernels/integrations/verl_impl/megatron.py``) makes this choice per call and its
tests prove both cases against an unsharded float64 gradient.
"""
from __future__ import annotations

import dataclasses

import torch

from ..core.validation import check_vocab_parallel_args
from ..torch_ops.linear_topk import merge_candidates


def _dist():
    import torch.distributed as dist

    return dist


# [Work handle or None, torch.ScriptList of the tensors, the tensors] of this module's collectives
# whose tensors a communication thread may still hold; see ``collective``.
_KEPT: list = []


def collective(fn, *tensors, group) -> None:
    """Run the ``torch.distributed`` collective ``fn(*tensors, group=group)`` (``tensors``: its
    tensor and tensor-list arguments, used in place, no copies) and wait for it. Every collective
    of this module runs through here, one thread at a time (as the ranks' common order of
    collectives requires), so that a communication thread never drops the last C++ reference
    besides a tensor's own Python object.

    Why (issue 35): torch keeps a tensor's Python object alive while C++ holds the tensor too and
    releases it, under the GIL, when the C++ references fall from two to one (``Note [PyObject
    preservation for Tensor and Storages]``, c10/util/intrusive_ptr.h). A communication thread
    (gloo's ``pt_gloo_runloop``, NCCL's watchdog) holds the Work, and through it the tensors, for
    a while after ``wait()`` returns. If it drops the second-to-last reference it takes the GIL,
    and at interpreter exit that thread is ended inside the Work's destructor: std::terminate,
    SIGABRT (about 12 of 30 runs over gloo on a loaded 2-core machine with the synchronous
    ``dist.all_gather`` / ``all_reduce`` on temporaries; torch issue #190489 is the same class).
    Here a ``torch.ScriptList`` adds one C++ reference to each tensor before the collective
    starts, so a communication thread's release never leaves only one. The Work handle stays
    referenced until the next collective here; the tensors and their ScriptList until a later
    collective sees that nothing else holds them (``Tensor._use_count()`` 2: the Python object and
    the ScriptList), and this thread drops them. What is kept at exit goes with this module's
    globals, after ``Py_IsInitialized()`` has turned false, when torch skips the GIL and leaks
    (``PyInterpreter::decref``); an atexit hook would run before that point, so there is none.
    Memory: the float32 ``dh`` of ``finish_hidden_grad`` lives until the next collective, not
    until its rounding. ``tests/autograd/test_exit_clean.py`` is the test."""
    flat = list({id(t): t for x in tensors for t in (x if isinstance(x, (list, tuple)) else (x,))}.values())
    held = torch.ScriptList(flat)  # one more C++ reference to each tensor, before the collective holds any
    work = fn(*tensors, group=group, async_op=True)
    if work is not None:  # None: this rank is not in ``group`` (torch warns, as the synchronous call did)
        work.wait()
    earlier = [(h, f) for _, h, f in _KEPT]
    _KEPT[:] = [(work, held, flat)]  # the earlier Work handles are dropped here
    _KEPT[:0] = [(None, h, f) for h, f in earlier if any(t._use_count() > 2 for t in f)]
    # the other earlier tensors are released on return, by this thread


@dataclasses.dataclass(frozen=True)
class ParallelParams:
    """A validated vocab-parallel layout: the group, this rank's first global id, the total
    vocabulary (None when ``vocab_start_index`` was given: no collective for it) and whether the
    backward all-reduces dh."""

    process_group: object
    start: int | None  # None only while torch.compile traces without vocab_start_index
    vocab_size: int | None
    reduce_hidden_grad: bool


def parallel_params(process_group, vocab_start_index, reduce_hidden_grad, ignore_index, local_vocab: int,
                    device, allow_reduce_hidden_grad: bool = True) -> ParallelParams | None:
    """The one entry point of every public function's vocab-parallel arguments: validates the trio
    (``validation.check_vocab_parallel_args``; raises TypeError / ValueError / RuntimeError naming
    the argument) and returns None without a group, else the layout. Without
    ``vocab_start_index`` one small all_gather of the shard sizes derives this rank's first id
    and the total vocabulary (shards in group-rank order). While torch.compile traces, only the
    arguments are checked: the layout (``start`` None when not given) is derived again in the
    custom ops' bodies."""
    check_vocab_parallel_args(process_group, vocab_start_index, reduce_hidden_grad, ignore_index,
                              allow_reduce_hidden_grad)
    if process_group is None:
        return None
    if torch.compiler.is_compiling():  # traced: the custom ops' bodies derive the layout (and its all_gather)
        return ParallelParams(process_group, vocab_start_index, None, reduce_hidden_grad)
    if vocab_start_index is not None:
        return ParallelParams(process_group, int(vocab_start_index), None, reduce_hidden_grad)
    dist = _dist()
    world = dist.get_world_size(process_group)
    mine = torch.tensor([local_vocab], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(mine) for _ in range(world)]
    collective(dist.all_gather, sizes, mine, group=process_group)
    sizes = [int(s) for s in torch.cat(sizes).tolist()]
    rank = dist.get_rank(process_group)
    return ParallelParams(process_group, sum(sizes[:rank]), sum(sizes), reduce_hidden_grad)


def local_labels(labels, start: int, local_vocab: int, ignore_index: int):
    """(local ids, owned): ids shifted into the shard; rows whose label lies in another shard get
    the id ``local_vocab`` (matches no column), ignored rows keep ``ignore_index``."""
    owned = (labels >= start) & (labels < start + local_vocab)
    local = torch.where(owned, labels - start, local_vocab)
    return torch.where(labels == ignore_index, ignore_index, local), owned


def all_gather_rows(process_group, part: torch.Tensor) -> torch.Tensor:
    """(W, *part.shape): every rank's ``part`` in group-rank order (one all_gather)."""
    dist = _dist()
    gathered = [torch.empty_like(part) for _ in range(dist.get_world_size(process_group))]
    collective(dist.all_gather, gathered, part.contiguous(), group=process_group)
    return torch.stack(gathered)


def gather_topk(process_group, values: torch.Tensor, ids: torch.Tensor, extra: torch.Tensor, k: int) -> tuple:
    """Each shard's top-k (``values`` (N, k) float32, ``ids`` (N, k) int64 global, -1 empty) and an
    ``extra`` (N, E) float32 of its own, gathered in one all_gather -> (values, ids) (N, k): the
    group's top k (``torch_ops.linear_topk.merge_candidates``: the same bits on every rank), and the
    shards' extras (W, N, E)."""
    n = values.shape[0]
    part = torch.cat([values, ids.to(torch.int32).view(torch.float32), extra], 1)
    gathered = all_gather_rows(process_group, part)  # (W, N, 2k + E)
    world = gathered.shape[0]
    values = gathered[:, :, :k].permute(1, 0, 2).reshape(n, world * k)
    ids = gathered[:, :, k:2 * k].contiguous().view(torch.int32).long().permute(1, 0, 2).reshape(n, world * k)
    return (*merge_candidates(values, ids, k), gathered[:, :, 2 * k:])


def finish_hidden_grad(dh, tp, dtype):
    """With ``tp.reduce_hidden_grad``: sum the float32 partial ``dh`` over the group and round it
    once to ``dtype`` (else ``dh`` as is: the caller's region sums it)."""
    if dh is None or tp is None or not tp.reduce_hidden_grad:
        return dh
    collective(_dist().all_reduce, dh, group=tp.process_group)
    return dh.to(dtype)


def merge_lse(lse_w: torch.Tensor):
    """(lse, log w_r) from the (W, N) shard logsumexps, in rank order."""
    m = lse_w.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), device=m.device))
    lse = m + torch.log(torch.exp(lse_w - m).sum(0))
    return lse, lse_w - lse


def merge_shards(process_group, lse_r, entropy_r, z_y_r, owned, labels, ignore_index, vocab_size,
                 sum_pi_squared_r=None):
    """all_gather the four (N,) float32 shard statistics (five with ``sum_pi_squared_r``, the shard's own
    sum of squared probabilities) over the group and merge them in rank order (module docstring).
    Returns (log_probs, entropy, lse, sum_pi_squared), (N,) float32, identical bits on every rank; entropy
    and log_probs are 0 where ``labels`` (if given) is ``ignore_index``; entropy / sum_pi_squared are None
    when ``entropy_r`` / ``sum_pi_squared_r`` are. sum_j p_j^2 = sum_r w_r^2 S_r (p_j = w_r p_j,r on shard
    r). Raises ValueError for a label owned by no rank or by several."""
    n = lse_r.shape[0]
    zero = torch.zeros((), device=lse_r.device)
    rows = [lse_r.float(), entropy_r.float() if entropy_r is not None else zero.expand(n),
            torch.where(owned, z_y_r.float(), zero), owned.float()]
    if sum_pi_squared_r is not None:
        rows.append(sum_pi_squared_r.float())
    gathered = all_gather_rows(process_group, torch.stack(rows)).unbind(1)  # (W, N) each
    lse_w, ent_w, zy_w, own_w = gathered[:4]
    lse, log_w = merge_lse(lse_w)
    w = log_w.exp()
    sum_pi_squared = (w * w * gathered[4]).sum(0) if sum_pi_squared_r is not None else None
    # a shard with w = 0 adds 0 (not 0 * inf); a NaN w (a non-finite row) must stay NaN
    entropy = torch.where(w == 0, zero, w * (ent_w - log_w)).sum(0).clamp_min(0.0) \
        if entropy_r is not None else None
    if labels is None:
        return None, entropy, lse, sum_pi_squared
    valid = labels != ignore_index
    count = own_w.sum(0)
    bad = valid & (count != 1)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        what = "no shard" if int(count[i]) == 0 else f"{int(count[i])} shards (overlapping vocab_start_index)"
        raise ValueError(f"labels: {int(bad.sum())} labels are held by no shard or by several; first at "
                         f"flat position {i}: label {int(labels[i])} is in {what}"
                         + (f" (vocab_size {vocab_size})" if vocab_size is not None else ""))
    log_probs = torch.where(valid, (zy_w.sum(0) - lse).clamp_max(0.0), zero)
    if entropy is not None:
        entropy = torch.where(valid, entropy, zero)
    return log_probs, entropy, lse, sum_pi_squared


# ------------------------------------------------------------------ the layout on torch.compile's route
# A custom op takes no Python objects: a family's ops take the layout as the plain values of
# ``GROUP_SCHEMA`` (the group by name, ``ProcessGroup.group_name``; all None / False without a
# group) and look the group up again in their bodies, which also derive the layout
# (``parallel_params``: one small all_gather when ``vocab_start_index`` is None, as in eager). The
# collectives run inside the ops' bodies, eagerly.
GROUP_SCHEMA = "str? group_name, int? vocab_start_index, bool reduce_hidden_grad"


def group_by_name(name: str):
    """The ``torch.distributed`` process group called ``name`` (``ProcessGroup.group_name``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def op_group(tp: ParallelParams | None) -> tuple:
    """(group name, vocab_start_index or None, reduce_hidden_grad): ``GROUP_SCHEMA``'s values of a
    layout, (None, None, False) without one."""
    return (None, None, False) if tp is None else (tp.process_group.group_name, tp.start, tp.reduce_hidden_grad)


def group_from_op(group_name, vocab_start_index, reduce_hidden_grad, ignore_index=-100, local_vocab=None,
                  device=None, allow_reduce_hidden_grad=True) -> ParallelParams | None:
    """The layout back from ``GROUP_SCHEMA``'s values in an op's body: None without a group; with
    ``local_vocab`` and ``device`` (a forward) derived as the public functions derive it
    (``parallel_params``, with its all_gather when ``vocab_start_index`` is None); otherwise (a
    backward) what a backward reads: the group and whether dh is all-reduced."""
    if group_name is None:
        return None
    if local_vocab is None:
        return ParallelParams(group_by_name(group_name), 0, None, reduce_hidden_grad)
    return parallel_params(group_by_name(group_name), vocab_start_index, reduce_hidden_grad, ignore_index,
                           local_vocab, device, allow_reduce_hidden_grad)
