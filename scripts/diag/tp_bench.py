"""Vocab-parallel linear_log_probs over NCCL: correctness and time vs the unsharded kernel.

torchrun --nproc_per_node=2 scripts/diag/tp_bench.py [N,H,V] [--iters K]   (default 16384,3584,152064)
TP_BACKEND=gloo torchrun --nproc_per_node=2 ... on a one-GPU machine: both ranks share the GPU
(gloo moves the gathered rows through the host): the correctness checks only, no timing.
torchrun --nproc_per_node=2 scripts/diag/tp_bench.py 64,32,101 --cpu --iters 3: the same code on
the CPU (gloo, the torch backend), timing included; tests/scripts/test_diag_timing.py runs it.

Each rank holds half of the vocabulary (uneven when V is odd); hidden states are replicated.
Checks: log-probs / entropy identical bits on every rank and equal (to float32 rounding) to the
unsharded kernel on one GPU; dW shard and the all-reduced dh vs the unsharded gradients (relative
Frobenius) and vs float64 on the first 1024 tokens. Times forward and forward+backward
(reduce_hidden_grad=True, so the dh all-reduce is included) against the unsharded run on one GPU.

Timing (``rl_kernels.tools.diag.slowest_rank_ms``, not ``triton.testing.do_bench``, whose repeat count each
rank picks from its own timing: with a cold Triton cache the two ranks called different numbers of
collectives and hung): 5 warm-up calls on every rank (they compile), a barrier, then the same
number of calls on every rank (``--iters``, or the count that fills 500 ms at the slowest rank's
time of one call, all-reduced), CUDA events around each; the time is the slowest rank's median.
The unsharded baseline on rank 0 is timed the same way (``diag.local_ms``).
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import rl_kernels
from rl_kernels.tools import diag
from rl_kernels.tools.diag import local_ms, slowest_rank_ms

ap = diag.parser(__doc__, shapes=["16384,3584,152064"], one_shape=True, json_out=True)
ap.add_argument("--iters", type=diag.positive_int, default=None,
                help="timed calls per case, the same on every rank (default: as many as fill 500 ms)")
ap.add_argument("--cpu", action="store_true", help="run on the CPU (gloo, torch backend): a check of the code")
args = ap.parse_args()
if not args.cpu:
    diag.require_cuda(ap.prog, "--cpu runs the same code on the CPU")
dist.init_process_group(os.environ.get("TP_BACKEND", "gloo" if args.cpu else "nccl"))
rank, world = dist.get_rank(), dist.get_world_size()
if args.cpu:
    dev, shared_gpu, device_name = torch.device("cpu"), False, "CPU"
else:
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    shared_gpu = torch.cuda.device_count() < world
    dev = torch.device("cuda")
    device_name = f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
n, h, v = args.shape
g = torch.Generator(device=dev).manual_seed(0)
hidden = torch.randn(n, h, device=dev, generator=g).bfloat16()
weight = (0.02 * torch.randn(v, h, device=dev, generator=g)).bfloat16()
labels = torch.randint(0, v, (n,), device=dev, generator=g)
labels[torch.rand(n, device=dev, generator=g) < 0.1] = -100
g_lp, g_ent = torch.randn(2, n, device=dev, generator=g)
bounds = [v * r // world for r in range(world + 1)]
lo, hi = bounds[rank], bounds[rank + 1]
shard = weight[lo:hi].contiguous()


def say(*a):
    if rank == 0:
        print(*a, flush=True)


def step(hx, wx, **kw):
    out = rl_kernels.linear_log_probs(hx, wx, labels, temperature=0.9, **kw)
    torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


hx, wx = hidden.clone().requires_grad_(), shard.clone().requires_grad_()
out = step(hx, wx, process_group=dist.group.WORLD, reduce_hidden_grad=True)
same = []
for t in (out.log_probs, out.entropy, hx.grad):
    all_t = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(all_t, t)
    same.append(all(torch.equal(x, all_t[0]) for x in all_t))
hu, wu = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
ref = step(hu, wu)
record = {"ranks": world, "backend": dist.get_backend(), "shape": [n, h, v], "shards": bounds,
          "bitwise_on_all_ranks": {"log_probs": same[0], "entropy": same[1], "dh": same[2]},
          "vs_unsharded": {"log_probs": (out.log_probs - ref.log_probs).abs().max().item(),
                           "entropy": (out.entropy - ref.entropy).abs().max().item(),
                           "dh_rel": rel(hx.grad, hu.grad), "dw_shard_rel": rel(wx.grad, wu.grad[lo:hi])}}
say(f"{device_name}, {world} ranks, {dist.get_backend()}, {n}x{h}x{v} bf16, shards {bounds}, "
    f"{time.strftime('%Y-%m-%d')}")
say(f"  identical bits on all ranks: log_probs {same[0]}, entropy {same[1]}, dh {same[2]}")
say(f"  vs unsharded kernel: max|dlogp| {(out.log_probs - ref.log_probs).abs().max().item():.2e}, "
    f"max|dent| {(out.entropy - ref.entropy).abs().max().item():.2e}, "
    f"dh rel {rel(hx.grad, hu.grad):.2e}, dW shard rel {rel(wx.grad, wu.grad[lo:hi]):.2e}")
# float64 on the first 1024 tokens (dh rows of those tokens; dW needs all tokens, so it is skipped)
m = min(1024, n)
h64, w64 = hidden[:m].double().requires_grad_(), weight.double()
lp64 = torch.log_softmax(h64 @ w64.T / 0.9, -1)
valid = labels[:m] != -100
lp_ref = torch.where(valid, lp64.gather(1, labels[:m].clamp_min(0)[:, None])[:, 0], 0.0)
ent_ref = torch.where(valid, -(lp64.exp() * lp64).sum(-1), 0.0)
(lp_ref * g_lp[:m] + ent_ref * g_ent[:m]).sum().backward()
record["vs_float64"] = {"tokens": m, "log_probs": (out.log_probs[:m].double() - lp_ref).abs().max().item(),
                        "entropy": (out.entropy[:m].double() - ent_ref).abs().max().item(),
                        "dh_rel": rel(hx.grad[:m], h64.grad), "dh_rel_unsharded": rel(hu.grad[:m], h64.grad)}
say(f"  vs float64 (first {m} tokens): max|dlogp| {(out.log_probs[:m].double() - lp_ref).abs().max().item():.2e}, "
    f"max|dent| {(out.entropy[:m].double() - ent_ref).abs().max().item():.2e}, dh rel {rel(hx.grad[:m], h64.grad):.2e}")
del h64, w64, lp64
# from-logits path: this rank's logits shard vs the unsharded logits (Triton kernels both)
with torch.no_grad():
    local_logits = hidden @ shard.T
    st = rl_kernels.logits_stats(local_logits, labels, temperature=0.9, process_group=dist.group.WORLD)
    all_lp = [torch.empty_like(st.log_probs) for _ in range(world)]
    dist.all_gather(all_lp, st.log_probs)
    del local_logits
    full = rl_kernels.logits_stats(hidden @ weight.T, labels, temperature=0.9)
say(f"  logits_stats on a logits shard: identical on all ranks {all(torch.equal(x, all_lp[0]) for x in all_lp)}, "
    f"vs unsharded max|dlogp| {(st.log_probs - full.log_probs).abs().max().item():.2e}, "
    f"max|dent| {(st.entropy - full.entropy).abs().max().item():.2e}, "
    f"max|dlse| {(st.lse - full.lse).abs().max().item():.2e}")
record["logits_stats_shard"] = {"bitwise_on_all_ranks": all(torch.equal(x, all_lp[0]) for x in all_lp),
                                "log_probs": (st.log_probs - full.log_probs).abs().max().item(),
                                "entropy": (st.entropy - full.entropy).abs().max().item(),
                                "lse": (st.lse - full.lse).abs().max().item()}
del st, full
if dev.type == "cuda":
    torch.cuda.empty_cache()


def bench(f):
    """Collectives inside: every rank calls ``f`` the same number of times; the slowest rank's median."""
    return slowest_rank_ms(f, dev, warmup=5, iters=args.iters, rep_ms=500)


def bench_local(f):
    """No collectives (rank 0 alone): the same method."""
    return local_ms(f, dev, warmup=5, iters=args.iters, rep_ms=500)


def tp_fwd():
    with torch.no_grad():
        rl_kernels.linear_log_probs(hidden, shard, labels, temperature=0.9, process_group=dist.group.WORLD,
                                    vocab_start_index=lo)


def tp_fb():
    hx.grad = wx.grad = None
    step(hx, wx, process_group=dist.group.WORLD, vocab_start_index=lo, reduce_hidden_grad=True)


if shared_gpu:
    say("  timing skipped: the ranks share one GPU")
    if args.json and rank == 0:
        diag.write_json(args.json, [record], device=dev)
    dist.destroy_process_group()
    sys.exit(0)


def tp_fb_partial():  # Megatron convention: partial dh, no all-reduce inside
    hx.grad = wx.grad = None
    step(hx, wx, process_group=dist.group.WORLD, vocab_start_index=lo)


t_tp_f, t_tp_fb, t_tp_fb_partial = bench(tp_fwd), bench(tp_fb), bench(tp_fb_partial)
if rank == 0:
    def one_fwd():
        with torch.no_grad():
            rl_kernels.linear_log_probs(hidden, weight, labels, temperature=0.9)

    def one_fb():
        hu.grad = wu.grad = None
        step(hu, wu)
    t_mm = bench_local(lambda: hidden @ weight.T)
    t_f = bench_local(one_fwd)
    t_fb = bench_local(one_fb)
    print(f"  one {'GPU' if dev.type == 'cuda' else 'process'} unsharded: cuBLAS mm {t_mm:.2f} ms, "
          f"fwd {t_f:.2f} ms ({t_f / t_mm:.2f}x mm), "
          f"fwd+bwd {t_fb:.2f} ms ({t_fb / t_mm:.2f}x mm)")
    print(f"  {world} {'GPUs' if dev.type == 'cuda' else 'CPU ranks'} vocab-parallel: "
          f"fwd {t_tp_f:.2f} ms ({t_f / t_tp_f:.2f}x speed-up), "
          f"fwd+bwd {t_tp_fb:.2f} ms ({t_fb / t_tp_fb:.2f}x speed-up, ideal {world}x; "
          f"{t_tp_fb_partial:.2f} ms with the partial dh, no all-reduce inside)")
    record["ms"] = {"mm": t_mm, "fwd_unsharded": t_f, "fwd_bwd_unsharded": t_fb, "fwd_tp": t_tp_f,
                    "fwd_bwd_tp": t_tp_fb, "fwd_bwd_tp_partial_dh": t_tp_fb_partial}
    if args.json:
        diag.write_json(args.json, [record], device=dev)
dist.barrier()
# The normal exit, on the CPU too: the SIGABRT at rank 1's exit that an os._exit(0) here used to hide
# (a gloo worker thread freeing a collective's tensors during finalization) is fixed at its cause,
# autograd.vocab_parallel.collective (issue 35; tests/autograd/test_exit_clean.py).
dist.destroy_process_group()
