"""Configuration classes (GPU generation / shared memory x dtype): every class's tiles fit its
shared-memory budget by the operand-stage estimate, keep the batch-invariance rules, and compute
the right values in the interpreter (bf16 and fp32, linear head forward + backward and JSD) with
bitwise batch invariance. The compiled kernels' own shared memory is checked per class and
target on a GPU (``tests/gpu/test_gpu_configs.py``)."""
import dataclasses

import pytest
import torch

from rl_kernels import linear_jsd, linear_log_probs
from rl_kernels.ops import config as config_mod

from rl_kernels.tools.reference import dense_linear_log_probs, make_inputs, reference_jsd, reference_linear_grads
from tolerances import assert_close_f32, head_magnitude

CLASS_NAMES = sorted(config_mod.CLASSES)


def stage_bytes(cfg, elem, jsd=False):
    """Operand bytes of the software pipeline (what the budget has to hold, before Triton's own
    scratch): stages x (BM + BN) x BK x element size, twice that for the two JSD heads."""
    tiles = [(cfg.block_m, cfg.block_n, cfg.num_stages), (cfg.bwd_cols.block_m, cfg.bwd_cols.block_n,
             cfg.bwd_cols.num_stages), (cfg.bwd_rows.block_m, cfg.bwd_rows.block_n, cfg.bwd_rows.num_stages)]
    if jsd:
        tiles = [(t.block_m, t.block_n, t.num_stages) for t in (cfg.jsd_fwd, cfg.jsd_bwd)]
    return max(st * (bm + bn) * cfg.block_k * elem * (2 if jsd else 1) for bm, bn, st in tiles)


@pytest.mark.parametrize("name", CLASS_NAMES)
def test_every_class_fits_its_budget_and_keeps_the_invariance_rules(name):
    cls = config_mod.CLASSES[name]
    for dtype, elem in ((torch.bfloat16, 2), (torch.float16, 2), (torch.float32, 4)):
        cfg = cls.for_dtype(dtype)
        # room for Triton's layout-conversion scratch: operand stages use at most 70% of the budget
        assert stage_bytes(cfg, elem) <= 0.7 * cls.smem_limit, (name, dtype)
        assert stage_bytes(cfg, elem, jsd=True) <= 0.9 * cls.smem_limit, (name, dtype)
        assert cfg.split_v % cfg.block_n == 0 and cfg.split_v == 1024
        if not cls.tma:
            assert not cfg.tma


def test_one_record_per_class_and_the_device_order():
    """Every class holds all its settings (tiles per dtype, from-logits tiles, budget, targets);
    the device lookup walks CLASSES in order, largest budget first."""
    budgets = [c.smem_limit for c in config_mod.CLASSES.values()]
    assert budgets == sorted(budgets, reverse=True)
    for cls in config_mod.CLASSES.values():
        assert cls.targets and all(isinstance(t, int) for t in cls.targets)
        assert isinstance(cls.logits, config_mod.LogitsConfig) and cls.logits.split_v % cls.logits.block_v == 0
    cpu = torch.device("cpu")
    assert config_mod.device_class(cpu) is config_mod.INTERPRETER
    assert config_mod.logits_config(cpu) is config_mod.INTERPRETER.logits
    forced = dataclasses.replace(config_mod.INTERPRETER_CONFIG, block_k=16)
    with config_mod.forced_config(forced):
        assert config_mod.default_config(cpu) is forced
    assert config_mod.default_config(cpu) is config_mod.INTERPRETER_CONFIG


@pytest.mark.parametrize("device,want", [("NVIDIA H200", "hopper-h200"), ("NVIDIA H100 80GB HBM3", "hopper"),
                                         ("NVIDIA H200 NVL", "hopper-h200"), ("NVIDIA A100-SXM4-80GB", "ampere")])
def test_class_by_device_name_then_budget(monkeypatch, device, want):
    """A class that names a device (the H200's) is chosen for it; any other device gets the
    largest unnamed class its shared memory fits (the H100 never gets the H200's)."""
    import types

    major = 8 if "A100" in device else 9
    smem = 166912 if major == 8 else 232448
    props = types.SimpleNamespace(name=device, major=major, shared_memory_per_block_optin=smem)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.delenv(config_mod.CONFIG_CLASS_ENV, raising=False)
    config_mod._device_class.cache_clear()
    try:
        assert config_mod.config_class(torch.device("cuda", 0)).name == want
    finally:
        config_mod._device_class.cache_clear()
    assert config_mod.HOPPER_H200.bf16 is config_mod.HOPPER.bf16  # the GEMM tiles are the H100's


def test_class_override_by_environment(monkeypatch):
    monkeypatch.setenv(config_mod.CONFIG_CLASS_ENV, "ampere")
    assert config_mod.config_class(torch.device("cuda", 0)) is config_mod.AMPERE
    monkeypatch.setenv(config_mod.CONFIG_CLASS_ENV, "volta")
    with pytest.raises(ValueError, match="RL_KERNELS_CONFIG_CLASS='volta': expected one of"):
        config_mod.config_class(torch.device("cuda", 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", CLASS_NAMES)
def test_every_class_computes_the_head_right_in_the_interpreter(name, dtype):
    cfg = config_mod.CLASSES[name].for_dtype(dtype)
    with config_mod.forced_config(dataclasses.replace(cfg, tma=False)):
        _computes_the_head_right(dtype)


def _computes_the_head_right(dtype):
    n, h, v = 37, 72, 1100  # several splits, a partial last tile, K not a multiple of BK
    hidden, weight, labels = make_inputs(n, h, v, dtype, seed=30)
    g = torch.Generator().manual_seed(31)
    g_lp, g_ent = torch.randn(2, n, generator=g)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, temperature=0.9, backend="triton")
    torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])
    ref_lp, ref_ent = dense_linear_log_probs(hidden, weight, labels, temperature=0.9)
    ref_dh, ref_dw = reference_linear_grads(hidden, weight, labels, g_lp, g_ent, temperature=0.9)
    # float32 rounding bounds (tests/support/tolerances.py): a logit's dot product over H (16-bit inputs are exact
    # in float32 products), 1/T rounded and the product by it (2), the row's sums over V; dh then sums over the V
    # columns, dW over the N rows (a 16-bit gradient: assert_close_f32 adds its own rounding)
    m, fwd = head_magnitude(hidden, weight, 0.9), h + v + 2
    assert_close_f32(out.log_probs, ref_lp, depth=fwd, logits=m, msg="log p")
    assert_close_f32(out.entropy, ref_ent, depth=fwd, logits=m, msg="entropy")
    assert_close_f32(hx.grad, ref_dh, depth=fwd + max(v, n), logits=m, floor=0, msg="dh")
    assert_close_f32(wx.grad, ref_dw, depth=fwd + max(v, n), logits=m, floor=0, msg="dw")
    # batch invariance: the first rows alone give the same bits (the interpreter's numpy dot may
    # round a row differently at another position inside a tile; the GPU test slices anywhere)
    part = linear_log_probs(hidden[:4], weight, labels[:4], temperature=0.9, backend="triton")
    assert torch.equal(part.log_probs, out.log_probs.detach()[:4])
    assert torch.equal(part.entropy, out.entropy.detach()[:4])
    if dtype == torch.float32:  # the JSD tiles of the class too
        th, tw, _ = make_inputs(n, 40, v, dtype, seed=32)
        loss = linear_jsd(hidden, weight, th, tw, beta=0.5, labels=labels, backend="triton")
        ref = reference_jsd(hidden.double(), weight.double(), th.double(), tw.double(), labels, 0.5, 1.0, "mean")
        # the larger hidden size, each head's log-softmax sum and the JSD's over V, 1/T's and T^2's two roundings
        # each, the mean's sum over the N rows + 1
        m = max(head_magnitude(hidden, weight), head_magnitude(th, tw))  # (T = 1)
        assert_close_f32(loss, ref, depth=max(h, 40) + 2 * v + 4 + n + 1, logits=m, msg="JSD")
