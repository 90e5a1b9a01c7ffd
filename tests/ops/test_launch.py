"""The direct launch path (``rl_kernels.ops.launch``): its specialization key must separate every
pair of calls that Triton would compile differently (else a binary built for aligned pointers or
16-divisible strides would run on arguments that are not), checked on the CPU against Triton's own
``native_specialize_impl``; on the GPU, the direct launches give the bits of Triton's path."""
import itertools
import random

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import JITFunction

try:
    from triton._C.libtriton import native_specialize_impl
except ImportError:  # pragma: no cover - a Triton without the native binder
    native_specialize_impl = None

from rl_kernels.ops import launch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _kernel(x_ptr, y_ptr, stride, n, scale, flag, check_id, BLOCK: tl.constexpr, MODE: tl.constexpr = 0):
    pass


KERNEL = JITFunction(_kernel, do_not_specialize=["check_id"])
INTS = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, -2**31, -2**31 - 1,
        -2**31 - 16, 2**40, 2**40 + 1, 2**63 - 16, 2**63, 2**63 + 16, 2**64 - 1]
DTYPES = [torch.float32, torch.bfloat16, torch.int32, torch.int64]


def _tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    return torch.empty(64, dtype=dtype)[rng.choice([0, 0, 1, 2, 3, 4, 8, 16])]  # 16-byte aligned or not


def _args(rng: random.Random):
    args = (_tensor(rng), _tensor(rng), rng.choice(INTS), rng.choice(INTS), rng.uniform(-2, 2),
            rng.choice([True, False]), rng.choice(INTS))
    return args, {"BLOCK": rng.choice([16, 32]), "num_warps": rng.choice([4, 8])}


def _triton_spec(args, kwargs) -> tuple:
    """Triton's own specialization of the call (what its cache key is built from)."""
    spec = []
    for p, a in zip(KERNEL.params, args):
        specialize = not p.do_not_specialize
        align = not p.do_not_specialize_on_alignment
        spec.append(native_specialize_impl(BaseBackend, a, p.is_const, specialize, align))
    return tuple(spec) + (kwargs["BLOCK"], kwargs.get("MODE", 0), kwargs["num_warps"])


@pytest.mark.skipif(native_specialize_impl is None, reason="Triton without native_specialize_impl")
def test_key_separates_every_triton_specialization():
    rng = random.Random(0)
    first = _args(rng)
    bind = launch.make_binder(KERNEL.params, *first)
    seen: dict = {}
    specs = set()
    for _ in range(3000):
        args, kwargs = _args(rng)
        key, ordered = bind(*args, **kwargs)
        assert key is not None  # same Python types as the first call
        assert ordered[:7] == args and ordered[7:] == (kwargs["BLOCK"], 0)
        spec = _triton_spec(args, kwargs)
        specs.add(spec)
        assert seen.setdefault(key, spec) == spec, f"one key for two Triton specializations: {args}"
    assert len(specs) > 50  # the draw covered many specialization classes (the test can fail)


def test_key_is_none_for_other_types_and_binder_for_unknown_types():
    rng = random.Random(1)
    args, kwargs = _args(rng)
    bind = launch.make_binder(KERNEL.params, args, kwargs)
    other = list(args)
    other[2] = float(other[2])  # a float where an int was: Triton would type it fp32
    assert bind(*other, **kwargs) == (None, None)
    other = list(args)
    other[5] = int(other[5])  # an int where a bool was
    assert bind(*other, **kwargs) == (None, None)
    assert launch.make_binder(KERNEL.params, (object(),) + args[1:], kwargs) is None


def test_int_width_classes_do_not_collide():
    """i32 / i64 / u64 of a do-not-specialize integer are three keys (True == 1 in a tuple)."""
    bind = launch.make_binder(KERNEL.params, *_args(random.Random(2)))
    base, kwargs = _args(random.Random(3))
    keys = {bind(*base[:6], v, **kwargs)[0] for v in (5, 2**40, 2**63 + 5)}
    assert len(keys) == 3


def test_interpreter_takes_tritons_path(monkeypatch):
    if not launch.interpreting():
        pytest.skip("CPU interpreter only")
    calls = []

    class Fake:
        params = KERNEL.params

        def __getitem__(self, grid):
            return lambda *a, **k: calls.append((grid, a, k))

    launcher = launch.Launcher(Fake())
    args, kwargs = _args(random.Random(4))
    launcher[(3,)](*args, **kwargs)
    launcher[(3,)](*args, **kwargs)
    assert len(calls) == 2 and launcher.direct_launches == 0


# ----------------------------------------------------------------------------- GPU


@triton.jit(do_not_specialize=["check_id"])
def _axpy(x_ptr, y_ptr, out_ptr, n, alpha, check_id, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    tl.store(out_ptr + offs, alpha * x + y + check_id, mask=mask)


@pytest.mark.gpu
@cuda
def test_direct_launch_equals_tritons_path_on_misaligned_views():
    """Aligned, then misaligned (offset) views, bf16 and fp32: each class compiles once through
    Triton, later calls go direct, and every result equals the float64 formula."""
    launcher = launch.Launcher(_axpy)
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(5000, device="cuda", generator=g)
    for dtype, offset, n in itertools.product((torch.float32, torch.bfloat16), (0, 1, 3, 8), (1000, 1024, 1)):
        x, y = base.to(dtype)[offset:offset + n], base.flip(0).to(dtype)[offset:offset + n]
        for _ in range(3):
            out = torch.full((n,), float("nan"), device="cuda")  # poisoned
            launcher[(-(-n // 256),)](x, y, out, n, 0.5, 7, BLOCK=256)
            want = 0.5 * x.double() + y.double() + 7
            torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-6)
    assert launcher.direct_launches >= 2 * 4 * 3 * 2  # calls after each class's first went direct


@pytest.mark.gpu
@cuda
def test_from_logits_direct_launch_is_bitwise_tritons(monkeypatch):
    import rl_kernels
    from rl_kernels.ops import logits as ls

    g = torch.Generator(device="cuda").manual_seed(1)
    logits = (3 * torch.randn(300, 5000, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, 5000, (300,), device="cuda", generator=g)
    g_lp = torch.randn(300, device="cuda", generator=g)

    def run():
        x = logits.clone().requires_grad_()
        out = rl_kernels.logits_stats(x, labels)
        (out.log_probs * g_lp + out.entropy).sum().backward()
        return out.log_probs, out.entropy, out.lse, x.grad

    run()  # first calls: Triton's path, which compiles
    before = ls._FWD.direct_launches
    direct = run()
    assert ls._FWD.direct_launches > before
    monkeypatch.setenv(launch.TRITON_LAUNCH_ENV, "1")
    via_triton = run()
    for a, b in zip(direct, via_triton):
        assert torch.equal(a, b)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n,v", [(1, 4096), (3, 100), (1, 40000), (37, 16384)])
def test_from_logits_two_level_with_specialized_sizes(n, v):
    """Sizes that Triton turns into constants (a single row, a single split: the integer 1) in
    both launch shapes: equal bits, and the float64 values (the kernel addresses its packed
    output and partial blocks with them)."""
    from rl_kernels.autograd.logits import LogitsParams
    from rl_kernels.core.backends import get_backend
    from rl_kernels.ops import logits_config, logits_forward

    g = torch.Generator(device="cuda").manual_seed(n * v)
    x = (3 * torch.randn(n, v, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    params = LogitsParams(backend=get_backend("triton", x.device), inv_temperature=1.0, ignore_index=-100,
                          return_entropy=True, name="test", return_mean_log_p=True, return_sum_pi_squared=True)
    cfg = logits_config(x.device)
    paths = [logits_forward(x, labels, params, cfg, two_level=t, last_combines=c)
             for t, c in ((False, None), (True, True), (True, False))]
    lp64 = x.double().log_softmax(-1)
    p64 = lp64.exp()
    ref = {"log_probs": lp64.gather(1, labels[:, None])[:, 0], "entropy": -(p64 * lp64).sum(-1),
           "lse": torch.logsumexp(x.double(), -1), "mean_log_p": lp64.mean(-1),
           "sum_pi_squared": (p64 * p64).sum(-1)}
    for key, want in ref.items():
        assert torch.equal(paths[0][key], paths[1][key]) and torch.equal(paths[0][key], paths[2][key]), key
        torch.testing.assert_close(paths[1][key].double(), want, rtol=1e-5, atol=2e-5, msg=key)


@pytest.mark.gpu
@cuda
def test_one_launch_combine_is_race_free():
    """The one-launch two-level forward (the last split of a row merges it, after an acq_rel count)
    against the two-launch one, 30 times on 512 x 152064 bf16 (10 splits per row, programs finishing
    in any order): every run bitwise equal; the row counters are zero again after each run."""
    from rl_kernels.autograd.logits import LogitsParams
    from rl_kernels.core.backends import get_backend
    from rl_kernels.ops import logits_config, logits_forward
    from rl_kernels.ops import logits as ls

    g = torch.Generator(device="cuda").manual_seed(7)
    x = (3 * torch.randn(512, 152064, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, 152064, (512,), device="cuda", generator=g)
    params = LogitsParams(backend=get_backend("triton", x.device), inv_temperature=1.0, ignore_index=-100,
                          return_entropy=True, name="test", return_sum_pi_squared=True)
    cfg = logits_config(x.device)
    want = logits_forward(x, labels, params, cfg, two_level=True, last_combines=False)
    for _ in range(30):
        got = logits_forward(x, labels, params, cfg, two_level=True, last_combines=True)
        for key in ("log_probs", "entropy", "lse", "sum_pi_squared", "row_max", "log_sum"):
            assert torch.equal(got[key], want[key]), key
    torch.cuda.synchronize()
    assert all(int(buf.abs().sum()) == 0 for buf in ls._counters.values())
