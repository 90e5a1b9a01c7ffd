"""Launch cost at small N: a public call eager (back to back), compiled (inductor, fullgraph) and
replayed from a CUDA graph, against its kernels alone (issue 29's question: how much of a small
call is host time, and how much of it a CUDA graph or torch.compile removes).

python scripts/diag/graph_launch.py [N,H,V ...] [--json PATH] [--no-compile]   (default 512,3584,152064)

Rows (bf16, labels uniform, medians of triton.testing.do_bench, ms):
  from-logits forward / forward+backward (``logits_stats`` with entropy) at N x V;
  fused head forward+backward (``linear_log_probs``) at N x H x V.
Each row: the public call eager, compiled (from-logits fwd+bwd only; inductor, and inductor with
``mode="reduce-overhead"``, its own CUDA graphs), one CUDA-graph replay of
the same call, and the kernels alone (the launchers, no autograd or checks); the ratios to the
kernels; and for the from-logits calls ``eager_b2b``: the eager call timed back to back without
do_bench's L2 flush between calls (which overlaps part of a host-bound call's host time).
Every graph is checked to give the eager call's bits before it is timed.
"""
import statistics
import sys

import torch
import triton.testing

import rl_kernels
from rl_kernels.tools import diag


def bench(f, rep: int = 300) -> float:
    """do_bench median (ms); ``rep`` is its time budget (ms): 1000 for steps of 100 ms and more."""
    return triton.testing.do_bench(f, warmup=25, rep=rep, return_mode="median")


def back_to_back(f) -> float:
    """ms per call of ``f`` called back to back (no L2 flush between calls, unlike do_bench,
    whose flush kernel hides part of a host-bound call's host time): ``per_call_us``, the larger
    of the host's and the GPU's time per call; the median of 5 runs of max(20, 30 ms worth of) calls."""
    reps = max(20, int(30e3 / diag.per_call_us(f, reps=1, warmup=1)))
    return statistics.median(diag.per_call_us(f, reps=reps, warmup=0) for _ in range(5)) / 1e3


def graphed(step, check):
    """A CUDA graph of ``step()`` (warmed up on a side stream); returns (replay, outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    graph.replay()
    torch.cuda.synchronize()
    check(outs)
    return graph.replay


def main():
    ap = diag.parser(__doc__, shapes=["512,3584,152064"], json_out=True)
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    args = diag.start(ap)
    rows = {}
    for n, h, v in args.shapes:
        rows.update(measure(n, h, v, compile_rows=not args.no_compile))
        torch.cuda.empty_cache()
    print("ms (do_bench median); x = / kernels")
    for name, r in rows.items():
        base = r.get("kernels")
        cells = [f"{k} {t:.3f}" + (f" ({t / base:.2f}x)" if base and k != "kernels" else "") for k, t in r.items()]
        print(f"{name:36s} " + " | ".join(cells))
    if args.json:
        diag.write_json(args.json, rows)


def measure(n: int, h: int, v: int, compile_rows: bool = True) -> dict:
    """The rows of one shape (``compile_rows``: with the torch.compile rows)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    logits = (3 * torch.randn(n, v, device="cuda", generator=g)).bfloat16()
    g_lp, g_ent = torch.randn(n, device="cuda", generator=g), torch.randn(n, device="cuda", generator=g)
    ops = diag.ops
    lp, lcfg = diag.logits_params(logits.device), ops.logits_config(logits.device)
    rows = {}

    # --- from-logits forward
    fwd = lambda: rl_kernels.logits_stats(logits, lab)  # noqa: E731
    ref = fwd()
    replay = graphed(fwd, lambda o: (torch.equal(o.log_probs, ref.log_probs) and torch.equal(o.entropy, ref.entropy))
                     or sys.exit("graph != eager (from-logits forward)"))
    rows[f"from-logits fwd {n}x{v}"] = dict(
        eager=bench(fwd), graph=bench(replay), kernels=bench(lambda: ops.logits_forward(logits, lab, lp, lcfg)),
        eager_b2b=back_to_back(fwd))

    # --- from-logits forward + backward
    x = logits.clone().requires_grad_()

    def fwd_bwd(f=rl_kernels.logits_stats):
        x.grad = None
        o = f(x, lab)
        torch.autograd.backward([o.log_probs, o.entropy], [g_lp, g_ent])
        return x.grad

    ref_grad = fwd_bwd().clone()
    replay = graphed(fwd_bwd, lambda gr: torch.equal(gr, ref_grad) or sys.exit("graph != eager (from-logits bwd)"))
    grad = torch.empty_like(logits)
    grads = {"log_probs": g_lp, "entropy": g_ent}

    def kernels():
        stats = ops.logits_forward(logits, lab, lp, lcfg)
        ops.logits_backward(logits, grad, lab, stats, grads, lp, lcfg)

    row = dict(eager=bench(fwd_bwd), graph=bench(replay), kernels=bench(kernels), eager_b2b=back_to_back(fwd_bwd))
    if compile_rows:
        for mode in ("default", "reduce-overhead"):  # inductor; and inductor with its CUDA graphs
            torch._dynamo.reset()
            compiled = torch.compile(lambda z, y: rl_kernels.logits_stats(z, y), fullgraph=True, mode=mode)
            for _ in range(3):  # (reduce-overhead records its graph after warm-up runs)
                got = fwd_bwd(compiled)
            if not torch.equal(got, ref_grad):
                sys.exit(f"compiled ({mode}) != eager (from-logits bwd)")
            row["compiled" if mode == "default" else "reduce-overhead"] = bench(lambda: fwd_bwd(compiled))
    rows[f"from-logits fwd+bwd {n}x{v}"] = row

    # --- fused head forward + backward
    hx, wx = hid.clone().requires_grad_(), w.clone().requires_grad_()

    def head_step():
        hx.grad = wx.grad = None
        o = rl_kernels.linear_log_probs(hx, wx, lab)
        torch.autograd.backward([o.log_probs, o.entropy], [g_lp, g_ent])
        return hx.grad, wx.grad

    ref_dh, ref_dw = (t.clone() for t in head_step())
    replay = graphed(head_step, lambda o: (torch.equal(o[0], ref_dh) and torch.equal(o[1], ref_dw))
                     or sys.exit("graph != eager (head)"))
    rep = 1000 if n >= 4096 else 300
    rows[f"head fwd+bwd {n}x{h}x{v}"] = dict(eager=bench(head_step, rep), graph=bench(replay, rep),
                                             matmul=bench(lambda: hid @ w.T))
    return rows


if __name__ == "__main__":
    main()
