"""Worker for tests/api/test_parallel.py: one process per rank of a gloo group (CPU).
Also checks linear_topk_kl and linear_jsd with sharded heads.

Every rank builds the same inputs from one seed, keeps its own vocab shard (uneven sizes) and
checks, against the unsharded float64 reference: log-probs / entropy / lse, dW of its shard, dh
(partial sums all-reduced, or reduce_hidden_grad=True), the gradient of a logits shard, that all
ranks hold identical bits, and that a label held by no shard raises.
"""
import os

import torch
import torch.distributed as dist

from rl_kernels.tools.reference import reference_jsd
from tolerances import assert_close_f32, head_magnitude

N, H, V = 13, 24, 203
BOUNDS = {2: [0, 120, 203], 3: [0, 50, 151, 203]}


def _inputs():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.4
    labels = torch.randint(0, V, (N,), generator=g)
    labels[torch.rand(N, generator=g) < 0.25] = -100
    labels[0], labels[1] = V - 1, 0  # the first and the last id
    g_lp, g_ent = torch.randn(2, N, generator=g)
    return hidden, weight, labels, g_lp, g_ent


def _reference(hidden, weight, labels, temperature, g_lp, g_ent):
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    z = h64 @ w64.T / _column(temperature)
    log_p = torch.log_softmax(z, -1)
    valid = labels != -100
    lp = torch.where(valid, log_p.gather(1, labels.clamp_min(0)[:, None])[:, 0], 0.0)
    ent = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    (lp * g_lp.double() + ent * g_ent.double()).sum().backward()
    return lp.detach(), ent.detach(), torch.logsumexp(z, -1).detach(), h64.grad, w64.grad


def _column(temperature):
    """A temperature as the divisor of (N, V) logits: a number, or a per-row (N,) one as a column."""
    return temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature


def _same_on_all_ranks(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return all(torch.equal(o, out[0]) for o in out)


def _check_dh(dh, ref, reduced, tol):
    """dh is the gradient (reduce_hidden_grad=True) or a partial sum whose group sum is."""
    dh = dh.clone()
    if not reduced:
        assert not torch.allclose(dh.double(), ref, atol=1e-3)  # a partial sum, not the gradient
        dist.all_reduce(dh)
    torch.testing.assert_close(dh.double(), ref, **tol)


def _tail_kl(group, backend, lo, hi, hidden, weight, ids, mask, tol):
    """linear_topk_kl(tail=True) and linear_log_probs_at_ids(return_tail=True) on a shard: equal to
    the single-process call (same backend) and to the float64 (K+1)-category KL."""
    from rl_kernels import linear_topk_kl
    from rl_kernels.distill import linear_log_probs_at_ids

    k = ids.shape[1]
    g = torch.Generator().manual_seed(6)
    t_lp = torch.log_softmax(torch.randn(N, k + 1, generator=g), -1)[:, :k].contiguous()  # top-K mass < 1
    t_lp[2, 0] = 0.0
    t_lp[2, 1:] = float("-inf")  # a teacher of mass 1: p_tail = 0
    h64, w64 = hidden.double(), weight.double()
    z = h64 @ w64.T / 0.8
    lse = torch.logsumexp(z, -1)
    excluded = torch.zeros(N, V, dtype=torch.bool).scatter_(1, ids, True)
    log_q_tail = torch.logsumexp(z.masked_fill(excluded, float("-inf")), -1) - lse
    for kind, reduce_dh in (("forward", True), ("reverse", False)):
        def loss_of(h, w, **shard):
            return linear_topk_kl(h, w, ids, t_lp, mask=mask, temperature=0.8, kind=kind, tail=True, reduction="sum",
                                  backend=backend, **shard)
        hx, wx = hidden.clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
        loss = loss_of(hx, wx, process_group=group, reduce_hidden_grad=reduce_dh)
        loss.backward()
        h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        single = loss_of(h1, w1)  # the single-process result
        single.backward()
        hr, wr = h64.clone().requires_grad_(), w64.clone().requires_grad_()
        zr = hr @ wr.T / 0.8
        lser = torch.logsumexp(zr, -1)
        log_q = zr.gather(1, ids) - lser[:, None]
        tail = torch.logsumexp(zr.masked_fill(excluded, float("-inf")), -1) - lser
        p, lp = t_lp.double().exp(), t_lp.double()
        p_tail = (1 - p.sum(-1)).clamp_min(0)
        if kind == "forward":
            per = torch.where(p > 0, p * (lp - log_q), 0.0).sum(-1) + torch.where(
                p_tail > 0, p_tail * (p_tail.log() - tail), 0.0)
        else:
            per = (log_q.exp() * (log_q - lp.clamp_min(-87.3365))).sum(-1) + tail.exp() * (
                tail - p_tail.log().clamp_min(-87.3365))
        ref = torch.where(mask, per * 0.64, 0.0).sum()
        ref.backward()
        for got in (loss, single):
            torch.testing.assert_close(got.double(), ref.detach(), **tol)
        # shard against single process: each within gamma_d of the exact value (d: a logit's H, its row's
        # 2 V, the N rows' sum), so within gamma_2d of each other
        magnitude = head_magnitude(hidden, weight, 0.8)
        assert_close_f32(loss, single.double(), depth=2 * (H + 2 * V + N), logits=magnitude, msg="loss")
        assert _same_on_all_ranks(loss.detach().reshape(1))
        torch.testing.assert_close(wx.grad.double(), wr.grad[lo:hi], **tol)
        assert_close_f32(wx.grad, w1.grad[lo:hi].double(), depth=2 * (H + 2 * V + N), logits=magnitude, floor=0,
                         msg="dW")
        _check_dh(hx.grad, hr.grad, reduce_dh, tol)
        assert torch.all(hx.grad[~mask] == 0)
    # the 4th output of linear_log_probs_at_ids on a shard, and its gradient
    labels = torch.where(mask, ids[:, 1], -100)
    hx, wx = hidden.clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
    *_, tail = linear_log_probs_at_ids(hx, wx, labels, ids, temperature=0.8, backend=backend, process_group=group,
                                       reduce_hidden_grad=True, return_tail=True)
    torch.testing.assert_close(tail.double(), log_q_tail, **tol)
    assert _same_on_all_ranks(tail)
    g_tail = torch.randn(N, generator=g)
    (tail * g_tail).sum().backward()
    hr, wr = h64.clone().requires_grad_(), w64.clone().requires_grad_()
    zr = hr @ wr.T / 0.8
    ref = torch.logsumexp(zr.masked_fill(excluded, float("-inf")), -1) - torch.logsumexp(zr, -1)
    torch.where(mask, ref * g_tail.double(), 0.0).sum().backward()
    torch.testing.assert_close(wx.grad.double(), wr.grad[lo:hi], **tol)
    torch.testing.assert_close(hx.grad.double(), hr.grad, **tol)
    # the student's top K from the head's own forward on a shard (issue 54): the ids of linear_topk on
    # the whole head, the same bits on every rank, the log-probs within float32 of float64, and the
    # other outputs bitwise those of the call without it
    from rl_kernels import linear_topk

    plain = linear_log_probs_at_ids(hidden, weight[lo:hi], labels, ids, temperature=0.8, backend=backend,
                                    process_group=group)
    *rest, top_lp, top_ids = linear_log_probs_at_ids(hidden, weight[lo:hi], labels, ids, temperature=0.8,
                                                     backend=backend, process_group=group, top_k=6)
    assert all(a is b is None or torch.equal(a, b) for a, b in zip(plain, rest))
    _, whole_ids = linear_topk(hidden, weight, k=6, temperature=0.8, backend=backend)
    assert torch.equal(top_ids, whole_ids)
    assert _same_on_all_ranks(top_lp) and _same_on_all_ranks(top_ids)
    ref_lp = torch.log_softmax(h64 @ w64.T / 0.8, -1).gather(1, whole_ids)
    assert_close_f32(top_lp, ref_lp, depth=H + 2 * V, logits=head_magnitude(hidden, weight, 0.8), msg="top-K log-probs")


def run(rank, world, init_file, backend):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from rl_kernels import linear_log_probs, logits_stats

    group = dist.group.WORLD
    lo, hi = BOUNDS[world][rank], BOUNDS[world][rank + 1]
    hidden, weight, labels, g_lp, g_ent = _inputs()
    tol = dict(atol=3e-5, rtol=1e-4)
    per_row = torch.rand(N, generator=torch.Generator().manual_seed(5)) * 1.5 + 0.4  # per-row temperature
    for temperature, reduce_dh, give_start in ((1.0, False, False), (0.7, True, True), (per_row, True, True)):
        ref_lp, ref_ent, ref_lse, ref_dh, ref_dw = _reference(hidden, weight, labels, temperature, g_lp, g_ent)
        hx = hidden.clone().requires_grad_()
        wx = weight[lo:hi].clone().requires_grad_()
        out = linear_log_probs(hx, wx, labels, temperature=temperature, backend=backend, process_group=group,
                               vocab_start_index=lo if give_start else None, reduce_hidden_grad=reduce_dh)
        (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
        torch.testing.assert_close(out.log_probs.double(), ref_lp, **tol)
        torch.testing.assert_close(out.entropy.double(), ref_ent, **tol)
        assert _same_on_all_ranks(out.log_probs) and _same_on_all_ranks(out.entropy)
        torch.testing.assert_close(wx.grad.double(), ref_dw[lo:hi], **tol)
        _check_dh(hx.grad, ref_dh, reduce_dh, tol)

        # from-logits: the shard of the logits (float32 from the same inputs)
        logits = (hidden @ weight[lo:hi].T).requires_grad_()
        stats = logits_stats(logits, labels, temperature=temperature, backend=backend, process_group=group,
                             vocab_start_index=lo if give_start else None)
        torch.testing.assert_close(stats.log_probs.double(), ref_lp, **tol)
        torch.testing.assert_close(stats.entropy.double(), ref_ent, **tol)
        torch.testing.assert_close(stats.lse.double(), ref_lse, **tol)
        assert _same_on_all_ranks(stats.log_probs) and _same_on_all_ranks(stats.lse)
        g_lse = torch.randn(N, generator=torch.Generator().manual_seed(3))
        (stats.log_probs * g_lp + stats.entropy * g_ent + stats.lse * g_lse).sum().backward()
        z = (hidden.double() @ weight.double().T).requires_grad_()
        log_p = torch.log_softmax(z / _column(temperature), -1)
        valid = labels != -100
        lp = torch.where(valid, log_p.gather(1, labels.clamp_min(0)[:, None])[:, 0], 0.0)
        ent = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
        (lp * g_lp + ent * g_ent + torch.logsumexp(z / _column(temperature), -1) * g_lse).sum().backward()
        torch.testing.assert_close(logits.grad.double(), z.grad[:, lo:hi], **tol)

    # top-K KL with a sharded student head: K ids spread over the shards (V - 1 and 0 included)
    from rl_kernels import linear_topk_kl

    g = torch.Generator().manual_seed(4)
    k = 6
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])
    ids[0, 0], ids[1, 0] = V - 1, 0
    t_lp = torch.log_softmax(torch.randn(N, k, generator=g), -1)
    mask = labels != -100
    for kind, reduce_dh in (("forward", True), ("reverse", False)):
        hx = hidden.clone().requires_grad_()
        wx = weight[lo:hi].clone().requires_grad_()
        loss = linear_topk_kl(hx, wx, ids, t_lp, mask=mask, temperature=0.8, kind=kind, reduction="sum",
                              backend=backend, process_group=group, reduce_hidden_grad=reduce_dh)
        loss.backward()
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        log_q = torch.log_softmax(h64 @ w64.T / 0.8, -1).gather(1, ids)
        lp = t_lp.double()
        per = (lp.exp() * (lp - log_q)).sum(-1) if kind == "forward" else (log_q.exp() * (log_q - lp)).sum(-1)
        ref = torch.where(mask, per * 0.64, 0.0).sum()
        ref.backward()
        torch.testing.assert_close(loss.double(), ref.detach(), **tol)
        assert _same_on_all_ranks(loss.detach().reshape(1))
        torch.testing.assert_close(wx.grad.double(), w64.grad[lo:hi], **tol)
        _check_dh(hx.grad, h64.grad, reduce_dh, tol)

    if world == 2:  # the tail-aware top-K KL (issue 45): the shards' tail lse merged like the lse
        _tail_kl(group, backend, lo, hi, hidden, weight, ids, mask, tol)

    # the fused head's Function on a shard with logits at given ids (the route of linear_topk_kl),
    # with gradients reaching all three outputs (log-probs, lse, the ids' logits) against float64
    from rl_kernels.autograd.linear import HeadParams, linear_head
    from rl_kernels.autograd.vocab_parallel import parallel_params
    from rl_kernels.core.backends import get_backend

    g_lse, g_z = torch.randn(N, generator=g), torch.randn(N, k, generator=g)
    params = HeadParams(backend=get_backend(backend, hidden.device), inv_temperature=1 / 0.8, ignore_index=-100,
                        return_entropy=False, name="linear_head")
    for reduce_dh in (True, False):
        hx = hidden.clone().requires_grad_()
        wx = weight[lo:hi].clone().requires_grad_()
        tp = parallel_params(group, None, reduce_dh, -100, hi - lo, hidden.device)
        out = linear_head(hx, wx, labels, params, ids, None, tp)
        (out.log_probs * g_lp + out.lse * g_lse + (out.gathered_logits * g_z).sum(-1)).sum().backward()
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        z = h64 @ w64.T / 0.8
        lse = torch.logsumexp(z, -1)
        valid = labels != -100
        lp = torch.where(valid, z.gather(1, labels.clamp_min(0)[:, None])[:, 0] - lse, 0.0)
        # (a row whose label is ignore_index gets no gradient from any output: the package's rule)
        (lp * g_lp.double() + torch.where(valid, lse * g_lse.double() + (z.gather(1, ids) * g_z.double()).sum(-1),
                                          0.0)).sum().backward()
        for got, ref in ((out.log_probs, lp), (out.lse, lse), (out.gathered_logits, z.gather(1, ids))):
            torch.testing.assert_close(got.double(), ref.detach(), **tol)
            assert _same_on_all_ranks(got.detach())
        torch.testing.assert_close(wx.grad.double(), w64.grad[lo:hi], **tol)
        _check_dh(hx.grad, h64.grad, reduce_dh, tol)

    # JSD between two sharded heads (teacher of another hidden size), beta 0.3 and 1
    from rl_kernels import linear_jsd

    ht = torch.randn(N, H + 8, generator=g)
    wt = 0.4 * torch.randn(V, H + 8, generator=g)
    for beta, reduce_dh in ((0.3, True), (1.0, False)):
        hx = hidden.clone().requires_grad_()
        wx = weight[lo:hi].clone().requires_grad_()
        loss = linear_jsd(hx, wx, ht, wt[lo:hi], beta=beta, temperature=1.2, labels=labels, reduction="sum",
                          backend=backend, process_group=group, reduce_hidden_grad=reduce_dh)
        loss.backward()
        h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        ref = reference_jsd(h64, w64, ht.double(), wt.double(), labels, beta, 1.2, "sum")
        ref.backward()
        torch.testing.assert_close(loss.double(), ref.detach(), **tol)
        assert _same_on_all_ranks(loss.detach().reshape(1))
        torch.testing.assert_close(wx.grad.double(), w64.grad[lo:hi], **tol)
        _check_dh(hx.grad, h64.grad, reduce_dh, tol)

    # sum of squared probabilities over the sharded vocabulary: fused head and logits shard
    g_sq = torch.randn(N, generator=torch.Generator().manual_seed(9))
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    p = torch.softmax(h64 @ w64.T / 0.9, -1)
    ref_sq = torch.where(labels != -100, (p * p).sum(-1), 0.0)
    (ref_sq * g_sq.double()).sum().backward()
    hx, wx = hidden.clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=0.9, return_sum_pi_squared=True, backend=backend,
                           process_group=group, reduce_hidden_grad=True)
    (out.sum_pi_squared * g_sq).sum().backward()
    torch.testing.assert_close(out.sum_pi_squared.double(), ref_sq.detach(), **tol)
    assert _same_on_all_ranks(out.sum_pi_squared)
    torch.testing.assert_close(wx.grad.double(), w64.grad[lo:hi], **tol)
    torch.testing.assert_close(hx.grad.double(), h64.grad, **tol)
    from rl_kernels import sum_pi_squared_from_logits

    z = (hidden.double() @ weight.double().T).requires_grad_()
    p = torch.softmax(z / 0.9, -1)
    ((p * p).sum(-1) * g_sq.double()).sum().backward()
    shard = (hidden @ weight[lo:hi].T).requires_grad_()
    sq = sum_pi_squared_from_logits(shard, temperature=0.9, backend=backend, process_group=group)
    (sq * g_sq).sum().backward()
    torch.testing.assert_close(sq.double(), (p * p).sum(-1).detach(), **tol)
    torch.testing.assert_close(shard.grad.double(), z.grad[:, lo:hi], **tol)

    # soft-capped logits (Gemma 2: z = c tanh(h.w / c) / T) over the sharded vocabulary; raw logits
    # have a std of ~2, so c = 1.5 caps most of them
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    raw = h64 @ w64.T
    log_p = torch.log_softmax(1.5 * torch.tanh(raw / 1.5) / 0.8, -1)
    valid = labels != -100
    ref_lp = torch.where(valid, log_p.gather(1, labels.clamp_min(0)[:, None])[:, 0], 0.0)
    ref_ent = torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0.0)
    (ref_lp * g_lp.double() + ref_ent * g_ent.double()).sum().backward()
    hx, wx = hidden.clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=0.8, softcap=1.5, backend=backend, process_group=group,
                           reduce_hidden_grad=True)
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    torch.testing.assert_close(out.log_probs.double(), ref_lp.detach(), **tol)
    torch.testing.assert_close(out.entropy.double(), ref_ent.detach(), **tol)
    assert _same_on_all_ranks(out.log_probs) and _same_on_all_ranks(out.entropy)
    torch.testing.assert_close(wx.grad.double(), w64.grad[lo:hi], **tol)
    torch.testing.assert_close(hx.grad.double(), h64.grad, **tol)

    # non-finite rows: a NaN row with a label gives non-finite outputs for that row only; a NaN
    # row whose label is ignored contributes nothing to dW or dh (NaN * 0 must not reach dW)
    bad_h, bad_labels = hidden.clone(), labels.clone()
    bad_h[2, 3], bad_labels[2] = float("nan"), 5
    bad_h[4, 1], bad_labels[4] = float("inf"), -100
    hx = bad_h.clone().requires_grad_()
    wx = weight[lo:hi].clone().requires_grad_()
    out = linear_log_probs(hx, wx, bad_labels, backend=backend, process_group=group, reduce_hidden_grad=True)
    ok = torch.arange(N) != 2
    assert not torch.isfinite(out.log_probs[2]) and not torch.isfinite(out.entropy[2]), out
    clean = bad_h.clone()
    clean[2] = clean[4] = 0.0
    ref_lp, ref_ent, _, _, _ = _reference(clean, weight, bad_labels, 1.0, g_lp, g_ent)
    torch.testing.assert_close(out.log_probs[ok].double(), ref_lp[ok], **tol)
    torch.testing.assert_close(out.entropy[ok].double(), ref_ent[ok], **tol)
    stats = logits_stats(bad_h @ weight[lo:hi].T, bad_labels, backend=backend, process_group=group)
    assert not torch.isfinite(stats.log_probs[2]) and not torch.isfinite(stats.lse[2])
    assert not torch.isfinite(stats.entropy[2])
    torch.testing.assert_close(stats.log_probs[ok].double(), ref_lp[ok], **tol)
    ign_labels = bad_labels.clone()
    ign_labels[2] = -100  # now both non-finite rows are ignored
    hx = bad_h.clone().requires_grad_()
    out = linear_log_probs(hx, wx, ign_labels, backend=backend, process_group=group, reduce_hidden_grad=True)
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    _, _, _, ref_dh, ref_dw = _reference(clean, weight, ign_labels, 1.0, g_lp, g_ent)
    torch.testing.assert_close(wx.grad.double(), ref_dw[lo:hi], **tol)
    torch.testing.assert_close(hx.grad.double(), ref_dh, **tol)

    # an ignored NaN row of a logits shard gets exactly zero gradient (selected out)
    shard = (bad_h @ weight[lo:hi].T).requires_grad_()
    from rl_kernels import log_probs_from_logits

    log_probs_from_logits(shard, ign_labels, backend=backend, process_group=group).sum().backward()
    assert torch.equal(shard.grad[2], torch.zeros_like(shard.grad[2])) and torch.isfinite(shard.grad).all()
    # a process_group of the wrong type, with torch.distributed initialized
    try:
        linear_log_probs(hidden, weight[lo:hi], labels, backend=backend, process_group="tp")
    except TypeError as e:
        assert "process_group: expected a torch.distributed.ProcessGroup" in str(e), e
    else:
        raise AssertionError("a str process_group did not raise")

    # a wrong vocab_start_index leaves label V - 1 in no shard: every rank raises
    try:
        linear_log_probs(hidden, weight[lo:hi], labels, backend=backend, process_group=group,
                         vocab_start_index=lo - 1 if rank == world - 1 else lo)
    except ValueError as e:
        assert "labels" in str(e) and "no shard" in str(e), e
    else:
        raise AssertionError("a label held by no shard did not raise")
    if world == 2:
        _compiled_equals_eager(group, backend, lo, hi)
        _topk_from_logits(group, backend, lo, hi, rank, world)
    dist.destroy_process_group()


def _topk_from_logits(group, backend, lo, hi, rank, world):
    """The from-logits top-K on a logits shard (issue 45): topk_log_probs_from_logits (with and
    without the tail) and topk_kl_from_logits (tail or not, both kinds, ignored rows) equal the
    single-process function on the whole logits within 1e-6 (values, and this shard's columns of
    the gradient), bitwise identical on every rank; torch.compile gives eager's bits; an id held by
    no shard raises ValueError naming the ids. The Triton backend (the interpreter: ~0.3 s a launch)
    runs the two tail cases (the shard-local masked kernels) and the error; the torch backend all."""
    from rl_kernels import topk_kl_from_logits, topk_log_probs_from_logits

    g = torch.Generator().manual_seed(21)
    k = 6
    full = 2 * torch.randn(N, V, generator=g)
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(N)])
    ids[0, 0], ids[1, 0] = V - 1, 0  # the last and the first id
    ids[2] = torch.arange(k)  # a row whose ids all lie in the first shard
    ids[3] = V - 1 - torch.arange(k)  # ... all in the last
    t_lp = torch.log_softmax(torch.randn(N, k, generator=g), -1) - 0.4 * torch.rand(N, 1, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[[4, 9]] = -100
    up, up_tail = torch.randn(N, k, generator=g), torch.randn(N, generator=g)
    tol = dict(atol=1e-6, rtol=1e-6)

    def run(fn, sharded, **kw):
        x = (full[:, lo:hi] if sharded else full).clone().requires_grad_()
        extra = dict(process_group=group, **kw) if sharded else {}
        out = fn(x, **extra)
        loss = sum(((o * w).sum() for o, w in zip(out, (up, up_tail))), torch.zeros(())) \
            if isinstance(out, tuple) else (out * up[:, 0]).sum()
        loss.backward()
        return [o.detach() for o in (out if isinstance(out, tuple) else (out,))], x.grad

    cases = [(lambda x, **kw: topk_log_probs_from_logits(x, ids, temperature=0.8, backend=backend,
                                                          return_tail=tail, **kw), tail, start)
             for tail, start in ((False, False), (True, True))]
    cases += [(lambda x, kind=kind, tail=tail, **kw: topk_kl_from_logits(
        x, ids, t_lp, temperature=0.8, labels=labels, kind=kind, tail=tail, reduction="none", backend=backend, **kw),
        tail, start) for kind, tail, start in (("forward", True, False), ("reverse", True, True),
                                               ("reverse", False, False))]
    triton = backend == "triton"
    for fn, _, start in [cases[1], cases[3]] if triton else cases:
        ref_outs, ref_grad = run(fn, False)
        outs, grad = run(fn, True, vocab_start_index=lo if start else None)
        kl = len(outs) == 1 and outs[0].dim() == 1
        for o, r in zip(outs, ref_outs):
            torch.testing.assert_close(o, r, **tol)
            assert _same_on_all_ranks(o)
        torch.testing.assert_close(grad, ref_grad[:, lo:hi], **tol)
        if kl:  # ignored rows get exactly zero gradient
            assert torch.equal(grad[labels == -100], torch.zeros_like(grad[labels == -100]))
    if not triton:  # the tail matters on the shards too: the KL with and without it differ
        with_tail, without = run(cases[3][0], True)[0][0], run(cases[4][0], True)[0][0]
        assert (with_tail - without)[labels != -100].abs().min() > 1e-4
    # compiled over the group (the tail KL: its top-K inside; the layout derived in the ops' bodies):
    # eager's bits, values and this shard's gradient
    for fn, _, _ in () if triton else (cases[2],):
        eager = run(fn, True)
        compiled = torch.compile(lambda x, **kw: fn(x, **kw), fullgraph=True, backend="aot_eager")
        got = run(compiled, True)
        assert all(torch.equal(a, b) for a, b in zip(eager[0], got[0])) and torch.equal(eager[1], got[1])
    # a vocab_start_index that leaves id V - 1 in no shard (and another in two): every rank raises
    try:
        topk_log_probs_from_logits(full[:, lo:hi], ids, backend=backend, process_group=group,
                                   vocab_start_index=lo - 1 if rank == world - 1 else lo)
    except ValueError as e:
        assert "token_ids" in str(e) and "no shard or by several" in str(e), e
    else:
        raise AssertionError("an id held by no shard did not raise")


def _compiled_equals_eager(group, backend, lo, hi):
    """torch.compile(fullgraph=True) of each sharded public function (the group passed by name to
    the custom ops, the layout derived in their bodies): the same bits as eager, values and
    gradients, on every rank; a bad label still raises ValueError under compile."""
    from rl_kernels import linear_jsd, linear_log_probs, linear_topk_kl, logits_stats

    hidden, weight, labels, g_lp, g_ent = _inputs()
    g = torch.Generator().manual_seed(11)
    ids = torch.stack([torch.randperm(V, generator=g)[:4] for _ in range(N)])
    t_lp = torch.log_softmax(torch.randn(N, 4, generator=g), -1)
    ht, wt = torch.randn(N, H, generator=g), 0.4 * torch.randn(V, H, generator=g)[lo:hi]

    def head(h, w, y):
        o = linear_log_probs(h, w, y, temperature=0.7, return_sum_pi_squared=True, backend=backend,
                             process_group=group, reduce_hidden_grad=True)
        return (o.log_probs * g_lp + o.entropy * g_ent + o.sum_pi_squared).sum()

    def from_logits(h, w, y):
        o = logits_stats(h @ w.T, y, temperature=0.7, backend=backend, process_group=group, vocab_start_index=lo)
        return (o.log_probs * g_lp + o.entropy * g_ent + o.lse).sum()

    def topk(h, w, y):
        return linear_topk_kl(h, w, ids, t_lp, labels=y, temperature=0.8, reduction="sum", backend=backend,
                              process_group=group)

    def topk_tail(h, w, y):  # (the shards' tail lse in the forward op's all_gather)
        return linear_topk_kl(h, w, ids, t_lp - 0.1, labels=y, temperature=0.8, kind="reverse", tail=True,
                              reduction="sum", backend=backend, process_group=group)

    def jsd(h, w, y):
        return linear_jsd(h, w, ht, wt, labels=y, beta=0.3, reduction="sum", backend=backend, process_group=group,
                          reduce_hidden_grad=True)

    for fn in (head, from_logits, topk, topk_tail, jsd):
        results = []
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            hx, wx = hidden.clone().requires_grad_(), weight[lo:hi].clone().requires_grad_()
            loss = f(hx, wx, labels)
            loss.backward()
            results.append((loss.detach(), hx.grad, wx.grad))
        for a, b in zip(*results):
            assert torch.equal(a, b), (fn.__name__, (a - b).abs().max())
        assert _same_on_all_ranks(results[1][0].reshape(1))
    bad = labels.clone()
    bad[3] = V + 2
    try:
        torch.compile(head, fullgraph=True, backend="aot_eager")(hidden, weight[lo:hi], bad)
    except ValueError as e:
        assert "labels" in str(e), e
    else:
        raise AssertionError("a bad label under torch.compile did not raise")


def run_topk(rank, world, init_file, backend):
    """linear_topk on a vocab shard (tests/api/test_linear_topk.py): global ids, the same ids as the
    unsharded call and log-probs within float32 of it and of float64, identical bits on every rank,
    with and without vocab_start_index, a per-row temperature, k = 128 (more than rank 1's 83
    rows: its empty slots never reach the merged top-k), and torch.compile (fullgraph) equal to
    eager; k above the whole vocabulary raises on every rank."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from rl_kernels import linear_topk

    group = dist.group.WORLD
    lo, hi = BOUNDS[world][rank], BOUNDS[world][rank + 1]
    hidden, weight = _inputs()[:2]
    per_row = torch.rand(N, generator=torch.Generator().manual_seed(5)) * 1.5 + 0.4
    cases = [(5, 1.0, False), (6, per_row, True)] + ([(128, 0.7, True)] if backend == "torch" else [])
    for k, temperature, give_start in cases:
        lp, ids = linear_topk(hidden, weight[lo:hi], k=k, temperature=temperature, backend=backend,
                              process_group=group, vocab_start_index=lo if give_start else None)
        whole_lp, whole_ids = linear_topk(hidden, weight, k=k, temperature=temperature, backend=backend)
        assert torch.equal(ids, whole_ids), (rank, k)
        torch.testing.assert_close(lp, whole_lp, atol=2e-6, rtol=0)
        z = hidden.double() @ weight.double().T / _column(temperature)
        ref_ids = torch.sort(z, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(ids, ref_ids), (rank, k)
        torch.testing.assert_close(lp.double(), torch.log_softmax(z, -1).gather(1, ref_ids), atol=2e-5, rtol=0)
        assert _same_on_all_ranks(lp) and _same_on_all_ranks(ids)
    try:
        linear_topk(hidden, weight[lo:hi], k=V + 1 if V < 128 else 129, backend=backend, process_group=group)
    except ValueError as e:
        assert "k: expected an int in [1, min(128, vocab_size)]" in str(e), e
    else:
        raise AssertionError("k above 128 did not raise")

    def f(h, w):
        return linear_topk(h, w, k=4, temperature=0.8, backend=backend, process_group=group)

    eager = f(hidden, weight[lo:hi])
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(hidden, weight[lo:hi])
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    dist.destroy_process_group()
