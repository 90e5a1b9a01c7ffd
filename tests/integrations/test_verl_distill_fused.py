"""Top-K distillation on verl's FSDP fused path (issue 44): the model's fused forward fills
``fused_linear_aux`` (distillation_losses, student_mass, teacher_mass) that verl's FSDP engine reads.

The reference is verl's own logits path through the same engine methods: verl's
``FSDPEngineWithLMHead.forward_step`` (its ``prepare_model_inputs`` / ``prepare_model_outputs``,
the engine object built bare, on CPU) with ``use_fused_kernels=False``, the model's HF forward and
verl's unpatched ``compute_forward_kl_topk`` (via verl's ``compute_topk_loss``, strategy fsdp).
The fused run is the same forward_step with ``use_fused_kernels=True`` on the model patched with
``impl_backend=rl_kernels``. The loss function stands in for verl's ``distillation_ppo_loss``
partial (it carries ``distillation_config`` as verl's does, computes the logits processor's outputs
with verl's ``compute_topk_loss``, and sums random weightings of the model outputs).

Tiny random Qwen2 (float32, V = 1037), two sequences of 7 and 6 tokens, teacher top-6 from the
model's own logits plus noise, one slot per third token at the student's least likely id with
teacher log-prob -12 (below the clamp -10 on both sides), temperature 0.8. Compared: the three
per-token outputs (atol 1e-5), log-probs (atol 1e-5), and the gradients of the loss w.r.t. the
last hidden states and lm_head.weight (float32, atol 1e-5, rtol 1e-4: different summation orders).
"""
import functools
import importlib.util
from types import SimpleNamespace

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch

import rl_kernels.integrations.verl as rkv
from rl_kernels.core import _logging
from rl_kernels.integrations.verl_impl import distill_losses
from rl_kernels.integrations.verl_impl.schema import VerlIntegrationError
from verl_helpers import VOCAB, bare_fsdp_engine, tiny_qwen2, verl_unpatched  # (the qwen2_forward fixture: tests/integrations/conftest.py)

pytestmark = pytest.mark.verl_matrix


def _has(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


needs_fused_distillation = pytest.mark.skipif(
    not (_has(distill_losses.FSDP_MODULE) and rkv.report().get(distill_losses.FUSED_PART, (False,))[0]),
    reason="this verl's FSDP engine reads no fused_linear_aux (or has no distillation)")

LENGTHS, K, T, CLAMP = (7, 6), 6, 0.8, -10.0
TOL = dict(atol=1e-5, rtol=0)
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)


@pytest.fixture
def cpu_engine(monkeypatch):
    """verl's FSDPEngineWithLMHead built bare (its methods as they are, no FSDP, float32, CPU)."""
    import verl.workers.engine.fsdp.transformer_impl as impl

    monkeypatch.setattr(impl, "get_device_id", lambda: "cpu")
    monkeypatch.setattr(impl, "get_device_name", lambda: "cpu")
    return lambda model: bare_fsdp_engine(model, get_data_parallel_group=lambda: None)


def _config(loss_mode="forward_kl_topk", clamp=CLAMP):
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    return DistillationConfig(distillation_loss=DistillationLossConfig(
        loss_mode=loss_mode, topk=K, log_prob_min_clamp=clamp, use_policy_gradient=False))


def _loss(model_output=None, data=None, dp_group=None, student_logits=None, data_format="thd", *, config,
          distillation_config, weights):
    """verl's distillation loss partial, in both of its roles: the logits processor (verl's
    compute_topk_loss) and the final loss (here a random weighting of the outputs)."""
    from verl.trainer.distillation.losses import compute_topk_loss

    if student_logits is not None:
        return compute_topk_loss(config, distillation_config, data, student_logits, data_format)
    loss = (model_output["distillation_losses"].values() * weights[0]).sum()
    if "log_probs" in model_output:
        loss = loss + (model_output["log_probs"].values() * weights[1]).sum()
    return loss, {}


def _micro_batch(input_ids, teacher_lp, teacher_ids, fused, distillation_only):
    from verl.utils import tensordict_utils as tu

    def nested(t):
        return torch.nested.as_nested_tensor(list(t.split(list(LENGTHS))), layout=torch.jagged)

    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    return tu.get_tensordict(
        {"input_ids": nested(input_ids), "position_ids": nested(positions), "teacher_logprobs": nested(teacher_lp),
         "teacher_ids": nested(teacher_ids)},
        {"temperature": T, "use_remove_padding": True, "use_fused_kernels": fused, "calculate_entropy": False,
         "distillation_use_topk": True, "distillation_only": distillation_only})


def _case(seed: int) -> tuple:
    """(model, packed input ids, two per-token loss weights, the teacher's top-K log-probs and ids, the
    student's log-probs at those ids) of one test, drawn from ``seed`` (the model from ``seed - 1``)."""
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    input_ids = torch.randint(0, VOCAB, (total,), generator=g)
    weights = (torch.randn(total, generator=g), torch.randn(total, generator=g))
    model = tiny_qwen2(seed=seed - 1)
    return (model, input_ids, weights, *_teacher(model, input_ids, g))


def _teacher(model, input_ids, g):
    with torch.no_grad():
        logits = model(input_ids=input_ids[None], position_ids=None).logits[0] / T
    t_lp, t_ids = torch.log_softmax(logits + 2 * torch.randn(logits.shape, generator=g), -1).topk(K, dim=-1)
    perm = torch.argsort(torch.rand(t_ids.shape, generator=g), dim=-1)
    t_lp, t_ids = t_lp.gather(1, perm), t_ids.gather(1, perm)
    t_ids[::3, 0] = logits[::3].argmin(-1)
    t_lp[::3, 0] = -12.0
    return t_lp, t_ids, torch.log_softmax(logits, -1).gather(1, t_ids)


def _step(engine, micro_batch, weights, distillation_config=None):
    """verl's forward_step and the backward of its loss -> (model output, d loss / d last hidden
    states, d loss / d lm_head.weight)."""
    model = engine.module
    model.zero_grad(set_to_none=True)
    hidden = []

    def keep(module, args, output):
        output.last_hidden_state.retain_grad()
        hidden.append(output.last_hidden_state)

    handle = model.model.register_forward_hook(keep)
    try:
        loss_function = functools.partial(_loss, config=SimpleNamespace(strategy="fsdp"),
                                          distillation_config=distillation_config or _config(), weights=weights)
        loss, output = engine.forward_step(micro_batch, loss_function=loss_function, forward_only=False)
        loss.backward()
    finally:
        handle.remove()
    return output["model_output"], hidden[0].grad.clone(), model.lm_head.weight.grad.clone()


@needs_fused_distillation
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("distillation_only", [False, True], ids=["with_policy", "distillation_only"])
def test_fused_forward_fills_fused_linear_aux_as_verls_logits_path(qwen2_forward, cpu_engine, backend,
                                                                    distillation_only):
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    model, input_ids, weights, t_lp, t_ids, student_lq = _case(4)
    with verl_unpatched():  # verl's own engine methods and compute_forward_kl_topk
        ref = _step(cpu_engine(model), _micro_batch(input_ids, t_lp, t_ids, False, distillation_only), weights)
    assert not rkv.report() or rkv.is_patched()

    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    previous = rkv.options().backend
    rkv.configure(backend=backend)
    try:
        before = rkv.call_counts()["distillation_calls"]
        got = _step(cpu_engine(model), _micro_batch(input_ids, t_lp, t_ids, True, distillation_only), weights)
        assert rkv.call_counts()["distillation_calls"] == before + 1
    finally:
        rkv.configure(backend=previous)

    keys = ["distillation_losses", "student_mass", "teacher_mass"] + ([] if distillation_only else ["log_probs"])
    # with distillation_only, the log-probs are in the model output exactly where verl's own logits
    # path puts them (verl 0.9.1 and main: not there; 0.8.0: there too)
    assert set(keys) <= set(got[0]) and ("log_probs" in got[0]) == ("log_probs" in ref[0]), (set(got[0]), set(ref[0]))
    for key in keys:
        assert got[0][key].is_nested, key
        torch.testing.assert_close(got[0][key].values(), ref[0][key].values().float(), **TOL, msg=key)
    torch.testing.assert_close(got[1], ref[1], **GRAD_TOL, msg="d loss / d hidden_states")
    torch.testing.assert_close(got[2], ref[2], **GRAD_TOL, msg="d loss / d lm_head.weight")
    # the clamp is active on both sides somewhere, so its (zero) gradient rule is exercised
    assert bool((t_lp < CLAMP).any()) and bool((student_lq < CLAMP).any())
    # verl's overlap metrics, the student's top K from the fused head's forward, equal verl's own (torch.topk of
    # the logits), and verl's registered loss logs them; an engine without _gather_and_unpad_packed (verl
    # 0.8.0) cannot lay them out: none there (a WARNING says so)
    if not distill_losses._engine_lays_out_extra():
        assert "overlap_count" not in got[0] and "overlap_token_advantage" not in got[0], set(got[0])
        return
    _assert_same_overlap(got[0], ref[0])
    _assert_loss_logs_same_overlap("forward_kl_topk", _config(), got[0], ref[0])


def _assert_same_overlap(got, ref):
    """The two overlap metrics of the model outputs ``got`` (fused) and ``ref`` (a logits path): laid out
    per sequence alike, the counts equal (and not all alike), the advantages within TOL."""
    for key in distill_losses.OVERLAP_KEYS:
        assert key in got and got[key].is_nested and torch.equal(got[key].offsets(), ref[key].offsets()), key
    assert got["overlap_count"].dtype == ref["overlap_count"].dtype == torch.int64
    assert torch.equal(got["overlap_count"].values(), ref["overlap_count"].values())
    counts = ref["overlap_count"].values()
    assert int(counts.min()) < int(counts.max()) and int(counts.max()) > 0  # several values
    torch.testing.assert_close(got["overlap_token_advantage"].values(),
                               ref["overlap_token_advantage"].values().float(), **TOL)


def _assert_loss_logs_same_overlap(loss_mode, config, got, ref):
    """verl's registered loss function on the model outputs: the overlap metrics logged from ``got`` as
    from ``ref``."""
    from verl_helpers import _loss_data
    from verl.trainer.distillation.losses import get_distillation_loss_fn

    loss_fn, data = get_distillation_loss_fn(loss_mode), _loss_data(LENGTHS)
    metrics, want = (loss_fn(SimpleNamespace(), config, output, data)[1] for output in (got, ref))
    for name in ("distillation/overlap_ratio", "distillation/overlap_token_advantage"):
        assert metrics[name] == pytest.approx(want[name], abs=1e-6), name
    assert 0 < metrics["distillation/overlap_ratio"] < 1 and metrics["distillation/overlap_token_advantage"] != 0


@needs_fused_distillation
def test_tail_mode_on_the_fused_path_equals_the_logits_path(qwen2_forward, cpu_engine):
    """loss_mode=forward_kl_topk_tail through verl's FSDP engine forward_step: the fused head
    (fused_linear_aux plus the tail outputs laid out by the engine's own _gather_and_unpad_packed)
    against the logits path (rl-kernels' compute_forward_kl_topk, checked against float64 in
    test_verl_distill.py): every tail output per sequence, the log-probs, and the gradients w.r.t.
    the hidden states and lm_head.weight."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    model, input_ids, weights, t_lp, t_ids, _ = _case(5)
    config = _config("forward_kl_topk_tail", None)
    ref = _step(cpu_engine(model), _micro_batch(input_ids, t_lp, t_ids, False, False), weights, config)
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    if not distill_losses._engine_lays_out_extra():  # verl 0.8.0: the tail outputs cannot be laid out: it raises
        with pytest.raises(VerlIntegrationError, match="no _gather_and_unpad_packed"):
            _step(cpu_engine(model), _micro_batch(input_ids, t_lp, t_ids, True, False), weights, config)
        return
    got = _step(cpu_engine(model), _micro_batch(input_ids, t_lp, t_ids, True, False), weights, config)
    keys = ["distillation_losses", "student_mass", "teacher_mass", "tail_loss", "student_tail_mass", "log_probs"]
    assert set(keys) <= set(got[0]) and set(keys) <= set(ref[0]), (set(got[0]), set(ref[0]))
    for key in keys:
        assert got[0][key].is_nested and torch.equal(got[0][key].offsets(), ref[0][key].offsets()), key
        torch.testing.assert_close(got[0][key].values(), ref[0][key].values(), **TOL, msg=key)
    torch.testing.assert_close(got[1], ref[1], **GRAD_TOL, msg="d loss / d hidden_states")
    torch.testing.assert_close(got[2], ref[2], **GRAD_TOL, msg="d loss / d lm_head.weight")
    assert float(got[0]["tail_loss"].values().abs().max()) > 1e-2
    _assert_same_overlap(got[0], ref[0])  # the tail mode's (unclamped) terms
    _assert_loss_logs_same_overlap("forward_kl_topk_tail", config, got[0], ref[0])
    # the option off: no overlap metrics on the fused path (verl's loss then logs none), the rest as before
    rkv.configure(overlap_metrics=False)
    try:
        off = _step(cpu_engine(model), _micro_batch(input_ids, t_lp, t_ids, True, False), weights, config)
    finally:
        rkv.configure(overlap_metrics=True)
    assert set(off[0]) == set(got[0]) - set(distill_losses.OVERLAP_KEYS), set(off[0])
    torch.testing.assert_close(off[0]["distillation_losses"].values(), got[0]["distillation_losses"].values(),
                               atol=0, rtol=0)
    from verl_helpers import _loss_data
    from verl.trainer.distillation.losses import get_distillation_loss_fn

    metrics = get_distillation_loss_fn(config.distillation_loss.loss_mode)(SimpleNamespace(), config, off[0],
                                                                          _loss_data(LENGTHS))[1]
    assert "distillation/overlap_ratio" not in metrics and "distillation/student_mass" in metrics


@needs_fused_distillation
def test_a_fused_forward_that_is_not_rl_kernels_is_warned(qwen2_forward, cpu_engine, caplog, monkeypatch):
    """verl's own fused backend computes no distillation outputs: one WARNING from the engine's
    prepare_model_outputs, then verl's loss runs on (and finds no distillation_losses)."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=g)
    model = tiny_qwen2(seed=3)
    t_lp, t_ids, _ = _teacher(model, input_ids, g)
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend="torch")
    weights = (torch.randn(sum(LENGTHS), generator=g),) * 2
    monkeypatch.setattr(_logging, "_seen", set())  # (log_once: once per process)
    with caplog.at_level("WARNING", logger="rl_kernels"), pytest.raises(KeyError, match="distillation_losses"):
        _step(cpu_engine(model), _micro_batch(input_ids, t_lp, t_ids, True, False), weights)
    said = [m for m in caplog.messages if "top-K distillation on verl's FSDP fused path is not served" in m]
    assert len(said) == 1 and "the model's fused forward is not rl-kernels'" in said[0], caplog.messages


@needs_fused_distillation
def test_ulysses_slicing_goes_through_verls_helpers(monkeypatch):
    """Sequence parallelism: the teacher's packed tensors are sliced for this rank with the helpers
    of verl's loss module, as verl's logits path slices them (a stand-in for rank 0 of 2 with
    verl's padding: 21 tokens padded to 22, the first 11). serve_fused_topk on this rank's hidden
    states vs verl's compute_forward_kl_topk on this rank's logits: outputs within 1e-5, the
    gradients w.r.t. hidden states and weight within atol 1e-5 / rtol 1e-4."""
    import importlib

    fsdp = importlib.import_module(distill_losses.FSDP_MODULE)
    original = fsdp.compute_forward_kl_topk
    original = getattr(original, "_rl_kernels_original", original)  # verl's own

    def first_half(x, dim, padding=True):
        if padding and x.shape[dim] % 2:
            x = torch.cat([x, x.new_zeros(x.shape[:dim] + (1,) + x.shape[dim + 1:])], dim)
        return x.narrow(dim, 0, x.shape[dim] // 2).contiguous()

    monkeypatch.setattr(fsdp, "get_ulysses_sequence_parallel_world_size", lambda: 2)
    monkeypatch.setattr(fsdp, "slice_input_tensor", first_half)
    g = torch.Generator().manual_seed(6)
    lengths, n, hidden_size, vocab = (8, 6, 7), 11, 16, 97
    t_lp, t_ids = torch.log_softmax(3 * torch.randn(sum(lengths), vocab, generator=g), -1).topk(K, dim=-1)
    t_lp[::4, 1] = -11.0
    nested = [torch.nested.as_nested_tensor(list(t.split(list(lengths))), layout=torch.jagged) for t in (t_lp, t_ids)]
    h = torch.randn(1, n, hidden_size, generator=g)
    w = torch.randn(vocab, hidden_size, generator=g)
    weights = torch.randn(1, n, generator=g)
    labels = torch.randint(0, vocab, (1, n), generator=g)
    config = _config()

    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    ref = original((hr @ wr.T) / T, nested[0], nested[1], config, "thd")
    (ref["distillation_losses"] * weights).sum().backward()

    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    from rl_kernels.integrations.verl_impl.patch_state import StepRequest

    step = StepRequest(topk=True, micro_batch={"teacher_logprobs": nested[0], "teacher_ids": nested[1]},
                       loss_function=functools.partial(_loss, distillation_config=config))
    distill_losses.serve_fused_topk(step, hg, wg, labels, temperature=T, softcap=None, return_entropy=False,
                             backend="torch")
    aux = step.outputs["aux"]
    (aux.distillation_losses * weights).sum().backward()
    for key in ("distillation_losses", "student_mass", "teacher_mass"):
        torch.testing.assert_close(getattr(aux, key), ref[key].detach().float(), **TOL, msg=key)
    torch.testing.assert_close(hg.grad, hr.grad, **GRAD_TOL)
    torch.testing.assert_close(wg.grad, wr.grad, **GRAD_TOL)


def test_megatron_fused_top_k_reported_and_says_so_where_not_served(monkeypatch, caplog):
    """On verl's Megatron fused path the report says top-K distillation is served (the values and
    gradients: tests/integrations/test_verl_megatron.py); the engine's forward_step wrapper, where a fused
    top-K batch gets no terms (here: ``served=False``), logs one WARNING and returns verl's
    output unchanged."""
    import importlib

    pytest.importorskip("megatron.core")
    if not _has(distill_losses.MEGATRON_MODULE):
        pytest.skip("this verl has no distillation")
    from verl.utils import tensordict_utils as tu

    served, what = rkv.report()[distill_losses.MEGATRON_FUSED_PART]
    if not rkv.report()["Megatron fused path"][0]:  # this verl's Megatron engine is not served (0.8.x)
        assert not served, what
        pytest.skip("this verl's Megatron fused path is not served by rl-kernels (nor its top-K distillation)")
    assert served and "vocab-parallel" in what, what
    impl = importlib.import_module(distill_losses.MEGATRON_ENGINE_MODULE)
    installed = getattr(impl, distill_losses.MEGATRON_ENGINE_CLASS).forward_step
    assert installed._rl_kernels_original is not None
    calls = []

    def forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):  # verl's
        batch = next(batch_iter)
        calls.append(batch)
        return {"log_probs": batch["x"]}, "post"

    from rl_kernels.integrations.verl_impl import megatron_step
    wrapped = megatron_step._forward_step(forward_step, megatron_step.Served())
    engine = SimpleNamespace(engine_config=SimpleNamespace(use_fused_kernels=True))
    batches = [tu.get_tensordict({"x": torch.zeros(1)}, {"distillation_use_topk": topk})
               for topk in (False, True, True)]
    monkeypatch.setattr(_logging, "_seen", set())
    with caplog.at_level("WARNING", logger="rl_kernels"):
        outs = [wrapped(engine, iter([b]), "model", "loss", "post") for b in batches]
    assert [o[1] for o in outs] == ["post"] * 3 and all(set(o[0]) == {"log_probs"} for o in outs)
    assert calls == batches
    said = [m for m in caplog.messages if "top-K distillation on verl's Megatron fused path is not served" in m]
    assert len(said) == 1, caplog.messages


def test_fused_overlap_metrics_beyond_what_the_fused_head_selects_are_left_out(caplog, monkeypatch):
    """topk above the fused top-K selection's 128: no overlap metrics on the fused paths (no top K asked
    of the head: verl's loss logs none) and one WARNING saying so, never an error in the training step;
    at 128 the head is asked for them."""
    monkeypatch.setattr(_logging, "_seen", set())  # (log_once: once per process)
    with caplog.at_level("WARNING", logger="rl_kernels"):
        assert distill_losses.overlap_top_k(torch.zeros(3, 129, dtype=torch.int64), "FSDP fused path") == 0
        assert distill_losses.overlap_top_k(torch.zeros(3, 128, dtype=torch.int64), "FSDP fused path") == 128
    said = [m for m in caplog.messages if "overlap metrics are not computed with topk=129" in m]
    assert len(said) == 1 and "at most 128" in said[0], caplog.messages


@needs_fused_distillation
def test_fused_top_k_with_loss_rows_only_equals_the_option_off_on_the_loss_rows(qwen2_forward, cpu_engine):
    """``loss_rows_only`` (issue 53 item 3) on a fused top-K distillation micro-batch: the teacher's rows
    are selected with the student's, so every distillation output and the log-probs of the loss rows,
    and the gradients of a loss that reads only those rows, equal the option off; the other rows' outputs
    are exactly 0. The loss mask is in verl's v1 response layout (prompts of 2 and 3 tokens)."""
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    g = torch.Generator().manual_seed(8)
    total = sum(LENGTHS)
    input_ids = torch.randint(0, VOCAB, (total,), generator=g)
    prompts, masks = (2, 3), ([1, 0, 1, 1, 0], [0, 1, 1])  # responses of 5 and 3 tokens, tool tokens among them
    rows = torch.tensor([0] * (prompts[0] - 1) + masks[0] + [0] + [0] * (prompts[1] - 1) + masks[1] + [0],
                        dtype=torch.bool)  # row t reads the label at token t + 1
    weights = tuple(torch.randn(total, generator=g) * rows for _ in range(2))
    model = tiny_qwen2(seed=3)
    t_lp, t_ids, _ = _teacher(model, input_ids, g)
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=rkv.BACKEND_NAME)
    previous = rkv.options()
    rkv.configure(backend="torch")
    outs = {}
    try:
        for on in (False, True):
            rkv.configure(loss_rows_only=on)
            micro_batch = _micro_batch(input_ids, t_lp, t_ids, True, False)
            micro_batch["loss_mask"] = torch.nested.nested_tensor([torch.tensor(m) for m in masks], layout=torch.jagged)
            outs[on] = _step(cpu_engine(model), micro_batch, weights)
    finally:
        rkv.configure(backend=previous.backend, loss_rows_only=previous.loss_rows_only)
    for key in ("distillation_losses", "student_mass", "teacher_mass", "log_probs"):
        got, ref = outs[True][0][key].values(), outs[False][0][key].values()
        assert bool((ref[~rows] != 0).all()) and torch.equal(got[~rows], torch.zeros(int((~rows).sum()))), key
        torch.testing.assert_close(got[rows], ref[rows], **TOL, msg=key)
    torch.testing.assert_close(outs[True][1], outs[False][1], **GRAD_TOL, msg="d loss / d hidden_states")
    torch.testing.assert_close(outs[True][2], outs[False][2], **GRAD_TOL, msg="d loss / d lm_head.weight")
