"""Top-K distillation, part 2, on one GPU: verl's ``forward_kl_topk`` (logits path) against
rl-kernels' top-K KL from logits and fused, without and with the tail bucket (``tail=True``, verl
RFC #7856), and the fused top-K selection (``rl_kernels.linear_topk``) against one cuBLAS matmul.

Rows (bf16 hidden ~ N(0, 1) (N, H), weight ~ N(0, 0.02^2) (V, H), ``tools.bench.head_inputs``; the
teacher's K ids and float32 log-probs from the student's logits plus N(0, 1) noise):
  mm                                   cuBLAS hidden @ weight.T (the ratios' denominator)
  verl logits path                     logits = hidden @ weight.T (bf16), verl's FSDP
                                       compute_forward_kl_topk, backward of the losses' sum
  from logits [tail]                   logits = hidden @ weight.T, rl_kernels.topk_kl_from_logits
  fused [tail]                         rl_kernels.linear_topk_kl (no N x V tensor)
  fused top-K selection (no grad)      rl_kernels.linear_topk(hidden, weight, K)
  at ids [tail] [...]                  the integration's fused call: rl_kernels.distill.linear_log_probs_at_ids
                                       (log-probs at the labels and at the teacher's ids, a loss of both),
                                       alone, + linear_topk (the student's top K for verl's overlap
                                       metrics, as before issue 54), or with top_k=K (the top K selected
                                       in the head's own forward)
Every loss row is forward + backward to hidden and weight (reduction "sum"), timed by
triton.testing.do_bench (rep 1000 ms, median; gradients reset inside the step). Peak extra memory:
max_memory_allocated during one call minus what was allocated before it.
Checks first (--check-rows rows): the tail-aware loss, fused and from logits, against float64
(per-token loss, dh, dW), and the top-K selection against torch.topk of the float64 logits.

    python scripts/diag/distill_tail_bench.py [--n 16384 --hidden 3584 --vocab 152064 --topk 64 --json F]
"""
from __future__ import annotations

import torch

import rl_kernels
from rl_kernels.tools import diag
from rl_kernels.tools.diag import bench, head_inputs, rel_err, topk_teacher


def tail_reference(hidden, weight, ids, t_lp, kind):
    """float64 tail-aware per-token KL (N,) and its dh, dW (loss = sum)."""
    h = hidden.double().requires_grad_()
    w = weight.double().requires_grad_()
    z = h @ w.T
    lse = torch.logsumexp(z, -1)
    log_q = z.gather(1, ids) - lse[:, None]
    tail_lse = torch.logsumexp(z.scatter(1, ids, float("-inf")), -1)
    log_q_tail = tail_lse - lse
    p = t_lp.double().exp()
    p_tail = (1 - p.sum(-1)).clamp(0, 1)
    if kind == "forward":
        loss = (p * (t_lp.double() - log_q)).sum(-1) + torch.where(p_tail > 0, p_tail * (p_tail.log() - log_q_tail), 0)
    else:
        loss = (log_q.exp() * (log_q - t_lp.double())).sum(-1) + log_q_tail.exp() * (log_q_tail - p_tail.log())
    loss.sum().backward()
    return loss.detach(), h.grad, w.grad


def checks(n, h, v, k):
    hidden, weight, _, _, _ = head_inputs(n, h, v, seed=1)
    hidden, weight = hidden.float(), weight.float()
    ids, t_lp = topk_teacher(hidden, weight, k, seed=5)
    res = {}
    ref, dh, dw = tail_reference(hidden, weight, ids, t_lp, "forward")
    for name in ("fused", "from logits"):
        hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        if name == "fused":
            loss = rl_kernels.linear_topk_kl(hx, wx, ids, t_lp, tail=True, reduction="none")
        else:
            loss = rl_kernels.topk_kl_from_logits(hx @ wx.T, ids, t_lp, tail=True, reduction="none")
        loss.sum().backward()
        res[name] = {"loss_max_abs": (loss.double() - ref).abs().max().item(), "dh_rel": rel_err(hx.grad, dh),
                     "dw_rel": rel_err(wx.grad, dw)}
    with torch.no_grad():
        z = hidden.double() @ weight.double().T
        ref_lp, ref_ids = torch.sort(z, dim=-1, descending=True, stable=True)  # ties: the smaller id first
        lp, got_ids = rl_kernels.linear_topk(hidden, weight, k=k)
        ref_lp = ref_lp[:, :k] - torch.logsumexp(z, -1, keepdim=True)
        res["linear_topk"] = {"ids_equal_rows": (got_ids == ref_ids[:, :k]).all(-1).float().mean().item(),
                              "log_probs_max_abs": (lp.double() - ref_lp).abs().max().item()}
    return res


def main() -> int:
    ap = diag.parser(__doc__, json_out=True, n=16384, hidden=3584, vocab=152064, topk=64, check_rows=512)
    args = diag.start(ap, full_precision_bf16=True)
    n, v, k = args.n, args.vocab, args.topk
    head = {**diag.header(), "n": n, "hidden": args.hidden, "vocab": v, "topk": k}
    print(head, flush=True)
    head["checks"] = checks(args.check_rows, args.hidden, v, k)
    print("checks:", head["checks"], flush=True)

    hidden, weight, _, _, _ = head_inputs(n, args.hidden, v)
    ids, t_lp = topk_teacher(hidden, weight, k)
    head["teacher_topk_mass_mean"] = t_lp.exp().sum(-1).mean().item()
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    verl_losses, how = diag.verl_losses()
    head["verl"] = how
    lengths = [n // 8] * 7 + [n - 7 * (n // 8)]
    nested = [torch.nested.as_nested_tensor(list(t.split(lengths)), layout=torch.jagged) for t in (t_lp, ids)]
    cfg = diag.verl_loss_config(False, None)

    def verl_step():
        hx.grad = wx.grad = None
        out = verl_losses.compute_forward_kl_topk((hx @ wx.T)[None], nested[0], nested[1], cfg, "thd")
        out["distillation_losses"].sum().backward()

    def from_logits(tail):
        def f():
            hx.grad = wx.grad = None
            rl_kernels.topk_kl_from_logits(hx @ wx.T, ids, t_lp, tail=tail, reduction="sum").backward()
        return f

    def fused(tail):
        def f():
            hx.grad = wx.grad = None
            rl_kernels.linear_topk_kl(hx, wx, ids, t_lp, tail=tail, reduction="sum").backward()
        return f

    def select():
        with torch.no_grad():
            return rl_kernels.linear_topk(hidden, weight, k=k)

    labels = ids[:, 0].contiguous()
    t_p = t_lp.exp()

    def at_ids(tail, top_k=0, separate=False):
        def f():
            hx.grad = wx.grad = None
            out = diag.linear_log_probs_at_ids(hx, wx, labels, ids, return_tail=tail, top_k=top_k)
            (out[0].sum() - (out[2] * t_p).sum() - (out[3].sum() if tail else 0)).backward()
            if separate:
                select()
        return f

    rows = {}
    for _ in range(2):  # interleaved: the closest pairs twice
        rows["mm"] = bench(lambda: hidden @ weight.T)
        rows["fused top-K selection (no grad)"] = bench(select)
    rows["verl logits path forward_kl_topk fwd+bwd"] = bench(verl_step)
    for _ in range(2):
        rows["from logits fwd+bwd"] = bench(from_logits(False))
        rows["from logits, tail fwd+bwd"] = bench(from_logits(True))
    for _ in range(2):
        rows["fused fwd+bwd"] = bench(fused(False))
        rows["fused, tail fwd+bwd"] = bench(fused(True))
    for _ in range(2):
        rows["at ids fwd+bwd"] = bench(at_ids(False))
        rows["at ids + linear_topk fwd+bwd"] = bench(at_ids(False, separate=True))
        rows["at ids, top_k in the forward fwd+bwd"] = bench(at_ids(False, top_k=k))
        rows["at ids, tail + linear_topk fwd+bwd"] = bench(at_ids(True, separate=True))
        rows["at ids, tail, top_k in the forward fwd+bwd"] = bench(at_ids(True, top_k=k))

    print(f"{diag.device_line()} | N={n} H={args.hidden} V={v} K={k} bf16 | verl: {how}")
    diag.print_bench_rows(rows)
    if args.json:
        diag.write_json(args.json, diag.bench_records(rows), header=head)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
