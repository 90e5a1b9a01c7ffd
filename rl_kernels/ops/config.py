"""Tile configuration of the linear-head kernels.

One fixed configuration per device kind, never a function of the number of tokens N: a row's
reduction tree (vocab split size, tile widths, K step) is then the same in any batch, which is
what makes results batch invariant. The CPU interpreter gets small tiles (each interpreted
program costs time per op, not per element) and upcasts bf16 before ``tl.dot`` because the
interpreter's bf16 dot is wrong.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os

import torch

from ..core.backends import interpreting


@dataclasses.dataclass(frozen=True)
class BwdTile:
    """Tile of the dlogits recompute kernel (the K step is the config's block_k)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    split_v: int  # vocab columns per split (first aggregation level); multiple of block_n
    block_m: int  # token rows per program
    block_n: int  # vocab columns per tile
    block_k: int  # hidden (reduction) step
    num_warps: int = 4
    num_stages: int = 3
    # backward dlogits kernel tiles
    # dlogits tiles for the two backward passes: windows of all rows x a vocab chunk (dW pass) and
    # of a row chunk x all vocab (dh pass). Tile shape does not change any element's K order.
    bwd_cols: BwdTile = BwdTile(128, 256, 8, 3)
    bwd_rows: BwdTile = BwdTile(128, 256, 8, 3)
    # both JSD kernels (two GEMM tiles, so two fp32 accumulators, live at once)
    jsd_fwd: BwdTile = BwdTile(128, 128, 8, 3)
    jsd_bwd: BwdTile = BwdTile(128, 128, 8, 3)
    jsd_fused_k: bool = True  # one K loop for both heads' tiles (TMA, equal hidden sizes)
    group_m: int = 8  # row blocks per group of the grouped tile order (L2 reuse)
    # dlogits launch: 0 = one program per tile; k > 0 = persistent, k programs per multiprocessor
    # walking the tiles (with ``flatten``: one pipeline across a program's tiles)
    bwd_programs_per_sm: int = 0
    bwd_tma_store: bool = False  # dlogits tiles stored through a tensor descriptor (with tma)
    # forward mainloop variants (tl.constexpr flags; none changes any element's arithmetic)
    tma: bool = False  # tensor-descriptor (TMA) loads where the operands allow them (fwd and bwd)
    flatten: bool = False  # one software pipeline across the split's tiles (tl.range flatten)
    warp_specialize: bool = False  # producer/consumer warps (tl.range warp_specialize)
    # float32 inputs: tl.dot's input_precision. "tf32x3" (the default) runs each product on the
    # tensor cores as three TF32 products (hi*hi + hi*lo + lo*hi, fp32 accumulation), with logits
    # errors at or below cuBLAS SGEMM's (issue 54); "ieee" runs full fp32 products on the FMA units
    # (about 3x slower); "tf32" one TF32 product (faster, 10-bit mantissa inputs: not SGEMM-class)
    fp32_precision: str = "tf32x3"
    # float32 inputs: the form of the backward's matmuls (dh = dz W, dW = dz^T h;
    # ``autograd.backward_schedule._addmm_fp32``). "ieee" (the default): cuBLAS SGEMM, full fp32
    # products on the FMA units; "tf32x3" (the Hopper class: it reads through tensor descriptors):
    # three TF32 products from operands split once, partial sums promoted into float32
    # (``ops.fp32_matmul``: SGEMM-class accuracy on the tensor cores); "tf32": one TF32 cuBLAS
    # matmul (not SGEMM-class).
    fp32_backward: str = "ieee"

    def dlogits_tile(self, window_cols: int, vocab_size: int) -> BwdTile:
        """The dlogits tile of a backward window: ``bwd_rows`` for a window of every vocab column
        (a row chunk: the dh pass), ``bwd_cols`` for a vocab chunk (all rows: the dW pass)."""
        return self.bwd_rows if window_cols == vocab_size else self.bwd_cols

    def upcast(self, dtype: torch.dtype) -> bool:
        return interpreting() and dtype == torch.bfloat16

    def dot_precision(self, dtype: torch.dtype) -> str:
        """``tl.dot``'s ``input_precision`` for inputs of ``dtype``: :attr:`fp32_precision` for
        float32 (the interpreter computes every form as full fp32 products), "tf32" (ignored) for
        16-bit inputs."""
        return self.fp32_precision if dtype == torch.float32 else "tf32"


# H100, 16384 x 3584 x 152064 bf16, 2026-11-22 (scripts/diag/fwd_sweep.py): forward 1.19x cuBLAS
# with BN=256 and grouped order (G8); 1.49x with BN=128; 2.20x with BN=128 ungrouped.
# dlogits tiles measured on an H100 at 16384 x 3584 x 152064 with aligned windows
# (scripts/diag/bwd_profile.py, retired in issue 28; 2026-11-22), as multiples of one full-size cuBLAS matmul:
# 128x256 / 8 warps / 3 stages 1.29x (column windows) and 1.58x (row windows); 128x128/s3
# 1.65x / 2.03x; 128x256/s4 1.35x / 1.76x; 256x128/s3 1.54x / 2.28x; 64x256/4 warps 1.96x / 1.97x
# Mainloop flags, H100, 2026-11-23 (scripts/diag/fwd_sweep.py --bwd, 16384 x 3584 x 152064, label
# gather still in the tile loop): forward 1.31x pointer loads -> 1.12x TMA -> 1.05x TMA + flatten;
# fwd+bwd 5.10x -> 4.54x with TMA in the dlogits kernel too. Every variant bitwise equal.
# With the label logit in its own kernel (same day): TMA + flatten 1.03x at both large shapes;
# warp specialization +/-3% (not adopted); split 1024 vs 2048: N=512 1.35x -> 1.22x at an equal
# time for the large shapes (1.03-1.04x), so one split of 1024 columns serves every N.
# dlogits launch, H100, 2026-11-24 (scripts/diag/dlogits_sweep.py, one 4096-column window of all rows,
# as multiples of its cuBLAS matmul; fwd+bwd of the three benchmark shapes): one tile per program
# 1.23 / 1.22 / 1.21x; persistent (1 program per SM, flattened tile loop) 1.19 / 1.15 / 1.15x;
# persistent + TMA store 1.16 / 1.15 / 1.11x, fwd+bwd -1.0 to -1.6%; 4 stages instead of 3: mixed
# (+-1.5%), not adopted. Every variant bitwise equal.
# JSD kernels, H100, 4096 x 3584 x 152064 bf16, 2026-11-23 (scripts/diag/jsd_bench.py --sweep), as
# multiples of one cuBLAS matmul: forward 128x128 / 8 warps / 3 stages 5.17x with two K loops, 4.65x
# with one (jsd_fused_k); 2 stages 6.9x; 4 warps 10x; 128x256 and 256x128 / 16 warps 12-17x. Backward
# 128x128 / 8 warps / 3 stages 4.9x; 2 stages 6.3x; 16-warp 128x256 / 256x128 15-20x.
CUDA_CONFIG = KernelConfig(split_v=1024, block_m=128, block_n=256, block_k=64,
                           num_warps=8, num_stages=3, bwd_cols=BwdTile(128, 256, 8, 3),
                           bwd_rows=BwdTile(128, 256, 8, 3), group_m=8,
                           tma=True, flatten=True, warp_specialize=False, bwd_programs_per_sm=1,
                           bwd_tma_store=True)


@dataclasses.dataclass(frozen=True)
class LogitsConfig:
    """Launch shape of the from-logits kernels (``logits_stats``). ``split_v`` (a multiple of
    ``block_v``) fixes each row's reduction tree whatever N or the launch shape, so results are
    batch invariant; ``rows_per_sm`` sets where the two-level split takes over (few rows)."""

    split_v: int  # columns per split (first aggregation level)
    block_v: int  # columns per load inside a split
    num_warps: int
    bwd_block_v: int  # columns per backward program
    bwd_num_warps: int
    rows_per_sm: int  # one level when N >= rows_per_sm * multiprocessors
    prefetch: bool = False  # forward: load the next block before this block's math (same bits)
    bwd_blocks_per_program: int = 1  # backward: column blocks per program, the next one prefetched


# H100, bf16 16384 x 152064, 2026-11-23 (scripts/diag/logits_sweep.py; read ceiling 3057 GB/s, copy
# 3025 GB/s): forward 4096 / 4 warps 94% of read (8 warps 81%, 2048 / 4 87%, 8192 / 8 88%, 16 warps
# 58-76%); splits of 8192 / 32768 columns 79% / 82% (with 8 warps); backward 4096 / 4 warps 92% of copy
# (8192 / 8 93%, 4096 / 8 87%, 16384 / 16 73%). At 512 rows the two-level split wins (68% vs 59%).
# 2026-11-26 (same script, H100, three runs): backward with 2 column blocks per program (the second
# prefetched) 93% of copy at 16384 and 4096 rows against 91% with one (bitwise equal); 4 per program
# 88-90%. Forward with the next block prefetched: 90-91% against 94-95% (not adopted here).
# After the instruction-count change (base-2 exponents, folded gradient scalars; same script, H100,
# 2026-11-26, benchmarks/results/logits_sweep_h100_2026-11-26c.log): forward 4096 / 4 warps 100% of read
# at 16384 rows, 94% at 4096 (2048 / 2 warps 100% / 93%, prefetch 99% / 94%); backward 94% / 93% of copy with
# 2 blocks per program (1: 93%, 4: 94%). The shipped tiles stay.
LOGITS_CUDA_CONFIG = LogitsConfig(split_v=16384, block_v=4096, num_warps=4, bwd_block_v=4096,
                                  bwd_num_warps=4, rows_per_sm=4, bwd_blocks_per_program=2)



# ----------------------------------------------------------------------------- configuration classes
# A class is a shared-memory budget per block (bytes, the device's opt-in limit) and, per input
# dtype, the tiles that fit it. A K-loop stage holds one (BLOCK_M x BLOCK_K) and one
# (BLOCK_N x BLOCK_K) operand tile, four for the JSD kernels (two heads), so the pipeline needs
# about stages * (BM + BN) * BK * element size bytes (x2 for JSD); the compiled kernels' own
# figure is checked against the limit by tests/gpu/test_gpu_configs.py. Every class keeps split_v =
# 1024 (a multiple of every BLOCK_N), and nothing depends on N: batch invariance and run-to-run
# identity hold in every class; the K step (hence a row's summation order) differs between
# classes and dtypes only. float16 uses the bfloat16 tiles; float32 gets a smaller K step.
@dataclasses.dataclass(frozen=True)
class ConfigClass:
    """Everything a GPU class sets, in one record: its shared-memory budget and target
    architectures, the linear-head / JSD tiles per dtype and the from-logits tiles."""

    name: str
    smem_limit: int  # bytes of shared memory per block the tiles are built for
    tma: bool  # tensor-descriptor loads (sm90+ only; tma_ok() checks the device too)
    targets: tuple  # compute capabilities (e.g. 90 = sm_90) the class is built for and checked on
    bf16: KernelConfig  # bfloat16 and float16
    fp32: KernelConfig
    logits: LogitsConfig  # the from-logits kernels (any dtype)
    device_names: tuple = ()  # chosen only for devices whose name contains one of these (else by budget)

    def for_dtype(self, dtype: torch.dtype) -> KernelConfig:
        return self.fp32 if dtype == torch.float32 else self.bf16


def _cfg(bm, bn, bk, warps, stages, jsd, **kw) -> KernelConfig:
    """A class's config: the forward and both dlogits passes share (bm, bn, warps, stages); the
    JSD kernels get ``jsd`` = (bm, bn, warps, stages)."""
    tile = BwdTile(bm, bn, warps, stages)
    return KernelConfig(split_v=1024, block_m=bm, block_n=bn, block_k=bk, num_warps=warps,
                        num_stages=stages, bwd_cols=tile, bwd_rows=tile, jsd_fwd=BwdTile(*jsd),
                        jsd_bwd=BwdTile(*jsd), group_m=8, flatten=True, **kw)


# A100 (sm80, 163 KB, no TMA): 128 x 128 tiles, 98 KB (JSD 131 KB bf16, 98 KB fp32).
_AMPERE_FP32 = _cfg(128, 128, 32, 8, 3, (64, 128, 4, 2))
AMPERE = ConfigClass("ampere", 166912, False, (80,), _cfg(128, 128, 64, 8, 3, (128, 128, 8, 2)), _AMPERE_FP32,
                     LOGITS_CUDA_CONFIG)
# H100 / H200 / B200 (sm90+, 227 KB): bf16 is the tuned CUDA_CONFIG (147 KB of operand stages).
# fp32: products on the tensor cores as three TF32 products (tf32x3), the ampere tiles with TMA (98 KB).
# H200, 2026-12-07, 4096 x 3584 x 152064 (scripts/diag/fp32_head_bench.py,
# benchmarks/results/fp32_head_bench_h200_2026-12-07.json), as multiples of one torch fp32 matmul:
# forward 0.66x, forward+backward 3.38x (10.7x the bf16 head); on the pointer path 0.69x / 3.42x;
# a K step of 64 in 2 stages 0.67x / 3.26x, but its 3-stage dlogits passes (196 KB) leave too little
# of the budget for Triton's scratch (tests/ops/test_configs.py); 128 x 256 / 2 stages 0.95x / 3.94x; full
# fp32 products ("ieee", the FMA units) 2.42x / 6.95x. The backward's two GEMMs as cuBLAS SGEMM made
# most of the rest; as three TF32 products from operands split once (``ops.fp32_matmul``, 192 KB of
# operand stages) fwd+bwd went from 10.5x to 8.6x the bf16 head (H100, 2026-12-08, BENCHMARKS.md).
_HOPPER_FP32 = dataclasses.replace(_AMPERE_FP32, tma=True, fp32_backward="tf32x3")
HOPPER = ConfigClass("hopper", 232448, True, (90,), CUDA_CONFIG, _HOPPER_FP32, LOGITS_CUDA_CONFIG)
# H200 (sm90, HBM3e at 4.8 TB/s against the H100's 3.35): the H100's tiles for the GEMM kernels.
# Its from-logits kernels reached 71% of read / 81% of copy with the H100's tiles (2026-11-26);
# the variants with more bytes in flight per program (``prefetch``, ``bwd_blocks_per_program``)
# have not been measured on an H200 yet, so this class holds the H100's measured settings until
# `scripts/diag/logits_sweep.py` runs there.
LOGITS_H200_CONFIG = LOGITS_CUDA_CONFIG
HOPPER_H200 = dataclasses.replace(HOPPER, name="hopper-h200", logits=LOGITS_H200_CONFIG, device_names=("H200",))
# A10 / L40S / RTX 3090-5090 (sm86 / sm89 / sm120, 99 KB): K step 32 (bf16 49 KB, fp32 49 KB).
ADA = ConfigClass("ada", 101376, False, (86, 89, 120),
                  _cfg(128, 128, 32, 8, 3, (64, 128, 4, 2)),
                  _cfg(64, 128, 32, 4, 2, (64, 64, 4, 2)), LOGITS_CUDA_CONFIG)
# anything with less (e.g. 64 KB): small tiles (bf16 25 KB, fp32 32 KB, JSD fp32 49 KB).
SMALL = ConfigClass("small", 65536, False, (80,),
                    _cfg(64, 128, 32, 4, 2, (64, 64, 4, 2)),
                    _cfg(64, 64, 32, 4, 2, (32, 64, 4, 2)), LOGITS_CUDA_CONFIG)
CLASSES = {c.name: c for c in (HOPPER_H200, HOPPER, AMPERE, ADA, SMALL)}
"""The GPU classes, largest first: a device gets the first class that names it (``device_names``),
else the first without names whose budget its opt-in limit covers."""
CONFIG_CLASS_ENV = "RL_KERNELS_CONFIG_CLASS"
"""Environment variable that forces a configuration class by name (tests, or a user who hits a
problem): one of ``CLASSES``. Forcing a class with more shared memory than the device has fails
at the first launch with Triton's out-of-resources error."""


@functools.cache
def _device_class(index: int) -> ConfigClass:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", 0) or 0
    major = props.major
    fits = [cls for cls in CLASSES.values() if smem >= cls.smem_limit and (not cls.tma or major >= 9)]
    for cls in fits:  # a class made for this device by name
        if any(name in props.name for name in cls.device_names):
            return cls
    for cls in fits:
        if not cls.device_names:
            return cls
    return SMALL


def config_class(device: torch.device) -> ConfigClass:
    """The configuration class for a CUDA ``device``: ``$RL_KERNELS_CONFIG_CLASS`` when set, else
    a class made for the device's name (``hopper-h200`` for an H200) if its budget fits, else
    the largest class without device names whose shared-memory limit the device's opt-in limit
    covers (TMA classes need sm90+). Read from the device, so an unknown GPU gets tiles that fit."""
    forced = os.environ.get(CONFIG_CLASS_ENV, "").strip()
    if forced:
        if forced not in CLASSES:
            raise ValueError(f"{CONFIG_CLASS_ENV}={forced!r}: expected one of {sorted(CLASSES)}")
        return CLASSES[forced]
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_class(index)
# The interpreter runs the TMA path too (strided operands take the pointer path), so CPU tests
# cover both.
INTERPRETER_CONFIG = KernelConfig(split_v=256, block_m=32, block_n=64, block_k=32,
                                  num_warps=4, num_stages=1, bwd_cols=BwdTile(32, 64, 4, 1),
                                  bwd_rows=BwdTile(32, 64, 4, 1), group_m=2,
                                  jsd_fwd=BwdTile(32, 64, 4, 1), jsd_bwd=BwdTile(32, 64, 4, 1),
                                  tma=True, flatten=True, warp_specialize=False,
                                  bwd_programs_per_sm=2, bwd_tma_store=True)


# Interpreter: small blocks so that odd vocabularies cover several splits and partial chunks; the
# backward's blocks per program as the GPU classes ship it (CPU tests cover that path, in place too).
LOGITS_INTERPRETER_CONFIG = LogitsConfig(split_v=64, block_v=32, num_warps=4, bwd_block_v=64,
                                         bwd_num_warps=4, rows_per_sm=4, bwd_blocks_per_program=2)
INTERPRETER = ConfigClass("interpreter", 0, True, (), INTERPRETER_CONFIG, INTERPRETER_CONFIG,
                          LOGITS_INTERPRETER_CONFIG)
"""Triton's CPU interpreter (not a GPU class: never chosen for a CUDA device)."""

_forced: contextvars.ContextVar[KernelConfig | None] = contextvars.ContextVar("rl_kernels_forced_config",
                                                                                default=None)


@contextlib.contextmanager
def forced_config(cfg: KernelConfig):
    """Within the block, every linear-head / JSD launch uses ``cfg`` (tile sweeps, A/B
    measurements and tests); the previous setting is restored on exit, also on error."""
    token = _forced.set(cfg)
    try:
        yield cfg
    finally:
        _forced.reset(token)


def device_class(device: torch.device) -> ConfigClass:
    """The configuration record that runs on ``device``: the interpreter's on CPU (or under
    TRITON_INTERPRET=1), else :func:`config_class`."""
    if device.type != "cuda" or interpreting():
        return INTERPRETER
    return config_class(device)


def default_config(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> KernelConfig:
    """The linear-head / JSD tiles for ``device`` and the inputs' ``dtype`` (never a function of
    the number of tokens); inside :func:`forced_config`, the forced tiles."""
    forced = _forced.get()
    return forced if forced is not None else device_class(device).for_dtype(dtype)


def logits_config(device: torch.device) -> LogitsConfig:
    """The from-logits tiles of ``device``'s class."""
    return device_class(device).logits
