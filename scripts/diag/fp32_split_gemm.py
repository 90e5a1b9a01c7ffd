"""float32 GEMM forms on the tensor cores (issue 54 item 1; behind ``ops/fp32_matmul.py``):
C = A @ B^T in a plain Triton kernel with TMA operands, as Triton's own in-register
``input_precision="tf32x3"`` ("in-loop split"), as three TF32 dots from operands split once
outside the kernel ("presplit": the low part stored, the high part as the tensor cores read it,
lo = x - trunc(x), or lo = x - rna(x) to see which the hardware does), with and without the partial
sum of every 4 K steps added into a second float32 accumulator ("promote 4"), and full fp32
products ("ieee"), against cuBLAS SGEMM (and bf16 for speed only); per tile configuration
(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages), TFLOP/s and |error| vs float64 (mean, max, mean
signed). Also whether a TF32 dot of x equals one of x truncated or rounded to TF32. One run.

    python scripts/diag/fp32_split_gemm.py [--json PATH]
"""
import json

import torch
import triton
import triton.language as tl

from rl_kernels.tools import diag

ap = diag.parser(__doc__, json_out=True)
args = diag.start(ap)
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402 - after the CUDA check


@triton.jit
def gemm(a_d, alo_d, b_d, blo_d, c_ptr, M, N, K,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr,
         PREC: tl.constexpr, PROMOTE: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BM)
    num_n = tl.cdiv(N, BN)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pm = first_m + (pid % group) % size_m
    pn = (pid % group) // size_m
    row0 = pm * BM
    col0 = pn * BN
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if PROMOTE == 0:
        for k0 in range(0, K, BK):
            a = a_d.load([row0, k0])
            b = b_d.load([col0, k0])
            if MODE == 0:
                acc = tl.dot(a, b.T, acc, input_precision=PREC)
            else:
                alo = alo_d.load([row0, k0])
                blo = blo_d.load([col0, k0])
                acc = tl.dot(alo, b.T, acc, input_precision="tf32")
                acc = tl.dot(a, blo.T, acc, input_precision="tf32")
                acc = tl.dot(a, b.T, acc, input_precision="tf32")
    else:
        for k1 in range(0, K, BK * PROMOTE):
            part = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(k1, k1 + BK * PROMOTE, BK):
                a = a_d.load([row0, k0])
                b = b_d.load([col0, k0])
                if MODE == 0:
                    part = tl.dot(a, b.T, part, input_precision=PREC)
                else:
                    alo = alo_d.load([row0, k0])
                    blo = blo_d.load([col0, k0])
                    part = tl.dot(alo, b.T, part, input_precision="tf32")
                    part = tl.dot(a, blo.T, part, input_precision="tf32")
                    part = tl.dot(a, b.T, part, input_precision="tf32")
            acc += part
    rows = row0 + tl.arange(0, BM)
    cols = col0 + tl.arange(0, BN)
    tl.store(c_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], acc,
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def trunc_tf32(x):
    return (x.view(torch.int32) & ~0x1FFF).view(torch.float32)


def rna_tf32(x):  # round to nearest (ties away) at 10 mantissa bits
    i = x.view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


def run(a, b, alo, blo, mode, prec, promote, cfg):
    bm, bn, bk, warps, stages = cfg
    m, k = a.shape
    n = b.shape[0]
    c = torch.empty(m, n, device=a.device, dtype=torch.float32)
    ds = [TensorDescriptor.from_tensor(t, [bm if i % 2 == 0 else bn, bk]) for i, t in enumerate((a, alo, b, blo))]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    gemm[grid](ds[0], ds[1], ds[2], ds[3], c, m, n, k, BM=bm, BN=bn, BK=bk, MODE=mode, PREC=prec,
               PROMOTE=promote, GROUP_M=8, num_warps=warps, num_stages=stages)
    return c


def main():
    out = {"device": torch.cuda.get_device_name(), "rows": []}
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(4096, 32768, 3584, "forward-like"), (4096, 3584, 32768, "long-K (dh-like)")]
    cfgs = [(128, 128, 32, 8, 3), (128, 128, 32, 8, 2), (128, 256, 16, 8, 3), (128, 128, 16, 8, 4),
            (128, 128, 16, 4, 4), (64, 256, 32, 8, 3), (128, 64, 32, 4, 4)]
    for m, n, k, label in shapes:
        a = torch.randn(m, k, device="cuda", generator=g)
        b = torch.randn(n, k, device="cuda", generator=g) * (2 / k ** 0.5)
        ref = (a.double() @ b.double().T)
        flop = 2 * m * n * k

        def err(c):
            e = (c.double() - ref).abs()
            return float(e.mean()), float(e.max()), float((c.double() - ref).mean())

        torch.backends.cuda.matmul.allow_tf32 = False
        sg = a @ b.T
        t_sg = triton.testing.do_bench(lambda: a @ b.T, rep=300)
        ab, bb = a.bfloat16(), b.bfloat16()
        t_bf = triton.testing.do_bench(lambda: ab @ bb.T, rep=300)
        rows = [dict(shape=label, variant="cuBLAS SGEMM", ms=t_sg, tflops=flop / t_sg / 1e9, err=err(sg)),
                dict(shape=label, variant="cuBLAS bf16 (speed only)", ms=t_bf, tflops=flop / t_bf / 1e9)]
        # hardware's tf32 conversion: truncation or rounding?
        c_plain = run(a, b, a, b, 0, "tf32", 0, cfgs[0])
        c_tr = run(trunc_tf32(a), trunc_tf32(b), a, b, 0, "tf32", 0, cfgs[0])
        c_rn = run(rna_tf32(a), rna_tf32(b), a, b, 0, "tf32", 0, cfgs[0])
        rows.append(dict(shape=label, variant="tf32 conversion", equal_trunc=bool(torch.equal(c_plain, c_tr)),
                         equal_rna=bool(torch.equal(c_plain, c_rn))))
        splits = {"lo=x-trunc(x)": (a - trunc_tf32(a), b - trunc_tf32(b)),
                  "lo=x-rna(x)": (a - rna_tf32(a), b - rna_tf32(b))}
        for cfg in cfgs:
            for name, mode, prec, promote, lo in [
                    ("triton tf32x3 (in-loop split)", 0, "tf32x3", 0, None),
                    ("presplit lo=x-trunc(x)", 1, "tf32", 0, "lo=x-trunc(x)"),
                    ("presplit lo=x-rna(x)", 1, "tf32", 0, "lo=x-rna(x)"),
                    ("presplit lo=x-trunc(x), promote 4", 1, "tf32", 4, "lo=x-trunc(x)"),
                    ("triton ieee", 0, "ieee", 0, None)]:
                if name == "triton ieee" and cfg != cfgs[0]:
                    continue
                alo, blo = splits[lo] if lo else (a, b)
                try:
                    c = run(a, b, alo, blo, mode, prec, promote, cfg)
                    t = triton.testing.do_bench(lambda: run(a, b, alo, blo, mode, prec, promote, cfg), rep=300)
                    rows.append(dict(shape=label, variant=name, cfg=cfg, ms=t, tflops=flop / t / 1e9, err=err(c)))
                except Exception as e:  # out of shared memory etc.
                    rows.append(dict(shape=label, variant=name, cfg=cfg, error=str(e)[:120]))
                print(rows[-1], flush=True)
        out["rows"] += rows
        for r in rows[:3]:
            print(r, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}", flush=True)


main()
