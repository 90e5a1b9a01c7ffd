"""float32 matmul on the tensor cores, SGEMM-class: ``acc += a @ b`` as three TF32 products from
operands split once (issue 54 item 1; the float32 head's backward matmuls).

Each operand x is split outside the kernel into its TF32 high part (x with its 13 low mantissa
bits cleared, exact in TF32) and its low part x - high (exact in float32), the split of Ootomo and
Yokota ("Recovering single precision accuracy from Tensor Cores while surpassing the FP32
theoretical peak performance", IJHPCA 2022). The kernel's K loop is then three plain TF32 dots per
step, a_lo b_hi + a_hi b_lo + a_hi b_hi (the a_lo b_lo term, below 2^-20 |a||b|, dropped), all four
tiles read by the copy engine (TMA) straight into shared memory: Triton's own
``input_precision="tf32x3"`` splits in registers at each step (H100, 4096 x 32768 x 3584, the same
tiles: 82 TFLOP/s against 100 here; cuBLAS SGEMM 52).

The tensor cores add a product into a float32 accumulator with its low bits cut (truncated at
the larger operand's exponent): summed in one accumulator over a long K, the small a_lo b_hi terms
mostly vanish (mean error 4e-5 at logits std 2, 27x SGEMM's). So the partial sum of every
``PROMOTE`` K steps starts at zero and is added into the running float32 sum by an ordinary,
round-to-nearest add (H100, P = 4: mean |error| vs float64 1.8e-6 / 1.8e-6 at K = 3584 / 32768,
where SGEMM has 1.5e-6 / 4.5e-6, max 1.4e-5 / 1.6e-5 against 3.5e-5 / 9.2e-5).

The high part is not stored: the tensor cores read a float32 operand as TF32 by dropping those
same 13 bits (checked on the H100: a TF32 dot of x equals one of its high part bit for bit). The
CPU interpreter computes every dot in full float32, so there the kernel clears the bits itself.
No atomics, fixed order: repeated calls give the same bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .building_blocks import TensorDescriptor, grouped_tile
from .config import interpreting

BLOCK_M, BLOCK_N, BLOCK_K = 128, 128, 32
PROMOTE = 4  # K steps per partial sum (see the module docstring)
NUM_WARPS, NUM_STAGES, GROUP_M = 8, 3, 8
PIECE_ELEMENTS = 1 << 24
"""Bound on one launch's copies, in elements (64 MiB of float32): the reduction runs in pieces of
K (b's K-major copy and its low part together: 2N x piece elements) and the rows in blocks of M
(a's low part, and a's copy when it is not K-major: rows x piece each), each launch adding its
sum into its rows of ``acc``: at most 192 MiB of copies at a time (each launch's are released
before the next one's are made). Without it dh = dz W over a whole vocabulary copies W twice
(4 GiB at 152064 x 3584), and dW = dz^T h over a wide window copies the window twice. The piece
depends on N alone and the row block on the piece, so a row's sum does not depend on M."""


@triton.jit
def _tf32_high(x):
    """``x`` (float32) with its 13 low mantissa bits cleared."""
    return (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _addmm_tf32x3_kernel(a_desc, a_lo_desc, b_desc, b_lo_desc, c_ptr, M, N, K, stride_cm, stride_cn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PROMOTE: tl.constexpr, GROUP_M: tl.constexpr, CLEAR_LOW_BITS: tl.constexpr):
    # c[M, N] += a[M, K] @ b[N, K]^T: a, b and their low parts through tensor descriptors with
    # blocks (BLOCK_M, BLOCK_K) / (BLOCK_N, BLOCK_K) (K past the end reads as zeros).
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    row0 = pid_m * BLOCK_M
    col0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k1 in range(0, K, BLOCK_K * PROMOTE):
        part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k1, min(k1 + BLOCK_K * PROMOTE, K), BLOCK_K):
            a = a_desc.load([row0, k0])
            b = b_desc.load([col0, k0])
            if CLEAR_LOW_BITS:  # the interpreter's dots are full float32: make a, b their high parts
                a = _tf32_high(a)
                b = _tf32_high(b)
            part = tl.dot(a_lo_desc.load([row0, k0]), b.T, part, input_precision="tf32")
            part = tl.dot(a, b_lo_desc.load([col0, k0]).T, part, input_precision="tf32")
            part = tl.dot(a, b.T, part, input_precision="tf32")
        acc += part
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    c = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(c, tl.load(c, mask=mask, other=0.0) + acc, mask=mask)


def _k_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` (rows, K) as a tensor descriptor can read it: unit K stride, rows and base 16-byte
    aligned; itself when it is one, else a copy (rows padded to a multiple of 4 elements)."""
    if x.stride(1) == 1 and x.stride(0) % 4 == 0 and x.data_ptr() % 16 == 0:
        return x
    return _aligned_empty(x).copy_(x)


def _aligned_empty(x: torch.Tensor) -> torch.Tensor:
    """A new (rows, K) float32 tensor shaped as ``x``, rows padded to a multiple of 4 elements (16
    bytes, as tensor descriptors need)."""
    rows, k = x.shape
    return x.new_empty(rows, -(-k // 4) * 4)[:, :k]


def _high_part(x: torch.Tensor) -> torch.Tensor:
    """``x`` (float32) with its 13 low mantissa bits cleared: exact in TF32, and ``x - high`` is
    exact in float32 (the low bits themselves); an infinity stays itself (its low part is NaN)."""
    return (x.view(torch.int32) & -8192).view(torch.float32)


def _low_part(x: torch.Tensor) -> torch.Tensor:
    """x - high(x) (exact in float32), laid out as ``x`` (a K-major, aligned (rows, K) view)."""
    return torch.sub(x, _high_part(x), out=_aligned_empty(x))


def addmm_tf32x3(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in float32 on the tensor cores (module docstring: three TF32 products from
    operands split once, partial sums every ``PROMOTE`` K steps added in float32).

    ``acc``: (M, N) float32, any strides (written in place); ``a``: (M, K) float32; ``b``: (K, N)
    float32, any strides (copied into a K-major layout when they are not one: ``b`` usually is).
    The work runs in pieces of K and blocks of rows (``PIECE_ELEMENTS``: at most 192 MiB of copies
    at a time), each launch's sum added into its rows of ``acc`` in float32. Accuracy
    (vs float64, random normal operands): mean |error| at most SGEMM's at long K, 1.2x at
    K = 3584; max below SGEMM's. Needs tensor descriptors (Hopper, or the interpreter)."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return
    step = BLOCK_K * PROMOTE
    piece = max(step, PIECE_ELEMENTS // (2 * n) // step * step)
    block = max(BLOCK_M, PIECE_ELEMENTS // piece // BLOCK_M * BLOCK_M)
    for m0 in range(0, m, block):
        rows = min(block, m - m0)
        grid = (triton.cdiv(rows, BLOCK_M) * triton.cdiv(n, BLOCK_N),)
        out = acc[m0:m0 + rows]
        for k0 in range(0, k, piece):
            a_hi, b_hi = _k_major(a[m0:m0 + rows, k0:k0 + piece]), _k_major(b[k0:k0 + piece].T)
            a_lo, b_lo = _low_part(a_hi), _low_part(b_hi)
            descs = [TensorDescriptor.from_tensor(t, [BLOCK_M if i < 2 else BLOCK_N, BLOCK_K])
                     for i, t in enumerate((a_hi, a_lo, b_hi, b_lo))]
            _addmm_tf32x3_kernel[grid](*descs, out, rows, n, a_hi.shape[1], out.stride(0), out.stride(1),
                                       BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, PROMOTE=PROMOTE,
                                       GROUP_M=GROUP_M, CLEAR_LOW_BITS=interpreting(),
                                       num_warps=NUM_WARPS, num_stages=NUM_STAGES)
            del a_hi, a_lo, b_hi, b_lo, descs  # (the allocator reuses them for the next launch, in stream order)
