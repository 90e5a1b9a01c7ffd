"""rl_kernels.integrations.verl.distill: verl's top-K distillation loss (``compute_forward_kl_topk``
of ``verl.trainer.distillation.fsdp.losses``, FSDP / VeOmni) with rl-kernels' student log-probs.

Marked ``verl_matrix``: on verl 0.7.x, which has no distillation module, the tests that
need it skip (the report's "not in this verl" entries are checked on every release).

verl's own function, captured before patching, is the reference: CPU float32 logits (1, 20, 203)
of scale ~3, nested (jagged) teacher top-5 log-probs and ids for three sequences of 7, 4 and 9
tokens, as verl's batches hold them. Every output within 1e-5 (overlap_count equal), and the
logits' gradient of a random weighting of distillation_losses within 1e-5: both compute float32
log-softmax values, so only float32 rounding of different summation orders is left.
"""
import importlib
import importlib.util
import sys
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch

import rl_kernels.integrations.verl as rkv
from rl_kernels.integrations.verl import common, distill
from rl_kernels.integrations.verl_schema import VerlIntegrationError
from verl_helpers import verl_unpatched

pytestmark = pytest.mark.verl_matrix


def _has_distillation() -> bool:
    try:
        return importlib.util.find_spec(distill.FSDP_MODULE) is not None
    except ImportError:
        return False


needs_distillation = pytest.mark.skipif(
    not _has_distillation(), reason="this verl has no verl.trainer.distillation (verl 0.7.x): nothing to patch")

LENGTHS, V, K = (7, 4, 9), 203, 5
TOL = dict(atol=1e-5, rtol=0)


@pytest.fixture
def patched():
    """verl as installed plus patch_distillation() alone: (verl's loss module, verl's original
    function, the report); restore() afterwards must leave the original in place."""
    with verl_unpatched():
        fsdp = importlib.import_module(distill.FSDP_MODULE)
        original = fsdp.compute_forward_kl_topk
        assert not hasattr(original, "_rl_kernels_original")
        report = distill.patch_distillation()
        try:
            yield fsdp, original, report
        finally:
            common.restore()
        assert fsdp.compute_forward_kl_topk is original


def _backend(name):
    previous = rkv.options().backend
    rkv.configure(backend=name)
    return previous


def _config(clamp, chunked=False):
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    # use_chunked_topk: verl 0.9 on (0.8.0's loss has only the log_softmax path)
    chunking = {"use_chunked_topk": chunked} if "use_chunked_topk" in DistillationLossConfig.__dataclass_fields__ \
        else {}
    return DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode="forward_kl_topk", topk=K, log_prob_min_clamp=clamp, **chunking,
        use_policy_gradient=False))


def _inputs(seed=0, lengths=LENGTHS):
    """Student logits (1, total, V) and nested teacher (log-probs, ids) per sequence: mostly the
    teacher's own top K of logits correlated with the student's (so the overlap count varies)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    student = 3 * torch.randn(1, total, V, generator=g)
    teacher_logits = student[0] + 3 * torch.randn(total, V, generator=g)
    t_lp, t_ids = torch.log_softmax(teacher_logits, -1).topk(K, dim=-1)
    perm = torch.argsort(torch.rand(total, K, generator=g), dim=-1)  # not in descending order
    t_lp, t_ids = t_lp.gather(1, perm), t_ids.gather(1, perm)
    # every third token: one slot at the student's least likely id, teacher log-prob -12 (both
    # sides below a clamp of -10 there)
    t_ids[::3, 0] = student[0, ::3].argmin(-1)
    t_lp[::3, 0] = -12.0
    nested = [torch.nested.as_nested_tensor(list(t.split(list(lengths))), layout=torch.jagged) for t in (t_lp, t_ids)]
    return student, nested[0], nested[1], torch.randn(1, total, generator=g)


def _run(fn, student, t_lp, t_ids, config, weights):
    x = student.clone().requires_grad_()
    out = fn(student_logits=x, teacher_topk_log_probs=t_lp, teacher_topk_ids=t_ids, config=config,
             data_format="thd")
    (out["distillation_losses"] * weights).sum().backward()
    return {k: v.detach() for k, v in out.items()}, x.grad


def _compare(got, ref):
    assert sorted(got[0]) == sorted(ref[0])
    for key, value in ref[0].items():
        assert got[0][key].shape == value.shape and got[0][key].dtype == value.dtype, key
        if key == "overlap_count":
            assert torch.equal(got[0][key], value)
        else:
            torch.testing.assert_close(got[0][key], value, **TOL, msg=key)
    torch.testing.assert_close(got[1], ref[1], **TOL)


@needs_distillation
@pytest.mark.parametrize("backend,clamp,chunked", [("torch", None, False), ("torch", -10.0, True),
                                                   ("triton", None, True), ("triton", -10.0, False)])
def test_patched_function_reproduces_verl(patched, backend, clamp, chunked):
    fsdp, original, report = patched
    previous = _backend(backend)
    try:
        student, t_lp, t_ids, weights = _inputs()
        config = _config(clamp, chunked)
        ref = _run(original, student, t_lp, t_ids, config, weights)
        before = rkv.call_counts()["distillation_calls"]
        got = _run(fsdp.compute_forward_kl_topk, student, t_lp, t_ids, config, weights)
        assert rkv.call_counts()["distillation_calls"] == before + 1
    finally:
        rkv.configure(backend=previous)
    _compare(got, ref)
    counts = ref[0]["overlap_count"]
    assert counts.min() < counts.max() and counts.max() > 0  # the overlap metrics see several values
    if clamp is not None:  # the clamp is active somewhere (the gradient of those slots is 0)
        lq = torch.log_softmax(student, -1).gather(-1, t_ids.values()[None])
        assert bool((lq < clamp).any()) and bool((t_lp.values() < clamp).any())


@needs_distillation
def test_verl_loss_dispatch_reaches_the_replacement(patched):
    """verl's compute_topk_loss looks the function up as a module attribute for strategy fsdp /
    veomni: the call goes through rl-kernels, with verl's shape checks on the outputs."""
    from verl.trainer.distillation import losses

    fsdp, original, _ = patched
    student, t_lp, t_ids, weights = _inputs(seed=1)
    data = {"teacher_logprobs": t_lp, "teacher_ids": t_ids}
    config = _config(-10.0)
    for strategy in ("fsdp", "veomni"):
        before = rkv.call_counts()["distillation_calls"]
        out = losses.compute_topk_loss(SimpleNamespace(strategy=strategy), config, data, student, "thd")
        assert rkv.call_counts()["distillation_calls"] == before + 1
        ref = original(student, t_lp, t_ids, config, "thd")
        torch.testing.assert_close(out["distillation_losses"], ref["distillation_losses"], **TOL)


@needs_distillation
def test_ulysses_slicing_goes_through_verls_helpers(patched, monkeypatch):
    """Sequence parallelism: the teacher tensors are sliced with the helpers of verl's loss module
    (here a stand-in for rank 0 of 2: the first half of the packed tokens), as verl slices them."""
    fsdp, original, _ = patched
    monkeypatch.setattr(fsdp, "get_ulysses_sequence_parallel_world_size", lambda: 2)
    monkeypatch.setattr(fsdp, "slice_input_tensor", lambda x, dim: x[:, : x.shape[1] // 2].contiguous())
    student, t_lp, t_ids, weights = _inputs(seed=2, lengths=(6, 5, 9))
    half = sum((6, 5, 9)) // 2
    student, weights = student[:, :half].contiguous(), weights[:, :half]
    config = _config(None)
    _compare(_run(fsdp.compute_forward_kl_topk, student, t_lp, t_ids, config, weights),
             _run(original, student, t_lp, t_ids, config, weights))


@needs_distillation
def test_report_idempotence_restore_and_inputs_left_to_verl(patched):
    fsdp, original, report = patched
    replaced, what = report[distill.FSDP_PART]
    assert replaced and "topk_log_probs_from_logits" in what, report
    replaced, why = report[distill.MEGATRON_PART]
    assert not replaced and why.startswith("not replaced: ") and "vocab-parallel" in why, why
    ours = fsdp.compute_forward_kl_topk
    assert ours._rl_kernels_original is original
    assert common.signature(ours) == distill.PARAMETERS
    assert distill.patch_distillation() == report and fsdp.compute_forward_kl_topk is ours  # idempotent
    # teacher tensors that are not nested: verl's own function runs (and asserts, as verl does)
    student, t_lp, t_ids, _ = _inputs(seed=3)
    before = rkv.call_counts()["distillation_calls"]
    with pytest.raises(AssertionError):
        ours(student, t_lp.values()[None], t_ids.values()[None], _config(None), "thd")
    assert rkv.call_counts()["distillation_calls"] == before


@needs_distillation
def test_changed_signature_raises_and_patches_nothing(monkeypatch):
    with verl_unpatched(), monkeypatch.context() as patcher:  # (undone before verl is patched again)
        fsdp = importlib.import_module(distill.FSDP_MODULE)

        def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config):
            raise AssertionError("not called")

        patcher.setattr(fsdp, "compute_forward_kl_topk", compute_forward_kl_topk)
        with pytest.raises(VerlIntegrationError, match=r"changed verl\.trainer\.distillation\.fsdp\.losses\."
                                                        r"compute_forward_kl_topk: expected parameters"):
            distill.patch_distillation()
        assert fsdp.compute_forward_kl_topk is compute_forward_kl_topk
        assert not common._undo


def test_verl_without_distillation_reports_not_in_this_verl(monkeypatch):
    """verl 0.7.x (simulated here on any verl: the modules made unimportable)."""
    monkeypatch.setitem(sys.modules, distill.FSDP_MODULE, None)
    monkeypatch.setitem(sys.modules, distill.MEGATRON_MODULE, None)
    report = distill.patch_distillation()
    assert report == {distill.FSDP_PART: (False, distill.NOT_IN_THIS_VERL),
                      distill.MEGATRON_PART: (False, distill.NOT_IN_THIS_VERL)}
    assert report[distill.FSDP_PART][1].startswith("not in this verl")


@needs_distillation
def test_megatron_distillation_stays_verls_and_says_so_at_its_first_call(monkeypatch, caplog):
    """verl's Megatron top-K loss is not replaced: where it imports, a wrapper logs one WARNING at
    its first call and runs verl's function with the same arguments and result."""
    pytest.importorskip("megatron.core")
    megatron_losses = importlib.import_module(distill.MEGATRON_MODULE)
    calls = []

    def compute_forward_kl_topk(*args, **kwargs):  # stands for verl's (which needs a TP group)
        calls.append((args, kwargs))
        return {"distillation_losses": "verl's"}

    with verl_unpatched(), monkeypatch.context() as patcher:
        patcher.setattr(megatron_losses, "compute_forward_kl_topk", compute_forward_kl_topk)
        report = distill.patch_distillation()
        try:
            assert not report[distill.MEGATRON_PART][0]
            assert "a WARNING at its first call" in report[distill.MEGATRON_PART][1]
            wrapped = megatron_losses.compute_forward_kl_topk
            assert wrapped is not compute_forward_kl_topk and wrapped._rl_kernels_original is compute_forward_kl_topk
            with caplog.at_level("WARNING", logger="rl_kernels"):
                assert wrapped(1, 2, config=3) == {"distillation_losses": "verl's"}
                wrapped(4, 5, config=6)
            assert calls == [((1, 2), {"config": 3}), ((4, 5), {"config": 6})]
            said = [m for m in caplog.messages if "Megatron top-K distillation loss is not served" in m]
            assert len(said) <= 1  # once per process (an earlier test may have logged it)
        finally:
            common.restore()
        assert megatron_losses.compute_forward_kl_topk is compute_forward_kl_topk
