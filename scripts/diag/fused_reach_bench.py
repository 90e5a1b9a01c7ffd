"""What verl's fused path gains from rl-kernels where verl refuses it: the sum of squared
probabilities (no grad, the old-log-prob pass), a per-row temperature (fwd+bwd) and the top-K
distillation loss (fwd+bwd), against verl's logits path on the same inputs, one GPU, one run.

Rows (bf16 hidden ~ N(0, 1) (N, H), weight ~ N(0, 0.02^2) (V, H), ``tools.bench.head_inputs``):
  mm                       cuBLAS hidden @ weight.T (the ratio's denominator)
  (a) log-probs + Σπ², no grad:
    verl logits path       logits = hidden @ weight.T (bf16), then verl's logprobs_from_logits and
                           calculate_sum_pi_squared_from_logits (as its engines call them)
    fused                  rl_kernels.linear_log_probs(return_entropy=False), without / with Σπ²
  (b) per-row temperature, fwd+bwd of log-probs and entropy: a scalar T against a (N,) T
  (c) top-K distillation, fwd+bwd to hidden and weight, K teacher ids per token:
    verl logits path       logits = hidden @ weight.T, verl's compute_forward_kl_topk, backward
    fused                  rl_kernels.linear_topk_kl(reduction="sum"), and what the verl integration
                           runs (rl_kernels.distill.linear_log_probs_at_ids: the log-probs at the
                           labels and at the teacher's ids from one head call, verl's KL terms on them)
Peak extra memory: max_memory_allocated during one call minus what was allocated before it.
Checks first (N_CHECK rows): a per-row temperature against float64 (log-probs, entropy, dh, dW),
and a constant per-row temperature against the scalar one, bitwise (fwd and bwd).

``--loss-rows`` (instead of (a)-(c)): the verl integration's ``loss_rows_only`` (verl #7686), the
fused head on the rows whose loss mask is 1 alone, fwd+bwd of log-probs and entropy, with a
fraction ``--outside F ...`` of the rows outside the loss (default 0 0.3 0.6), each as a random
mask and as contiguous blocks (per 1024-row sequence, its first F x 1024 rows outside: the prompt /
tool output of an agentic trace). The timed step is the shipped one: the integration's own
``loss_row_index`` (one host sync), ``select_rows``, ``linear_log_probs`` on the selected rows,
``scatter_rows`` back (0 outside), backward with the upstream gradients of every row; gradients
reset inside the step. Rows: mm, the full head (first and last), the selected path per fraction
and mask, and the head alone on the kept rows (no selection: the ideal's time, measured).
"fraction of ideal" = full head ms x kept fraction / selected ms (goal >= 0.9). Checked once per
mask: log-probs and entropy on the kept rows bitwise those of the full head (the kernels are
batch-invariant), 0 outside, and dh 0 outside.

    python scripts/diag/fused_reach_bench.py [--n 16384 --hidden 3584 --vocab 152064 --topk 64]
    python scripts/diag/fused_reach_bench.py --loss-rows [--outside 0 0.3 0.6 --rep 2000 --json F]
"""
from __future__ import annotations

import argparse

import torch

import rl_kernels
from rl_kernels.tools import diag
from rl_kernels.tools.diag import (bench, head_inputs, reference_linear_grads, reference_linear_log_probs, rel_err,
                                   topk_teacher)


def checks(n, h, v):
    """Per-row temperature vs float64, and constant rows vs the scalar temperature (bitwise)."""
    hidden, weight, labels, g_lp, g_ent = head_inputs(n, h, v, seed=1)
    temperature = torch.rand(n, device="cuda", generator=torch.Generator("cuda").manual_seed(2)) * 1.5 + 0.4
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = rl_kernels.linear_log_probs(hx, wx, labels, temperature=temperature)
    (out.log_probs * g_lp + out.entropy * g_ent).sum().backward()
    ref = reference_linear_log_probs(hidden, weight, labels, temperature=temperature)
    dh, dw = reference_linear_grads(hidden, weight, labels, g_lp, g_ent, temperature=temperature)
    res = {"lp_max_abs": (out.log_probs.double() - ref.log_probs).abs().max().item(),
           "ent_max_abs": (out.entropy.double() - ref.entropy).abs().max().item(),
           "dh_rel": rel_err(hx.grad, dh), "dw_rel": rel_err(wx.grad, dw)}
    same = []
    for t in (torch.full((n,), 0.7, device="cuda"), 0.7):
        hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        o = rl_kernels.linear_log_probs(hx, wx, labels, temperature=t)
        (o.log_probs * g_lp + o.entropy * g_ent).sum().backward()
        same.append((o.log_probs, o.entropy, hx.grad, wx.grad))
    res["constant_rows_bitwise"] = all(torch.equal(a, b) for a, b in zip(*same))
    return res


SEQ = 1024  # rows of one sequence in the block masks


def fraction(text: str) -> float:
    """An argparse type: a fraction of the rows in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def loss_masks(n, outside, device, seed=5):
    """{(F, kind): bool (n,) mask, True for a row in the loss}: kind "random", exactly round(F n) rows
    outside drawn without replacement; kind "blocks" (F > 0), per SEQ-row sequence its first
    round(F SEQ) rows outside (an agentic trace's prompt / tool output, then the model's turn)."""
    g = torch.Generator(device).manual_seed(seed)
    masks = {}
    for f in outside:
        rnd = torch.ones(n, dtype=torch.bool, device=device)
        rnd[torch.randperm(n, device=device, generator=g)[:round(f * n)]] = False
        masks[(f, "random")] = rnd
        if f > 0:
            masks[(f, "blocks")] = torch.arange(n, device=device) % SEQ >= round(f * SEQ)
    return masks


def loss_rows(args, head) -> int:
    """``--loss-rows``: the fused head on the loss rows alone through the verl integration's own
    selection and scatter (module docstring), against the full head and one matmul."""
    from rl_kernels.tools.verl_kernels import import_verl_modules

    head["verl"] = import_verl_modules(stub=True)  # the integration's package patches verl on import
    from rl_kernels.integrations.verl_impl import patch_state
    n, rep = args.n, args.rep
    hidden, weight, labels, g_lp, g_ent = head_inputs(n, args.hidden, args.vocab)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def full(g=(g_lp, g_ent)):
        def f():
            hx.grad = wx.grad = None
            out = rl_kernels.linear_log_probs(hx, wx, labels)
            torch.autograd.backward([out.log_probs, out.entropy], list(g))
            return out.log_probs, out.entropy
        return f

    def selected(mask):  # fused_log_probs_entropy's loss_rows_only path, as shipped
        def f():
            hx.grad = wx.grad = None
            index = patch_state.loss_row_index(mask, labels)
            h, y = (patch_state.select_rows(t, index, labels.numel()).unsqueeze(0) for t in (hx, labels))
            out = rl_kernels.linear_log_probs(h, wx, y)
            lp, ent = (patch_state.scatter_rows(t.reshape(-1), index, labels.shape)
                       for t in (out.log_probs, out.entropy))
            torch.autograd.backward([lp, ent], [g_lp, g_ent])
            return lp, ent
        return f

    def kept_alone(k):  # the ideal's time, measured: the plain head on k rows, no selection
        hk = hidden[:k].clone().requires_grad_()

        def f():
            hk.grad = wx.grad = None
            out = rl_kernels.linear_log_probs(hk, wx, labels[:k])
            torch.autograd.backward([out.log_probs, out.entropy], [g_lp[:k], g_ent[:k]])
        return f

    masks = loss_masks(n, args.outside, labels.device)
    lp_full, ent_full = (t.detach().clone() for t in full()())
    head["checks"] = {}
    for (f, kind), mask in masks.items():  # the selected path against the full head, once per mask
        keep = mask.float()
        full((g_lp * keep, g_ent * keep))()  # the full head with the loss's gradients: 0 outside
        dh_ref, dw_ref = hx.grad.clone(), wx.grad.clone()
        lp, ent = selected(mask)()
        head["checks"][f"{f:g} {kind}"] = {
            "log_probs_entropy_bitwise_on_kept_rows": bool(torch.equal(lp[mask], lp_full[mask])
                                                           and torch.equal(ent[mask], ent_full[mask])),
            "zero_outside": bool((lp[~mask] == 0).all() and (ent[~mask] == 0).all()
                                 and (hx.grad[~mask] == 0).all()),
            "dh_rel_vs_full_masked": rel_err(hx.grad, dh_ref), "dw_rel_vs_full_masked": rel_err(wx.grad, dw_ref)}
        del dh_ref, dw_ref
    print("checks:", head["checks"], flush=True)

    timed = {"mm": bench(lambda: hidden @ weight.T, rep), "full head": bench(full(), rep)}
    records = {}
    for (f, kind), mask in masks.items():
        kept = mask.sum().item() / n
        name = f"selected, {f:.0%} outside, {kind}"
        timed[name] = bench(selected(mask), rep)
        records[name] = {"outside": f, "mask": kind, "kept": kept}
        if kind == "random" and f > 0:  # the same kept count for both masks
            alone = f"head alone on the kept rows, {f:.0%} outside"
            timed[alone] = bench(kept_alone(int(mask.sum().item())), rep)
            records[alone] = {"outside": f, "kept": kept}
    timed["full head (again, last)"] = bench(full(), rep)
    full_ms = timed["full head"][0]
    for name, (ms, peak) in timed.items():
        rec = records.setdefault(name, {})
        rec.update(ms=ms, peak_extra_gib=peak)
        if "kept" in rec:
            rec["fraction_of_ideal"] = full_ms * rec["kept"] / ms
    print(f"{diag.device_line()} | N={n} H={args.hidden} V={args.vocab} bf16, entropy on, fwd+bwd | do_bench rep "
          f"{rep} ms | verl: {head['verl']}")
    diag.print_bench_rows(timed)
    for name, rec in records.items():
        if "fraction_of_ideal" in rec:
            print(f"{name}: kept {rec['kept']:.3f}, fraction of ideal {rec['fraction_of_ideal']:.3f}")
    print(f"full head first / last: {full_ms:.3f} / {timed['full head (again, last)'][0]:.3f} ms")
    if args.json:
        diag.write_json(args.json, records, header=head)
    return 0


def main() -> int:
    ap = diag.parser(__doc__, json_out=True, n=16384, hidden=3584, vocab=152064, topk=64, check_rows=1024)
    ap.add_argument("--loss-rows", action="store_true",
                    help="time loss_rows_only (the head on the loss rows alone) instead of (a)-(c)")
    ap.add_argument("--outside", nargs="+", type=fraction, default=[0.0, 0.3, 0.6], metavar="F",
                    help="--loss-rows: fractions of the rows outside the loss (default 0 0.3 0.6)")
    ap.add_argument("--rep", type=diag.positive_int, default=2000,
                    help="--loss-rows: do_bench's rep, ms per row (default 2000)")
    args = diag.start(ap, full_precision_bf16=True)
    head = {**diag.header(), "n": args.n, "hidden": args.hidden, "vocab": args.vocab, "topk": args.topk}
    if args.loss_rows:
        del head["topk"]
        head["rep_ms"] = args.rep
        print(head, flush=True)
        return loss_rows(args, head)
    print(head, flush=True)
    head["checks"] = checks(args.check_rows, args.hidden, args.vocab)
    print("checks:", head["checks"], flush=True)

    n, v = args.n, args.vocab
    hidden, weight, labels, g_lp, g_ent = head_inputs(n, args.hidden, v)
    rows = {}
    rows["mm"] = bench(lambda: hidden @ weight.T)

    # (a) log-probs + sum_pi_squared, no grad
    verl_F, how_f = diag.verl_functional()
    head["verl_functional"] = how_f
    # verl's log-probs: flash-attn's Triton cross-entropy when importable (as verl users run it),
    # else a per-row log_softmax loop (its fallback): the table says which
    flash = getattr(verl_F, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False)
    head["verl_log_probs"] = "flash-attn Triton cross-entropy" if flash else "fallback (no flash-attn)"

    def verl_sum_pi():
        with torch.no_grad():
            logits = hidden @ weight.T
            return verl_F.logprobs_from_logits(logits, labels), verl_F.calculate_sum_pi_squared_from_logits(logits)

    def fused(sum_pi):
        def f():
            with torch.no_grad():
                return rl_kernels.linear_log_probs(hidden, weight, labels, return_entropy=False,
                                                   return_sum_pi_squared=sum_pi)
        return f
    for _ in range(2):  # interleaved: the closest pair twice
        rows["(a) fused log-probs"] = bench(fused(False))
        rows["(a) fused log-probs + sum_pi_squared"] = bench(fused(True))
    rows["(a) verl logits path log-probs + sum_pi_squared"] = bench(verl_sum_pi)

    def verl_sum_pi_only():
        with torch.no_grad():
            return verl_F.calculate_sum_pi_squared_from_logits(hidden @ weight.T)
    rows["(a) verl logits path sum_pi_squared alone"] = bench(verl_sum_pi_only)
    ref_sq = verl_F.calculate_sum_pi_squared_from_logits((hidden[:1024] @ weight.T).double())
    head["sum_pi_squared_max_abs_err"] = {
        "fused": (fused(True)().sum_pi_squared[:1024].double() - ref_sq).abs().max().item(),
        "verl logits path": (verl_sum_pi()[1][:1024].double() - ref_sq).abs().max().item()}

    # (b) per-row temperature, fwd+bwd
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    row_t = torch.rand(n, device="cuda") + 0.5

    def step(t):
        def f():
            hx.grad = wx.grad = None
            o = rl_kernels.linear_log_probs(hx, wx, labels, temperature=t)
            (o.log_probs * g_lp + o.entropy * g_ent).sum().backward()
        return f
    for _ in range(2):
        rows["(b) fwd+bwd scalar temperature"] = bench(step(0.7))
        rows["(b) fwd+bwd per-row temperature"] = bench(step(row_t))

    # (c) top-K distillation, fwd+bwd
    verl_losses, how = diag.verl_losses()
    head["verl"] = how
    k = args.topk
    ids, t_lp = topk_teacher(hidden, weight, k)
    lengths = [n // 8] * 7 + [n - 7 * (n // 8)]
    nested = [torch.nested.as_nested_tensor(list(t.split(lengths)), layout=torch.jagged) for t in (t_lp, ids)]
    cfg = diag.verl_loss_config(False, None)

    def verl_distill():
        hx.grad = wx.grad = None
        logits = (hx @ wx.T)[None]
        out = verl_losses.compute_forward_kl_topk(logits, nested[0], nested[1], cfg, "thd")
        out["distillation_losses"].sum().backward()

    def fused_distill():
        hx.grad = wx.grad = None
        rl_kernels.linear_topk_kl(hx, wx, ids, t_lp, reduction="sum").backward()
    linear_log_probs_at_ids = diag.linear_log_probs_at_ids

    def served_distill():  # what the verl integration's fused forward computes (verl's three outputs)
        hx.grad = wx.grad = None
        _, _, log_q = linear_log_probs_at_ids(hx, wx, labels, ids)
        losses = (t_lp.exp() * (t_lp - log_q)).sum(-1)  # (verl's masses: O(N K), left out)
        losses.sum().backward()
    rows["(c) fused linear_topk_kl fwd+bwd"] = bench(fused_distill)
    rows["(c) fused, as the verl integration serves it, fwd+bwd"] = bench(served_distill)
    rows["(c) verl logits path compute_forward_kl_topk fwd+bwd"] = bench(verl_distill)

    print(f"{diag.device_line()} | N={n} H={args.hidden} V={v} K={k} bf16 | verl: {how}; {how_f}; "
          f"log-probs: {head['verl_log_probs']}")
    diag.print_bench_rows(rows)
    a0, a1 = rows["(a) fused log-probs"][0], rows["(a) fused log-probs + sum_pi_squared"][0]
    b0, b1 = rows["(b) fwd+bwd scalar temperature"][0], rows["(b) fwd+bwd per-row temperature"][0]
    print(f"sum_pi_squared / fused forward: {a1 / a0:.4f}; per-row / scalar temperature fwd+bwd: {b1 / b0:.4f}")
    print("sum_pi_squared max |err| vs float64 (first 1024 rows):", head["sum_pi_squared_max_abs_err"])
    if args.json:
        diag.write_json(args.json, diag.bench_records(rows), header=head)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
