"""Autograd for the fused linear head: forward statistics, backward by recompute in chunks.

Saved state is O(N): (lse, entropy) per row. The backward needs dz = d(loss)/d(h.w) (N x V), which
is never stored whole. It is recomputed window by window (Triton ``linear_dlogits`` or its torch
twin) and consumed at once by cuBLAS matmuls. Two schedules:

* one recompute (both gradients needed, the usual case): windows of all rows x a vocab chunk;
  each gives ``dW[chunk] = dz^T h`` (full N reduction) and adds ``dz W[chunk]`` to a float32 dh
  accumulator. The accumulator (N x H float32) lives in the not-yet-written tail of dW's own
  storage, so it costs no memory: the vocab rows whose storage it occupies are recomputed a
  second time, after dh is final, to write their dW (2N of V rows for 16-bit weights). While dW
  rows are still unwritten, windows are placed in their bytes and made as wide as fits (fewer
  passes over the accumulator); later ones use the fixed buffer. Falls back
  to the two-pass schedule when the accumulator does not fit (N > V/2 for 16-bit weights) or
  torch cannot add a 16-bit matmul into a float32 output (``addmm(out_dtype=float32)``), logged once.
* two passes (otherwise): dW pass over vocab chunks, dh pass over token chunks (windows of a
  token chunk x all vocab, ``dh[chunk] = dz W``).

Every gradient element is rounded once to the output dtype (dh from its float32 sum), with no
atomics: repeated runs give identical bits. The window buffer is bounded by
``max(MIN_CHUNK_ELEMENTS, CHUNK_FRACTION * (N + V) * H)`` elements, i.e. 8% of the two
gradients. Window row strides are multiples of ``ALIGN`` elements: cuBLAS runs a 16-bit matmul
whose operand has a leading dimension that is not a multiple of 8 several times slower (H100, dW
pass on 16384 x 1842 windows: 3.5x a full-size matmul instead of ~1x).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import torch

from ._logging import log_once
from .torch_backend import torch_dlogits, torch_forward, torch_gathered_logits

MIN_CHUNK_ELEMENTS = 1 << 22
CHUNK_FRACTION = 0.08  # of (N + V) * H: the buffer stays under 10% of the two gradients
ALIGN = 64
WIDE_FACTOR = 0  # windows placed in dW's unwritten rows are at most this many times `cols` (0: no cap)


@dataclasses.dataclass(frozen=True)
class HeadParams:
    backend: str  # "triton" or "torch" (already resolved)
    inv_temperature: float
    ignore_index: int
    return_entropy: bool
    return_lse: bool = False  # internal (distillation losses): lse as a differentiable output
    name: str = "linear_log_probs"  # the public function, for error messages
    # False when the caller knows no label equals ignore_index (read in the label check's host
    # sync): the backward then skips the non-finite ignored-row check and its host sync
    may_have_ignored: bool = True
    return_sum_pi_squared: bool = False  # sum_j p_j^2 as a differentiable output


def first_order_only(backward):
    """Decorate an autograd Function's ``backward``: gradients are computed without a graph, and
    under ``create_graph=True`` they are wired to a node that raises "double backward is not
    supported by rl_kernels.<ctx.fn_name>" when differentiated again. The first derivatives stay
    correct; a second derivative never comes out silently wrong (or silently zero)."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        with torch.no_grad():
            outs = backward(ctx, *grads)
        if not torch.is_grad_enabled():
            return outs
        msg = (f"double backward is not supported by rl_kernels.{ctx.fn_name}: its backward "
               f"computes first derivatives only")
        present = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
        # the node's extra inputs: what the gradients depend on (the saved inputs and the
        # incoming gradients), so that differentiating the gradients reaches the node
        deps = [t for t in (*ctx.saved_tensors, *grads)
                if isinstance(t, torch.Tensor) and t.requires_grad]
        if not present or not deps:
            return outs
        delayed = getattr(getattr(torch._C, "_functions", None), "DelayedError", None)
        if delayed is None:  # pragma: no cover - torch without the C++ node: refuse up front
            raise RuntimeError(msg + " (create_graph=True)")
        guarded = delayed(msg.encode(), len(present) + len(deps))(*[outs[i] for i in present], *deps)
        outs = list(outs)
        for i, g in zip(present, guarded):
            outs[i] = g
        return tuple(outs)
    return wrapper


def hidden_for_weight_grad(hidden_states: torch.Tensor, ignored: torch.Tensor,
                           lse: torch.Tensor) -> torch.Tensor:
    """``hidden_states`` with the rows that must not reach dW zeroed: rows that are ``ignored``
    (label == ignore_index, or masked) and non-finite. Their dlogits rows are exactly 0, but in
    dW = dz^T h a NaN/inf hidden value times 0 is NaN, which would spread over all of dW. A row of
    non-finite hidden states has a non-finite lse (every logit of the row is NaN or +-inf), so the
    check reads O(N) values; it costs one host sync, and a copy of hidden_states only when such a
    row exists."""
    bad = ignored & ~torch.isfinite(lse)
    if bool(bad.any()):
        return hidden_states.masked_fill(bad[:, None], 0)
    return hidden_states


def head_forward(hidden_states, weight, labels, params: HeadParams):
    """(log_probs, entropy or None, lse, sum_sq or None), (N,) float32 each, no autograd."""
    sq = params.return_sum_pi_squared
    if params.backend == "triton":
        from . import ops

        n = hidden_states.shape[0]
        if n == 0:
            empty = hidden_states.new_empty(0, dtype=torch.float32)
            return (empty, (empty.clone() if params.return_entropy else None), empty.clone(),
                    empty.clone() if sq else None)
        cfg = ops.default_config(hidden_states.device, hidden_states.dtype)
        m, s, b, z_y, q = ops.linear_split_stats(hidden_states, weight, labels, params.inv_temperature,
                                                 params.return_entropy, cfg, return_sum_pi_squared=sq)
        return ops.split_combine(m, s, b, z_y, labels, params.ignore_index, params.return_entropy,
                                 part_q=q)
    return torch_forward(hidden_states, weight, labels, params.inv_temperature,
                         params.ignore_index, params.return_entropy, return_sum_pi_squared=sq)


@contextlib.contextmanager
def _full_precision_reduction():
    """cuBLAS may reduce split-K partials of bf16/fp16 matmuls in 16 bits when torch allows it
    (the default). Over the long V reduction of dh that tripled the error (H100, 2048 x 3584 x
    151937: relative dh error 7.2e-3 with it, 2.3e-3 without), so our matmuls turn it off and
    restore the user's setting afterwards."""
    flags = torch.backends.cuda.matmul
    saved = (flags.allow_bf16_reduced_precision_reduction,
             flags.allow_fp16_reduced_precision_reduction)
    flags.allow_bf16_reduced_precision_reduction = False
    flags.allow_fp16_reduced_precision_reduction = False
    try:
        yield
    finally:
        (flags.allow_bf16_reduced_precision_reduction,
         flags.allow_fp16_reduced_precision_reduction) = saved


_ADDMM_OUT_DTYPE: dict = {}


def _can_accumulate_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch adds a ``dtype`` matmul into a float32 output on ``device`` here."""
    if dtype == torch.float32:
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


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (float32) += a @ b, computed and summed in float32."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == out.dtype and b.dtype == out.dtype:
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b))


def head_backward(hidden_states, weight, labels, lse, entropy, grad_log_probs, grad_entropy,
                  params: HeadParams, need_dh: bool, need_dw: bool, grad_lse=None, gathered=None,
                  dh_float32: bool = False, sum_sq=None, grad_sum_sq=None):
    """(dh or None, dW or None) in the input dtypes; see the module docstring. ``gathered``:
    optional (ids (N, K), grad (N, K)): upstream gradients of the logits z[i, ids[i, k]], added to
    each recomputed dlogits window as sparse entries (no dense (N, K, H) work). ``dh_float32``:
    return dh unrounded in float32 (a vocab shard's partial sum, rounded after the all-reduce).
    ``sum_sq``, ``grad_sum_sq``: the forward's sum_j p_j^2 and its upstream gradient, (N,) float32
    contiguous, or None."""
    if params.backend == "triton":
        from . import ops

        cfg = ops.default_config(hidden_states.device, hidden_states.dtype)
        dz_dtype = hidden_states.dtype

        def dlogits(rows, cols, out):
            tile = cfg.bwd_rows if cols.stop - cols.start == weight.shape[0] else cfg.bwd_cols
            return ops.linear_dlogits(hidden_states, weight, labels, lse, entropy, grad_log_probs,
                                      grad_entropy, rows, cols, params.inv_temperature,
                                      params.ignore_index, out, cfg, tile, grad_lse, sum_sq, grad_sum_sq)
    else:
        dz_dtype = torch.float32

        def dlogits(rows, cols, out):
            return torch_dlogits(hidden_states, weight, labels, lse, entropy, grad_log_probs,
                                 grad_entropy, rows, cols, params.inv_temperature,
                                 params.ignore_index, out, grad_lse, sum_sq, grad_sum_sq)

    if gathered is not None:
        dlogits = _with_gathered(dlogits, *gathered, labels != params.ignore_index,
                                 params.inv_temperature)
    h_dw = hidden_states
    if need_dw and params.may_have_ignored:
        h_dw = hidden_for_weight_grad(hidden_states, labels == params.ignore_index, lse)
    with _full_precision_reduction():
        return _chunked_backward(dlogits, hidden_states, weight, dz_dtype, need_dh, need_dw, dh_float32,
                                 h_dw)


def _with_gathered(dlogits, ids, grad, valid, inv_temperature):
    """Wrap a dlogits window function: add grad[i, k] * inv_temperature at (i, ids[i, k]) for the
    ids inside the window's columns (rows whose label is ignored get nothing)."""
    g = torch.where(valid[:, None], grad.float() * inv_temperature, torch.zeros((), device=grad.device))

    def wrapped(rows, cols, out):
        dz = dlogits(rows, cols, out)
        ids_r = ids[rows]
        r, k = ((ids_r >= cols.start) & (ids_r < cols.stop)).nonzero(as_tuple=True)
        dz.index_put_((r, ids_r[r, k] - cols.start), g[rows][r, k].to(dz.dtype), accumulate=True)
        return dz
    return wrapped


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _chunked_backward(dlogits, hidden_states, weight, dz_dtype, need_dh, need_dw, dh_float32=False,
                      h_dw=None):
    """dh, dW from dlogits windows (module docstring). ``h_dw``: the hidden states that multiply
    into dW (``hidden_for_weight_grad``); default ``hidden_states``."""
    h_dw = hidden_states if h_dw is None else h_dw
    n, h = hidden_states.shape
    v = weight.shape[0]
    budget = max(MIN_CHUNK_ELEMENTS, int(CHUNK_FRACTION * (n + v) * h))
    v_pad = _round_up(v, ALIGN)
    # column windows: all rows x `cols` columns; row windows: `rows` rows x all columns; both
    # with a row stride that is a multiple of ALIGN (cols itself, or v_pad)
    cols = min(v_pad, max(ALIGN, budget // max(n, 1) // ALIGN * ALIGN))
    rows = max(1, budget // v_pad)
    if n == 0:
        dw = torch.zeros_like(weight, memory_format=torch.contiguous_format) if need_dw else None
        dh = torch.empty_like(hidden_states, memory_format=torch.contiguous_format) if need_dh else None
        return dh, dw
    if need_dh and need_dw:
        result = _one_recompute(dlogits, hidden_states, weight, dz_dtype, cols, dh_float32, h_dw)
        if result is not None:
            return result
    size = max(n * cols if need_dw else 0, min(rows, n) * v_pad if need_dh else 0)
    buf = torch.empty(size, dtype=dz_dtype, device=hidden_states.device)
    dw = None
    if need_dw:
        dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
        h_mm = h_dw.to(dz_dtype)
        window = buf[: n * cols].view(n, cols)
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            dz = dlogits(slice(0, n), slice(c0, c1), window[:, : c1 - c0])
            _mm_into(dw[c0:c1], dz.T, h_mm)
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
                _mm_into(dh[r0:r1], dz, w_mm)
    return dh, dw


def _one_recompute(dlogits, hidden_states, weight, dz_dtype, cols, dh_float32=False, h_dw=None):
    """The one-recompute schedule (module docstring); None when it cannot run here."""
    n, h = hidden_states.shape
    v = weight.shape[0]
    elem = weight.element_size()  # dW has the weight's dtype
    acc_elems = n * h * 4 // elem  # dW elements whose bytes hold the accumulator
    if acc_elems * elem != n * h * 4 or acc_elems > v * h - 2 * h:
        log_once(logging.INFO, "rl_kernels backward: the float32 dh accumulator does not fit in dW's "
                 "storage (N > V/2 for 16-bit weights); using two recompute passes")
        return None
    if not _can_accumulate_fp32(hidden_states.device, dz_dtype):
        log_once(logging.INFO, f"rl_kernels backward: torch cannot add a {dz_dtype} matmul into a "
                 f"float32 output on {hidden_states.device.type} (addmm out_dtype); using two "
                 f"recompute passes")
        return None
    dw = torch.empty_like(weight, memory_format=torch.contiguous_format)
    per_float = 4 // elem
    start = (v * h - acc_elems) // per_float * per_float  # float32-aligned
    acc = dw.view(-1)[start:start + acc_elems].view(torch.float32).view(n, h)
    tail = start // h  # dW rows from here on share bytes with the accumulator
    h_mm = (hidden_states if h_dw is None else h_dw).to(dz_dtype)
    w_mm = weight.to(dz_dtype)
    buffer = torch.empty(n * cols, dtype=dz_dtype, device=hidden_states.device).view(n, cols)
    flat = dw.view(-1)

    def window(c0: int, free_until: int):
        """(width, n x width window) for the chunk starting at vocab row c0. While dW rows
        [c0, free_until) are unwritten, the window is placed in their bytes after this chunk's own
        output rows, as wide as fits (fewer, wider windows: fewer passes over the accumulator);
        otherwise it is the fixed buffer."""
        wide = 0
        if dz_dtype == dw.dtype and free_until > c0:
            wide = (free_until - c0) * h // (h + n) // ALIGN * ALIGN
        if WIDE_FACTOR:
            wide = min(wide, WIDE_FACTOR * cols)
        if wide <= cols:
            return min(cols, v - c0), buffer
        width = min(wide, v - c0)
        base = (c0 + width) * h  # ends by c0*h + wide*(h + n) <= free_until*h
        return width, flat[base: base + n * wide].view(n, wide)

    acc.zero_()
    c0, unwritten = 0, None
    while c0 < v:
        width, win = window(c0, tail)
        c1 = c0 + width
        dz = dlogits(slice(0, n), slice(c0, c1), win[:, :width])
        _accumulate(acc, dz, w_mm[c0:c1])
        if c1 <= tail and unwritten is None:
            _mm_into(dw[c0:c1], dz.T, h_mm)
        elif unwritten is None:
            unwritten = c0
        c0 = c1
    # (copy: the accumulator aliases dW's storage)
    dh = acc.clone() if dh_float32 else acc.to(hidden_states.dtype, copy=True)
    # the accumulator is free: recompute the vocab rows whose dW is not written yet
    c0 = v if unwritten is None else unwritten
    while c0 < v:
        width, win = window(c0, v)
        c1 = c0 + width
        dz = dlogits(slice(0, n), slice(c0, c1), win[:, :width])
        _mm_into(dw[c0:c1], dz.T, h_mm)
        c0 = c1
    return dh, dw


class LinearLogProbsFunction(torch.autograd.Function):
    """Inputs: hidden_states (N, H), weight (V, H), labels (N,), HeadParams.
    Outputs, in this order: log_probs (N,) float32, entropy (N,) when params.return_entropy, lse
    (N,) when params.return_lse, sum_j p_j^2 (N,) when params.return_sum_pi_squared, and the (N, K)
    logits at ``gather_ids`` when given."""

    @staticmethod
    def forward(ctx, hidden_states, weight, labels, params: HeadParams, gather_ids=None):
        log_probs, entropy, lse, sum_sq = head_forward(hidden_states, weight, labels, params)
        ctx.save_for_backward(hidden_states, weight, labels, lse, entropy, sum_sq, gather_ids)
        ctx.params, ctx.fn_name = params, params.name
        ctx.set_materialize_grads(False)
        outs = (log_probs,) + ((entropy,) if params.return_entropy else ()) + \
            ((lse.clone(),) if params.return_lse else ()) + \
            ((sum_sq,) if params.return_sum_pi_squared else ())
        if gather_ids is not None:  # (N, K) logits z[i, ids[i, k]] (internal: distillation)
            outs += (gathered_logits(hidden_states, weight, gather_ids, params),)
        return outs if len(outs) > 1 else log_probs

    @staticmethod
    @first_order_only
    def backward(ctx, grad_log_probs, *more):
        hidden_states, weight, labels, lse, entropy, sum_sq, gather_ids = ctx.saved_tensors
        params: HeadParams = ctx.params
        more = list(more)
        grad_entropy = more.pop(0) if params.return_entropy else None
        grad_lse = more.pop(0) if params.return_lse else None
        grad_sum_sq = more.pop(0) if params.return_sum_pi_squared else None
        grad_gathered = more.pop(0) if gather_ids is not None else None
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if all(g is None for g in (grad_log_probs, grad_entropy, grad_lse, grad_sum_sq, grad_gathered)) \
                or not (need_dh or need_dw):
            return None, None, None, None, None
        if grad_lse is not None:
            grad_lse = grad_lse.float().contiguous()
        if grad_sum_sq is not None:
            grad_sum_sq = grad_sum_sq.float().contiguous()
        dh, dw = head_backward(hidden_states, weight, labels, lse, entropy,
                               grad_log_probs, grad_entropy, params, need_dh, need_dw, grad_lse,
                               None if grad_gathered is None else (gather_ids, grad_gathered),
                               sum_sq=sum_sq, grad_sum_sq=grad_sum_sq)
        return dh, dw, None, None, None


def gathered_logits(hidden_states, weight, ids, params: HeadParams) -> torch.Tensor:
    """(N, K) float32 z[i, k] = hidden_states[i] . weight[ids[i, k]] * inv_temperature."""
    if params.backend == "triton":
        from .ops.linear_forward import label_logits

        return label_logits(hidden_states, weight, ids, params.inv_temperature)
    return torch_gathered_logits(hidden_states, weight, ids, params.inv_temperature)
