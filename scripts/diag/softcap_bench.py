"""Cost of soft-capping in the fused head: ``linear_log_probs`` with and without ``softcap`` (the
SOFTCAP kernel variant: one tanh per logit in the forward and the backward's recompute), timed in
one process, interleaved, with the cuBLAS ``hidden @ W.T`` of the same shape as the unit.

    python scripts/diag/softcap_bench.py [--rounds 3]

bf16, h ~ N(0, 1), W ~ N(0, 0.02^2); the cap (30, Gemma 2's) changes what is computed, not how
much. Prints ms and x matmul per shape, forward (no grad) and forward+backward.
"""
import argparse
import statistics

import torch
import triton.testing

from rl_kernels import linear_log_probs


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=400, return_mode="median")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'case':34s} {'plain ms':>9s} {'cap ms':>9s} {'cap/plain':>9s} {'plain xmm':>9s} {'cap xmm':>8s}")
    for n, h, v in ((16384, 3584, 152064), (4096, 2304, 256000), (512, 3584, 152064)):
        g = torch.Generator(device="cuda").manual_seed(n)
        hid = torch.randn(n, h, device="cuda", generator=g).bfloat16()
        w = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
        lab = torch.randint(0, v, (n,), device="cuda", generator=g)
        hx, wx = hid.clone().requires_grad_(), w.clone().requires_grad_()
        mm = bench(lambda: hid @ w.T)

        def fwd(cap):
            def run():
                with torch.no_grad():
                    linear_log_probs(hid, w, lab, softcap=cap)
            return run

        def fwd_bwd(cap):
            def run():
                hx.grad = wx.grad = None
                out = linear_log_probs(hx, wx, lab, softcap=cap)
                (out.log_probs.sum() + out.entropy.sum()).backward()
            return run

        for name, make in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
            plain_fn, cap_fn = make(None), make(30.0)
            plain_fn(), cap_fn()
            tp, tc = [], []
            for _ in range(args.rounds):
                tp.append(bench(plain_fn))
                tc.append(bench(cap_fn))
            p, c = statistics.median(tp), statistics.median(tc)
            print(f"{name + f' {n}x{h}x{v}':34s} {p:9.3f} {c:9.3f} {c / p:9.3f} {p / mm:9.3f} {c / mm:8.3f}",
                  flush=True)


if __name__ == "__main__":
    main()
