"""rl_kernels.integrations.verl_impl.distill_losses: verl's top-K distillation loss (``compute_forward_kl_topk``
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
from rl_kernels.integrations.verl_impl import distill_losses, patch_state
from rl_kernels.integrations.verl_impl.schema import VerlIntegrationError
from verl_helpers import _loss_data, verl_unpatched

pytestmark = pytest.mark.verl_matrix


def _has_distillation() -> bool:
    try:
        return importlib.util.find_spec(distill_losses.FSDP_MODULE) is not None
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
        fsdp = importlib.import_module(distill_losses.FSDP_MODULE)
        original = fsdp.compute_forward_kl_topk
        assert not hasattr(original, "_rl_kernels_original")
        report = distill_losses.patch_distillation()
        try:
            yield fsdp, original, report
        finally:
            patch_state.restore()
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
    replaced, what = report[distill_losses.FSDP_PART]
    assert replaced and "topk_log_probs_from_logits" in what, report
    replaced, what = report[distill_losses.MEGATRON_PART]
    assert replaced and "over the TP group" in what, what
    ours = fsdp.compute_forward_kl_topk
    assert ours._rl_kernels_original is original
    assert patch_state.signature(ours) == distill_losses.PARAMETERS
    assert distill_losses.patch_distillation() == report and fsdp.compute_forward_kl_topk is ours  # idempotent
    # teacher tensors that are not nested: verl's own function runs (and asserts, as verl does)
    student, t_lp, t_ids, _ = _inputs(seed=3)
    before = rkv.call_counts()["distillation_calls"]
    with pytest.raises(AssertionError):
        ours(student, t_lp.values()[None], t_ids.values()[None], _config(None), "thd")
    assert rkv.call_counts()["distillation_calls"] == before


@needs_distillation
def test_changed_signature_raises_and_patches_nothing(monkeypatch):
    with verl_unpatched(), monkeypatch.context() as patcher:  # (undone before verl is patched again)
        fsdp = importlib.import_module(distill_losses.FSDP_MODULE)

        def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config):
            raise AssertionError("not called")

        patcher.setattr(fsdp, "compute_forward_kl_topk", compute_forward_kl_topk)
        with pytest.raises(VerlIntegrationError, match=r"changed verl\.trainer\.distillation\.fsdp\.losses\."
                                                        r"compute_forward_kl_topk: expected parameters"):
            distill_losses.patch_distillation()
        assert fsdp.compute_forward_kl_topk is compute_forward_kl_topk
        assert not patch_state._undo


def test_verl_without_distillation_reports_not_in_this_verl(monkeypatch):
    """verl 0.7.x (simulated here on any verl: the modules made unimportable)."""
    monkeypatch.setitem(sys.modules, distill_losses.FSDP_MODULE, None)
    monkeypatch.setitem(sys.modules, distill_losses.MEGATRON_MODULE, None)
    report = distill_losses.patch_distillation()
    assert report == {distill_losses.FSDP_PART: (False, distill_losses.NOT_IN_THIS_VERL),
                      distill_losses.MEGATRON_PART: (False, distill_losses.NOT_IN_THIS_VERL)}
    assert report[distill_losses.FSDP_PART][1].startswith("not in this verl")


@needs_distillation
def test_megatron_distillation_is_replaced_and_leaves_float64_to_verl(monkeypatch):
    """verl's Megatron top-K loss is replaced (its values are checked on 2 gloo ranks in
    tests/integrations/megatron_worker.py); float64 logits go to verl's own function, and restore() puts it back."""
    pytest.importorskip("megatron.core")
    megatron_losses = importlib.import_module(distill_losses.MEGATRON_MODULE)
    calls = []

    def compute_forward_kl_topk(student_logits, teacher_topk_log_probs, teacher_topk_ids, config, data_format):
        calls.append(student_logits.dtype)  # stands for verl's (which needs a TP group)
        return {"distillation_losses": "verl's"}

    with verl_unpatched(), monkeypatch.context() as patcher:
        patcher.setattr(megatron_losses, "compute_forward_kl_topk", compute_forward_kl_topk)
        report = distill_losses.patch_distillation()
        try:
            assert report[distill_losses.MEGATRON_PART][0], report
            ours = megatron_losses.compute_forward_kl_topk
            assert ours._rl_kernels_original is compute_forward_kl_topk
            assert patch_state.signature(ours) == distill_losses.PARAMETERS
            student, t_lp, t_ids, _ = _inputs(seed=4)
            assert ours(student.double(), t_lp, t_ids, _config(None), "thd") == {"distillation_losses": "verl's"}
            assert calls == [torch.float64]
        finally:
            patch_state.restore()
        assert megatron_losses.compute_forward_kl_topk is compute_forward_kl_topk


# ----------------------------------------------------------------------------- forward_kl_topk_tail (issue 45)
def _tail_config(clamp=None):
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    return DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode="forward_kl_topk_tail", topk=K, log_prob_min_clamp=clamp, use_policy_gradient=False))


def _tail_reference(student, t_lp, t_ids, weights):
    """float64: the (K+1)-category forward KL per token, its tail term, the student's tail mass, and
    d(sum weights * KL) / d student logits."""
    z = student.double().requires_grad_()
    log_p = z.log_softmax(-1)
    ids = t_ids.values()[None]
    log_q = log_p.gather(-1, ids)
    inside = torch.zeros(z.shape, dtype=torch.bool).scatter(-1, ids, True)
    log_q_tail = log_p.masked_fill(inside, float("-inf")).logsumexp(-1)
    lp = t_lp.values()[None].double()
    p = lp.exp()
    p_tail = (1 - p.sum(-1)).clamp_min(0)
    tail = torch.where(p_tail > 0, p_tail * (p_tail.log() - log_q_tail), torch.zeros(()).double())
    slots = (p * (lp - log_q)).sum(-1)
    kl = slots + tail
    (kl * weights).sum().backward()
    return {"distillation_losses": kl.detach(), "tail_loss": tail.detach(),
            "student_tail_mass": log_q_tail.exp().detach(), "student_mass": log_q.exp().sum(-1).detach(),
            "teacher_mass": p.sum(-1)}, z.grad, slots.detach()


@needs_distillation
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tail_mode_matches_float64(patched, backend):
    """loss_mode=forward_kl_topk_tail through rl-kernels' FSDP replacement: every tail output and the
    logits' gradient of a random weighting of the losses against float64 within 1e-5; the overlap
    metrics as in forward_kl_topk (no clamp). Tokens whose truncated top-K sum is negative (verl's
    forward_kl_topk clamps them to 0) keep a positive loss and a gradient."""
    fsdp, original, _ = patched
    previous = _backend(backend)
    try:
        student, t_lp, t_ids, weights = _inputs(seed=5)
        # every other token: the teacher's top K less likely than the student's there (P < Q: the truncated
        # sum is negative, a tail that matters)
        values = t_lp.values().clone()
        values[::2] = torch.log_softmax(student[0, ::2], -1).gather(-1, t_ids.values()[::2]) - 0.7
        t_lp = torch.nested.nested_tensor_from_jagged(values, offsets=t_lp.offsets())
        before = rkv.call_counts()["distillation_calls"]
        got, grad = _run(fsdp.compute_forward_kl_topk, student, t_lp, t_ids, _tail_config(), weights)
        assert rkv.call_counts()["distillation_calls"] == before + 1
    finally:
        rkv.configure(backend=previous)
    want, want_grad, slots = _tail_reference(student, t_lp, t_ids, weights)
    for key, value in want.items():
        assert got[key].dtype == torch.float32 and got[key].shape == value.shape, key
        torch.testing.assert_close(got[key].double(), value, **TOL, msg=key)
    torch.testing.assert_close(grad.double(), want_grad, **TOL)
    assert float(want["distillation_losses"].min()) >= 0 and bool((slots < 0).any())  # the clamp at 0 would act
    assert float(want["tail_loss"].abs().max()) > 1e-2
    ref, _ = _run(original, student, t_lp, t_ids, _config(None), weights)  # verl's overlap definitions
    assert torch.equal(got["overlap_count"], ref["overlap_count"])
    torch.testing.assert_close(got["overlap_token_advantage"], ref["overlap_token_advantage"].float(), **TOL)


@needs_distillation
def test_tail_mode_refuses_a_clamp_and_inputs_outside_the_kernels(patched):
    fsdp, _, _ = patched
    student, t_lp, t_ids, _ = _inputs(seed=6)
    with pytest.raises(ValueError, match=r"log_prob_min_clamp: loss_mode=forward_kl_topk_tail takes no"):
        fsdp.compute_forward_kl_topk(student, t_lp, t_ids, _tail_config(-10.0), "thd")
    with pytest.raises(VerlIntegrationError, match=r"forward_kl_topk_tail got torch.float64 logits"):
        fsdp.compute_forward_kl_topk(student.double(), t_lp, t_ids, _tail_config(), "thd")
    with pytest.raises(VerlIntegrationError, match="do not match the student logits"):
        fsdp.compute_forward_kl_topk(student[:, :-1], t_lp, t_ids, _tail_config(), "thd")


def _nested(values, lengths):
    return torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, *lengths]).cumsum(0))


@needs_distillation
def test_registered_tail_loss_is_not_clamped_and_raises_on_verls_own_terms(patched):
    """verl's registry holds rl-kernels' forward_kl_topk_tail (use_topk=True, so verl's config
    validates it and its trainer asks for the teacher's top K); verl's compute_topk_loss dispatches
    the logits processor to rl-kernels' replacement; the registered loss returns the per-token
    losses unclamped (equal to the unpadded logits-processor output, with its gradient) and verl's
    forward_kl_topk metrics plus the tail ones; on verl's own terms (no tail_loss) it raises."""
    from verl.trainer.distillation import losses

    from rl_kernels.integrations.verl_impl import modes as verl_modes

    assert losses.get_distillation_loss_fn(verl_modes.TAIL_MODE) is verl_modes.forward_kl_topk_tail
    assert losses.get_distillation_loss_settings(verl_modes.TAIL_MODE).use_topk
    assert verl_modes.registered_here() and verl_modes.register() == "registered by rl-kernels"
    fsdp, original, _ = patched
    student, t_lp, t_ids, weights = _inputs(seed=7)
    config = _tail_config()
    leaf = student.clone().requires_grad_()
    data = {"teacher_logprobs": t_lp, "teacher_ids": t_ids}
    out = losses.compute_topk_loss(SimpleNamespace(strategy="fsdp"), config, data, leaf, "thd")
    model_output = {k: _nested(v[0], LENGTHS) for k, v in out.items()}
    batch = _loss_data(LENGTHS)
    got, metrics = verl_modes.forward_kl_topk_tail(SimpleNamespace(), config, model_output, batch)
    mask = batch["response_mask"]
    per_token = out["distillation_losses"][0].split(list(LENGTHS))
    for i, n in enumerate(LENGTHS):  # the response tokens' positions (verl shifts by one: all but the last), unclamped
        torch.testing.assert_close(got[i, :n - 1], per_token[i][:-1], atol=0, rtol=0)
    assert not bool(got[~mask].any())
    (got[mask] * weights[0, :int(mask.sum())]).sum().backward()
    assert leaf.grad is not None and float(leaf.grad.abs().max()) > 0
    tail = torch.cat([t[:-1] for t in out["tail_loss"][0].split(list(LENGTHS))])
    assert metrics["distillation/tail_loss"] == pytest.approx(float(tail.mean()), rel=1e-5)
    assert metrics["distillation/topk_loss"] == pytest.approx(float((got[mask].detach() - tail).mean()), rel=1e-4)
    assert {"distillation/student_mass", "distillation/teacher_mass", "distillation/overlap_ratio",
            "distillation/student_tail_mass", "distillation/teacher_tail_mass"} <= set(metrics)
    # verl's own top-K computation (rl-kernels' replacement not in the way): its outputs have no tail terms
    theirs = original(student, t_lp, t_ids, _config(None), "thd")
    with pytest.raises(VerlIntegrationError, match=r"no tail_loss, student_tail_mass: this micro-batch went through "
                                                   r"verl's own top-K computation"):
        verl_modes.forward_kl_topk_tail(SimpleNamespace(), config, {k: _nested(v[0], LENGTHS) for k, v in
                                                                    theirs.items()}, batch)


@needs_distillation
def test_the_plugin_registers_at_verls_import_of_its_losses_and_patches_nothing(tmp_path):
    """In a fresh process, as verl's ``verl.plugins`` entry point loads it: importing the plugin
    imports no verl module and patches nothing; verl's config then validates the tail mode (the hook
    registers it when verl imports its losses; without it verl raises "Unsupported loss mode")."""
    import subprocess

    code = (
        "import sys\n"
        "import rl_kernels.integrations.verl_plugin\n"
        "assert not [m for m in sys.modules if m == 'verl' or m.startswith('verl.')], 'verl imported'\n"
        "from verl.workers.config import DistillationLossConfig\n"
        "c = DistillationLossConfig(loss_mode='forward_kl_topk_tail', log_prob_min_clamp=None)\n"
        "assert c.loss_settings.use_topk\n"
        "assert 'rl_kernels.integrations.verl' not in sys.modules, 'the patch was imported'\n"
        "import verl.utils.torch_functional as F\n"
        "assert F.logprobs_from_logits.__module__ == 'verl.utils.torch_functional'\n"
        "print('ok', rl_kernels.integrations.verl_impl.modes.status())\n")
    env = {**__import__("os").environ, "VERL_USE_EXTERNAL_PLUGINS": "none"}  # the installed entry point (if any) off
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "ok registered by rl-kernels" in done.stdout, done.stderr[-2000:]


@needs_distillation
def test_the_report_says_where_the_tail_mode_is_served(monkeypatch):
    """The report's forward_kl_topk_tail part: served on the paths whose distillation part is served
    (and the rest named), where verl's registry holds rl-kernels' mode; not served, saying why, where
    verl registers its own."""
    from verl.trainer.distillation import losses

    from rl_kernels.integrations.verl_impl import modes as verl_modes

    parts = {distill_losses.FSDP_PART: (True, ""), distill_losses.FUSED_PART: (True, ""),
             distill_losses.MEGATRON_PART: (True, ""), distill_losses.MEGATRON_FUSED_PART: (False, "not served")}
    served, what = distill_losses.tail_entry(parts)
    if distill_losses._engine_lays_out_extra():
        assert served and what.startswith("served on the FSDP / VeOmni logits path, FSDP fused path (impl_backend="
                                          "rl_kernels), Megatron logits path"), what
        assert "NOT on the Megatron fused path" in what, what
    else:  # verl 0.8.0: its FSDP engine cannot lay out the tail outputs of a fused forward
        assert served and what.startswith("served on the FSDP / VeOmni logits path, Megatron logits path"), what
        assert "NOT on the FSDP fused path (impl_backend=rl_kernels), Megatron fused path" in what, what
    assert "registered by rl-kernels" in what, what
    assert rkv.report()[distill_losses.TAIL_PART][1].startswith("served on the"), rkv.report()[distill_losses.TAIL_PART]
    monkeypatch.setitem(losses.DISTILLATION_LOSS_REGISTRY, verl_modes.TAIL_MODE, lambda **kwargs: None)  # verl's own
    served, what = distill_losses.tail_entry(parts)
    assert not served and "verl's own" in what, what


@needs_distillation
def test_tail_mode_under_ulysses_padding(patched, monkeypatch):
    """Sequence parallelism with verl's zero padding (19 tokens over 2 ranks: rank 1's slice ends with
    one padding row of K zero ids, which the library's tail could not take): the padding row gets
    distinct ids, the token rows equal float64 (values and gradient)."""
    fsdp, _, _ = patched
    lengths = (6, 5, 8)
    student, t_lp, t_ids, weights = _inputs(seed=8, lengths=lengths)

    def slice_input(x, dim):  # rank 1 of 2, zero-padded as verl's slice_input_tensor pads
        pad = torch.zeros(*x.shape[:dim], 1, *x.shape[dim + 1:], dtype=x.dtype)
        x = torch.cat([x, pad], dim)
        return x.narrow(dim, x.shape[dim] // 2, x.shape[dim] // 2).contiguous()

    monkeypatch.setattr(fsdp, "get_ulysses_sequence_parallel_world_size", lambda: 2)
    monkeypatch.setattr(fsdp, "slice_input_tensor", slice_input)
    mine = slice_input(student, 1)  # (1, 10, V): 9 tokens and the padding row
    w = slice_input(weights, 1)
    got, grad = _run(fsdp.compute_forward_kl_topk, mine, t_lp, t_ids, _tail_config(), w * (torch.arange(10) < 9))
    lp = torch.nested.nested_tensor_from_jagged(t_lp.values()[10:], offsets=torch.tensor([0, 9]))
    ids = torch.nested.nested_tensor_from_jagged(t_ids.values()[10:], offsets=torch.tensor([0, 9]))
    want, want_grad, _ = _tail_reference(mine[:, :9], lp, ids, w[:, :9])
    for key, value in want.items():
        torch.testing.assert_close(got[key][:, :9].double(), value, **TOL, msg=key)
        assert bool(got[key][:, 9].isfinite().all()), key  # the padding row: finite, dropped by verl
    torch.testing.assert_close(grad[:, :9].double(), want_grad, **TOL)
    assert not bool(grad[:, 9].any())
