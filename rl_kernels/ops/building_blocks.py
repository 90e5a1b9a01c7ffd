"""Triton building blocks shared by the linear-head kernel families.

* ``logits_tile``: one (BLOCK_M x BLOCK_N) tile of ``hidden @ weight.T / temperature`` with an
  fp32 accumulator (the K-loop GEMM tile); ``logits_tile_log2`` the same tile times log2(e),
  soft-capped on request, as the softmax kernels use it.
* ``grouped_tile``: maps a 1-D program id to (pid_m, pid_n) in groups of GROUP_M row blocks, so
  that the programs resident at one time share a few hidden-state blocks and weight tiles in L2.
* ``merge_stats``: the associative merge of two softmax partials (m, s, b), where
  ``s = sum exp(z - m)`` and ``b = sum exp(z - m) * (z - m)`` (b is kept relative to m so that the
  entropy ``log s - b / s`` never subtracts two large numbers). Identity: (-inf, 0, 0).
  ``merge_q`` merges ``q = sum exp(2 (z - m))`` alongside (sum_j p_j^2 = q / s^2);
  ``merge_max_sum`` merges (m, s) alone (the tail statistics of the tail-aware top-K KL).
* ``exp_ftz``: exp with subnormal results flushed to zero (one ``ex2`` instruction per element;
  the same bits as ``tl.exp`` for every normal result).
* ``soft_cap``: the logit soft-capping of Gemma-2-style heads, z = (c / T) * tanh(x) for
  x = (h . w) / c, with an infinite x made NaN (a non-finite hidden row stays non-finite).
* ``log_sum_lse`` / ``stats_entropy``: log s and lse = m + log s, and the entropy log s - b / s,
  of merged statistics, clamped as the finalizers of the head's combine and of ``logits`` need.
* ``window_tile`` / ``store_window``: the prologue and epilogue of the dlogits kernels
  (``linear``'s backward, ``linear_jsd``): this program's tile of a (rows x cols) window of the
  logits, and the store of its gradient tile into the window-shaped output.
* ``row_temperature``: the per-row temperature's read (each row's 1 / T and the tile's scales,
  ``row_scales``), the one place every kernel with ROW_TEMPERATURE reads it.
* The columns of each row's sorted ids (the tail-aware top-K KL's K ids): ``among_ids`` as a
  (rows x cols) mask (the from-logits kernels, whose rows are long vectors), and ``ids_below`` /
  ``next_id`` / ``fill_ids`` as a walk that carries each row's pointer into its ids across a
  split's tiles (the GEMM kernels, which must not hold a mask beside the tile).
* ``topk_start`` / ``topk_insert`` / ``topk_store``: each row's K best logits, kept in registers
  while a program walks its tiles (``linear_topk`` and the head's forward with TOPK).

These are ``@triton.jit`` helpers, inlined into the kernels of ``linear``, ``linear_jsd`` and
``logits``. The host-side helpers
``tma_ok`` / ``tma_operands`` (tensor descriptors or plain tensors for the GEMM operands),
``gemm_meta`` (the GEMM kernels' launch meta-parameters) and ``window_grid`` (the grid of a
dlogits window) serve their launchers.
"""
import functools
import logging

import torch
import triton
import triton.language as tl

from ..core._logging import log_once
from ..core.backends import interpreting

try:  # CUDA's libdevice (tanh); the CPU interpreter has none
    from triton.language.extra.cuda import libdevice
except ImportError:  # pragma: no cover - a Triton without the CUDA extras
    libdevice = None

try:  # host-side tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = None


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether 2-D ``tensors`` can be read through tensor descriptors (TMA): a Hopper-or-newer GPU
    (or the interpreter), unit last stride, 16-byte aligned base and row stride. When not, the
    pointer path runs; that choice is logged once per reason."""
    if TensorDescriptor is None:
        log_once(logging.INFO, "rl_kernels: this Triton has no tensor descriptors; the linear-head "
                 "kernels use pointer loads")
        return False
    dev = tensors[0].device
    if not interpreting() and (dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] < 9):
        log_once(logging.INFO, f"rl_kernels: no TMA on {dev} (needs sm90+); pointer loads")
        return False
    for t in tensors:
        if (t.stride(-1) != 1 or (t.stride(0) * t.element_size()) % 16
                or t.data_ptr() % 16 or t.shape[0] == 0):
            log_once(logging.INFO, f"rl_kernels: a {tuple(t.shape)} operand with strides {t.stride()} "
                     f"is not TMA-aligned (unit last stride, 16-byte rows and base); pointer loads")
            return False
    return True


def tma_operands(cfg, block_m: int, block_n: int, *pairs: tuple[torch.Tensor, torch.Tensor]):
    """(use_tma, operands) for the GEMM operand ``pairs`` (hidden (N, H), weight (V, H)) of a
    kernel with (block_m x block_n) tiles and ``cfg.block_k`` K steps (``cfg``: a
    ``KernelConfig``): with ``cfg.tma`` and when ``tma_ok`` allows it for every operand, tensor
    descriptors with blocks (block_m, block_k) / (block_n, block_k), else the tensors themselves
    (pointer loads); flattened in pair order."""
    tensors = [t for pair in pairs for t in pair]
    if not (cfg.tma and tma_ok(*tensors)):
        return False, tensors
    operands = []
    for h, w in pairs:
        operands += [TensorDescriptor.from_tensor(h, [block_m, cfg.block_k]),
                     TensorDescriptor.from_tensor(w, [block_n, cfg.block_k])]
    return True, operands


def gemm_meta(cfg, tile, dtype: torch.dtype, use_tma: bool) -> dict:
    """Launch meta-parameters shared by the kernels built on ``logits_tile`` with a ``BwdTile``
    ``tile`` (the dlogits and JSD kernels): tile shape, K step, ``dtype``'s upcast and dot
    precision, group size, TMA, warps and stages."""
    return dict(BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=cfg.block_k,
                UPCAST=cfg.upcast(dtype), DOT_PRECISION=cfg.dot_precision(dtype),
                GROUP_M=cfg.group_m, USE_TMA=use_tma,
                num_warps=tile.num_warps, num_stages=tile.num_stages)


def window_grid(rows: slice, cols: slice, tile) -> tuple[int, int, tuple[int]]:
    """(n_rows, n_cols, grid) of a dlogits launch over the window logits[rows, cols] with a
    ``BwdTile`` ``tile``: one program per (block_m x block_n) tile (see ``window_tile``)."""
    n_rows = rows.stop - rows.start
    n_cols = cols.stop - cols.start
    return n_rows, n_cols, (triton.cdiv(n_rows, tile.block_m) * triton.cdiv(n_cols, tile.block_n),)


@functools.cache
def multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``; 1 for the CPU interpreter."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def persistent_programs(num_tiles: int, programs_per_sm: int, device: torch.device) -> int:
    """Programs of a tile-loop launch (``window_tile``'s ``tile_id`` loop): one per tile when
    ``programs_per_sm`` is 0, else at most ``programs_per_sm`` per multiprocessor, each walking
    the tiles with a stride of the program count. Only which program runs a tile changes, never
    what a tile computes."""
    if programs_per_sm <= 0:
        return num_tiles
    return max(1, min(num_tiles, programs_per_sm * multiprocessors(device)))


@triton.jit
def logits_tile(
    h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
    stride_hn, stride_hk, stride_wv, stride_wk,
    inv_temperature,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr = False,
    row0=0, col0=0,
):
    """z[i, j] = (h[rows[i]] . w[cols[j]]) * inv_temperature, fp32; masked entries are garbage-free
    zeros before scaling (callers mask columns to -inf themselves). Offsets are int64.

    With USE_TMA, ``h_ptr`` / ``w_ptr`` are tensor descriptors with blocks (BLOCK_M, BLOCK_K) /
    (BLOCK_N, BLOCK_K), ``rows`` / ``cols`` are the ranges starting at ``row0`` / ``col0``, and the
    copy engine fills out-of-bounds elements with zeros, so the masks are not needed. Both paths
    sum K in the same BLOCK_K steps.
    """
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for k0 in range(0, H, BLOCK_K):
            a = h_ptr.load([row0, k0])
            b = w_ptr.load([col0, k0])
            if UPCAST:
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b.T, acc, input_precision=DOT_PRECISION)
    else:
        h_base = h_ptr + rows.to(tl.int64)[:, None] * stride_hn
        w_base = w_ptr + cols.to(tl.int64)[None, :] * stride_wv
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + offs_k
            k_mask = ks < H
            a = tl.load(h_base + ks.to(tl.int64)[None, :] * stride_hk,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(w_base + ks.to(tl.int64)[:, None] * stride_wk,
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            if UPCAST:  # the CPU interpreter computes bf16 dots wrongly; do them in fp32 there
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc * inv_temperature


@triton.jit
def logits_tile_log2(
    h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
    stride_hn, stride_hk, stride_wv, stride_wk,
    logit_scale, softcap_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, row0, col0,
    SOFTCAP: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """(z2, t): z2 = log2(e) z for the tile's logits z in base 2 (the exponents of the softmax
    kernels are ``ex2`` of differences of z2: one instruction each), with z = (h . w) * logit_scale
    or, with SOFTCAP, z = softcap_scale * tanh((h . w) * logit_scale) (``soft_cap``; the arguments
    of ``softcap_args``). log2(e) rides on the last scale, so z2 costs no multiply of its own. ``t``:
    the cap's tanh with SOFTCAP (the backward's chain factor 1 - t^2), else z2 (unused)."""
    if SOFTCAP:
        z = logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
                        stride_hn, stride_hk, stride_wv, stride_wk, logit_scale,
                        BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, col0)
        z2, t = soft_cap(z, softcap_scale * 1.4426950408889634, LIBDEVICE)
    else:
        z2 = logits_tile(h_ptr, w_ptr, rows, cols, row_mask, col_mask, H,
                         stride_hn, stride_hk, stride_wv, stride_wk, logit_scale * 1.4426950408889634,
                         BLOCK_M, BLOCK_N, BLOCK_K, UPCAST, DOT_PRECISION, USE_TMA, row0, col0)
        t = z2
    return z2, t


def scalar_inv_temperature(inv_temperature) -> float:
    """The scalar 1 / T a kernel takes: ``inv_temperature`` itself, or 1.0 when it is a per-row
    (N,) float32 tensor (``row_temperature_args``: the kernel then multiplies by each row's value)."""
    return 1.0 if isinstance(inv_temperature, torch.Tensor) else inv_temperature


def row_temperature_args(inv_temperature, placeholder: torch.Tensor) -> dict:
    """The per-row temperature's launch arguments: ``inv_temperature_ptr`` (the (N,) float32 1 / T
    of each row, or ``placeholder``, never read) and the ROW_TEMPERATURE flag (off for a scalar
    ``inv_temperature``: the kernels are then the scalar ones, bit for bit)."""
    if isinstance(inv_temperature, torch.Tensor):
        return dict(inv_temperature_ptr=inv_temperature, ROW_TEMPERATURE=True)
    return dict(inv_temperature_ptr=placeholder, ROW_TEMPERATURE=False)


def softcap_args(softcap: float | None, inv_temperature, placeholder: torch.Tensor) -> dict:
    """Launch arguments of the soft-capping variant (``soft_cap``) for a head whose raw logits
    h . w are capped at ``softcap`` (None: no cap) before the temperature: the kernels' GEMM tile
    is scaled by ``logit_scale`` (1 / softcap, or inv_temperature without a cap), and with
    SOFTCAP the capped tile is ``softcap_scale * tanh(tile)`` (softcap_scale = softcap /
    temperature). LIBDEVICE picks CUDA's tanh (the interpreter has no libdevice). A per-row
    ``inv_temperature`` (N,) tensor adds ``row_temperature_args``: the scales are then those of
    T = 1, and ``row_scales`` multiplies the temperature's one by each row's 1 / T in the kernel."""
    row = row_temperature_args(inv_temperature, placeholder)
    inv_temperature = scalar_inv_temperature(inv_temperature)
    if softcap is None:
        return dict(logit_scale=inv_temperature, softcap_scale=1.0, SOFTCAP=False, LIBDEVICE=False, **row)
    return dict(logit_scale=1.0 / softcap, softcap_scale=softcap * inv_temperature, SOFTCAP=True,
                LIBDEVICE=libdevice is not None and not interpreting(), **row)


@triton.jit
def row_temperature(inv_temperature_ptr, rows, row_mask, inv_temperature, logit_scale, softcap_scale,
                    SOFTCAP: tl.constexpr, ROW_TEMPERATURE: tl.constexpr, COLUMN: tl.constexpr):
    """(row_inv_temperature, tile_scale, cap_scale) of a kernel's ``rows``: without ROW_TEMPERATURE
    the scalars ``inv_temperature``, ``logit_scale`` and ``softcap_scale`` as given; with it each
    row's own 1 / T, read from ``inv_temperature_ptr + rows`` (1.0 past ``row_mask``; ``row_mask``
    None: ``rows`` is one row, read unmasked), and :func:`row_scales` of it, as a (BLOCK, 1) column
    for a tile with COLUMN, else as row vectors. The one place a kernel reads the per-row
    temperature (the scalar's exact bits: ``tests/api/test_row_temperature.py``)."""
    tile_scale, cap_scale = logit_scale, softcap_scale
    if ROW_TEMPERATURE:
        if row_mask is None:
            inv_temperature = tl.load(inv_temperature_ptr + rows)
        else:
            inv_temperature = tl.load(inv_temperature_ptr + rows, mask=row_mask, other=1.0)
        if COLUMN:
            tile_scale, cap_scale = row_scales(inv_temperature[:, None], logit_scale, softcap_scale, SOFTCAP)
        else:
            tile_scale, cap_scale = row_scales(inv_temperature, logit_scale, softcap_scale, SOFTCAP)
    return inv_temperature, tile_scale, cap_scale


@triton.jit
def row_scales(row_inv_temperature, logit_scale, softcap_scale, SOFTCAP: tl.constexpr):
    """(logit_scale, softcap_scale) of ``softcap_args`` for rows whose own 1 / T is
    ``row_inv_temperature`` (a column (BLOCK_M, 1) for a tile, or (BLOCK,) for a row vector): the
    temperature's scale (the cap's when SOFTCAP, else the GEMM tile's) times the row's 1 / T."""
    if SOFTCAP:
        return logit_scale + tl.zeros_like(row_inv_temperature), softcap_scale * row_inv_temperature
    return logit_scale * row_inv_temperature, softcap_scale + tl.zeros_like(row_inv_temperature)


@triton.jit
def tanh(x, LIBDEVICE: tl.constexpr):
    """tanh in float32: CUDA's libdevice tanhf (within 2 ulp) on the GPU; in the interpreter
    sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) (no overflow, absolute error a few 1e-7)."""
    if LIBDEVICE:
        return libdevice.tanh(x)
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def soft_cap(x, softcap_scale, LIBDEVICE: tl.constexpr):
    """(softcap_scale * tanh(x), tanh(x)) for the scaled tile x = (h . w) / softcap; an infinite
    x gives NaN, not the finite cap: a non-finite hidden row stays non-finite (the model's own
    tanh would return +-softcap there). The backward's chain factor is 1 - tanh(x)^2."""
    t = tanh(x, LIBDEVICE)
    t = tl.where(tl.abs(x) == float("inf"), float("nan"), t)
    return softcap_scale * t, t


@triton.jit
def exp_ftz(x):
    """exp(x) in float32 as ex2(x * log2 e) with subnormal results flushed to zero. ``tl.exp``
    lowers to the same multiply and ``ex2.approx.f32``, whose subnormal handling costs three more
    instructions per element on sm90 (a compare and two predicated multiplies); ``tl.exp2`` lowers
    to ``ex2.approx.ftz.f32``, one instruction. Every result >= 2**-126 has the same bits as
    ``tl.exp``'s; smaller ones are 0 (they carry nothing next to the terms >= 1 of a softmax sum,
    nor in a 16-bit gradient)."""
    return tl.exp2(x * 1.4426950408889634)


@triton.jit
def merge_scales(m1, s1, m2, s2):
    """The common max m of two partials and each one's shift d = m_i - m and scale a = exp(d).
    An operand with s == 0 is the identity (-inf, 0, 0): d = 0, so exp(-inf - (-inf)) = NaN never
    arises."""
    m = tl.maximum(m1, m2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d1 = tl.where(s1 > 0, m1 - m_safe, 0.0)
    d2 = tl.where(s2 > 0, m2 - m_safe, 0.0)
    return m, d1, d2, exp_ftz(d1), exp_ftz(d2)


@triton.jit
def merge_stats(m1, s1, b1, m2, s2, b2):
    """(m1, s1, b1) (+) (m2, s2, b2) -> (m, s, b); see ``merge_scales``."""
    m, d1, d2, a1, a2 = merge_scales(m1, s1, m2, s2)
    s = a1 * s1 + a2 * s2
    b = a1 * (b1 + s1 * d1) + a2 * (b2 + s2 * d2)
    return m, s, b


@triton.jit
def merge_max_sum(m1, s1, m2, s2):
    """(m1, s1) (+) (m2, s2) -> (m, s) for logsumexp partials alone (no b); identity (-inf, 0)."""
    m, _, _, a1, a2 = merge_scales(m1, s1, m2, s2)
    return m, a1 * s1 + a2 * s2


@triton.jit
def merge_q(m1, s1, q1, m2, s2, q2):
    """Merged q = sum exp(2 (z - m)) of two partials (relative to their maxima m1, m2): each
    scales by exp(2 d) = a^2. With s: sum_j p_j^2 = q / s^2."""
    _, _, _, a1, a2 = merge_scales(m1, s1, m2, s2)
    return a1 * a1 * q1 + a2 * a2 * q2


@triton.jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Program ``pid`` of a 1-D grid of num_m * num_n -> (pid_m, pid_n), GROUP_M row blocks at a
    time with the column index moving slowest inside a group. Changes only the order in which
    tiles run, never what a tile computes."""
    per_group = GROUP_M * num_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    inner = pid % per_group
    return first_m + inner % group_m, inner // group_m


@triton.jit
def window_tile(row_start, n_rows, col_start, n_cols,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, tile_id=None):
    """Tile ``tile_id`` (default: this program's id) of the (BLOCK_M x BLOCK_N) tiles of the
    window logits[row_start:+n_rows, col_start:+n_cols], in ``grouped_tile`` order. Returns
    (local_rows, local_cols, rows, cols, row_mask, col_mask, row0, col0): the tile's rows and columns inside the window (they index the
    window-shaped output) and in the full logits, the masks of the window's bounds, and the first
    global row and column (the block origin of ``logits_tile``'s TMA loads)."""
    if tile_id is None:
        tile_id = tl.program_id(0)
    pid_m, pid_n = grouped_tile(tile_id, tl.cdiv(n_rows, BLOCK_M), tl.cdiv(n_cols, BLOCK_N), GROUP_M)
    local_rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    local_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = local_rows < n_rows
    col_mask = local_cols < n_cols
    rows = row_start + local_rows
    cols = col_start + local_cols
    return (local_rows, local_cols, rows, cols, row_mask, col_mask,
            row_start + pid_m * BLOCK_M, col_start + pid_n * BLOCK_N)


@triton.jit
def store_window(dz_ptr, dz, keep, local_rows, local_cols, row_mask, col_mask,
                 stride_dzm, stride_dzn):
    """Store the fp32 tile ``dz`` at (local_rows, local_cols) of the window-shaped output
    ``dz_ptr`` in its dtype (int64 offsets, masked to the window). Rows where ``keep`` is False
    get exactly 0: a where, not a product, so a non-finite value in a dropped row cannot leak
    NaN into the matmuls that consume the window."""
    dz = tl.where(keep[:, None], dz, 0.0)
    dz_ptrs = (dz_ptr + local_rows.to(tl.int64)[:, None] * stride_dzm
               + local_cols.to(tl.int64)[None, :] * stride_dzn)
    tl.store(dz_ptrs, dz.to(dz_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def log_sum_lse(m, s):
    """(log_sum, lse) = (log s, m + log s) of merged statistics (scalars or row vectors).
    s >= 1 exactly when m is finite (the row max contributes exp(0) = 1), but the GPU's fast
    exp/log put log s a few 1e-7 below 0 on a row with p_y ~ 1 (H100), which made log p > 0 and
    entropy < 0: clamp (finite rows only, so an all -inf row keeps lse = -inf). The clamp
    propagates NaN: a NaN logit makes s NaN (the max ignores it), and max(NaN, 0) = 0 would turn
    that row's lse and log-prob finite."""
    log_sum = tl.log(s)
    log_sum = tl.where(m > float("-inf"), tl.maximum(log_sum, 0.0, propagate_nan=tl.PropagateNan.ALL),
                       log_sum)
    return log_sum, m + log_sum


@triton.jit
def stats_entropy(log_sum, b, s):
    """Entropy log s - b / s of merged statistics, clamped at 0 (NaN-propagating)."""
    return tl.maximum(log_sum - b / s, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def among_ids(ids_ptr, stride_ids, rows64, row_mask, cols, col0, width, n_ids, BLOCK_IDS: tl.constexpr):
    """(rows x cols) bool: True where column ``cols[j]`` is one of row i's ids (the tail-aware
    top-K KL's exclusion mask: the tail is the vocabulary outside the row's K ids).

    ``ids_ptr``: (N, n_ids) int32 row-major with ``stride_ids``, each row sorted ascending
    (``autograd.head_family.sorted_tail_ids``; entries outside the vocabulary never match); ``rows64``: the tile's rows
    (int64) with ``row_mask``; ``cols``: the tile's column ids, all inside [col0, col0 + width);
    BLOCK_IDS: a power of two >= n_ids. Sorted ids make the row's ids inside the tile one run
    [lo, lo + count): 2 x BLOCK_IDS compares per row find it, then one compare per element per id
    of the longest run (0 to 2 at K = 64 ids over V = 152064 and a 128-wide tile)."""
    k = tl.arange(0, BLOCK_IDS)
    block = tl.load(ids_ptr + rows64[:, None] * stride_ids + k[None, :],
                    mask=row_mask[:, None] & (k[None, :] < n_ids), other=2147483647)
    lo = tl.sum((block < col0).to(tl.int32), axis=1)
    count = tl.sum((block < col0 + width).to(tl.int32), axis=1) - lo
    hit = (rows64[:, None] < 0) & (cols[None, :] < 0)  # all False, (rows x cols)
    for j in range(0, tl.max(count)):
        row_id = tl.load(ids_ptr + rows64 * stride_ids + lo + j, mask=row_mask & (j < count), other=-1)
        hit = hit | (cols[None, :] == row_id[:, None])
    return hit


@triton.jit
def ids_below(ids_ptr, stride_ids, rows64, row_mask, n_ids, x, BLOCK_IDS: tl.constexpr):
    """(rows,) int32: how many of each row's sorted ids are < ``x`` (the index of its first id >= x),
    by a branchless binary search: log2(BLOCK_IDS) + 1 dependent one-id loads per row, no
    (rows x BLOCK_IDS) block in registers (the starting point of a ``fill_ids`` walk; arguments as
    in ``among_ids``, BLOCK_IDS a power of two >= n_ids)."""
    at = tl.zeros(rows64.shape, tl.int32)
    for i in tl.static_range(31):
        if (BLOCK_IDS >> i) > 0:  # steps BLOCK_IDS, BLOCK_IDS / 2, ..., 1 (constexpr: unrolled)
            cand = at + (BLOCK_IDS >> i)
            ok = row_mask & (cand <= n_ids)
            below = tl.load(ids_ptr + rows64 * stride_ids + tl.where(ok, cand - 1, 0), mask=ok, other=2147483647) < x
            at = tl.where(ok & below, cand, at)
    return at


@triton.jit
def next_id(ids_ptr, stride_ids, rows64, row_mask, n_ids, at):
    """(rows,) int32: each row's id number ``at`` (2147483647 past its last id or for a masked row)."""
    ok = row_mask & (at < n_ids)
    return tl.load(ids_ptr + rows64 * stride_ids + tl.where(ok, at, 0), mask=ok, other=2147483647)


@triton.jit
def fill_ids(x, fill, ids_ptr, stride_ids, rows64, row_mask, n_ids, at, nxt, col0, BLOCK_N: tl.constexpr):
    """(x', at, nxt): the (rows x BLOCK_N) tile ``x`` of the columns [col0, col0 + BLOCK_N) with
    ``fill`` (a scalar or a (rows, 1) column) where the column is one of the row's sorted ids (the
    mask of ``among_ids``), walked from each row's pointer ``at`` into its ids (no id of the row at or
    after ``at`` is below col0; ``nxt``: its id number ``at``, from ``next_id``); returned with the
    pointer and next id past the tile, so a walk across consecutive tiles (the forward's split)
    carries (at, nxt) and loads each id once. Per element: one 32-bit compare and one select per id
    of the tile's fullest row (0 to 2 at K = 64 over V = 152064 and 256-wide tiles), the selects
    applied to ``x`` itself (no boolean tile kept across the loop); per row: one id load per id and
    a reduction over the rows per id plus one to stop."""
    offs = tl.arange(0, BLOCK_N)[None, :]
    local = nxt - col0  # >= 0; the past-the-end 2147483647 stays >= BLOCK_N
    while tl.max((local < BLOCK_N).to(tl.int32)) > 0:
        inside = local < BLOCK_N
        x = tl.where(offs == local[:, None], fill, x)
        at = at + inside.to(tl.int32)
        ok = inside & row_mask & (at < n_ids)  # only the rows that moved load
        nxt = tl.where(inside, tl.load(ids_ptr + rows64 * stride_ids + tl.where(ok, at, 0), mask=ok,
                                       other=2147483647), nxt)
        local = nxt - col0
    return x, at, nxt


# ------------------------------------------------------------------ top-K selection in the tile loop
# Each row's K best (value, id) pairs so far, in registers ((BLOCK_M, KP) tensors, KP the power of
# two >= K; slots K..KP-1 are pads that never leave), with the row's worst entry (worst_v, worst_i).
# Order: value descending, then id ascending (a is better than b when a.v > b.v, or a.v == b.v and
# a.id < b.id), so the list is the exact top K of what the program has seen, ties to the smaller id.
# ``linear_topk``'s kernel and the head's forward (its TOPK variant) walk a split's tiles in column
# order through ``topk_insert``; ``torch_ops.linear_topk.merge_candidates`` merges the splits.
TOPK_PAD_ID = -2  # the ids of the pad slots K..KP-1 (smaller than every id: never the worst entry)
TOPK_EMPTY_ID = 2147483647  # (minus the slot) the ids of the empty slots: larger than every id


@triton.jit
def topk_start(rows, K: tl.constexpr, KP: tl.constexpr):
    """(list_v, list_i, worst_v, worst_i): an empty candidate list for ``rows``: K empty slots
    (-inf, TOPK_EMPTY_ID - slot: distinct, larger than every id, so any finite logit beats them)
    and KP - K pads (+inf, TOPK_PAD_ID: never the worst)."""
    slot = tl.arange(0, KP)
    real_slot = (slot < K)[None, :] & (rows >= 0)[:, None]
    list_v = tl.where(real_slot, float("-inf"), float("inf"))
    list_i = tl.where(real_slot, 2147483647 - slot[None, :], -2)
    worst_v = tl.full(rows.shape, float("-inf"), tl.float32)
    worst_i = tl.full(rows.shape, 2147483647, tl.int32)  # slot 0's
    return list_v, list_i, worst_v, worst_i


@triton.jit
def topk_insert(z, col0, list_v, list_i, worst_v, worst_i, BLOCK_N: tl.constexpr):
    """The candidate list after the (rows x BLOCK_N) tile ``z`` of the columns [col0, col0 +
    BLOCK_N), whose ids are larger than every listed one (the split's tiles come in column order);
    padded columns must be -inf. Only elements that beat the row's worst can enter (a value equal to
    the worst has a larger id, so it never does); NaN and -inf never enter. While some row still has
    a beating element, each row takes its largest (the max with the index of its leftmost
    occurrence: the smallest id among equal values); if it beats the row's worst it takes the worst
    slot and the worst is found again (min value, then the largest id), else the row is done with
    this tile. Loop count: the most entries of one row of the tile, plus one (K in a split's first
    tile, then ~K / t in its t-th for logits in random order)."""
    offs = tl.arange(0, BLOCK_N)
    zc = tl.where(z > worst_v[:, None], z, float("-inf"))
    best_v, best_at = tl.max(zc, axis=1, return_indices=True, return_indices_tie_break_left=True)
    while tl.max(best_v, axis=0) > float("-inf"):
        best_i = col0 + best_at
        enter = (best_v > worst_v) | ((best_v == worst_v) & (best_i < worst_i))
        enter = enter & (best_v > float("-inf"))
        at_worst = (list_i == worst_i[:, None]) & enter[:, None]
        list_v = tl.where(at_worst, best_v[:, None], list_v)
        list_i = tl.where(at_worst, best_i[:, None], list_i)
        worst_v = tl.min(list_v, axis=1)
        worst_i = tl.max(tl.where(list_v == worst_v[:, None], list_i, -2147483647), axis=1)
        # drop the element taken; a row whose best did not enter is done with this tile
        zc = tl.where((offs[None, :] == best_at[:, None]) | (~enter)[:, None], float("-inf"), zc)
        best_v, best_at = tl.max(zc, axis=1, return_indices=True, return_indices_tie_break_left=True)
    return list_v, list_i, worst_v, worst_i


@triton.jit
def topk_store(cand_v_ptr, cand_i_ptr, rows, row_mask, split, num_splits, list_v, list_i,
               K: tl.constexpr, KP: tl.constexpr):
    """The K real slots of the list (unordered) at (row, split) of the (N, num_splits, K) outputs."""
    slot = tl.arange(0, KP)
    cand = (rows.to(tl.int64)[:, None] * num_splits + split) * K + slot[None, :]
    keep = row_mask[:, None] & (slot < K)[None, :]
    tl.store(cand_v_ptr + cand, list_v, mask=keep)
    tl.store(cand_i_ptr + cand, list_i, mask=keep)
