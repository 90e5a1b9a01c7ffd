"""Top-K KL forward+backward time vs our linear_log_probs forward+backward (same run), bf16.

python scripts/diag/distill_bench.py [N,H,V,K]   (default 4096,3584,152064,64: a Qwen2.5-7B head, K = 64)
"""
import sys

import torch
import triton.testing

import rl_kernels

n, h, v, k = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4096,3584,152064,64").split(","))
g = torch.Generator(device="cuda").manual_seed(0)
hid = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16().requires_grad_()
lab = torch.randint(0, v, (n,), device="cuda", generator=g)
ids = torch.randint(0, v, (n, k), device="cuda", generator=g)
t_lp = torch.log_softmax(2 * torch.randn(n, k, device="cuda", generator=g), -1)
g_lp, g_ent = torch.randn(2, n, device="cuda", generator=g)
bench = lambda f: triton.testing.do_bench(f, warmup=10, rep=1000, return_mode="median")  # noqa: E731


def head():
    hid.grad = w.grad = None
    out = rl_kernels.linear_log_probs(hid, w, lab)
    torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])


def topk(kind):
    def step():
        hid.grad = w.grad = None
        rl_kernels.linear_topk_kl(hid, w, ids, t_lp, kind=kind).backward()
    return step


t_mm = bench(lambda: hid.detach() @ w.detach().T)
t_head = bench(head)
print(f"{n}x{h}x{v} K={k}: cuBLAS {t_mm:.2f} ms; linear_log_probs fwd+bwd {t_head:.2f} ms ({t_head / t_mm:.2f}x mm)")
for kind in ("forward", "reverse"):
    f = topk(kind)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    f()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    t = bench(f)
    print(f"  linear_topk_kl {kind}: fwd+bwd {t:.2f} ms = {t / t_head:.3f}x linear_log_probs "
          f"({t / t_mm:.2f}x mm), peak extra {peak:.2f} GiB")
