"""verl's top-K distillation loss (``compute_forward_kl_topk`` of
``verl.trainer.distillation.fsdp.losses``) against rl-kernels' replacement
(``rl_kernels.integrations.verl_impl.distill_losses``) on one GPU: forward+backward time, peak extra memory and
accuracy against float64.

Variants, the same inputs:
  verl          verl's function, ``use_chunked_topk=False`` (F.log_softmax over the vocabulary, kept for backward)
  verl chunked  verl's function, ``use_chunked_topk=True`` (chunked float32 logsumexp + gather)
  rl_kernels    the replacement: student log-probs from rl_kernels.topk_log_probs_from_logits

Inputs: bf16 student logits (1, N, V) = 2 N(0, 1), requiring grad; the teacher's top K per token
taken from the student's logits plus 2 N(0, 1) noise (its float32 log-probs at those ids, its int64
ids), both nested (jagged) over ``--seqs`` sequences, as verl's batches hold them. The timed step
(triton.testing.do_bench, rep=1000 ms, median) resets the logits' gradient, runs the function and
backpropagates ``distillation_losses.sum()``. Peak extra memory: torch.cuda.max_memory_allocated
during one step minus what was allocated before it (the inputs); it includes the logits' gradient
(N x V bf16) that every variant writes. Errors: max |distillation_losses - float64| and max
|d loss / d logits - float64| (the float64 reference from the same bf16 logits, in row chunks).
``log_prob_min_clamp`` is off by default (``--clamp -10`` is verl's default): the clamp's
discontinuity would otherwise show up as error wherever a bf16 log-prob and its float64 value fall
on opposite sides of it; the time does not depend on it.

verl: the installed (or PYTHONPATH) verl; when its full import fails (a GPU machine without verl's
Ray / tensordict / omegaconf stack), the loss file alone is loaded with verl's Ulysses helpers
stubbed at world size 1 (the table's header says which).

    python scripts/distill_bench.py [--n 4096 --vocab 152064 --topk 64 --seqs 8 --json out.json]
    python scripts/distill_bench.py --cpu-smoke     # CPU: tiny shape, the same code path (timed by a loop)
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import time

import torch

from rl_kernels.tools import diag


def make_inputs(n, v, k, seqs, device, seed=0):
    """Student logits (1, n, v) bf16 requiring grad; nested teacher (float32 log-probs, int64 ids)."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = (2 * torch.randn(1, n, v, device=device, generator=g)).bfloat16()
    ids = torch.empty(n, k, dtype=torch.int64, device=device)
    log_probs = torch.empty(n, k, dtype=torch.float32, device=device)
    for r0 in range(0, n, 1024):  # the teacher, a row chunk at a time
        r1 = min(n, r0 + 1024)
        teacher = logits[0, r0:r1].float() + 2 * torch.randn(r1 - r0, v, device=device, generator=g)
        top, ids[r0:r1] = teacher.topk(k, dim=-1)
        log_probs[r0:r1] = top - torch.logsumexp(teacher, -1, keepdim=True)
        del teacher, top
    cuts = sorted(torch.randperm(n - 1, generator=torch.Generator().manual_seed(seed))[: seqs - 1].add(1).tolist())
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
    nested = [torch.nested.as_nested_tensor(list(t.split(lengths)), layout=torch.jagged) for t in (log_probs, ids)]
    return logits.requires_grad_(), nested[0], nested[1], lengths


def load_replacement_module():
    """rl-kernels' ``rl_kernels.integrations.verl_impl.distill_losses``: importing it patches nothing of
    verl (the bench calls verl's function and the replacement itself)."""
    return importlib.import_module("rl_kernels.integrations.verl_impl.distill_losses")


def reference(logits, log_probs, ids, clamp, chunk=256):
    """float64 distillation_losses (n,) and d sum(losses) / d logits (n, v), in row chunks."""
    x = logits.detach()[0]
    lp, ids = log_probs.values(), ids.values()
    losses = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    grad = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    for r0 in range(0, x.shape[0], chunk):
        r1 = min(x.shape[0], r0 + chunk)
        z = x[r0:r1].double().requires_grad_()
        lq = torch.log_softmax(z, -1).gather(-1, ids[r0:r1])
        lt = lp[r0:r1].double()
        if clamp is not None:
            lq, lt = lq.clamp_min(clamp), lt.clamp_min(clamp)
        per = (lt.exp() * (lt - lq)).sum(-1)
        per.sum().backward()
        losses[r0:r1], grad[r0:r1] = per.detach(), z.grad
    return losses, grad


def run(args, device):
    import rl_kernels

    verl, how = diag.verl_losses()
    original = verl.compute_forward_kl_topk
    ours = load_replacement_module().replacement(verl, original, megatron=False)
    logits, t_lp, t_ids, lengths = make_inputs(args.n, args.vocab, args.topk, args.seqs, device)
    config = diag.verl_loss_config
    variants = {"verl": (original, config(False, args.clamp)), "verl chunked": (original, config(True, args.clamp)),
                "rl_kernels": (ours, config(False, args.clamp))}

    def step(fn, cfg):
        def once():
            logits.grad = None
            out = fn(logits, t_lp, t_ids, cfg, "thd")
            out["distillation_losses"].sum().backward()
            return out
        return once

    ref_losses, ref_grad = reference(logits, t_lp, t_ids, args.clamp)
    rows = []
    for name, (fn, cfg) in variants.items():
        once = step(fn, cfg)
        out = once()  # warm-up, and the values checked
        err_loss = (out["distillation_losses"][0].double() - ref_losses).abs().max().item()
        err_grad = (logits.grad[0].double() - ref_grad).abs().max().item()
        del out
        logits.grad = None
        if device.type == "cuda":
            import triton.testing

            peak = diag.peak_extra_gib(once)
            ms = triton.testing.do_bench(once, rep=1000, return_mode="median")
        else:  # --cpu-smoke: a plain loop
            peak, times = None, []
            for _ in range(3):
                t0 = time.perf_counter()
                once()
                times.append((time.perf_counter() - t0) * 1e3)
            ms = sorted(times)[1]
        logits.grad = None
        rows.append({"variant": name, "fwd_bwd_ms": ms, "peak_extra_gib": peak, "max_abs_err_loss": err_loss,
                     "max_abs_err_grad": err_grad})
    header = {**diag.header(device), "rl_kernels": rl_kernels.__version__,
              "verl": how, "n": args.n, "vocab": args.vocab, "topk": args.topk, "sequences": lengths,
              "log_prob_min_clamp": args.clamp, "max_abs_grad_float64": ref_grad.abs().max().item()}
    return header, rows


def table(header, rows) -> str:
    lines = [f"{header['device']} | torch {header['torch']} | {header['date']} | N={header['n']} V={header['vocab']} "
             f"K={header['topk']} bf16 logits, {len(header['sequences'])} sequences | log_prob_min_clamp="
             f"{header['log_prob_min_clamp']} | verl: {header['verl']}",
             f"{'variant':<14}{'fwd+bwd ms':>12}{'peak extra GiB':>16}{'max|err| loss':>15}{'max|err| grad':>15}"]
    for r in rows:
        peak = "n/a" if r["peak_extra_gib"] is None else f"{r['peak_extra_gib']:.2f}"
        lines.append(f"{r['variant']:<14}{r['fwd_bwd_ms']:>12.2f}{peak:>16}{r['max_abs_err_loss']:>15.2e}"
                     f"{r['max_abs_err_grad']:>15.2e}")
    lines.append(f"(max |d loss / d logits| of the float64 reference: {header['max_abs_grad_float64']:.3g})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = diag.parser(__doc__, json_out=True, n=4096, vocab=152064, topk=64)
    ap.add_argument("--seqs", type=diag.positive_int, default=8,
                    help="sequences the tokens are split into (nested teacher; default 8)")
    ap.add_argument("--clamp", type=float, default=None, help="log_prob_min_clamp (verl's default: -10)")
    ap.add_argument("--cpu-smoke", action="store_true", help="CPU: N=24, V=301, K=4, 3 sequences, timed by a loop")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        args.n, args.vocab, args.topk, args.seqs = 24, 301, 4, 3
        device = torch.device("cpu")
    else:
        diag.require_cuda(ap.prog, "use --cpu-smoke for the CPU check")
        device = torch.device("cuda")
    if not (1 <= args.topk <= args.vocab and 1 <= args.seqs <= args.n):
        ap.error("need 1 <= --topk <= --vocab and 1 <= --seqs <= --n")
    header, rows = run(args, device)
    print(table(header, rows))
    if args.json:
        diag.write_json(args.json, rows, device=device, header=header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
