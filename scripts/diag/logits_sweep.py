"""From-logits kernels: launch-shape sweep, bandwidth vs ceilings measured in the same run, accuracy.

python scripts/diag/logits_sweep.py [N,V ...]   (default 16384,152064 and 512,152064; bf16)

Forward = logits_stats (log-probs + entropy + lse, one read): GB/s = N*V*2 / t. Backward = the
gradient kernel alone (read logits + write the gradient): GB/s = 2*N*V*2 / t. Ceilings: read =
best of torch sum / amax over 4 GiB bf16; copy = y.copy_(x) (read + write bytes).
"""
import dataclasses

import torch
import triton.testing

import rl_kernels
from rl_kernels.tools import diag

args = diag.start(diag.parser(__doc__, shapes=["16384,152064", "512,152064"], form="N,V"))
ops = diag.ops
bench = lambda f: triton.testing.do_bench(f, warmup=25, rep=300, return_mode="median")  # noqa: E731

big = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)  # 4 GiB
nbytes = big.numel() * 2
read_bw = max(nbytes / bench(lambda: big.sum(dtype=torch.float32)) / 1e6,
              nbytes / bench(lambda: big.amax()) / 1e6)
out = torch.empty_like(big)
copy_bw = 2 * nbytes / bench(lambda: out.copy_(big)) / 1e6
del big, out
torch.cuda.empty_cache()
print(f"ceilings: read {read_bw:.0f} GB/s, copy (read+write) {copy_bw:.0f} GB/s", flush=True)

base = ops.config.LOGITS_CUDA_CONFIG  # the H100's tiles; "shipped" is this device's class
shipped = ops.logits_config(torch.device("cuda"))
VARIANTS = [("shipped", {f.name: getattr(shipped, f.name) for f in dataclasses.fields(shipped)}),
            ("h100 class", {})] + [
    (f"block {b}, {w} warps{', prefetch' if pf else ''}", dict(block_v=b, num_warps=w, prefetch=pf))
    for b, w in ((1024, 2), (2048, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 8)) for pf in (False, True)] + [
    ("split 8192, prefetch", dict(split_v=8192, prefetch=True)),
    ("split 32768, prefetch", dict(split_v=32768, prefetch=True))]
BWD = [(b, w, k) for b, w, k in ((4096, 4, 1), (4096, 4, 2), (4096, 4, 4), (2048, 4, 2), (2048, 4, 4),
                                 (2048, 2, 4), (1024, 4, 4), (8192, 8, 1), (8192, 8, 2), (8192, 4, 2))]

for n, v in args.shapes:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(n, v, device="cuda", generator=g)).bfloat16()
    lp = diag.logits_params(x.device)
    lab = torch.randint(0, v, (n,), device="cuda", generator=g)
    rows = slice(0, min(n, 256))
    z64 = x[rows].double()
    ref_lp = z64.log_softmax(-1).gather(1, lab[rows, None])[:, 0]
    p64 = z64.softmax(-1)
    ref_ent = -(p64 * z64.log_softmax(-1)).sum(-1)
    print(f"\n{n} x {v} bf16 ({n * v * 2 / 1e9:.2f} GB): two-level auto = "
          f"{ops.use_two_level(n, v, base, x.device)}", flush=True)
    ref = None
    for name, fields in VARIANTS:
        cfg = dataclasses.replace(base, **fields)
        for two in (False, True):
            f = lambda: ops.logits_forward(x, lab, lp, cfg, two_level=two)  # noqa: E731
            try:
                o = f()
                t = bench(f)
            except Exception as e:  # noqa: BLE001
                print(f"  fwd {name} two={two}: {type(e).__name__} {str(e)[:100]}")
                continue
            ref = o if ref is None else ref
            same = all(torch.equal(o[k], ref[k]) for k in ("log_probs", "entropy", "lse"))
            err = max((o["log_probs"][rows] - ref_lp).abs().max().item(),
                      (o["entropy"][rows] - ref_ent).abs().max().item())
            print(f"  fwd {name:22s} {'2-level' if two else '1-level'}: {t:7.3f} ms "
                  f"{n * v * 2 / t / 1e6:6.0f} GB/s = {n * v * 2 / t / 1e6 / read_bw:.0%} of read; "
                  f"max err {err:.1e}; bitwise = first: {same}", flush=True)
    stats = ops.logits_forward(x, lab, lp, base)
    grads = {"log_probs": torch.randn(n, device="cuda"), "entropy": torch.randn(n, device="cuda")}
    grad = torch.empty_like(x)
    first = None
    for b, w, k in [(shipped.bwd_block_v, shipped.bwd_num_warps, shipped.bwd_blocks_per_program)] + BWD:
        cfg = dataclasses.replace(base, bwd_block_v=b, bwd_num_warps=w, bwd_blocks_per_program=k)
        grad.fill_(float("nan"))
        ops.logits_backward(x, grad, lab, stats, grads, lp, cfg)
        first = grad.clone() if first is None else first
        same = torch.equal(grad, first)
        t = bench(lambda: ops.logits_backward(x, grad, lab, stats, grads, lp, cfg))
        print(f"  bwd block {b}, {w} warps, {k} per program: {t:7.3f} ms {2 * n * v * 2 / t / 1e6:6.0f} GB/s = "
              f"{2 * n * v * 2 / t / 1e6 / copy_bw:.0%} of copy; bitwise = first: {same}", flush=True)
    # whole public call, fwd and fwd+bwd, vs torch eager (verl's two functions)
    xg = x.detach().requires_grad_()

    def ours():
        xg.grad = None
        o = rl_kernels.logits_stats(xg, lab)
        torch.autograd.backward([o.log_probs, o.entropy], [grads["log_probs"], grads["entropy"]])

    def eager():
        xg.grad = None
        lf = xg.float()
        lp = lf.log_softmax(-1).gather(1, lab[:, None])[:, 0]
        pd = lf.softmax(-1)
        ent = torch.logsumexp(lf, -1) - (pd * lf).sum(-1)
        torch.autograd.backward([lp, ent], [grads["log_probs"], grads["entropy"]])

    with torch.no_grad():
        t_fwd = bench(lambda: rl_kernels.logits_stats(x, lab))
    for name, fn in (("rl_kernels.logits_stats", ours), ("torch eager", eager)):
        try:
            torch.cuda.reset_peak_memory_stats()
            base_mem = torch.cuda.memory_allocated()
            fn()
            peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**30
            t = bench(fn)
            print(f"  {name}: fwd+bwd {t:7.3f} ms, peak extra {peak:.2f} GiB", flush=True)
        except torch.OutOfMemoryError:
            print(f"  {name}: OOM")
    print(f"  rl_kernels.logits_stats no-grad forward: {t_fwd:.3f} ms "
          f"({n * v * 2 / t_fwd / 1e6:.0f} GB/s)")
    del x, xg, grad
    torch.cuda.empty_cache()
