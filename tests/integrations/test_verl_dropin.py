"""The drop-in contract of the replaced verl functions (issue 44): what verl's own function takes,
the replacement takes. Logits outside rl-kernels' kernels (float64, meta) run verl's own function
(``patch_state.verl_fallback``; on the FSDP fused path, float64 hidden states with a plain head) and give
exactly its result (same function, same bits: compared with ``torch.equal``); one WARNING per
function and reason, however many calls; float32 inputs still go to rl-kernels. verl's functions
are captured unpatched; inputs are fresh random tensors.

Marked ``verl_matrix``: every tested release has the four from-logits functions; the
distillation loss only where verl has it (0.8.0 on), the Megatron engine where rl-kernels
serves it (one gloo rank with Megatron's tensor-parallel state, spawned).
"""
import importlib
import importlib.util
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch

import rl_kernels.core._logging as rk_logging
import rl_kernels.integrations.verl as rkv
from rl_kernels.integrations.verl_impl import distill_losses
from rl_kernels.integrations.verl_impl import megatron as rk_megatron
from verl_helpers import verl_unpatched

pytestmark = pytest.mark.verl_matrix

TORCH_FUNCTIONAL = "verl.utils.torch_functional"
SERVED = {"logprobs_from_logits": "logits_log_probs_calls", "entropy_from_logits": "logits_entropy_calls",
          "entropy_from_logits_with_chunking": "logits_entropy_calls",
          "calculate_sum_pi_squared_from_logits": "sum_pi_squared_calls"}
"""verl's from-logits function -> the call counter rl-kernels bumps when it serves it."""


@pytest.fixture
def fresh_log_once(monkeypatch):
    """log_once with nothing logged yet (the WARNING is checked whatever ran before)."""
    monkeypatch.setattr(rk_logging, "_seen", set())


def _verl_functions(names, module=TORCH_FUNCTIONAL):
    """(verl's own, the patched) function per name."""
    tf = importlib.import_module(module)
    with verl_unpatched():
        own = {name: getattr(tf, name) for name in names}
    assert rkv.is_patched()
    return own, {name: getattr(tf, name) for name in names}


def _call(fn, name, logits, labels):
    return fn(logits, labels) if name == "logprobs_from_logits" else fn(logits)


def _fallback_lines(caplog, name, why):
    return [m for m in caplog.messages if f".{name} got {why}, outside rl-kernels' kernels: verl's own" in m]


@pytest.mark.parametrize("name", sorted(SERVED))
def test_float64_logits_run_verls_own_function(name, fresh_log_once, caplog):
    own, patched = _verl_functions([name])
    assert patched[name] is not own[name]
    g = torch.Generator().manual_seed(44)
    logits = 4 * torch.randn(6, 37, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 37, (6,), generator=g)
    ref = _call(own[name], name, logits, labels)
    counts = rkv.call_counts()
    with caplog.at_level("WARNING", logger="rl_kernels"):
        got = [_call(patched[name], name, logits, labels) for _ in range(2)]
    for out in got:  # verl's dtype (float64; float32 for the chunked entropy) and its exact values
        assert out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out, ref)
    assert len(_fallback_lines(caplog, name, "torch.float64 logits")) == 1, caplog.messages
    after = rkv.call_counts()
    assert after["verl_fallback_calls"] == counts["verl_fallback_calls"] + 2
    assert after[SERVED[name]] == counts[SERVED[name]]
    # float32 logits: rl-kernels (counted), within float32 rounding of verl's float64 result
    out32 = _call(patched[name], name, logits.float(), labels)
    assert rkv.call_counts()[SERVED[name]] == counts[SERVED[name]] + 1
    assert rkv.call_counts()["verl_fallback_calls"] == after["verl_fallback_calls"]
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref.double(), atol=2e-5, rtol=2e-5)


def test_meta_logits_get_verls_shapes(fresh_log_once, caplog):
    own, patched = _verl_functions(sorted(SERVED))
    logits = torch.empty(2, 3, 29, device="meta")
    labels = torch.empty(2, 3, dtype=torch.long, device="meta")
    with caplog.at_level("WARNING", logger="rl_kernels"):
        for name in ("logprobs_from_logits", "entropy_from_logits", "calculate_sum_pi_squared_from_logits"):
            ref, out = _call(own[name], name, logits, labels), _call(patched[name], name, logits, labels)
            assert (out.device.type, out.shape, out.dtype) == (ref.device.type, ref.shape, ref.dtype), name
            assert len(_fallback_lines(caplog, name, "meta-device logits")) == 1, caplog.messages


def test_expanded_logits_get_verls_values_and_gradient():
    """logprobs_from_logits' default inplace_backward=True on logits whose elements share memory
    (expanded): no in-place gradient (rl-kernels' own function refuses one), verl's values and
    gradient (float32 rounding: 1e-6)."""
    own, patched = _verl_functions(["logprobs_from_logits"])
    g = torch.Generator().manual_seed(9)
    base, labels = 3 * torch.randn(1, 31, generator=g), torch.randint(0, 31, (4,), generator=g)
    weights = torch.randn(4, generator=g)
    results = []
    for fn in (own, patched):
        x = base.clone().requires_grad_()
        out = fn["logprobs_from_logits"](x.expand(4, 31), labels)
        (out * weights).sum().backward()
        results.append((out.detach(), x.grad))
    for got, ref in zip(results[1], results[0]):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_chunk_size_takes_what_verls_range_takes():
    np = pytest.importorskip("numpy")
    own, patched = _verl_functions(["entropy_from_logits_with_chunking"])
    fn = patched["entropy_from_logits_with_chunking"]
    logits = 3 * torch.randn(5, 41, generator=torch.Generator().manual_seed(7))
    ref = own["entropy_from_logits_with_chunking"](logits, chunk_size=np.int64(2))
    torch.testing.assert_close(fn(logits, chunk_size=np.int64(2)), ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(TypeError, match="chunk_size"):
        fn(logits, chunk_size=2.5)
    with pytest.raises(ValueError, match="chunk_size"):  # verl's returns zeros for a negative one
        fn(logits, chunk_size=-1)


@pytest.mark.skipif(importlib.util.find_spec("verl.trainer.distillation") is None,
                    reason="this verl has no verl.trainer.distillation (verl 0.7.x)")
def test_float64_student_logits_run_verls_distillation_loss(fresh_log_once, caplog):
    own, patched = _verl_functions([distill_losses.FUNCTION], distill_losses.FSDP_MODULE)
    own, patched = own[distill_losses.FUNCTION], patched[distill_losses.FUNCTION]
    assert patched is not own
    g = torch.Generator().manual_seed(4)
    student = 3 * torch.randn(1, 9, 23, generator=g, dtype=torch.float64)
    t_lp, t_ids = torch.log_softmax(student[0] + torch.randn(9, 23, generator=g, dtype=torch.float64), -1).topk(3)
    t_lp, t_ids = (torch.nested.as_nested_tensor(list(t.split([5, 4])), layout=torch.jagged) for t in (t_lp, t_ids))
    config = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=None))
    ref = own(student, t_lp, t_ids, config, "thd")
    with caplog.at_level("WARNING", logger="rl_kernels"):
        got = patched(student, t_lp, t_ids, config, "thd")
    assert sorted(got) == sorted(ref)
    for key, value in ref.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert len(_fallback_lines(caplog, distill_losses.FUNCTION, "torch.float64 logits")) == 1, caplog.messages


def _megatron_float64_rank(rank, init_file):
    """One gloo rank: verl's Megatron from-logits functions, patched, on float64 logits give what
    verl's own give (verl's log-probs and chunked entropy are float32 there, its others float64)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    names = rk_megatron.LOGITS_FUNCTIONS + (rk_megatron.SUM_PI_SQUARED_FUNCTION,)
    own, patched = _verl_functions(names, rk_megatron.TENSOR_PARALLEL_MODULE)
    assert all(patched[name] is not own[name] for name in names)
    g = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(1, 6, 19, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 19, (1, 6), generator=g)
    before = rkv.call_counts()["verl_fallback_calls"]
    for name in names:  # verl's cross-entropy writes into its logits: a fresh copy for each call
        args = (labels,) if name == "vocab_parallel_log_probs_from_logits" else ()
        ref, out = own[name](logits.clone(), *args), patched[name](logits.clone(), *args)
        assert out.dtype == ref.dtype and torch.equal(out, ref), name
    assert rkv.call_counts()["verl_fallback_calls"] == before + len(names)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_float64_logits_run_verls_megatron_functions(tmp_path):
    import torch.multiprocessing as mp

    for part in ("Megatron logits path", "sum_pi_squared (Megatron)"):
        replaced, what = rkv.report()[part]
        if not replaced:  # no megatron-core, or a verl whose Megatron engine rl-kernels does not serve
            pytest.skip(f"{part}: {what}")

    mp.spawn(_megatron_float64_rank, args=(str(tmp_path / "init"),), nprocs=1, join=True)


def test_float64_hidden_states_run_verls_fused_forward(fresh_log_once, caplog):
    """verl's FusedLinearForPPO as rl-kernels serves it (inside a served model's forward, built bare
    as every release's fused forward may build it) on float64 hidden states: verl's own
    torch-backend forward, same bits and dtypes (log-probs float32, entropy float64 in verl's);
    float32 ones go to rl-kernels (1e-5 of verl's float64 result); a soft-capped head keeps
    rl-kernels' TypeError (verl's forward would skip the cap)."""
    import verl.utils.experimental.torch_functional as etf

    from rl_kernels.integrations.lm_heads import HeadTransform
    from rl_kernels.integrations.verl_impl import fsdp_fused
    with verl_unpatched():
        verls = etf.FusedLinearForPPO()
    ours = etf.FusedLinearForPPO()
    assert type(ours) is not type(verls)
    g = torch.Generator().manual_seed(12)
    hidden = torch.randn(2, 5, 16, generator=g, dtype=torch.float64)
    weight = 0.5 * torch.randn(37, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 37, (2, 5), generator=g)
    ref = verls(hidden, weight, labels, 0.7)
    serving = fsdp_fused._serving.set(True)
    try:
        with caplog.at_level("WARNING", logger="rl_kernels"):
            got = [ours(hidden, weight, labels, 0.7) for _ in range(2)]
        for out in got:
            for o, r in zip(out, ref):
                assert o.dtype == r.dtype and torch.equal(o, r)
        assert len(_fallback_lines(caplog, "forward", "torch.float64 hidden_states")) == 1, caplog.messages
        before = rkv.call_counts()["fused_fsdp_calls"]
        out32 = ours(hidden.float(), weight.float(), labels, 0.7)
        assert rkv.call_counts()["fused_fsdp_calls"] == before + 1
        for o, r in zip(out32, ref):
            torch.testing.assert_close(o.double(), r.double(), atol=1e-5, rtol=1e-5)
        head = fsdp_fused._head.set(HeadTransform(softcap=30.0, description="soft-capped"))
        try:
            with pytest.raises(TypeError, match="hidden_states: expected bfloat16, float16 or float32"):
                ours(hidden, weight, labels, 0.7)
        finally:
            fsdp_fused._head.reset(head)
    finally:
        fsdp_fused._serving.reset(serving)
