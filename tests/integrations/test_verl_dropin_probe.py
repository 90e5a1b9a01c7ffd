"""Differential probe of the drop-in contract (issue 53): every replaced verl from-logits function
(``verl.utils.torch_functional``'s four, ``verl.utils.megatron.tensor_parallel``'s four at TP = 1)
against verl's own (``patch_state.verl_original``) on the same inputs, over logits dtypes (float16,
bfloat16, float32, float64, int32, int64, bool), ranks 0-D..4-D, empty shapes and vocab_size 1 and 0,
label values (in range, -100, V, -1; int64 and int32), and labels that verl's broadcasts.

For each input: where verl's raises, the replacement raises too; where verl's returns, the
replacement returns the same shape, and either verl's dtype and values (same bits where the call
went to verl's own function, else within float32 rounding of verl's function on the float64 copy of
the logits: tests/support/tolerances.py), or, for 16-bit logits inside rl-kernels' kernels, float32
(by design: rl-kernels' outputs are float32) within float32 rounding of that float64 reference.
Each input the replacement serves itself must be inside the kernels' domain (16/32-bit float logits
of 1+ dims with rows, int labels of logits.shape[:-1] in [0, V)); each input it routes to verl's
own function is counted in ``verl_fallback_calls``. The domain's cases (2-D / 3-D, the three float
dtypes, in-range labels) must be served by rl-kernels, so a guard that sends everything to verl fails.
"""
import itertools

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch

import rl_kernels.integrations.verl as rkv
from rl_kernels.integrations.verl_impl import patch_state
from rl_kernels.integrations.verl_impl import megatron as rk_megatron
from tolerances import assert_close_f32, logits_magnitude

pytestmark = pytest.mark.verl_matrix

TORCH_FUNCTIONAL = "verl.utils.torch_functional"
FSDP_NAMES = ("logprobs_from_logits", "entropy_from_logits", "entropy_from_logits_with_chunking",
              "calculate_sum_pi_squared_from_logits")
MEGATRON_NAMES = rk_megatron.LOGITS_FUNCTIONS + (rk_megatron.SUM_PI_SQUARED_FUNCTION,)
LABELLED = ("logprobs_from_logits", "vocab_parallel_log_probs_from_logits")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64, torch.bool)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SHAPES = ((), (7,), (4, 7), (2, 3, 7), (2, 2, 3, 7), (0, 7), (2, 0, 7), (4, 1), (3, 0))


def _logits(shape, dtype, g):
    x = 3 * torch.randn(shape, generator=g, dtype=torch.float64)
    if dtype == torch.bool:
        return x > 0
    return (x.round() if not dtype.is_floating_point else x).to(dtype)


def _labels(shape, g):
    """(what, labels) for logits of ``shape``: in range (int64, int32), -100, V, -1, broadcast."""
    rows, vocab = shape[:-1], shape[-1]
    top = max(vocab, 1)
    out = [("in range", torch.randint(0, top, rows, generator=g)),
           ("in range int32", torch.randint(0, top, rows, generator=g, dtype=torch.int32)),
           ("-100", torch.full(rows, -100)), ("V", torch.full(rows, vocab)), ("-1", torch.full(rows, -1))]
    if len(shape) == 2:
        out += [("broadcast (1,)", torch.randint(0, top, (1,), generator=g)),
                ("(N, 1)", torch.randint(0, top, (shape[0], 1), generator=g))]
    if len(shape) == 3:
        out += [("broadcast (B, 1)", torch.randint(0, top, (shape[0], 1), generator=g)),
                ("broadcast (T,)", torch.randint(0, top, shape[1:2], generator=g))]
    return out


def _cases(name, seed=53):
    g = torch.Generator().manual_seed(seed)
    for dtype, shape in itertools.product(DTYPES, SHAPES):
        logits = _logits(shape, dtype, g)
        if name in LABELLED:
            if not shape:
                yield (dtype, shape, "0-d labels"), (logits, torch.tensor(0))
                continue
            for what, labels in _labels(shape, g):
                yield (dtype, shape, what), (logits, labels)
        else:
            yield (dtype, shape, None), (logits,)


def _in_domain(name, dtype, shape, labels_what):
    """The inputs rl-kernels' kernels may serve: 16/32-bit float logits with rows and a vocabulary
    (1-D too, but not for the log-probs: verl's gathers along V there), int labels in range."""
    if dtype not in KERNEL_DTYPES or not shape or 0 in shape:
        return False
    if name == "logprobs_from_logits" and len(shape) == 1:
        return False
    if name == "entropy_from_logits_with_chunking" and len(shape) != 2:
        return False
    if name == "vocab_parallel_entropy_with_chunking" and len(shape) < 3:
        return False
    return labels_what in (None, "in range", "in range int32")


def _required(name, dtype, shape, labels_what):
    """The inputs rl-kernels must keep serving (verl's callers' 2-D / 3-D logits)."""
    return _in_domain(name, dtype, shape, labels_what) and len(shape) in (2, 3)


def _run(fn, args):
    try:
        return fn(*[a.clone() for a in args])  # verl's Megatron cross-entropy writes into its logits
    except Exception as exc:  # noqa: BLE001 (any exception type: the contract is "raises too")
        return exc


def probe(module, names):
    """The mismatches (list of str) of every case of every function in ``names``."""
    import importlib

    problems, served = [], 0
    for name in names:
        ours = getattr(importlib.import_module(module), name)
        own = patch_state.verl_original(module, name)
        assert ours is not own, f"{name} is not patched"
        for (dtype, shape, what), args in _cases(name):
            case = f"{name}({dtype}, {shape}, labels {what})"
            ref = _run(own, args)
            before = rkv.call_counts()["verl_fallback_calls"]
            out = _run(ours, args)
            routed = rkv.call_counts()["verl_fallback_calls"] == before + 1
            domain = _in_domain(name, dtype, shape, what)
            if _required(name, dtype, shape, what) and routed:
                problems.append(f"{case}: sent to verl's own function, inside rl-kernels' domain")
            served += _required(name, dtype, shape, what) and not routed
            if isinstance(ref, Exception):
                if not isinstance(out, Exception):
                    problems.append(f"{case}: verl's raises {type(ref).__name__}, rl-kernels' returns")
                continue
            if isinstance(out, Exception):
                problems.append(f"{case}: verl's returns {ref.dtype} {tuple(ref.shape)}, rl-kernels' raises "
                                f"{type(out).__name__}: {out}")
                continue
            if out.shape != ref.shape:
                problems.append(f"{case}: shape {tuple(out.shape)}, verl's {tuple(ref.shape)}")
                continue
            if routed:
                if out.dtype != ref.dtype or not torch.equal(out, ref) and not (
                        torch.isnan(out).equal(torch.isnan(ref)) and torch.equal(out.nan_to_num(), ref.nan_to_num())):
                    problems.append(f"{case}: routed to verl's own function, yet not its result")
                continue
            if not domain:
                problems.append(f"{case}: served by rl-kernels outside the kernels' domain")
                continue
            if out.dtype != ref.dtype and not (ref.dtype == dtype and out.dtype == torch.float32):
                problems.append(f"{case}: dtype {out.dtype}, verl's {ref.dtype}")
                continue
            expected = _run(own, (args[0].double(),) + args[1:])  # verl's function in float64: the reference
            try:
                assert_close_f32(out, expected, depth=4 * shape[-1] + 16, logits=logits_magnitude(args[0]),
                                 msg=case)
            except AssertionError as exc:
                problems.append(str(exc))
    return problems, served


def test_fsdp_from_logits_functions_match_verls(caplog):
    problems, served = probe(TORCH_FUNCTIONAL, FSDP_NAMES)
    assert not problems, "\n".join(problems)
    assert served >= 4 * 3 * 3, served  # every function keeps its domain (3 dtypes x shapes x labels)


def _megatron_rank(rank, init_file):
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        problems, served = probe(rk_megatron.TENSOR_PARALLEL_MODULE, MEGATRON_NAMES)
        assert not problems, "\n".join(problems)
        assert served >= 4 * 3, served
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_megatron_from_logits_functions_match_verls_at_tp1(tmp_path):
    import torch.multiprocessing as mp

    for part in ("Megatron logits path", "sum_pi_squared (Megatron)"):
        replaced, what = rkv.report()[part]
        if not replaced:
            pytest.skip(f"{part}: {what}")
    mp.spawn(_megatron_rank, args=(str(tmp_path / "init"),), nprocs=1, join=True)
