"""rl_kernels.integrations.verl patched into the installed verl (0.7.x, 0.8.0 or 0.9.x) in this process.

Marked ``verl_matrix``: ``.ci/run`` also runs this file in venvs with verl 0.7.1 and 0.8.0
(``pytest -m verl_matrix``); tests of one release only skip, with the reason, on the others.

The tiny Qwen2 (H=64, 2 layers, V=1037) goes through verl's own ``apply_monkey_patch`` with
``fused_kernels_backend='rl_kernels'``; verl's unpatched logits path (HF forward, then verl's
``logprobs_from_logits`` / ``entropy_from_logits``, float32 logits) is the reference. Both run in
float32, so the tolerances (2e-5 on values, 1e-4 relative on gradients) leave only float32
rounding of different summation orders.
"""
import ast
import importlib
import importlib.util
import inspect
import os

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import torch
import verl.utils.torch_functional as verl_F

import rl_kernels
from safetensors import safe_open
from verl.models.transformers.monkey_patch import apply_monkey_patch

import rl_kernels.integrations.verl as rkv
import rl_kernels.integrations.verl_impl.megatron as rkm
from rl_kernels.integrations.verl_impl import patch_state
from rl_kernels.samples import load_sample
from verl_helpers import VOCAB, tiny_qwen2, verl_logits_path, verl_unpatched  # (qwen2_forward: tests/integrations/conftest.py)

pytestmark = pytest.mark.verl_matrix

FEATURES = rkv.verl_features()  # what the installed verl has (never its version string)
T = 0.7
VALUE_ATOL = 2e-5
GRAD_RTOL = 1e-4


def _fused_forward_takes_shift_labels() -> bool:
    """verl's fused forwards take ``shift_labels`` (globally rolled under Ulysses SP): 0.8.0 on."""
    from verl.models.transformers.dense_common import forward_with_torch_backend

    return "shift_labels" in inspect.signature(forward_with_torch_backend).parameters


@pytest.fixture
def backend():
    yield from _with_backend("torch")


def _with_backend(name):
    previous = rkv.options().backend
    rkv.configure(backend=name)
    yield name
    rkv.configure(backend=previous)


def _inputs(rmpad: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    if rmpad:  # two packed sequences of 7 and 6 tokens, positions restart (verl's rmpad layout)
        ids = torch.randint(0, VOCAB, (1, 13), generator=g)
        pos = torch.cat([torch.arange(7), torch.arange(6)])[None]
        return {"input_ids": ids, "position_ids": pos}
    ids = torch.randint(0, VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding
    return {"input_ids": ids, "attention_mask": mask}


def _ppo_loss(log_probs, entropy, seed=2):
    """A clipped PPO surrogate minus an entropy bonus, on random advantages."""
    g = torch.Generator().manual_seed(seed)
    adv = torch.randn(log_probs.shape, generator=g)
    old = log_probs.detach() + 0.1 * torch.randn(log_probs.shape, generator=g)
    ratio = torch.exp(log_probs - old)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    return -surrogate.mean() - 0.01 * entropy.mean()


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("rmpad", [False, True], ids=["padded", "rmpad"])
@pytest.mark.parametrize("kernel_backend", ["torch", "triton"])
def test_fused_path_matches_verl_logits_path(qwen2_forward, rmpad, kernel_backend):
    for _ in _with_backend(kernel_backend):
        inputs = _inputs(rmpad)
        labels = torch.roll(inputs["input_ids"], shifts=-1, dims=-1)

        ref_model = tiny_qwen2()
        ref_lp, ref_ent = verl_logits_path(ref_model, qwen2_forward, T, labels, **inputs)
        _ppo_loss(ref_lp, ref_ent).backward()
        ref_grads = _grads(ref_model)

        model = tiny_qwen2()
        apply_monkey_patch(model, use_remove_padding=rmpad, use_fused_kernels=True,
                           fused_kernels_backend=rkv.BACKEND_NAME)
        assert model._verl_fused_kernels_backend == rkv.BACKEND_NAME
        before = rkv.call_counts()["fused_calls"]
        out = model(**inputs, temperature=T, return_dict=True)
        assert rkv.call_counts()["fused_calls"] == before + 1  # rl-kernels computed them
        assert type(out).__name__ == "CausalLMOutputForPPO"
        assert out.log_probs.shape == labels.shape and out.entropy.shape == labels.shape
        assert out.log_probs.dtype == torch.float32
        torch.testing.assert_close(out.log_probs, ref_lp.float(), atol=VALUE_ATOL, rtol=0)
        torch.testing.assert_close(out.entropy, ref_ent.float(), atol=VALUE_ATOL, rtol=0)

        _ppo_loss(out.log_probs, out.entropy).backward()
        for name, grad in _grads(model).items():
            ref = ref_grads[name]
            err = (grad - ref).norm() / ref.norm()
            assert err < GRAD_RTOL, f"{name}: relative gradient error {err:.2e} (backend {kernel_backend})"


def test_entropy_only_when_verl_asks(qwen2_forward):
    """verl #2608: verl's fused forwards always ask for entropy. Inside the method where verl reads
    ``calculate_entropy`` (the FSDP engine's forward_step on verl 0.8+, the legacy actor's
    _forward_micro_batch on 0.7.x), a micro-batch with calculate_entropy=False runs the fused head
    without entropy: same log-probs, a NaN placeholder for the entropy verl drops."""
    what = rkv.report()["FSDP fused path"][1]
    hook = ("DataParallelPPOActor._forward_micro_batch" if FEATURES.legacy_actor
            else "FSDPEngineWithLMHead.forward_step")
    assert "calculate_entropy asks (" in what and hook in what, what
    inputs = _inputs(rmpad=True)
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True,
                       fused_kernels_backend=rkv.BACKEND_NAME)
    labels = torch.roll(inputs["input_ids"], shifts=-1, dims=-1)
    ref_lp, _ = verl_logits_path(tiny_qwen2(), qwen2_forward, T, labels, **inputs)

    def micro_batch_forward(micro_batch, calculate_entropy=False):  # stands for verl's method
        with torch.no_grad():
            return model(**inputs, temperature=T, return_dict=True)

    wrapped = rkv.entropy_on_request(micro_batch_forward, lambda a: a.get("calculate_entropy", False))
    counts = rkv.call_counts()
    out = wrapped({}, calculate_entropy=False)
    after = rkv.call_counts()
    assert after["fused_fsdp_calls"] == counts["fused_fsdp_calls"] + 1
    assert after["entropy_skipped_calls"] == counts["entropy_skipped_calls"] + 1
    torch.testing.assert_close(out.log_probs, ref_lp.float(), atol=VALUE_ATOL, rtol=0)
    assert out.entropy.shape == out.log_probs.shape and bool(out.entropy.isnan().all())
    out = wrapped({}, calculate_entropy=True)
    assert rkv.call_counts()["entropy_skipped_calls"] == after["entropy_skipped_calls"]
    assert bool(torch.isfinite(out.entropy).all()) and float(out.entropy.min()) > 0
    if not FEATURES.legacy_actor:  # the engine reads the flag from the micro-batch's non-tensor data
        from tensordict import TensorDict
        from verl.utils import tensordict_utils as tu

        for flag in (False, True):
            micro_batch = TensorDict({"x": torch.zeros(2)}, batch_size=[2])
            tu.assign_non_tensor(micro_batch, calculate_entropy=flag)
            assert rkv.micro_batch_flag({"micro_batch": micro_batch}) is flag


@pytest.mark.skipif(not _fused_forward_takes_shift_labels(), reason="this verl's fused forward has no shift_labels (0.7.x)")
def test_shift_labels_take_precedence(qwen2_forward, backend):
    """verl #6068: the engine passes globally rolled labels as shift_labels under Ulysses SP; the
    fused forward must use them instead of rolling its local shard."""
    inputs = _inputs(rmpad=True)
    g = torch.Generator().manual_seed(5)
    shift_labels = torch.randint(0, VOCAB, inputs["input_ids"].shape, generator=g)
    assert not torch.equal(shift_labels, torch.roll(inputs["input_ids"], -1, -1))
    ref_lp, ref_ent = verl_logits_path(tiny_qwen2(), qwen2_forward, T, shift_labels, **inputs)

    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True,
                       fused_kernels_backend=rkv.BACKEND_NAME)
    with torch.no_grad():
        out = model(**inputs, temperature=T, shift_labels=shift_labels, return_dict=True)
    torch.testing.assert_close(out.log_probs, ref_lp.float(), atol=VALUE_ATOL, rtol=0)
    torch.testing.assert_close(out.entropy, ref_ent.float(), atol=VALUE_ATOL, rtol=0)


def test_verl_backends_untouched(qwen2_forward):
    """verl's own impl_backend='torch' still runs verl's code (not rl-kernels) while patched."""
    inputs = _inputs(rmpad=False)
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True, fused_kernels_backend="torch")
    before = rkv.call_counts()["fused_calls"]
    with torch.no_grad():
        out = model(**inputs, temperature=T, return_dict=True)
    assert rkv.call_counts()["fused_calls"] == before
    labels = torch.roll(inputs["input_ids"], -1, -1)
    ref_lp, _ = verl_logits_path(tiny_qwen2(), qwen2_forward, T, labels, **inputs)
    torch.testing.assert_close(out.log_probs, ref_lp.float(), atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_path_functions(dtype):
    """The patched verl.utils.torch_functional functions vs verl's originals (values, gradients)."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 7, 301, generator=g) * 3).to(dtype)
    labels = torch.randint(0, 301, (2, 7), generator=g)
    g_lp, g_ent = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)

    def run(lp_fn, ent_fn, chunked_fn):
        x = logits.clone().requires_grad_()
        lp, ent = lp_fn(x, labels, inplace_backward=False), ent_fn(x)
        ent_c = chunked_fn(x.reshape(-1, 301), chunk_size=4).view(2, 7)
        (g_lp * lp + g_ent * ent).sum().backward()
        return lp.float(), ent.float(), ent_c.float(), x.grad.float()

    assert verl_F.logprobs_from_logits is rkv.logprobs_from_logits
    before = rkv.call_counts()
    ours = run(verl_F.logprobs_from_logits, verl_F.entropy_from_logits,
               verl_F.entropy_from_logits_with_chunking)
    after = rkv.call_counts()
    assert after["logits_log_probs_calls"] == before["logits_log_probs_calls"] + 1
    assert after["logits_entropy_calls"] == before["logits_entropy_calls"] + 2
    # float64 truth (verl's own functions return bf16 values for bf16 logits: see the bug catalogue)
    x64 = logits.double().requires_grad_()
    log_p = x64.log_softmax(-1)
    lp64 = log_p.gather(-1, labels[..., None])[..., 0]
    ent64 = -(log_p.exp() * log_p).sum(-1)
    (g_lp * lp64 + g_ent * ent64).sum().backward()
    for got, want in zip(ours[:3], (lp64, ent64, ent64)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    # bf16: each function's gradient is rounded to bf16 (rel. 2^-8), then autograd adds the two
    atol, rtol = (1e-5, 0) if dtype == torch.float32 else (1e-3, 2 ** -7)
    torch.testing.assert_close(ours[3].double(), x64.grad, atol=atol, rtol=rtol)
    with verl_unpatched():
        theirs = run(verl_F.logprobs_from_logits, verl_F.entropy_from_logits,
                     verl_F.entropy_from_logits_with_chunking)
    # verl's own path is the baseline we must not be worse than
    for got, ref, want in zip(ours[:2], theirs[:2], (lp64, ent64)):
        assert (got.double() - want).abs().max() <= (ref.double() - want).abs().max() + 1e-6


def test_logits_path_under_verls_torch_compile():
    """verl 0.8 / 0.9's engines build ``torch.compile(entropy_from_logits, dynamic=True)`` from
    ``verl.utils.torch_functional`` when ``use_torch_compile=True`` (their default); with the patch
    in place that compiles rl-kernels' replacement, which runs eagerly inside the compiled wrapper
    (``torch.compiler.disable``: one custom op gains nothing from tracing and inductor's wrappers add
    host time). verl 0.7's legacy actor caches the same; the patch replaces that cache with the
    uncompiled function (test_verl_dp_actor). Here: no error, served by rl-kernels (counted), the
    eager bits, at two shapes (dynamic=True)."""
    g = torch.Generator().manual_seed(5)
    for fn_name in ("entropy_from_logits", "entropy_from_logits_with_chunking"):
        compiled = torch.compile(getattr(verl_F, fn_name), dynamic=True)  # verl's engine line
        for shape in ((9, 301), (14, 301)):
            logits = torch.randn(*shape, generator=g) * 3
            grads = []
            for f in (getattr(rkv, fn_name), compiled):
                x = logits.clone().requires_grad_()
                before = rkv.call_counts()["logits_entropy_calls"]
                ent = f(x)
                assert rkv.call_counts()["logits_entropy_calls"] == before + 1, "not served by rl-kernels"
                (ent * torch.arange(shape[0])).sum().backward()
                grads.append((ent.detach(), x.grad))
            for a, b in zip(*grads):
                assert torch.equal(a, b)


def test_inplace_backward_writes_into_logits():
    g = torch.Generator().manual_seed(4)
    base = torch.randn(5, 33, generator=g)
    labels = torch.randint(0, 33, (5,), generator=g)
    leaf = base.clone().requires_grad_()
    logits = leaf * 1.0  # a non-leaf like verl's logits
    storage = logits.data_ptr()
    captured = {}
    logits.register_hook(lambda grad: captured.update(ptr=grad.data_ptr()))
    verl_F.logprobs_from_logits(logits, labels, inplace_backward=True).sum().backward()
    assert captured["ptr"] == storage
    expected = torch.nn.functional.one_hot(labels, 33) - base.softmax(-1)
    torch.testing.assert_close(leaf.grad, expected, atol=1e-6, rtol=0)


def _logits_function_imports():
    """(module, name) for every by-name import of the logits-path functions in installed verl."""
    import verl

    root = os.path.dirname(verl.__file__)
    found = []
    for dirpath, _, files in os.walk(root):
        for fname in files:
            if not fname.endswith(".py"):
                continue
            path = os.path.join(dirpath, fname)
            with open(path, encoding="utf-8") as source:
                tree = ast.parse(source.read())
            module = "verl." + os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            module = module.removesuffix(".__init__")
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "verl.utils.torch_functional":
                    for alias in node.names:
                        if alias.name in rkv.LOGITS_FUNCTIONS:
                            found.append((module, alias.asname or alias.name, alias.name,
                                          node.col_offset == 0))
    return found


def test_every_by_name_import_is_patched():
    imports = _logits_function_imports()
    # verl 0.9.1 has 5 (fsdp/automodel/torchtitan engines, ...), 0.8.0 2, 0.7.1 more (legacy workers)
    assert len(imports) >= 2, imports
    checked = 0
    for module, bound, original, top_level in imports:
        try:
            mod = importlib.import_module(module)  # imported after the patch
        except Exception:  # optional dependency (torchtitan, nemo_automodel, ...) missing here
            continue
        if top_level:
            assert getattr(mod, bound) is getattr(rkv, original), f"{module}.{bound} not patched"
            checked += 1
    assert checked >= 1
    # modules imported before the patch are found through sys.modules
    rkv.unpatch()
    for module, bound, original, top_level in imports:
        mod = importlib.sys.modules.get(module)
        if mod is not None and top_level:
            assert getattr(mod, bound) is getattr(verl_F, original)
    rkv.patch()
    for module, bound, original, top_level in imports:
        mod = importlib.sys.modules.get(module)
        if mod is not None and top_level:
            assert getattr(mod, bound) is getattr(rkv, original), f"{module}.{bound} not re-patched"


def test_patch_is_idempotent_and_undoable():
    import verl.models.transformers.monkey_patch as mp
    import verl.utils.experimental.torch_functional as xtf

    assert rkv.is_patched()
    patched = (mp.patch_forward_with_backends, xtf.FusedLinearForPPO, verl_F.logprobs_from_logits)
    rkv.patch()  # second call: no double wrapping
    assert (mp.patch_forward_with_backends, xtf.FusedLinearForPPO, verl_F.logprobs_from_logits) == patched
    with verl_unpatched():
        assert mp.patch_forward_with_backends is patched[0]._rl_kernels_original
        assert xtf.FusedLinearForPPO is patched[1]._rl_kernels_base
        assert verl_F.logprobs_from_logits.__module__ == "verl.utils.torch_functional"
        if FEATURES.fused_impl_backend:  # verl 0.9.x: impl_backend torch / triton / liger
            with pytest.raises(ValueError, match="Unsupported FusedLinearForPPO backend"):
                xtf.FusedLinearForPPO(impl_backend=rkv.BACKEND_NAME)
        else:  # verl 0.7.x / 0.8.0 / main: FusedLinearForPPO takes no impl_backend at all
            with pytest.raises(TypeError):
                xtf.FusedLinearForPPO(impl_backend=rkv.BACKEND_NAME)
    assert hasattr(mp.patch_forward_with_backends, "_rl_kernels_original")  # patched again
    assert xtf.FusedLinearForPPO._rl_kernels_base is patched[1]._rl_kernels_base
    assert verl_F.logprobs_from_logits is rkv.logprobs_from_logits


def test_changed_verl_signature_raises(monkeypatch):
    def entropy_from_logits(logits, dim=-1):  # a hypothetical future verl
        return logits

    with verl_unpatched():
        monkeypatch.setattr(verl_F, "entropy_from_logits", entropy_from_logits)
        with pytest.raises(rkv.VerlIntegrationError, match=r"entropy_from_logits.*\['logits'\].*dim=-1"):
            rkv.patch()
        assert not rkv.is_patched()
        import verl.models.transformers.monkey_patch as mp
        assert not hasattr(mp.patch_forward_with_backends, "_rl_kernels_original")  # rolled back
        monkeypatch.undo()


def test_options_from_model_config():
    class HFModelConfig:  # what verl hands over: fused_kernel_options may be an OmegaConf mapping
        fused_kernel_options = {"impl_backend": "rl_kernels", "rl_kernels": {"backend": "torch"}}

    previous = rkv.options()
    try:
        rkv.configure_from_model_config(HFModelConfig())
        assert rkv.options().backend == "torch"
        HFModelConfig.fused_kernel_options = {"rl_kernels": {"backend": "cuda"}}
        with pytest.raises(ValueError, match=r"rl_kernels\.backend.*'cuda'"):
            rkv.configure_from_model_config(HFModelConfig())
        HFModelConfig.fused_kernel_options = {"rl_kernels": {"anomaly_dirr": "/tmp"}}
        with pytest.raises(ValueError, match="unknown option.*anomaly_dirr"):
            rkv.configure_from_model_config(HFModelConfig())
    finally:
        rkv.configure(**{f: getattr(previous, f) for f in previous.__dataclass_fields__})


def test_anomaly_capture_saves_a_replayable_sample(tmp_path, qwen2_forward, backend):
    """A NaN in the head's input is captured once, as a sample that `rl-kernels repro` loads."""
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                       fused_kernels_backend=rkv.BACKEND_NAME)
    previous = rkv.options()
    try:
        rkv.configure(anomaly_dir=str(tmp_path), anomaly_max_count=1, anomaly_recheck_every=1)
        inputs = _inputs(rmpad=False)
        with torch.no_grad():
            model(**inputs, temperature=T, return_dict=True)  # clean: re-checked, nothing saved
            assert os.listdir(tmp_path) == []
            model.lm_head.weight[3, 0] = float("nan")
            model(**inputs, temperature=T, return_dict=True)
            model(**inputs, temperature=T, return_dict=True)  # over max_count: logged, not saved
        files = os.listdir(tmp_path)
        assert len(files) == 1 and files[0].endswith(".safetensors")
        sample = load_sample(str(tmp_path / files[0]))
        assert sample.temperature == pytest.approx(T)
        assert sample.weight.shape == (VOCAB, 64) and torch.isnan(sample.weight[3, 0])
        assert sample.labels.shape == (2, 9)
        with safe_open(str(tmp_path / files[0]), framework="pt") as f:
            meta = f.metadata()
        assert meta["reason"].startswith("non-finite") and meta["verl_version"] == rkv.verl_version()
        assert meta["rank"] == "0" and meta["call"] == "2"
    finally:
        rkv.configure(**{f: getattr(previous, f) for f in previous.__dataclass_fields__})


def test_anomaly_recheck_catches_a_wrong_kernel(tmp_path, monkeypatch):
    """A kernel result off by 0.01 nats (the size of verl's phantom-column bias) is caught by the
    sampled float32 re-check although it is finite and <= 0."""
    from rl_kernels.integrations.anomaly import AnomalyCapture

    g = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(6, 16, generator=g), torch.randn(50, 16, generator=g) * 0.5
    labels = torch.randint(0, 50, (6,), generator=g)
    from rl_kernels import linear_log_probs
    out = linear_log_probs(hidden, weight, labels, backend="torch")
    capture = AnomalyCapture(str(tmp_path), recheck_every=1, recheck_rows=6, recheck_tolerance=1e-3)
    assert capture.check(hidden, weight, labels, temperature=1.0, ignore_index=-100,
                         log_probs=out.log_probs, entropy=out.entropy) is None
    reason = capture.check(hidden, weight, labels, temperature=1.0, ignore_index=-100,
                           log_probs=out.log_probs - 0.01, entropy=out.entropy)
    assert reason is not None and "re-check" in reason
    assert len(os.listdir(tmp_path)) == 1


def _configured(**options):
    """rkv.configure(**options) for a test; the options in force before, restored by the caller."""
    previous = rkv.options()
    rkv.configure(**options)
    return {f: getattr(previous, f) for f in previous.__dataclass_fields__}


def _replay(path, capsys):
    """`rl-kernels repro PATH` on CPU: (exit status, the table's rows)."""
    from repro_rows import table_rows
    from rl_kernels.tools.cli import main

    status = main(["repro", "--device", "cpu", str(path)])
    return status, table_rows(capsys.readouterr().out)


def test_logits_path_capture_saves_the_anomalous_rows(tmp_path, monkeypatch, capsys):
    """verl's logits path (rl-kernels' logprobs_from_logits / entropy_from_logits in verl's place)
    with the capture on: a planted log-prob > 0 in one row saves that row only (its bf16 logits as
    verl passed them, its label), which `rl-kernels repro` replays: PASS. A NaN logit row makes the
    entropy NaN: that row is saved with its argmax as the label (entropy takes none), once, although
    the log-probs of the same logits are NaN there too."""
    import rl_kernels.integrations.verl_impl.logits_path as rk_logits

    g = torch.Generator().manual_seed(8)
    logits = (3 * torch.randn(2, 7, 101, generator=g)).bfloat16()
    labels = torch.randint(0, 101, (2, 7), generator=g)
    real = rk_logits._rk_log_probs_from_logits

    def planted(*args, **kwargs):  # a kernel bug: a probability > 1 at token (1, 4)
        out = real(*args, **kwargs).clone()
        out[1, 4] = 0.01
        return out

    restore = _configured(anomaly_dir=str(tmp_path), anomaly_recheck_every=0)
    try:
        monkeypatch.setattr(rk_logits, "_rk_log_probs_from_logits", planted)
        verl_F.logprobs_from_logits(logits, labels)
        (first,) = os.listdir(tmp_path)
        monkeypatch.setattr(rk_logits, "_rk_log_probs_from_logits", real)
        nan_logits = logits.clone()
        nan_logits[0, 3, 17] = float("nan")
        assert torch.isnan(verl_F.entropy_from_logits(nan_logits)[0, 3])
        verl_F.logprobs_from_logits(nan_logits, labels)  # the same row of the same logits: not saved again
        files = sorted(os.listdir(tmp_path))
    finally:
        rkv.configure(**restore)
    assert len(files) == 2, files
    sample = load_sample(tmp_path / first)
    assert sample.logits.dtype == torch.bfloat16 and torch.equal(sample.logits, logits[1, 4][None])
    assert torch.equal(sample.labels, labels[1, 4][None]) and sample.temperature == 1.0
    meta = sample.metadata
    assert meta["reason"] == "log-prob above 1e-05 (max 0.01)" and meta["rows"] == "11 of the call's 14 rows"
    assert meta["function"] == "verl logprobs_from_logits (FSDP logits path)" and "temperature 1" in meta["logits"]
    status, rows = _replay(tmp_path / first, capsys)
    assert status == 0 and all(r["result"] == "PASS" for r in rows if r["backend"].startswith("rl_kernels")), rows
    (second,) = [f for f in files if f != first]
    sample = load_sample(tmp_path / second)
    torch.testing.assert_close(sample.logits, nan_logits[0, 3][None], rtol=0, atol=0, equal_nan=True)
    assert sample.labels.tolist() == [17]  # argmax of a row holding NaN: the NaN's column
    assert sample.metadata["reason"] == "non-finite log-prob or entropy" and "argmax" in sample.metadata["labels"]


def test_capture_of_from_logits_calls_with_a_per_row_temperature(tmp_path, capsys):
    """AnomalyCapture.check_logits: the re-check saves only the sampled rows that differ (taken from
    strided logits without flattening them), with their temperature rows (a per-row temperature
    round-trips: `rl-kernels repro` PASS); max_bytes keeps
    the first anomalous rows that fit; a capture that cannot write logs and never raises."""
    from rl_kernels.integrations.anomaly import AnomalyCapture

    g = torch.Generator().manual_seed(9)
    logits = (4 * torch.randn(3, 5, 70, generator=g))[..., 3:67]  # a strided slice, as verl's can be
    labels = torch.randint(0, 64, (3, 5), generator=g)
    labels[0, 1] = -100
    temperature = 0.5 + torch.rand(3, 5, generator=g)
    out = rl_kernels.logits_stats(logits, labels, temperature=temperature, backend="torch")
    wrong = out.log_probs.clone()
    wrong[2, 3] -= 0.01  # finite and < 0: only the float32 re-check sees it
    capture = AnomalyCapture(str(tmp_path / "a"), recheck_every=1, recheck_rows=15)
    assert capture.check_logits(logits, labels, log_probs=out.log_probs, entropy=out.entropy,
                                temperature=temperature) is None
    reason = capture.check_logits(logits, labels, log_probs=wrong, entropy=out.entropy, temperature=temperature)
    assert reason.startswith("float32 re-check differs by 0.01")
    (path,) = (tmp_path / "a").iterdir()
    sample = load_sample(path)
    assert torch.equal(sample.logits, logits[2, 3][None]) and torch.equal(sample.temperature, temperature[2, 3][None])
    assert sample.metadata["rows"] == "13 of the call's 15 rows" and sample.metadata["call"] == "2"
    status, rows = _replay(path, capsys)
    assert status == 0 and all(r["result"] == "PASS" for r in rows if r["backend"].startswith("rl_kernels")), rows

    high = out.log_probs.clone()
    high[1:] = 0.5  # 10 anomalous rows; room for 3
    row_bytes = 64 * 4 + 8 + 4
    capture = AnomalyCapture(str(tmp_path / "b"), max_bytes=3 * row_bytes + 5)
    capture.check_logits(logits, labels, log_probs=high, entropy=None, temperature=temperature)
    (path,) = (tmp_path / "b").iterdir()
    sample = load_sample(path)
    assert torch.equal(sample.logits, logits[1, :3]) and capture.saved_bytes == 3 * row_bytes
    assert sample.metadata["rows"] == "5, 6, 7 of the call's 15 rows (the first 3 of its 10 anomalous rows: max_bytes)"
    capture.check_logits(logits, labels, log_probs=high, entropy=None)  # no room left: logged only
    assert len(list((tmp_path / "b").iterdir())) == 1

    (tmp_path / "file").write_text("")
    capture = AnomalyCapture(str(tmp_path / "file"))  # a file where the directory should be
    assert capture.check_logits(logits, labels, log_probs=high, entropy=None) is None  # logged, not raised


def test_fused_capture_with_a_per_sample_temperature(tmp_path, capsys):
    """The fused path's capture takes the per-token temperature as the head does (it skipped such
    calls before): the call is saved whole with its temperature rows and replays: PASS."""
    from rl_kernels.integrations.verl_impl import fsdp_fused
    g = torch.Generator().manual_seed(10)
    hidden, weight = torch.randn(1, 9, 16, generator=g), torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (1, 9), generator=g)
    temperature = torch.tensor([[0.5] * 4 + [1.3] * 5])
    restore = _configured(anomaly_dir=str(tmp_path), anomaly_recheck_every=1, anomaly_recheck_rows=9,
                          backend="torch")
    try:
        lp, _ = fsdp_fused.fused_log_probs_entropy(hidden, weight, labels, temperature)
        assert os.listdir(tmp_path) == []  # clean: re-checked, nothing saved
        hidden[0, 6, 3] = float("inf")
        fsdp_fused.fused_log_probs_entropy(hidden, weight, labels, temperature)
    finally:
        rkv.configure(**restore)
    (name,) = os.listdir(tmp_path)
    sample = load_sample(tmp_path / name)
    assert torch.equal(sample.temperature, temperature) and torch.equal(sample.weight, weight)
    assert sample.metadata["reason"] == "non-finite log-prob or entropy"
    status, rows = _replay(tmp_path / name, capsys)
    assert status == 0 and rows and all(r["result"] == "PASS" for r in rows if r["backend"].startswith("rl_kernels"))
    assert all("input holds NaN/inf in rows [(0, 6)]" in r["note"] for r in rows)  # the others compared


def test_signature_table_matches_installed_verl():
    """The signatures the patch checks are those of the installed verl 0.9.1 (guards the table)."""
    import verl.models.transformers.monkey_patch as mp
    import verl.utils.experimental.torch_functional as xtf

    with verl_unpatched():
        from verl.workers.engine.base import EngineRegistry

        fns = {"patch_forward_with_backends": mp.patch_forward_with_backends,
               "FusedLinearForPPO.__init__": xtf.FusedLinearForPPO.__init__,
               "FusedLinearForPPO.forward": xtf.FusedLinearForPPO.forward,
               "EngineRegistry.get_engine_cls": vars(EngineRegistry)["get_engine_cls"].__func__,
               "EngineRegistry.new": vars(EngineRegistry)["new"].__func__,
               **{n: getattr(verl_F, n) for n in rkv.LOGITS_FUNCTIONS + (rkv.SUM_PI_SQUARED_FUNCTION,)}}
        if FEATURES.legacy_actor:
            from verl.workers.actor.dp_actor import DataParallelPPOActor
            fns["DataParallelPPOActor.__init__"] = DataParallelPPOActor.__init__
        for label, fn in fns.items():
            assert patch_state.signature(fn) in rkv.SIGNATURES[label], label
            assert inspect.isfunction(fn)
        assert set(fns) == set(rkv.SIGNATURES) - ({"DataParallelPPOActor.__init__"} - set(fns))
        # the Megatron part (rl_kernels.integrations.verl_impl.megatron), when megatron-core is installed
        if importlib.util.find_spec("megatron.core") is not None and not rkm._engine_functions()[1]:
            import megatron.core.tensor_parallel as mcore_tp
            import verl.utils.megatron.tensor_parallel as vtp
            from verl.utils.kernel.linear_cross_entropy import LinearCrossEntropy

            fns = {**{n: getattr(vtp, n) for n in rkm.LOGITS_FUNCTIONS + (rkm.SUM_PI_SQUARED_FUNCTION,)},
                   "LinearCrossEntropy.forward": LinearCrossEntropy.forward,
                   rkm.GATHER: getattr(mcore_tp, rkm.GATHER)}
            assert set(fns) == set(rkm.EXPECTED_SIGNATURES)
            for label, fn in fns.items():
                assert patch_state.signature(fn) == rkm.EXPECTED_SIGNATURES[label], label


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_pi_squared_function(dtype):
    """verl.utils.torch_functional.calculate_sum_pi_squared_from_logits (the FSDP engine's sum of
    squared probabilities) is rl-kernels' while patched: vs float64 and verl's original."""
    assert verl_F.calculate_sum_pi_squared_from_logits is rkv.calculate_sum_pi_squared_from_logits
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(3, 5, 301, generator=g) * 3).to(dtype)
    g_out = torch.randn(3, 5, generator=g)

    def run():
        x = logits.clone().requires_grad_()
        out = verl_F.calculate_sum_pi_squared_from_logits(x)
        (out * g_out).sum().backward()
        return out, x.grad

    before = rkv.call_counts()["sum_pi_squared_calls"]
    ours, ours_grad = run()
    assert rkv.call_counts()["sum_pi_squared_calls"] == before + 1
    x64 = logits.double().requires_grad_()
    want = x64.softmax(-1).pow(2).sum(-1)
    (want * g_out.double()).sum().backward()
    assert ours.dtype == torch.float32 and ours.shape == (3, 5)
    torch.testing.assert_close(ours.double(), want.detach(), atol=1e-6, rtol=1e-5)
    atol, rtol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-4, 2 ** -7)
    torch.testing.assert_close(ours_grad.double(), x64.grad, atol=atol, rtol=rtol)
    with verl_unpatched():
        theirs, theirs_grad = run()
    err = (ours.double() - want).abs().max()
    assert err <= (theirs.double() - want).abs().max() + 1e-7
    if dtype == torch.float32:
        torch.testing.assert_close(ours_grad, theirs_grad, atol=1e-6, rtol=1e-4)


def test_fused_routing_follows_the_model_not_impl_backend(qwen2_forward, backend):
    """verl 0.7.x / 0.8.0 build ``FusedLinearForPPO()`` bare: rl-kernels serves it only inside the
    forward of a model patched with impl_backend='rl_kernels'; a bare one elsewhere is verl's."""
    import verl.utils.experimental.torch_functional as xtf

    g = torch.Generator().manual_seed(9)
    hidden, weight = torch.randn(1, 5, 64, generator=g), torch.randn(VOCAB, 64, generator=g)
    ids = torch.randint(0, VOCAB, (1, 5), generator=g)
    before = rkv.call_counts()["fused_calls"]
    with torch.no_grad():
        xtf.FusedLinearForPPO()(hidden, weight, ids, temperature=T)
    assert rkv.call_counts()["fused_calls"] == before  # not inside a served model: verl's code
    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                       fused_kernels_backend=rkv.BACKEND_NAME)
    assert model._rl_kernels_fused
    other = tiny_qwen2(seed=1)  # same class, not patched for rl-kernels: verl's forward
    with torch.no_grad():
        out = other(**_inputs(rmpad=False), return_dict=True)
    assert rkv.call_counts()["fused_calls"] == before
    with torch.no_grad():
        model(**_inputs(rmpad=False), temperature=T, return_dict=True)
    assert rkv.call_counts()["fused_calls"] == before + 1


@pytest.mark.skipif(_fused_forward_takes_shift_labels(),
                    reason="this verl passes globally rolled shift_labels under Ulysses SP (0.8.0+)")
def test_fused_with_ulysses_is_refused_without_shift_labels(qwen2_forward, backend, monkeypatch):
    """verl #3512 / #3723: 0.7.x's fused forward rolls each Ulysses shard's labels; refused, loudly."""
    import verl.utils.ulysses as ulysses

    model = tiny_qwen2()
    apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True,
                       fused_kernels_backend=rkv.BACKEND_NAME)
    monkeypatch.setattr(ulysses, "get_ulysses_sequence_parallel_world_size", lambda group=None: 2)
    with pytest.raises(rkv.VerlIntegrationError, match=r"Ulysses.*ulysses_sequence_parallel_size=2.*#3512"):
        model(**_inputs(rmpad=True), temperature=T, return_dict=True)
    monkeypatch.undo()
    with torch.no_grad():  # SP of one rank: served
        model(**_inputs(rmpad=True), temperature=T, return_dict=True)


def _restore_options(previous):
    rkv.configure(**{f: getattr(previous, f) for f in previous.__dataclass_fields__})


def test_options_from_the_legacy_worker_config():
    """verl 0.7.x's legacy workers import external_lib in init_model, with no HFModelConfig: the
    method init_model calls next (``_build_model_optimizer``) hands ``self.config.model`` over."""
    from omegaconf import OmegaConf

    from rl_kernels.integrations.verl_impl import hooks
    class ActorRolloutRefWorker:  # stands for verl.workers.fsdp_workers.ActorRolloutRefWorker
        def __init__(self):
            self.config = OmegaConf.create({"model": {
                "external_lib": "rl_kernels.integrations.verl", "use_fused_kernels": True,
                "fused_kernel_options": {"impl_backend": "rl_kernels", "rl_kernels": {"backend": "triton"}}}})

        def _build_model_optimizer(self, path):
            return path, rkv.options().backend

    module = type(inspect)("verl.workers.fsdp_workers")  # a loaded legacy worker module
    module.ActorRolloutRefWorker = ActorRolloutRefWorker
    previous = rkv.options()
    sys_modules = importlib.sys.modules
    saved = sys_modules.get(module.__name__)
    sys_modules[module.__name__] = module
    try:
        rkv.configure(backend="torch")
        rkv.unpatch()
        rkv.patch()  # wraps the legacy workers that are loaded
        assert ActorRolloutRefWorker()._build_model_optimizer("p") == ("p", "triton")
        assert rkv.options().backend == "triton"
        assert hooks.LEGACY_WORKERS[module.__name__]["ActorRolloutRefWorker"] == "_build_model_optimizer"
    finally:
        rkv.unpatch()
        if saved is None:
            sys_modules.pop(module.__name__)
        else:
            sys_modules[module.__name__] = saved
        rkv.patch()
        _restore_options(previous)


def test_options_of_the_importing_config_repatch_before_use():
    """The first model config verl hands over after the import is the one that imported the
    module; options in it that change what patch() replaces re-apply the patch (no warning), a
    later config's only warn (they take effect at the next patch())."""
    from rl_kernels.integrations.verl_impl import patching
    class HFModelConfig:
        fused_kernel_options = {"impl_backend": "rl_kernels", "rl_kernels": {"patch_logits_path": False}}

    previous = rkv.options()
    try:
        assert verl_F.logprobs_from_logits is rkv.logprobs_from_logits
        patching.expect_import_config()
        rkv.apply_model_config(HFModelConfig())
        assert rkv.is_patched() and not rkv.options().patch_logits_path
        assert verl_F.logprobs_from_logits is not rkv.logprobs_from_logits  # verl's own again
        assert rkv.report()["FSDP logits path"] == (False, "not replaced (patch_logits_path=False)")
        HFModelConfig.fused_kernel_options = {"rl_kernels": {"patch_logits_path": True}}
        rkv.apply_model_config(HFModelConfig())  # not the importing config: options only
        assert rkv.options().patch_logits_path and verl_F.logprobs_from_logits is not rkv.logprobs_from_logits
    finally:
        _restore_options(previous)
        rkv.unpatch()
        rkv.patch()
    assert verl_F.logprobs_from_logits is rkv.logprobs_from_logits


def test_options_from_the_engine_model_config(monkeypatch):
    """``EngineRegistry.new(..., model_config=...)`` applies the model config's options before the
    engine is built (verl 0.8+ engine workers; the config that imported the module reaches it)."""
    from verl.workers.engine.base import EngineRegistry

    class HFModelConfig:
        fused_kernel_options = {"rl_kernels": {"backend": "triton"}}

    seen = {}

    class Engine:
        def __init__(self, model_config):
            seen["backend"] = rkv.options().backend

    monkeypatch.setattr(EngineRegistry, "get_engine_cls", classmethod(lambda cls, model_type, backend: Engine))
    previous = rkv.options()
    try:
        rkv.configure(backend="torch")
        EngineRegistry.new("language_model", "fsdp", model_config=HFModelConfig())
        assert seen["backend"] == "triton"
    finally:
        _restore_options(previous)


def test_logprobs_from_logits_rejects_a_list():
    """A Python list for labels or logits is a TypeError naming the argument, its type and what is
    expected (not an AttributeError from inside the patch)."""
    logits = torch.randn(2, 5)
    with pytest.raises(TypeError, match=r"labels: expected a torch\.Tensor, got list"):
        verl_F.logprobs_from_logits(logits, [1, 2])
    for inplace_backward in (True, False):
        with pytest.raises(TypeError, match=r"logits: expected a torch\.Tensor, got list"):
            verl_F.logprobs_from_logits(logits.tolist(), torch.tensor([1, 2]), inplace_backward=inplace_backward)


def _fake_verl_version(monkeypatch, version):
    """importlib.metadata reports ``version`` for verl (everything else as installed)."""
    import importlib.metadata as metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: version if name == "verl" else real(name))


@pytest.mark.parametrize("version", ["0.10.0", "0.10.0.dev0", "0.11.2", "1.0.0rc1"])
def test_an_unknown_verl_version_with_these_functions_is_accepted(monkeypatch, caplog, version):
    """Feature detection: a verl version no table names, whose functions are the installed ones,
    is patched as the installed one is (the same parts replaced), and the report names it."""
    expected = {part: ok for part, (ok, _) in rkv.report().items()}
    with verl_unpatched(), monkeypatch.context() as patcher:  # (undone before verl is patched again)
        _fake_verl_version(patcher, version)
        with caplog.at_level("INFO", logger="rl_kernels"):
            rkv.patch()
        try:
            assert {part: ok for part, (ok, _) in rkv.report().items()} == expected
            assert any(f"rl_kernels patched verl {version}:" in m for m in caplog.messages), caplog.messages
        finally:
            rkv.unpatch()


def test_a_changed_signature_is_refused_naming_it(monkeypatch):
    """A verl (of any version) whose FusedLinearForPPO.forward lost a parameter: refused with the
    function, the expected and the found parameters; nothing stays patched."""
    import verl.utils.experimental.torch_functional as xtf

    with verl_unpatched(), monkeypatch.context() as patcher:  # (undone before verl is patched again)
        _fake_verl_version(patcher, "0.12.0")

        def forward(self, hidden_states, vocab_weights, input_ids):  # no temperature
            raise AssertionError("never called")

        patcher.setattr(xtf.FusedLinearForPPO, "forward", forward)
        before = verl_F.logprobs_from_logits
        with pytest.raises(rkv.VerlIntegrationError) as err:
            rkv.patch()
        message = str(err.value)
        assert "verl 0.12.0 changed FusedLinearForPPO.forward" in message, message
        assert "'temperature=1.0'" in message and "found ['self', 'hidden_states', 'vocab_weights', 'input_ids']" \
            in message, message
        assert not rkv.is_patched() and verl_F.logprobs_from_logits is before


@pytest.mark.parametrize("version", ["0.6.2", "0.7.0rc1"])
def test_a_verl_older_than_the_oldest_handled_is_refused(monkeypatch, version):
    with verl_unpatched(), monkeypatch.context() as patcher:  # (undone before verl is patched again)
        _fake_verl_version(patcher, version)
        with pytest.raises(rkv.VerlIntegrationError, match=f"verl {version} is older than 0.7.0"):
            rkv.patch()
        assert not rkv.is_patched()


def test_optional_parts_follow_the_installed_functions():
    """Which optional parts are patched is read from verl's modules: the legacy actor where
    verl.workers.actor.dp_actor exists, the Megatron part where verl has every function it
    replaces (with megatron-core importable)."""
    report = rkv.report()
    assert FEATURES.legacy_actor == (importlib.util.find_spec("verl.workers.fsdp_workers") is not None)
    assert ("DataParallelPPOActor" in report["FSDP logits path"][1]) == FEATURES.legacy_actor
    missing = rkm._engine_functions()[1]
    if importlib.util.find_spec("megatron.core") is None:
        assert not report["Megatron logits path"][0]
    elif missing:
        assert not report["Megatron logits path"][0] and all(m in report["Megatron logits path"][1] for m in missing)
    else:
        assert report["Megatron logits path"][0] and report["Megatron fused path"][0]


def _engine_lines(caplog, engine_cls, backend):
    import rl_kernels.integrations.verl_impl.patching as patching

    caplog.clear()
    with caplog.at_level("INFO", logger="rl_kernels"):
        patching._report_engine("language_model", backend, engine_cls)
    return [(r.levelname, r.getMessage()) for r in caplog.records if f"'{backend}'" in r.getMessage()]


def test_an_engine_with_its_own_fused_route_is_not_reported_served(caplog):
    """VeOmni's engine subclasses FSDPEngineWithLMHead but sends fused micro-batches to its own
    chunk_logprobs (its prepare_model_inputs), which no patch reaches: one WARNING that says the
    fused path is NOT served and the logits path is; never 'is served by rl-kernels'. A subclass
    that keeps the FSDP route is served (INFO)."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    class VeOmniLikeEngineWithLMHead(FSDPEngineWithLMHead):
        def prepare_model_inputs(self, micro_batch):  # a fused route of its own
            raise AssertionError("not called")

    class KeepsTheRouteEngine(FSDPEngineWithLMHead):
        pass

    lines = _engine_lines(caplog, VeOmniLikeEngineWithLMHead, "rlk_veomni_like")
    assert len(lines) == 1, lines
    level, message = lines[0]
    assert level == "WARNING" and "is served by" not in message, message
    served, not_served = message.split("NOT served")
    assert "FSDP logits path" in served and "FSDP fused path" not in served, message
    assert ("FSDP fused path: not served (VeOmniLikeEngineWithLMHead.prepare_model_inputs replaces "
            "FSDPEngineWithLMHead's" in not_served), message
    assert "FSDP fused sum_pi_squared: not served (VeOmniLikeEngineWithLMHead" in not_served, message
    lines = _engine_lines(caplog, KeepsTheRouteEngine, "rlk_keeps_route")
    assert len(lines) == 1 and lines[0][0] == "INFO" and "is served by rl-kernels: FSDP fused path" in lines[0][1]


def test_verls_veomni_engine_is_not_reported_served(caplog):
    """verl's own VeOmniEngineWithLMHead, where the veomni package is installed."""
    pytest.importorskip("veomni", reason="veomni is not installed (verl's VeOmni engine needs it)")
    from verl.workers.engine.veomni.transformer_impl import VeOmniEngineWithLMHead

    lines = _engine_lines(caplog, VeOmniEngineWithLMHead, "veomni")
    assert len(lines) == 1 and lines[0][0] == "WARNING" and "FSDP fused path: not served" in lines[0][1], lines


@pytest.mark.parametrize("name", ["rl_kernel", "rl-kernels", "RL_Kernels"])
def test_a_misspelt_impl_backend_is_refused(qwen2_forward, name):
    """verl only prints "Skipping monkey patch" for an impl_backend it does not know and trains with
    the plain forward: a name close to rl_kernels is refused before the model runs."""
    with pytest.raises(rkv.VerlIntegrationError, match=f"impl_backend={name!r} is not a backend verl or "
                                                       f"rl-kernels knows.*did you mean impl_backend='rl_kernels'"):
        apply_monkey_patch(tiny_qwen2(), use_remove_padding=True, use_fused_kernels=True, fused_kernels_backend=name)


def test_an_unknown_impl_backend_is_warned(qwen2_forward, caplog):
    with caplog.at_level("WARNING", logger="rl_kernels"):
        try:
            apply_monkey_patch(tiny_qwen2(), use_remove_padding=True, use_fused_kernels=True,
                               fused_kernels_backend="cutlass_xyz")
        except Exception:  # noqa: BLE001 - whatever verl does with the name is verl's
            pass
    assert any("impl_backend='cutlass_xyz' is not one of verl's fused backends" in m for m in caplog.messages)
