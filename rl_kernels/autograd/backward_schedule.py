"""The backward schedule shared by the fused linear head, its vocab-parallel form and the JSD
loss: dh and dW from d loss / d logits windows that are recomputed and consumed at once.

The backward needs dz = d(loss)/d(h.w) (N x V), which
is never stored whole. It is recomputed window by window (Triton ``linear_dlogits`` or its torch
twin) and consumed at once by cuBLAS matmuls. Two schedules:

* one recompute (both gradients needed, the usual case): windows of all rows x a vocab chunk;
  each gives ``dW[chunk] = dz^T h`` (full N reduction) and adds ``dz W[chunk]`` to a float32 dh
  accumulator (N x H float32). Half of its columns live in dh's own storage (all of them for a
  float32 dh). The rest get storage of their own when that costs at most
  ``SPARE_ACCUMULATOR_FRACTION`` of the two gradients (N x H x 2 bytes for 16-bit tensors);
  otherwise they live in the not-yet-written tail of dW's storage (no memory beyond the
  gradients and the window buffer), and the vocab rows whose storage that part occupies are
  recomputed a second time, after dh is final, to write their dW (N of V rows for 16-bit
  weights). Those vocab rows come first: their windows go into the bytes of the other dW
  rows, none written yet. Then, while dW rows are still unwritten, windows are placed in their
  bytes and made as wide as fits (fewer passes over the accumulator); later ones use the fixed
  buffer. Windows are a multiple of the dlogits kernel's tile width where they can be. Falls
  back to the two-pass schedule when the accumulator does not fit (N > V - 2 for 16-bit weights)
  or torch cannot add a 16-bit matmul into a float32 output (``addmm(out_dtype=float32)``),
  logged once.
* two passes (otherwise): dW pass over vocab chunks, dh pass over token chunks (windows of a
  token chunk x all vocab, ``dh[chunk] = dz W``).

float32 inputs on CUDA: the matmuls take the form of the configuration's ``fp32_backward``
(``_addmm_fp32``): one SGEMM, or on the Hopper class three TF32 products from operands split once
(``ops.fp32_matmul``: SGEMM-class accuracy on the tensor cores, 1.2x faster fwd+bwd).

Every gradient element is rounded once to the output dtype (dh from its float32 sum), with no
atomics: repeated runs give identical bits. The window buffer is bounded by
``max(MIN_CHUNK_ELEMENTS, CHUNK_FRACTION * (N + V) * H)`` elements, i.e. 8% of the two
gradients. Window row strides are multiples of ``ALIGN`` elements: cuBLAS runs a 16-bit matmul
whose operand has a leading dimension that is not a multiple of 8 several times slower (H100, dW
pass on 16384 x 1842 windows: 3.5x a full-size matmul instead of ~1x).
"""
from __future__ import annotations

import contextlib
import logging
import math

import torch

from ..core._logging import log_once
from ..core.backends import interpreting

MIN_CHUNK_ELEMENTS = 1 << 22
CHUNK_FRACTION = 0.08  # of (N + V) * H: the buffer stays under 10% of the two gradients
ALIGN = 64
WIDE_FACTOR = 0  # windows placed in dW's unwritten rows are at most this many times `cols` (0: no cap)
SPARE_ACCUMULATOR_FRACTION = 0.25
"""The one-recompute schedule gives the float32 dh accumulator's second half (N x H/2 float32 for
a 16-bit dh: N x H x 2 bytes) storage of its own when that costs at most this fraction of the
two gradients' bytes (N / (N + V) for 16-bit tensors: 4096 x 152064 2.6%, 32768 x 128256 20%):
then no vocab row is recomputed a second time. Above it, that half lives in the tail of dW's
storage (no memory beyond the gradients and the window buffer) and those N vocab rows are
recomputed after dh is final. 0 turns the spare storage off."""


@contextlib.contextmanager
def _matmul_flags(**values):
    """Set ``torch.backends.cuda.matmul``'s flags to ``values`` while the block runs, then give the
    user's settings back."""
    flags = torch.backends.cuda.matmul
    saved = {name: getattr(flags, name) for name in values}
    for name, value in values.items():
        setattr(flags, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(flags, name, value)


def full_precision_reduction():
    """cuBLAS may reduce split-K partials of bf16/fp16 matmuls in 16 bits when torch allows it
    (the default). Over the long V reduction of dh that tripled the error (H100, 2048 x 3584 x
    151937: relative dh error 7.2e-3 with it, 2.3e-3 without), so our matmuls turn it off and
    restore the user's setting afterwards."""
    return _matmul_flags(allow_bf16_reduced_precision_reduction=False,
                         allow_fp16_reduced_precision_reduction=False)


_ADDMM_OUT_DTYPE: dict = {}


def _can_accumulate_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a ``dtype`` matmul can be added into a float32 output on ``device`` here (CUDA:
    torch's ``addmm(out_dtype=float32)``; the CPU always, see ``_accumulate``)."""
    if dtype == torch.float32 or device.type == "cpu":
        return True
    key = (device.type, dtype)
    if key not in _ADDMM_OUT_DTYPE:
        try:
            probe = torch.zeros(2, 2, device=device)
            ones = torch.ones(2, 2, device=device, dtype=dtype)
            torch.addmm(probe, ones, ones, out_dtype=torch.float32, out=probe)
            _ADDMM_OUT_DTYPE[key] = bool(torch.all(probe == 2))
        except (RuntimeError, TypeError, NotImplementedError):
            _ADDMM_OUT_DTYPE[key] = False
    return _ADDMM_OUT_DTYPE[key]


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fp32_products: str) -> None:
    """acc += a @ b for float32 ``a``, ``b`` on CUDA in the form ``fp32_products``
    (``KernelConfig.fp32_backward``): "ieee" one SGEMM (full float32 products on CUDA cores);
    "tf32" one TF32 tensor-core matmul; "tf32x3" three TF32 products from operands split once, with
    partial sums promoted into float32 (``ops.fp32_matmul.addmm_tf32x3``: SGEMM-class accuracy on
    the tensor cores; also in the CPU interpreter, where a test forces it). Elsewhere (CPU) one
    float32 matmul."""
    if fp32_products == "ieee" or not (acc.is_cuda or interpreting()):
        acc.addmm_(a, b)
    elif fp32_products == "tf32":
        with _matmul_flags(allow_tf32=True):
            acc.addmm_(a, b)
    else:
        from ..ops.fp32_matmul import addmm_tf32x3

        addmm_tf32x3(acc, a, b)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fp32_products: str = "ieee") -> None:
    """acc (float32) += a @ b, computed and summed in float32 (float32 operands: in the form
    ``fp32_products``, :func:`_addmm_fp32`). On the CPU (tests, the torch backend) 16-bit operands
    are upcast first: their products are exact in float32, so this is the same arithmetic as
    cuBLAS's float32-output matmul, at the cost of float32 copies."""
    if a.dtype == torch.float32:
        _addmm_fp32(acc, a, b, fp32_products)
    elif acc.device.type == "cpu":
        acc.addmm_(a.float(), b.float())
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _cpu_bf16_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a contiguous copy when it is a non-contiguous bfloat16 tensor on the CPU.

    torch 2.13's CPU bfloat16 ``torch.mm`` reads a row-major operand's elements past its last
    column, up to its row stride, and multiplies them by zero: finite values there vanish, but a
    NaN or inf in that padding (the columns [v, v_pad) of a window ``buf.view(rows, v_pad)[:, :v]``,
    never written) makes whole output rows NaN. A contiguous operand has no such elements.
    Measured on random shapes: the left operand, bfloat16 only (float16 and float32 read only the
    view); both operands are made contiguous, the copy costing O(size) against the matmul's
    O(size x H). On CUDA nothing changes (cuBLAS honours the leading dimension, and the padded
    row stride is there for its speed: module docstring), so the GPU's operands and bits are those
    of before."""
    if t.dtype == torch.bfloat16 and t.device.type == "cpu" and not t.is_contiguous():
        return t.contiguous()
    return t


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fp32_products: str = "ieee") -> None:
    """out = a @ b, rounded once to ``out``'s dtype (a CPU bfloat16 operand contiguous first:
    :func:`_cpu_bf16_operand`; float32 operands and output in the form ``fp32_products``,
    :func:`_addmm_fp32`)."""
    a, b = _cpu_bf16_operand(a), _cpu_bf16_operand(b)
    if a.dtype == b.dtype == out.dtype == torch.float32 and fp32_products != "ieee":
        _addmm_fp32(out.zero_(), a, b, fp32_products)
    elif a.dtype == out.dtype and b.dtype == out.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b))


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def chunked_backward(dlogits, hidden_states, weight, dz_dtype, need_dh, need_dw, dh_float32=False,
                      h_dw=None, width_multiple=ALIGN, fp32_products="ieee"):
    """dh, dW from dlogits windows (module docstring). ``fp32_products``: the form of float32
    matmuls on CUDA (:func:`_addmm_fp32`), the configuration's ``fp32_backward``. ``h_dw``: the
    hidden states that multiply into dW, or a zero-argument function giving them, called at the first dW matmul
    (``hidden_for_weight_grad``); default ``hidden_states``. Column windows are a multiple of
    ``width_multiple`` columns wide where they can be (the dlogits kernel's tile width: a
    partial last tile costs a whole one)."""
    get_h = h_dw if callable(h_dw) else (lambda: hidden_states if h_dw is None else h_dw)
    memo = []

    def h_mm() -> torch.Tensor:
        if not memo:
            memo.append(get_h().to(dz_dtype))
        return memo[0]
    n, h = hidden_states.shape
    v = weight.shape[0]
    budget = max(MIN_CHUNK_ELEMENTS, int(CHUNK_FRACTION * (n + v) * h))
    v_pad = _round_up(v, ALIGN)
    step = ALIGN * width_multiple // math.gcd(ALIGN, width_multiple)
    # column windows: all rows x `cols` columns; row windows: `rows` rows x all columns; both
    # with a row stride that is a multiple of ALIGN (cols itself, or v_pad)
    cols = min(v_pad, max(step, budget // max(n, 1) // step * step))
    rows = max(1, budget // v_pad)
    if n == 0:
        dw = torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_dw else None
        dh = torch.empty_like(hidden_states, memory_format=torch.contiguous_format) if need_dh else None
        return dh, dw
    if need_dh and need_dw:
        result = _one_recompute(dlogits, hidden_states, weight, dz_dtype, cols, dh_float32, h_mm, step,
                                fp32_products)
        if result is not None:
            return result
    size = max(n * cols if need_dw else 0, min(rows, n) * v_pad if need_dh else 0)
    buf = torch.empty(size, dtype=dz_dtype, device=hidden_states.device)
    dw = None
    if need_dw:
        dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
        window = buf[: n * cols].view(n, cols)
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            dz = dlogits(slice(0, n), slice(c0, c1), window[:, : c1 - c0])
            _mm_into(dw[c0:c1], dz.T, h_mm(), fp32_products)
    dh = None
    if need_dh:
        dh = torch.empty_like(hidden_states, memory_format=torch.contiguous_format,
                              dtype=torch.float32 if dh_float32 else None)
        w_mm = weight.to(dz_dtype)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            dz = dlogits(slice(r0, r1), slice(0, v), buf[: (r1 - r0) * v_pad].view(r1 - r0, v_pad)[:, :v])
            if dh_float32 and dz.dtype != torch.float32 and _can_accumulate_fp32(dz.device, dz.dtype):
                _accumulate(dh[r0:r1].zero_(), dz, w_mm)
            else:
                _mm_into(dh[r0:r1], dz, w_mm, fp32_products)
    return dh, dw


def _one_recompute(dlogits, hidden_states, weight, dz_dtype, cols, dh_float32, h_mm, step, fp32_products):
    """The one-recompute schedule (module docstring); None when it cannot run here. ``h_mm``:
    zero-argument function giving the hidden states for dW in ``dz_dtype``; ``step``: column
    multiple of the wide windows.

    The N x H float32 dh accumulator is split by columns: the first ``lo`` columns live in dh's
    own storage (row i of an (N, lo) float32 matrix occupies exactly the bytes of dh's row i:
    lo = H/2 for a 16-bit dh, lo = H for a float32 dh), the other H - lo columns in the tail of
    dW's storage, whose vocab rows (N of V for 16-bit weights) are recomputed once more after dh
    is final. dh is finished row block by row block through the window buffer (each block is
    read whole before its bytes are written), rounding each element once."""
    n, h = hidden_states.shape
    v = weight.shape[0]
    if not _can_accumulate_fp32(hidden_states.device, dz_dtype):
        log_once(logging.INFO, f"rl_kernels backward: torch cannot add a {dz_dtype} matmul into a "
                 f"float32 output on {hidden_states.device.type} (addmm out_dtype); using two "
                 f"recompute passes")
        return None
    dh = torch.empty((n, h), dtype=torch.float32 if dh_float32 else hidden_states.dtype,
                     device=hidden_states.device)
    lo = h * dh.element_size() // 4 if (h * dh.element_size()) % 4 == 0 else 0
    hi = h - lo
    elem = weight.element_size()  # dW has the weight's dtype
    acc_elems = n * hi * 4 // elem  # dW elements whose bytes hold the accumulator's other columns
    if acc_elems * elem != n * hi * 4 or acc_elems > v * h - 2 * h:
        log_once(logging.INFO, "rl_kernels backward: the float32 dh accumulator does not fit in dh's and "
                 "dW's storage (N > V - 2 for 16-bit weights); using two recompute passes")
        return None
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    flat = dw.view(-1)
    acc_lo = dh.view(-1).view(torch.float32).view(n, lo) if lo else None
    acc_hi, tail = None, v  # dW rows from `tail` on share bytes with the accumulator
    if hi and n * hi * 4 <= SPARE_ACCUMULATOR_FRACTION * (dh.numel() * dh.element_size() + v * h * elem):
        # affordable: the other columns get their own storage, so no vocab row is recomputed twice
        acc_hi = torch.empty((n, hi), dtype=torch.float32, device=hidden_states.device)
    elif hi:
        per_float = 4 // elem
        start = (v * h - acc_elems) // per_float * per_float  # float32-aligned
        acc_hi = flat[start:start + acc_elems].view(torch.float32).view(n, hi)
        tail = start // h
    w_mm = weight.to(dz_dtype)
    buffer = torch.empty(n * cols, dtype=dz_dtype, device=hidden_states.device).view(n, cols)

    def window(c0: int, free_until: int):
        """(width, n x width window) for the chunk starting at vocab row c0. While dW rows
        [c0, free_until) are unwritten, the window is placed in their bytes after this chunk's own
        output rows, as wide as fits (fewer, wider windows: fewer passes over the accumulator);
        otherwise it is the fixed buffer."""
        wide = 0
        if dz_dtype == dw.dtype and free_until > c0:
            wide = (free_until - c0) * h // (h + n) // step * step
        if WIDE_FACTOR:
            wide = min(wide, WIDE_FACTOR * cols)
        if wide <= cols:
            return min(cols, v - c0), buffer
        width = min(wide, v - c0)
        base = (c0 + width) * h  # ends by c0*h + wide*(h + n) <= free_until*h
        return width, flat[base: base + n * wide].view(n, wide)

    def accumulate(c0: int, c1: int, dz: torch.Tensor) -> None:
        if lo:
            _accumulate(acc_lo, dz, w_mm[c0:c1, :lo], fp32_products)
        if acc_hi is not None:
            _accumulate(acc_hi, dz, w_mm[c0:c1, lo:], fp32_products)

    if acc_lo is not None:
        acc_lo.zero_()
    if acc_hi is not None:
        acc_hi.zero_()
    # first the vocab rows [tail, v) whose dW bytes hold the accumulator: their dz feeds only dh
    # now (their dW is written after dh is final), so their windows can use the bytes of dW rows
    # [0, tail), all unwritten yet: a few wide windows instead of many narrow ones at the end
    front = tail * h // n // step * step if dz_dtype == dw.dtype else 0
    c0 = tail
    while c0 < v:
        if front > cols:
            width, win = min(front, v - c0), flat[: n * front].view(n, front)
        else:
            width, win = min(cols, v - c0), buffer
        accumulate(c0, c0 + width, dlogits(slice(0, n), slice(c0, c0 + width), win[:, :width]))
        c0 += width
    # then rows [0, tail): dz feeds dh and writes dW
    c0 = 0
    while c0 < tail:
        width, win = window(c0, tail)
        c1 = min(c0 + width, tail)
        dz = dlogits(slice(0, n), slice(c0, c1), win[:, : c1 - c0])
        accumulate(c0, c1, dz)
        _mm_into(dw[c0:c1], dz.T, h_mm(), fp32_products)
        c0 = c1
    if acc_hi is not None:  # dh row blocks from both parts, through the window buffer
        block = max(1, buffer.numel() // h)  # (dh is 16-bit here: a float32 dh holds it all)
        scratch = buffer.view(-1) if buffer.numel() >= h else torch.empty(h, dtype=dz_dtype, device=dh.device)
        for r0 in range(0, n, block):
            r1 = min(n, r0 + block)
            rows = scratch[: (r1 - r0) * h].view(r1 - r0, h)
            if lo:
                rows[:, :lo].copy_(acc_lo[r0:r1])
            rows[:, lo:].copy_(acc_hi[r0:r1])
            dh[r0:r1].copy_(rows)
    # (with hi == 0, dh is float32 and holds the accumulator itself)
    # the accumulator is free: recompute the vocab rows whose dW is not written yet
    c0 = tail
    while c0 < v:
        width, win = window(c0, v)
        c1 = c0 + width
        dz = dlogits(slice(0, n), slice(c0, c1), win[:, :width])
        _mm_into(dw[c0:c1], dz.T, h_mm(), fp32_products)
        c0 = c1
    return dh, dw
