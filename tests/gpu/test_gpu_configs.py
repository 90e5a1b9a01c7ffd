"""Every configuration class on the GPU we have (``pytest -m gpu``).

* Shared memory: every kernel of every class is compiled, for each dtype, for that class's GPU
  target (the class's ``targets``: sm90 hopper, sm80 ampere, sm86 / sm89 / sm120 ada, sm80 small) without launching it (the
  driver's target is overridden during a compile-only ``warmup`` run), and the compiled kernel's
  ``shared`` bytes must fit the class's limit: a configuration that would crash on an A100 or an
  L40S fails here without owning one.
* Numerics: each class runs on this GPU (non-TMA classes take the pointer path) for bf16, fp16
  and fp32: log-probs / entropy vs float64 (fp32: within twice torch's own float32 eager error and
  <= 2e-5; 16-bit: <= 5e-5), dh / dW, batch invariance and run-to-run identity, at an odd
  vocabulary; and every head of the registry (tests/support/heads.py), values and gradients vs float64.
"""
import contextlib
import os

import pytest
import torch

from rl_kernels import linear_jsd, linear_log_probs, logits_stats
from rl_kernels.ops import config as config_mod
from rl_kernels.ops.launch import TRITON_LAUNCH_ENV
import importlib

kernels_mod = importlib.import_module("rl_kernels.ops.logits")
from rl_kernels.tools.reference import make_inputs, reference_linear_grads, reference_linear_log_probs, rel_err

import heads
from heads import HEADS


pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@contextlib.contextmanager
def compile_only_for(arch: int, compiled: list):
    """Kernels launched inside are compiled for sm_<arch> and not run; the CompiledKernels are
    appended to ``compiled``."""
    import triton
    from triton.backends.compiler import GPUTarget

    import importlib
    import pkgutil

    import rl_kernels.ops

    # every kernel of every family's file in rl_kernels/ops (a new family's kernels included)
    modules = [importlib.import_module(f"rl_kernels.ops.{m.name}")
               for m in pkgutil.iter_modules(rl_kernels.ops.__path__)]

    driver = triton.runtime.driver.active
    saved_target = driver.get_current_target
    kernels = [v for mod in modules for v in vars(mod).values()
               if isinstance(v, triton.runtime.jit.JITFunction) and v.__name__.endswith("_kernel")]
    saved_runs = [k.run for k in kernels]

    def make_run(orig):
        def run(*args, **kwargs):
            kwargs["warmup"] = True
            compiled.append(orig(*args, **kwargs))
        return run
    def forget():  # a kernel's per-device cache holds the target it was made for: start afresh
        for k in kernels:
            k.device_caches.clear()
    driver.get_current_target = lambda: GPUTarget("cuda", arch, 32)
    forget()
    for k, orig in zip(kernels, saved_runs):
        k.run = make_run(orig)
    # every launch through Triton's path (the patched run above): the direct launch path
    # (ops.launch) would run a kernel it compiled earlier, or keep one compiled for this target
    saved_env = os.environ.get(TRITON_LAUNCH_ENV)
    os.environ[TRITON_LAUNCH_ENV] = "1"
    try:
        yield
    finally:
        if saved_env is None:
            os.environ.pop(TRITON_LAUNCH_ENV)
        else:
            os.environ[TRITON_LAUNCH_ENV] = saved_env
        driver.get_current_target = saved_target
        forget()
        for k, orig in zip(kernels, saved_runs):
            k.run = orig


@pytest.mark.parametrize("name", sorted(config_mod.CLASSES))
def test_every_kernel_fits_the_class_shared_memory_on_its_target(monkeypatch, name):
    cls = config_mod.CLASSES[name]
    monkeypatch.setenv(config_mod.CONFIG_CLASS_ENV, name)
    report = []
    for arch in cls.targets:
        for dtype in DTYPES:
            if arch < 80 and dtype == torch.bfloat16:
                continue
            compiled = []
            hidden, weight, labels = make_inputs(256, 512, 4099, dtype, seed=1, device="cuda", w_scale=0.02)
            th, tw, _ = make_inputs(256, 512, 4099, dtype, seed=2, device="cuda", w_scale=0.02)
            hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            with compile_only_for(arch, compiled):
                out = linear_log_probs(hx, wx, labels, return_sum_pi_squared=True)
                (out.log_probs.sum() + out.entropy.sum() + out.sum_pi_squared.sum()).backward()
                hx.grad = wx.grad = None
                linear_jsd(hx, wx, th, tw, beta=0.5).backward()
                x = (hidden @ weight.T).requires_grad_()
                for two_level in (False, True):
                    monkeypatch.setattr(kernels_mod, "use_two_level", lambda *a, t=two_level: t)
                    st = logits_stats(x, labels, return_sum_pi_squared=True)
                    (st.log_probs.sum() + st.entropy.sum() + st.sum_pi_squared.sum()).backward()
            assert compiled, "nothing was compiled"
            for c in compiled:
                assert c.metadata.target.arch == arch, (c.metadata.name, c.metadata.target)
                shared = c.metadata.shared
                report.append((arch, str(dtype), c.metadata.name, shared))
                assert shared <= cls.smem_limit, (name, arch, dtype, c.metadata.name, shared, cls.smem_limit)
    print(f"\n{name} (limit {cls.smem_limit} B): max shared per kernel",
          sorted({(r[0], r[1], r[2].split('_kernel')[0]): r[3] for r in report}.items()))


def _torch_fp32_error(hidden, weight, labels, ref):
    z = hidden.float() @ weight.float().T
    log_p = torch.log_softmax(z, -1)
    valid = labels != -100
    lp = torch.where(valid, log_p.gather(1, labels.clamp_min(0)[:, None])[:, 0], 0.0)
    return (lp.double() - ref.log_probs).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", sorted(config_mod.CLASSES))
def test_every_class_numerics_invariance_identity_on_this_gpu(monkeypatch, name, dtype):
    monkeypatch.setenv(config_mod.CONFIG_CLASS_ENV, name)
    n, h, v = 1024, 1024, 50257
    hidden, weight, labels = make_inputs(n, h, v, dtype, seed=3, device="cuda", w_scale=0.02)
    g = torch.Generator(device="cuda").manual_seed(4)
    g_lp, g_ent = torch.randn(2, n, device="cuda", generator=g)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = linear_log_probs(hx, wx, labels, backend="triton")
    torch.autograd.backward([out.log_probs, out.entropy], [g_lp, g_ent])
    ref = reference_linear_log_probs(hidden, weight, labels)
    err_lp = (out.log_probs.double() - ref.log_probs).abs().max().item()
    err_ent = (out.entropy.double() - ref.entropy).abs().max().item()
    if dtype == torch.float32:
        bound = min(2e-5, 2 * _torch_fp32_error(hidden, weight, labels, ref) + 1e-6)
    else:
        bound = 5e-5
    assert err_lp <= bound and err_ent <= max(bound, 5e-5), (err_lp, err_ent, bound)
    ref_dh, ref_dw = reference_linear_grads(hidden, weight, labels, g_lp, g_ent)
    gtol = 1e-4 if dtype == torch.float32 else 2.5e-3
    assert rel_err(hx.grad, ref_dh) < gtol and rel_err(wx.grad, ref_dw) < gtol
    # batch invariance (rows anywhere) and run-to-run identity
    part = linear_log_probs(hidden[123:456], weight, labels[123:456], backend="triton")
    assert torch.equal(part.log_probs, out.log_probs.detach()[123:456])
    assert torch.equal(part.entropy, out.entropy.detach()[123:456])
    hx2, wx2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out2 = linear_log_probs(hx2, wx2, labels, backend="triton")
    torch.autograd.backward([out2.log_probs, out2.entropy], [g_lp, g_ent])
    assert torch.equal(out2.log_probs, out.log_probs) and torch.equal(hx2.grad, hx.grad)
    assert torch.equal(wx2.grad, wx.grad)
    # from-logits and JSD in this dtype
    x = (hidden[:256].float() @ weight.float().T).to(dtype)
    s = logits_stats(x, labels[:256], backend="triton")
    ref_x = torch.log_softmax(x.double(), -1)
    valid = labels[:256] != -100
    ref_lp = torch.where(valid, ref_x.gather(1, labels[:256].clamp_min(0)[:, None])[:, 0], 0.0)
    assert (s.log_probs.double() - ref_lp).abs().max() < 5e-5
    th, tw, _ = make_inputs(256, 512, v, dtype, seed=5, device="cuda", w_scale=0.02)
    loss = linear_jsd(hidden[:256], weight, th, tw, beta=0.5, backend="triton")
    from rl_kernels.tools.reference import reference_jsd

    ref_j = reference_jsd(hidden[:256].double(), weight.double(), th.double(), tw.double(),
                          labels[:256], 0.5, 1.0, "mean")
    assert abs(loss.item() - ref_j.item()) <= 1e-4 * max(1.0, abs(ref_j.item()))


@pytest.mark.parametrize("head", sorted(HEADS))
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", sorted(config_mod.CLASSES))
def test_every_class_every_head_against_float64(monkeypatch, name, dtype, head):
    """Every head of the registry (tests/support/heads.py) on each class (as the test above: non-TMA classes
    take the pointer path) and dtype: every output per row and the gradients against float64 from
    the same values, at an odd vocabulary (257 rows, H 512, V 50257), within Head.tolerances
    (16-bit: values 5e-5, gradients the head's tolerance of tests/gpu/test_gpu.py; fp32: 2e-5, 1e-4)."""
    monkeypatch.setenv(config_mod.CONFIG_CLASS_ENV, name)
    print("\n" + name + ": " + heads.check_against_float64(HEADS[head], n=257, h=512, v=50257, dtype=dtype, seed=9))


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16", "fp32"])
def test_topk_kl_vocab_parallel_and_logits_backward_in_every_dtype(dtype):
    """The public functions not covered above, in each dtype on the default class: top-K KL and
    JSD (forward + backward) against float64, the from-logits backward against float64, and the
    vocab-parallel head (forward + backward) and from-logits path on a one-rank NCCL group
    against the unsharded results."""
    import torch.distributed as dist

    from rl_kernels import linear_topk_kl, log_probs_from_logits

    n, h, v, k = 512, 1024, 50257, 16
    hidden, weight, labels = make_inputs(n, h, v, dtype, seed=6, device="cuda", w_scale=0.02)
    g = torch.Generator(device="cuda").manual_seed(7)
    g_lp, g_ent = torch.randn(2, n, device="cuda", generator=g)
    ids = torch.randint(0, v, (n, k), device="cuda", generator=g)
    t_lp = torch.log_softmax(torch.randn(n, k, device="cuda", generator=g), -1)
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_topk_kl(hx, wx, ids, t_lp, reduction="sum")
    loss.backward()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    log_q = torch.log_softmax(h64 @ w64.T, -1).gather(1, ids)
    ref = (t_lp.double().exp() * (t_lp.double() - log_q)).sum()
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-4 * abs(ref.item())
    gtol = 1e-4 if dtype == torch.float32 else 5e-3
    assert rel_err(hx.grad, h64.grad) < gtol and rel_err(wx.grad, w64.grad) < gtol
    # logits backward in the dtype
    x = (hidden.float() @ weight.float().T).to(dtype).requires_grad_()
    log_probs_from_logits(x, labels).sum().backward()
    z = x.detach().double().requires_grad_()
    valid = labels != -100
    torch.where(valid, torch.log_softmax(z, -1).gather(1, labels.clamp_min(0)[:, None])[:, 0], 0.0).sum().backward()
    assert rel_err(x.grad, z.grad) < (1e-5 if dtype == torch.float32 else 5e-3)
    # one-rank NCCL group: bitwise the unsharded results
    if not dist.is_initialized():
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        a = linear_log_probs(hidden, weight, labels, process_group=group)
        b = linear_log_probs(hidden, weight, labels)
        assert torch.equal(a.log_probs, b.log_probs) and torch.equal(a.entropy, b.entropy)
        sa = logits_stats(x.detach(), labels, process_group=group)
        sb = logits_stats(x.detach(), labels)
        assert (sa.log_probs - sb.log_probs).abs().max() <= 1e-6
        # backward through the vocab-parallel head: the unsharded gradients
        grads = []
        for pg in (group, None):
            hp, wp = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            o = linear_log_probs(hp, wp, labels, process_group=pg)
            torch.autograd.backward([o.log_probs, o.entropy], [g_lp, g_ent])
            grads.append((hp.grad, wp.grad))
        assert rel_err(grads[0][0], grads[1][0]) < 1e-6 and rel_err(grads[0][1], grads[1][1]) < 1e-6
    finally:
        dist.destroy_process_group()
    # JSD forward + backward in the dtype vs float64
    th, tw, _ = make_inputs(n, 768, v, dtype, seed=8, device="cuda", w_scale=0.02)
    hj, wj = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_jsd(hj, wj, th, tw, beta=0.5, labels=labels, reduction="sum")
    loss.backward()
    from rl_kernels.tools.reference import reference_jsd

    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    ref = reference_jsd(h64, w64, th.double(), tw.double(), labels, 0.5, 1.0, "sum")
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 1e-4 * abs(ref.item())
    jtol = 1e-4 if dtype == torch.float32 else 5e-3
    assert rel_err(hj.grad, h64.grad) < jtol and rel_err(wj.grad, w64.grad) < jtol
