"""Vocab tensor parallelism: log-probs / entropy of a vocabulary sharded over a process group
(the convention of every public function's ``process_group`` argument, and its autograd).

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
integration (``rl_kernels/integrations/verl/megatron.py``) makes this choice per call and its
tests prove both cases against an unsharded float64 gradient.
"""
from __future__ import annotations

import dataclasses

import torch

from ..label_check import raise_label_errors
from ..validation import check_label_values, check_vocab_parallel_args, warn_fp16_temperature
from .common import (RUNTIME_TEMPERATURE_SCHEMA, compiling, custom_op_pair, fake_grads, first_order_only, float_grads,
                     grads_or_empty, if_asked, op_temperature, or_empty, refuse_double_backward, rl_op)
from .linear import (HEAD_OP_SCHEMA, HeadOutputs, HeadParams, gathered_logits, head_backward, head_forward,
                     head_op_params, head_params_from_op)
from .logits import LOGITS_OP_SCHEMA, LogitsOutputs, LogitsParams, logits_op_params, logits_params_from_op


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
    until its rounding. ``tests/test_exit_clean.py`` is the test."""
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
    if compiling():  # traced: the custom ops' bodies derive the layout (and run its all_gather)
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


def vp_linear_forward(hidden_states, weight, labels, params: HeadParams, tp: ParallelParams):
    """The vocab-parallel head's forward without autograd: (``HeadOutputs`` merged over the group,
    the labels shifted into this shard (``local_labels``), which the backward reads)."""
    v_r = weight.shape[0]
    local, owned = local_labels(labels, tp.start, v_r, params.ignore_index)
    shard = head_forward(hidden_states, weight, local, params)
    z_y = gathered_logits(hidden_states, weight, torch.where(owned, local, 0)[:, None], params)[:, 0]
    log_probs, entropy, lse, sum_pi_squared = merge_shards(
        tp.process_group, shard.lse, shard.entropy, z_y, owned, labels, params.ignore_index, tp.vocab_size,
        shard.sum_pi_squared)
    # the merged entropy of ignored rows is 0 here; the backward masks those rows anyway
    return HeadOutputs(log_probs, entropy, lse, sum_pi_squared), local


def vp_linear_backward(hidden_states, weight, local, saved: HeadOutputs, grads: HeadOutputs, params: HeadParams,
                       tp: ParallelParams, need_dh: bool, need_dw: bool):
    """(dh or None, dW or None) of the vocab-parallel head (``grads``: float32 contiguous)."""
    dh, dw = head_backward(hidden_states, weight, local, saved, grads, params, need_dh, need_dw,
                           dh_float32=tp.reduce_hidden_grad)
    # summed in float32, rounded once: as accurate as the unsharded head
    return finish_hidden_grad(dh, tp, hidden_states.dtype), dw


class VocabParallelLinearFunction(torch.autograd.Function):
    """hidden_states (N, H), weight shard (V_r, H), global labels (N,), HeadParams, ParallelParams
    -> the five fields of ``HeadOutputs`` (log_probs, entropy or None, lse, sum_pi_squared or
    None, None), float32, identical on every rank."""

    @staticmethod
    def forward(ctx, hidden_states, weight, labels, params: HeadParams, tp: ParallelParams):
        out, local = vp_linear_forward(hidden_states, weight, labels, params, tp)
        ctx.save_for_backward(hidden_states, weight, local, out.lse, out.entropy, out.sum_pi_squared)
        ctx.params, ctx.tp, ctx.fn_name = params, tp, params.name
        ctx.set_materialize_grads(False)
        return tuple(out)

    @staticmethod
    @first_order_only
    def backward(ctx, *output_grads):
        hidden_states, weight, local, lse, entropy, sum_pi_squared = ctx.saved_tensors
        grads = HeadOutputs(*output_grads)
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if all(g is None for g in grads) or not (need_dh or need_dw):
            return None, None, None, None, None
        grads = grads._replace(**{k: getattr(grads, k).float().contiguous()
                                  for k in ("lse", "sum_pi_squared") if getattr(grads, k) is not None})
        dh, dw = vp_linear_backward(hidden_states, weight, local, HeadOutputs(None, entropy, lse, sum_pi_squared),
                                    grads, ctx.params, ctx.tp, need_dh, need_dw)
        return dh, dw, None, None, None


def vp_logits_forward(logits, labels, params: LogitsParams, tp: ParallelParams):
    """The vocab-parallel from-logits forward without autograd: (``LogitsOutputs`` merged over
    the group, the labels shifted into this shard (``local_labels``; None without labels))."""
    v_r = logits.shape[1]
    shard_params = params._replace(return_mean_log_p=False)
    stats = params.backend.family("logits").forward(logits, None, shard_params)
    local = None
    if labels is not None:
        local, owned = local_labels(labels, tp.start, v_r, params.ignore_index)
        z_y = logits.gather(1, torch.where(owned, local, 0).long()[:, None])[:, 0].float() * params.inv_temperature
    else:
        owned = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        z_y = torch.zeros(logits.shape[0], device=logits.device)
    log_probs, entropy, lse, sum_pi_squared = merge_shards(
        tp.process_group, stats["lse"], stats.get("entropy"), z_y, owned, labels, params.ignore_index,
        tp.vocab_size, stats.get("sum_pi_squared"))
    return LogitsOutputs(log_probs, entropy, lse, None, sum_pi_squared), local


def vp_logits_backward(logits, local, lse, entropy, sum_pi_squared, g: LogitsOutputs, params: LogitsParams):
    """d loss / d logits of the shard (a new tensor in the logits' dtype) from the merged
    statistics and the upstream gradients ``g``; ``local``: the forward's shard labels or None."""
    params = params._replace(return_mean_log_p=False)
    zero = torch.zeros((), device=logits.device)
    valid = (local != params.ignore_index) if local is not None else None
    # onehot(y) - p on the shard: the -p part folds into the lse coefficient on every rank, the
    # onehot part is added below on the owner's column only
    coef = g.lse.float() if g.lse is not None else torch.zeros(lse.shape, device=lse.device)
    grad_log_probs = None
    if g.log_probs is not None:
        grad_log_probs = torch.where(valid, g.log_probs.float(), zero)
        coef = coef - grad_log_probs
    grads = {"lse": coef.contiguous()}
    if g.entropy is not None:
        grads["entropy"] = (torch.where(valid, g.entropy.float(), zero) if valid is not None
                            else g.entropy.float()).contiguous()
    stats = {"row_max": lse, "log_sum": torch.zeros_like(lse)}
    if entropy is not None:
        stats["entropy"] = entropy
    if g.sum_pi_squared is not None:  # global p = exp(z - lse) and global S on every shard
        stats["sum_pi_squared"] = sum_pi_squared
        grads["sum_pi_squared"] = g.sum_pi_squared.float().contiguous()
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format)
    # labels for the shard kernel: only the ignored / kept mask (id -1 ... matches no column,
    # and no log-prob gradient is passed: the onehot part is added below)
    row_labels = None if local is None else torch.where(valid, -1 if params.ignore_index != -1 else -2,
                                                        params.ignore_index)
    params.backend.family("logits").backward(logits, grad, row_labels, stats, grads, params)
    if grad_log_probs is not None:
        owned = valid & (local >= 0) & (local < logits.shape[1])  # (ignore_index is negative here)
        rows = owned.nonzero()[:, 0]
        cols = local[rows].long()
        grad[rows, cols] += (grad_log_probs[rows] * params.inv_temperature).to(grad.dtype)
    return grad


class VocabParallelLogitsFunction(torch.autograd.Function):
    """Logits shard (N, V_r), global labels (N,) or None, LogitsParams, ParallelParams -> the
    fields of ``LogitsOutputs`` (log_probs or None, entropy or None, lse, None, sum_pi_squared or
    None), float32 (N,), identical on every rank. The shard's statistics come from the params'
    backend (labels None: the label logit is gathered here)."""

    @staticmethod
    def forward(ctx, logits, labels, params: LogitsParams, tp: ParallelParams):
        out, local = vp_logits_forward(logits, labels, params, tp)
        ctx.save_for_backward(logits, local, out.lse, out.entropy, out.sum_pi_squared)
        ctx.params, ctx.fn_name = params, params.name
        ctx.set_materialize_grads(False)
        return tuple(out)

    @staticmethod
    @first_order_only
    def backward(ctx, *output_grads):
        logits, local, lse, entropy, sum_pi_squared = ctx.saved_tensors
        g = LogitsOutputs(*output_grads)
        if not ctx.needs_input_grad[0] or all(x is None for x in g):
            return (None,) * 4
        return (vp_logits_backward(logits, local, lse, entropy, sum_pi_squared, g, ctx.params),) + (None,) * 3


def vp_lse_gather_forward(hidden_states, weight, valid, ids, params: HeadParams, tp: ParallelParams):
    """``VocabParallelLseGatherFunction``'s forward without autograd: (lse, z, the shard's row
    labels, the shard's ids), the last two read by the backward."""
    v_r = weight.shape[0]
    labels = torch.where(valid, v_r, params.ignore_index)  # no label column on any shard
    lse_r = head_forward(hidden_states, weight, labels, params).lse
    owned = (ids >= tp.start) & (ids < tp.start + v_r)
    local_ids = torch.where(owned, ids - tp.start, -1)
    z_r = gathered_logits(hidden_states, weight, local_ids.clamp_min(0), params)
    zero = torch.zeros((), device=z_r.device)
    part = torch.cat([lse_r.float()[:, None], torch.where(owned, z_r, zero), owned.float()], 1)
    k = ids.shape[1]
    gathered = all_gather_rows(tp.process_group, part)  # (W, N, 1 + 2K)
    lse, _ = merge_lse(gathered[:, :, 0])
    count = gathered[:, :, 1 + k:].sum(0)
    if bool((count != 1).any()):
        bad = (count != 1).nonzero()[0]
        raise ValueError(f"teacher_token_ids: id {int(ids[bad[0], bad[1]])} at (token {int(bad[0])}, "
                         f"k {int(bad[1])}) is held by {int(count[bad[0], bad[1]])} shards, expected one "
                         f"(check vocab_start_index)")
    return lse, gathered[:, :, 1:1 + k].sum(0), labels, local_ids


def vp_lse_gather_backward(hidden_states, weight, labels, lse, local_ids, grad_lse, grad_z, params: HeadParams,
                           tp: ParallelParams, need_dh: bool, need_dw: bool):
    """(dh or None, dW or None) of :func:`vp_lse_gather_forward`."""
    grads = HeadOutputs(None, lse=grad_lse.float().contiguous() if grad_lse is not None else None,
                        gathered_logits=grad_z)
    dh, dw = head_backward(hidden_states, weight, labels, HeadOutputs(None, lse=lse), grads, params, need_dh,
                           need_dw, local_ids, dh_float32=tp.reduce_hidden_grad)
    return finish_hidden_grad(dh, tp, hidden_states.dtype), dw


class VocabParallelLseGatherFunction(torch.autograd.Function):
    """hidden_states (N, H), weight shard (V_r, H), valid (N,) bool, global ids (N, K),
    HeadParams, ParallelParams -> (lse (N,), z (N, K)) float32, identical on every rank: the row
    logsumexp over the whole sharded vocabulary and the logits at ``ids`` (each from the rank that
    holds it), merged after one all_gather. Backward: d lse/dz = p on every shard, the gradients of
    z as sparse entries on the owner's shard (``autograd.linear``); rows with ``valid``
    False get none. For the distillation losses (``rl_kernels.distill``)."""

    @staticmethod
    def forward(ctx, hidden_states, weight, valid, ids, params: HeadParams, tp: ParallelParams):
        lse, z, labels, local_ids = vp_lse_gather_forward(hidden_states, weight, valid, ids, params, tp)
        ctx.save_for_backward(hidden_states, weight, labels, lse, local_ids)
        ctx.params, ctx.tp, ctx.fn_name = params, tp, params.name
        ctx.set_materialize_grads(False)
        return lse, z

    @staticmethod
    @first_order_only
    def backward(ctx, grad_lse, grad_z):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_lse is None and grad_z is None) or not (need_dh or need_dw):
            return (None,) * 6
        dh, dw = vp_lse_gather_backward(*ctx.saved_tensors, grad_lse, grad_z, ctx.params, ctx.tp, need_dh, need_dw)
        return dh, dw, None, None, None, None


# ------------------------------------------------------------------ torch.compile: custom ops
# The three vocab-parallel Functions as torch.library custom ops (see the same section of
# ``autograd/linear.py``). The group travels by name (``ProcessGroup.group_name``; a custom op
# takes no Python objects) and is looked up again in the op's body, which also derives the layout
# (``parallel_params``: one small all_gather when ``vocab_start_index`` is None, as in eager) and
# checks the label values on the host. The collectives run inside the ops' bodies, eagerly. The
# runtime temperature (``autograd.common.op_temperature``) follows the head's plain values: in the
# forward ops before the group's (``_HEAD_AND_GROUP``), last in the backward ops.
_GROUP_SCHEMA = "str group_name, int? vocab_start_index, bool reduce_hidden_grad"
_HEAD_AND_GROUP = HEAD_OP_SCHEMA + ", Tensor? temperature, " + _GROUP_SCHEMA


def group_by_name(name: str):
    """The ``torch.distributed`` process group called ``name`` (``ProcessGroup.group_name``)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def op_layout(group_name, vocab_start_index, reduce_hidden_grad, ignore_index, local_vocab, device,
              allow_reduce_hidden_grad=True) -> ParallelParams:
    """A forward op's layout from its plain values (``parallel_params``, with its all_gather of
    the shard sizes when ``vocab_start_index`` is None)."""
    return parallel_params(group_by_name(group_name), vocab_start_index, reduce_hidden_grad, ignore_index,
                           local_vocab, device, allow_reduce_hidden_grad)


def op_backward_layout(group_name, reduce_hidden_grad) -> ParallelParams:
    """What a backward reads of the layout: the group and whether dh is all-reduced."""
    return ParallelParams(group_by_name(group_name), 0, None, reduce_hidden_grad)


def op_group(tp: ParallelParams) -> tuple:
    """(group name, vocab_start_index or None, reduce_hidden_grad): the ops' ``_GROUP_SCHEMA``."""
    return tp.process_group.group_name, tp.start, tp.reduce_hidden_grad


@custom_op_pair(
    "rl_kernels::vocab_parallel_linear_forward",
    schema="(Tensor hidden_states, Tensor weight, Tensor labels, " + _HEAD_AND_GROUP
           + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _vp_linear_forward_op(hidden_states, weight, labels, *args):
    """-> (log_probs, entropy, lse, sum_pi_squared, the shard's labels), empty where not asked."""
    raise_label_errors()
    p, (name, start, reduce) = head_params_from_op(*args[:-3]), args[-3:]
    warn_fp16_temperature(hidden_states.dtype, 1.0 / p.inv_temperature)  # (not logged while tracing)
    tp = op_layout(name, start, reduce, p.ignore_index, weight.shape[0], hidden_states.device)
    if tp.vocab_size is not None:
        check_label_values(labels, tp.vocab_size, p.ignore_index)
    out, local = vp_linear_forward(hidden_states, weight, labels, p, tp)
    return or_empty(out[:4], hidden_states) + (local,)


@_vp_linear_forward_op.register_fake
def _(hidden_states, weight, labels, *args):
    n, return_entropy, return_sum_pi_squared = hidden_states.shape[0], args[3], args[4]

    def rows(asked):
        return hidden_states.new_empty(n if asked else 0, dtype=torch.float32)
    return rows(True), rows(return_entropy), rows(True), rows(return_sum_pi_squared), torch.empty_like(labels)


@custom_op_pair(
    "rl_kernels::vocab_parallel_linear_backward",
    schema="(Tensor hidden_states, Tensor weight, Tensor local, Tensor lse, Tensor? entropy, Tensor? sum_pi_squared, "
           "Tensor? grad_log_probs, Tensor? grad_entropy, Tensor? grad_lse, Tensor? grad_sum_pi_squared, "
           "bool need_dh, bool need_dw, str group_name, bool reduce_hidden_grad, " + HEAD_OP_SCHEMA + ", "
           + RUNTIME_TEMPERATURE_SCHEMA + ") -> (Tensor, Tensor)")
def _vp_linear_backward_op(hidden_states, weight, local, lse, entropy, sum_pi_squared, grad_log_probs, grad_entropy,
                           grad_lse, grad_sum_pi_squared, need_dh, need_dw, group_name, reduce_hidden_grad, *params):
    raise_label_errors()
    grads = HeadOutputs(grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared)
    dh, dw = vp_linear_backward(hidden_states, weight, local, HeadOutputs(None, entropy, lse, sum_pi_squared), grads,
                                head_params_from_op(*params), op_backward_layout(group_name, reduce_hidden_grad),
                                need_dh, need_dw)
    return grads_or_empty(dh, dw, hidden_states, weight)


@_vp_linear_backward_op.register_fake
def _(hidden_states, weight, local, lse, entropy, sum_pi_squared, grad_log_probs, grad_entropy, grad_lse,
      grad_sum_pi_squared, need_dh, need_dw, *rest):
    return fake_grads(hidden_states, weight, need_dh, need_dw)


def _vp_linear_setup_context(ctx, inputs, output):
    hidden_states, weight, labels, *args = inputs
    _, entropy, lse, sum_pi_squared, local = output
    ctx.params, (name, _, reduce) = args[:-3], args[-3:]
    ctx.group = (name, reduce)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden_states, weight, local, lse, if_asked(entropy, args[3]),
                          if_asked(sum_pi_squared, args[4]))


def _vp_linear_backward(ctx, grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared, grad_local):
    hidden_states, weight, local, lse, entropy, sum_pi_squared = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    none = (None,) * (3 + len(ctx.params) + 3)
    asked = (True, ctx.params[3], True, ctx.params[4])
    grads = float_grads((grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared), asked)
    if not (need_dh or need_dw) or all(g is None for g in grads):
        return none
    dh, dw = rl_op("vocab_parallel_linear_backward", ctx.params[-1])(
        hidden_states, weight, local, lse, entropy, sum_pi_squared, *grads, need_dh, need_dw, *ctx.group, *ctx.params)
    return (dh if need_dh else None, dw if need_dw else None) + none[2:]


_vp_linear_forward_op.register_autograd(_vp_linear_backward, setup_context=_vp_linear_setup_context)
refuse_double_backward(_vp_linear_backward_op)


def compiled_vocab_parallel_head(hidden_states, weight, labels, params: HeadParams, tp: ParallelParams,
                                 temperature=None) -> HeadOutputs:
    """``VocabParallelLinearFunction``'s outputs through the custom ops (``torch.compile``'s route;
    ``temperature``: the public function's checked temperature, ``autograd.common.op_temperature``)."""
    op_params = _op_args(head_op_params, params, temperature)
    out = rl_op("vocab_parallel_linear_forward", op_params[-1])(hidden_states, weight, labels, *op_params,
                                                                *op_group(tp))
    return HeadOutputs(out[0], if_asked(out[1], params.return_entropy), out[2],
                       if_asked(out[3], params.return_sum_pi_squared))


@custom_op_pair(
    "rl_kernels::vocab_parallel_logits_forward",
    schema="(Tensor logits, Tensor? labels, " + LOGITS_OP_SCHEMA + ", Tensor? temperature, " + _GROUP_SCHEMA
           + ") -> (Tensor, Tensor, Tensor, Tensor, Tensor)")
def _vp_logits_forward_op(logits, labels, *args):
    """-> (log_probs, entropy, lse, sum_pi_squared, the shard's labels), empty where not asked."""
    raise_label_errors()
    p, (name, start, reduce) = logits_params_from_op(*args[:-3]), args[-3:]
    tp = op_layout(name, start, reduce, p.ignore_index, logits.shape[1], logits.device, allow_reduce_hidden_grad=False)
    if labels is not None and tp.vocab_size is not None:
        check_label_values(labels, tp.vocab_size, p.ignore_index)
    out, local = vp_logits_forward(logits, labels, p, tp)
    return or_empty((out.log_probs, out.entropy, out.lse, out.sum_pi_squared), logits) + (
        local if local is not None else logits.new_empty(0, dtype=torch.long),)


@_vp_logits_forward_op.register_fake
def _(logits, labels, *args):
    n, return_entropy, return_sum_pi_squared = logits.shape[0], args[3], args[5]

    def rows(asked):
        return logits.new_empty(n if asked else 0, dtype=torch.float32)
    local = torch.empty_like(labels) if labels is not None else logits.new_empty(0, dtype=torch.long)
    return rows(labels is not None), rows(return_entropy), rows(True), rows(return_sum_pi_squared), local


@custom_op_pair(
    "rl_kernels::vocab_parallel_logits_backward",
    schema="(Tensor logits, Tensor? local, Tensor lse, Tensor? entropy, Tensor? sum_pi_squared, "
           "Tensor? grad_log_probs, Tensor? grad_entropy, Tensor? grad_lse, Tensor? grad_sum_pi_squared, "
           + LOGITS_OP_SCHEMA + ", " + RUNTIME_TEMPERATURE_SCHEMA + ") -> Tensor")
def _vp_logits_backward_op(logits, local, lse, entropy, sum_pi_squared, grad_log_probs, grad_entropy, grad_lse,
                           grad_sum_pi_squared, *params):
    raise_label_errors()
    g = LogitsOutputs(grad_log_probs, grad_entropy, grad_lse, None, grad_sum_pi_squared)
    return vp_logits_backward(logits, local, lse, entropy, sum_pi_squared, g, logits_params_from_op(*params))


@_vp_logits_backward_op.register_fake
def _(logits, *rest):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _vp_logits_setup_context(ctx, inputs, output):
    logits, labels, *args = inputs
    log_probs, entropy, lse, sum_pi_squared, local = output
    ctx.params = args[:-3]
    ctx.has_labels = labels is not None
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(logits, local if labels is not None else None, lse, if_asked(entropy, args[3]),
                          if_asked(sum_pi_squared, args[5]))


def _vp_logits_backward(ctx, grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared, grad_local):
    logits, local, lse, entropy, sum_pi_squared = ctx.saved_tensors
    none = (None,) * (2 + len(ctx.params) + 3)
    asked = (ctx.has_labels, ctx.params[3], True, ctx.params[5])
    grads = float_grads((grad_log_probs, grad_entropy, grad_lse, grad_sum_pi_squared), asked)
    if not ctx.needs_input_grad[0] or all(g is None for g in grads):
        return none
    grad = rl_op("vocab_parallel_logits_backward", ctx.params[-1])(logits, local, lse, entropy, sum_pi_squared,
                                                                   *grads, *ctx.params)
    return (grad,) + none[1:]


_vp_logits_forward_op.register_autograd(_vp_logits_backward, setup_context=_vp_logits_setup_context)
refuse_double_backward(_vp_logits_backward_op)


def _op_args(pack, params, temperature) -> tuple:
    """A family's plain op arguments (``pack``: ``head_op_params`` or ``logits_op_params``) for the
    checked ``temperature`` (a symbolic one as the runtime 0-d tensor:
    ``autograd.common.op_temperature``)."""
    inv_temperature, runtime_temperature = op_temperature(params.inv_temperature, temperature)
    return pack(params._replace(inv_temperature=inv_temperature), runtime_temperature)


def vocab_parallel_head(hidden_states, weight, labels, params: HeadParams, tp: ParallelParams, temperature,
                        lead_labels) -> HeadOutputs:
    """The fused head over a vocab shard (2-D hidden states, labels (N,) global ids, the checked
    ``temperature``; ``lead_labels``: the labels as the caller passed them, for the host check):
    :class:`VocabParallelLinearFunction` eagerly (label values checked on the host when the
    vocabulary size is known, which also sets ``may_have_ignored``), the custom ops under
    torch.compile (:func:`compiled_vocab_parallel_head`)."""
    if compiling():
        return compiled_vocab_parallel_head(hidden_states, weight, labels, params, tp, temperature=temperature)
    raise_label_errors()  # a bad label that an earlier call's kernel reported
    warn_fp16_temperature(hidden_states.dtype, temperature)
    if tp.vocab_size is not None:
        has_ignored = check_label_values(lead_labels, tp.vocab_size, params.ignore_index, report_ignored=True)
        params = params._replace(may_have_ignored=has_ignored is not False)
    return HeadOutputs(*VocabParallelLinearFunction.apply(hidden_states, weight, labels, params, tp))


def vocab_parallel_logits(logits, labels, params: LogitsParams, tp: ParallelParams, temperature) -> tuple:
    """The from-logits statistics of a vocab shard (2-D ``logits``, labels (N,) or None, the checked
    ``temperature``): :class:`VocabParallelLogitsFunction` eagerly (label values checked on the
    host when the vocabulary size is known), the custom ops under torch.compile
    (:func:`compiled_vocab_parallel_logits`). The five fields of ``LogitsOutputs``."""
    if compiling():
        return tuple(compiled_vocab_parallel_logits(logits, labels, params, tp, temperature=temperature))
    raise_label_errors()  # a bad label that an earlier call's kernel reported
    if labels is not None and tp.vocab_size is not None:
        check_label_values(labels, tp.vocab_size, params.ignore_index)
    return VocabParallelLogitsFunction.apply(logits, labels, params, tp)


def compiled_vocab_parallel_logits(logits, labels, params: LogitsParams, tp: ParallelParams,
                                   temperature=None) -> LogitsOutputs:
    """``VocabParallelLogitsFunction``'s outputs through the custom ops (``torch.compile``'s route;
    ``temperature``: the public function's checked temperature, ``autograd.common.op_temperature``)."""
    op_params = _op_args(logits_op_params, params, temperature)
    out = rl_op("vocab_parallel_logits_forward", op_params[-1])(logits, labels, *op_params, *op_group(tp))
    return LogitsOutputs(if_asked(out[0], labels is not None), if_asked(out[1], params.return_entropy), out[2], None,
                         if_asked(out[3], params.return_sum_pi_squared))


@custom_op_pair(
    "rl_kernels::vocab_parallel_lse_gather_forward",
    schema="(Tensor hidden_states, Tensor weight, Tensor valid, Tensor ids, " + _HEAD_AND_GROUP
           + ") -> (Tensor, Tensor, Tensor, Tensor)")
def _vp_lse_gather_forward_op(hidden_states, weight, valid, ids, *args):
    """-> (lse, z at ids, the shard's row labels, the shard's ids)."""
    p, (name, start, reduce) = head_params_from_op(*args[:-3]), args[-3:]
    tp = op_layout(name, start, reduce, p.ignore_index, weight.shape[0], hidden_states.device)
    return vp_lse_gather_forward(hidden_states, weight, valid, ids, p, tp)


@_vp_lse_gather_forward_op.register_fake
def _(hidden_states, weight, valid, ids, *args):
    n = hidden_states.shape[0]
    return (hidden_states.new_empty(n, dtype=torch.float32), ids.new_empty(ids.shape, dtype=torch.float32),
            valid.new_empty(n, dtype=torch.int64), torch.empty_like(ids))


@custom_op_pair(
    "rl_kernels::vocab_parallel_lse_gather_backward",
    schema="(Tensor hidden_states, Tensor weight, Tensor labels, Tensor lse, Tensor local_ids, Tensor? grad_lse, "
           "Tensor? grad_z, bool need_dh, bool need_dw, str group_name, bool reduce_hidden_grad, " + HEAD_OP_SCHEMA
           + ", " + RUNTIME_TEMPERATURE_SCHEMA + ") -> (Tensor, Tensor)")
def _vp_lse_gather_backward_op(hidden_states, weight, labels, lse, local_ids, grad_lse, grad_z, need_dh, need_dw,
                               group_name, reduce_hidden_grad, *params):
    dh, dw = vp_lse_gather_backward(hidden_states, weight, labels, lse, local_ids, grad_lse, grad_z,
                                    head_params_from_op(*params), op_backward_layout(group_name, reduce_hidden_grad),
                                    need_dh, need_dw)
    return grads_or_empty(dh, dw, hidden_states, weight)


@_vp_lse_gather_backward_op.register_fake
def _(hidden_states, weight, labels, lse, local_ids, grad_lse, grad_z, need_dh, need_dw, *rest):
    return fake_grads(hidden_states, weight, need_dh, need_dw)


def _vp_lse_gather_setup_context(ctx, inputs, output):
    hidden_states, weight, valid, ids, *args = inputs
    lse, _, labels, local_ids = output
    ctx.params, (name, _, reduce) = args[:-3], args[-3:]
    ctx.group = (name, reduce)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden_states, weight, labels, lse, local_ids)


def _vp_lse_gather_backward(ctx, grad_lse, grad_z, grad_labels, grad_local_ids):
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    none = (None,) * (4 + len(ctx.params) + 3)
    if (grad_lse is None and grad_z is None) or not (need_dh or need_dw):
        return none
    dh, dw = rl_op("vocab_parallel_lse_gather_backward", ctx.params[-1])(
        *ctx.saved_tensors, grad_lse, grad_z, need_dh, need_dw, *ctx.group, *ctx.params)
    return (dh if need_dh else None, dw if need_dw else None) + none[2:]


_vp_lse_gather_forward_op.register_autograd(_vp_lse_gather_backward, setup_context=_vp_lse_gather_setup_context)
refuse_double_backward(_vp_lse_gather_backward_op)


def compiled_vocab_parallel_lse_gather(hidden_states, weight, valid, ids, params: HeadParams, tp: ParallelParams,
                                       temperature=None):
    """``VocabParallelLseGatherFunction``'s (lse, z) through the custom ops (``torch.compile``'s route;
    ``temperature``: the public function's checked temperature, ``autograd.common.op_temperature``)."""
    op_params = _op_args(head_op_params, params, temperature)
    out = rl_op("vocab_parallel_lse_gather_forward", op_params[-1])(hidden_states, weight, valid, ids, *op_params,
                                                                    *op_group(tp))
    return out[0], out[1]
