"""The float64 oracles of ``rl_kernels.tools.reference`` on their own: (a) against values computed by
hand or with Python's ``math`` on lists (no torch in the expected values), including dh / dW by
central differences of a pure-Python loss; (b) against the torch backend run in float64 on fresh
random inputs (two independent computations of the same definition agreeing to ~1e-10); (c) the
oracle module imports nothing of the backends. Outputs are made under ``poison`` (uninitialized
memory is NaN), inputs are random and never zero."""
from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import rl_kernels.tools.reference as reference
from rl_kernels.logits import logits_stats
from rl_kernels.tools.reference import (dense_linear_log_probs, reference_jsd, reference_linear_grads,
                                        reference_linear_log_probs, reference_logits_stats)
from rl_kernels.autograd.linear_jsd import JSDParams
from rl_kernels.autograd.linear import HeadOutputs, HeadParams
from rl_kernels.core.backends import get_backend
from rl_kernels.torch_ops.linear import torch_dlogits, torch_forward
from rl_kernels.torch_ops.linear_jsd import torch_jsd_sums
from tolerances import assert_close_f32, logits_magnitude

TORCH = get_backend("torch", torch.device("cpu"))


def _head(inv_temperature, return_entropy=True, softcap=None, return_sum_pi_squared=False):
    return HeadParams(backend=TORCH, inv_temperature=inv_temperature, ignore_index=-100,
                      return_entropy=return_entropy, return_sum_pi_squared=return_sum_pi_squared, softcap=softcap)

# ---------------------------------------------------------------- pure Python (math on lists)


def py_row(z, label=None):
    """(log p_label, entropy, lse, sum p^2) of one row of logits z (a list), with math only."""
    m = max(z)
    lse = m + math.log(sum(math.exp(v - m) for v in z))
    log_p = [v - lse for v in z]
    p = [math.exp(v) for v in log_p]
    ent = -sum(pi * li for pi, li in zip(p, log_p) if pi > 0)
    return (None if label is None else log_p[label]), ent, lse, sum(pi * pi for pi in p)


def py_logits(h, w, temperature, softcap=None):
    """Rows of z_v = (h . w_v) / T, or c tanh((h . w_v) / c) / T."""
    out = []
    for hi in h:
        row = []
        for wv in w:
            raw = sum(a * b for a, b in zip(hi, wv))
            row.append((raw if softcap is None else softcap * math.tanh(raw / softcap)) / temperature)
        out.append(row)
    return out


def py_head(h, w, labels, temperature, softcap=None, ignore_index=-100):
    """Per row (log p, entropy, sum p^2), 0 where the label is ignore_index."""
    res = []
    for z, y in zip(py_logits(h, w, temperature, softcap), labels):
        if y == ignore_index:
            res.append((0.0, 0.0, 0.0))
        else:
            lp, ent, _, sq = py_row(z, y)
            res.append((lp, ent, sq))
    return res


def close(got, want, tol):
    got = [float(x) for x in torch.as_tensor(got).reshape(-1).tolist()]
    want = [float(x) for x in want]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= tol * max(1.0, abs(w)), (got, want)


H2 = [[0.3, -1.2], [2.0, 0.7]]                       # 2 tokens, H = 2
W3 = [[1.5, -0.4], [-0.8, 0.9], [0.25, 1.1]]          # V = 3


def t64(x):
    return torch.tensor(x, dtype=torch.float64)

# ---------------------------------------------------------------- (a) hand-computed values


def test_logits_stats_by_hand(poison):
    """Rows whose statistics are closed forms: a uniform row (p = 1/3) and z = log(1, 2, 3)
    (p = 1/6, 2/6, 3/6); temperature 0.5 doubles the given logits."""
    logits = t64([[1.0, 1.0, 1.0], [0.0, math.log(2) / 2, math.log(3) / 2]]).add(0.75)  # shift: no zeros
    labels = torch.tensor([1, 2])
    ref = reference_logits_stats(logits, labels, temperature=0.5, chunk_elements=3)  # one row per chunk
    ent1 = -(1 / 6 * math.log(1 / 6) + 2 / 6 * math.log(2 / 6) + 3 / 6 * math.log(3 / 6))
    close(ref.log_probs, [-math.log(3), math.log(3 / 6)], 1e-14)
    close(ref.entropy, [math.log(3), ent1], 1e-14)
    close(ref.lse, [2.0 + 1.5 + math.log(3), 1.5 + math.log(6)], 1e-14)
    close(ref.sum_pi_squared, [1 / 3, (1 + 4 + 9) / 36], 1e-14)
    assert ref.log_probs.dtype == torch.float64 and ref.log_probs.shape == (2,)


def test_logits_stats_math_module(poison):
    """A 2 x 3 x 4 case with an ignored label and a -inf logit (a masked vocab entry: p = 0, it
    adds nothing), against ``math`` on lists; without labels lse / entropy are unmasked."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(2, 3, 4, generator=g, dtype=torch.float64) * 2 + 0.1)
    x[1, 0, 2] = float("-inf")
    labels = torch.tensor([[3, -100, 0], [1, 2, 2]])
    ref = reference_logits_stats(x, labels, temperature=0.7, chunk_elements=5)
    want = [py_row([v / 0.7 for v in row], None if y == -100 else y)
            for row, y in zip(x.reshape(-1, 4).tolist(), labels.reshape(-1).tolist())]
    keep = [y != -100 for y in labels.reshape(-1).tolist()]
    close(ref.log_probs, [w[0] if k else 0.0 for w, k in zip(want, keep)], 1e-13)
    close(ref.entropy, [w[1] if k else 0.0 for w, k in zip(want, keep)], 1e-13)
    close(ref.lse, [w[2] for w in want], 1e-13)
    close(ref.sum_pi_squared, [w[3] if k else 0.0 for w, k in zip(want, keep)], 1e-13)
    assert ref.log_probs.shape == (2, 3) and torch.isfinite(ref.entropy).all()
    bare = reference_logits_stats(x, temperature=0.7)
    assert bare.log_probs is None
    close(bare.entropy, [w[1] for w in want], 1e-13)


@pytest.mark.parametrize("softcap", [None, 1.3])
def test_linear_log_probs_math_module(poison, softcap):
    """Linear head 2 tokens x H 2 x V 3, with and without a cap that bends these logits."""
    for labels in ([1, 2], [0, -100]):
        want = py_head(H2, W3, labels, 0.7, softcap)
        ref = reference_linear_log_probs(t64(H2).float(), t64(W3).float(), torch.tensor(labels),
                                         temperature=0.7, softcap=softcap, chunk_elements=3)
        want32 = py_head([[float(torch.tensor(v).float()) for v in r] for r in H2],
                         [[float(torch.tensor(v).float()) for v in r] for r in W3], labels, 0.7, softcap)
        close(ref.log_probs, [w[0] for w in want32], 1e-13)
        close(ref.entropy, [w[1] for w in want32], 1e-13)
        close(ref.sum_pi_squared, [w[2] for w in want32], 1e-13)
        lp, ent = dense_linear_log_probs(t64(H2), t64(W3), torch.tensor(labels), 0.7, softcap=softcap)
        close(lp, [w[0] for w in want], 1e-13)
        close(ent, [w[1] for w in want], 1e-13)
    if softcap is not None:  # the cap changed the values (else the case tests nothing)
        plain = py_head(H2, W3, [1, 2], 0.7)
        assert abs(plain[1][0] - py_head(H2, W3, [1, 2], 0.7, softcap)[1][0]) > 0.1


@pytest.mark.parametrize("softcap", [None, 1.3])
@pytest.mark.parametrize("which", ["both", "log_probs", "entropy"])
def test_linear_grads_finite_differences(poison, softcap, which):
    """dh, dW of sum(g_lp log p + g_H H) against central differences of the pure-Python loss;
    the ignored row gets dh = 0."""
    labels = [2, -100, 0]
    h = H2 + [[-0.6, 1.4]]
    g_lp, g_ent = [0.7, -1.3, -0.4], [-0.9, 0.5, 1.6]
    use_lp, use_ent = which in ("both", "log_probs"), which in ("both", "entropy")

    def loss(hh, ww):
        return sum((gl * lp if use_lp else 0.0) + (ge * ent if use_ent else 0.0)
                   for (lp, ent, _), gl, ge in zip(py_head(hh, ww, labels, 0.8, softcap), g_lp, g_ent))

    def num_grad(x, f):
        eps = 1e-6
        out = []
        for i in range(len(x)):
            row = []
            for j in range(len(x[0])):
                up = [r[:] for r in x]
                dn = [r[:] for r in x]
                up[i][j] += eps
                dn[i][j] -= eps
                row.append((f(up) - f(dn)) / (2 * eps))
            out.append(row)
        return out

    dh_num = num_grad(h, lambda hh: loss(hh, W3))
    dw_num = num_grad(W3, lambda ww: loss(h, ww))
    dh, dw = reference_linear_grads(t64(h), t64(W3), torch.tensor(labels),
                                    t64(g_lp) if use_lp else None, t64(g_ent) if use_ent else None,
                                    0.8, chunk=2, softcap=softcap)
    assert dh.dtype == dw.dtype == torch.float64 and dh.shape == (3, 2) and dw.shape == (3, 2)
    close(dh, sum(dh_num, []), 1e-8)
    close(dw, sum(dw_num, []), 1e-8)
    assert torch.equal(dh[1], torch.zeros(2, dtype=torch.float64))
    assert float(dh.abs().max()) > 1e-2 and float(dw.abs().max()) > 1e-2


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_jsd_math_module(beta):
    """Generalized JSD x T^2 against ``math``: q student, p teacher, M = beta p + (1 - beta) q;
    beta 0: KL(p||q), beta 1: KL(q||p); the four reductions, one position ignored."""
    t = 1.4
    hs, ws = H2 + [[-0.6, 1.4]], W3
    ht, wt = [[0.9, 0.2, -0.5], [-1.1, 0.4, 0.8], [0.35, -0.7, 1.3]], [[0.5, -1.0, 0.3], [1.2, 0.6, -0.2],
                                                                       [-0.4, 0.8, 0.9]]
    labels = [1, -100, 2]

    def probs(z):
        m = max(z)
        s = sum(math.exp(v - m) for v in z)
        return [math.exp(v - m) / s for v in z]

    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)

    per = []
    for zs, zt, y in zip(py_logits(hs, ws, t), py_logits(ht, wt, t), labels):
        q, p = probs(zs), probs(zt)
        if beta == 0.0:
            d = kl(p, q)
        elif beta == 1.0:
            d = kl(q, p)
        else:
            m = [beta * a + (1 - beta) * b for a, b in zip(p, q)]
            d = beta * kl(p, m) + (1 - beta) * kl(q, m)
        per.append(0.0 if y == -100 else d * t * t)
    args = (t64(hs), t64(ws), t64(ht), t64(wt), torch.tensor(labels), beta, t)
    close(reference_jsd(*args, "none"), per, 1e-13)
    close(reference_jsd(*args, "sum"), [sum(per)], 1e-13)
    close(reference_jsd(*args, "mean"), [sum(per) / 2], 1e-13)
    close(reference_jsd(*args, "batchmean"), [sum(per) / 3], 1e-13)
    assert min(per[0], per[2]) > 1e-3


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_non_finite_row_stays_in_its_row(poison, softcap):
    """A hidden row with inf gives non-finite log-prob and entropy in that row only (under a cap
    an infinite raw logit is NaN, not +-c); a NaN logit row likewise for the logits oracle."""
    g = torch.Generator().manual_seed(4)
    h = torch.randn(5, 6, generator=g) + 0.05
    w = torch.randn(9, 6, generator=g) + 0.05
    labels = torch.randint(0, 9, (5,), generator=g)
    bad = h.clone()
    bad[2, 1] = float("inf")
    ref = reference_linear_log_probs(bad, w, labels, softcap=softcap, chunk_elements=18)
    clean = reference_linear_log_probs(h, w, labels, softcap=softcap)
    ok = torch.arange(5) != 2
    assert not torch.isfinite(ref.log_probs[2]) and not torch.isfinite(ref.entropy[2])
    assert torch.equal(ref.log_probs[ok], clean.log_probs[ok]) and torch.equal(ref.entropy[ok], clean.entropy[ok])
    lp, ent = dense_linear_log_probs(bad, w, labels, softcap=softcap)
    assert not torch.isfinite(lp[2]) and not torch.isfinite(ent[2]) and torch.isfinite(lp[ok]).all()
    x = h @ w.T
    x[3, 4] = float("nan")
    st = reference_logits_stats(x, labels)
    assert not torch.isfinite(st.entropy[3]) and not torch.isfinite(st.log_probs[3])
    assert torch.isfinite(st.entropy[ok & (torch.arange(5) != 3)]).all()


def test_linear_grads_ignored_non_finite_row_contributes_nothing(poison):
    """A non-finite hidden row whose label is ignore_index is left out of dh and dW (selected out,
    not multiplied by 0), as ``linear_log_probs`` documents; a counted one makes dW non-finite."""
    hidden, weight, labels = _random(12, n=9)
    labels[4] = -100
    g = torch.Generator().manual_seed(13)
    g_lp, g_ent = torch.randn(2, 9, generator=g, dtype=torch.float64)
    clean = reference_linear_grads(hidden, weight, labels, g_lp, g_ent, 0.9, chunk=4, softcap=2.0)
    bad = hidden.clone()
    bad[4, 3] = float("inf")
    dh, dw = reference_linear_grads(bad, weight, labels, g_lp, g_ent, 0.9, chunk=4, softcap=2.0)
    assert torch.equal(dh, clean[0]) and torch.equal(dw, clean[1]) and torch.isfinite(dw).all()
    labels[4] = 1
    dh, dw = reference_linear_grads(bad, weight, labels, g_lp, g_ent, 0.9, chunk=4, softcap=2.0)
    assert not torch.isfinite(dw).all() and torch.isfinite(dh[torch.arange(9) != 4]).all()


def test_bad_arguments_raise():
    h, w, y = torch.randn(2, 3) + 0.1, torch.randn(4, 3) + 0.1, torch.tensor([0, 4])
    with pytest.raises(ValueError, match="labels"):
        reference_linear_log_probs(h, w, y)
    with pytest.raises(ValueError, match="labels"):
        reference_logits_stats(h @ w.T, y)
    with pytest.raises(ValueError, match="temperature"):
        reference_linear_log_probs(h, w, y.clamp(max=3), temperature=0.0)
    with pytest.raises(ValueError, match="softcap"):
        reference_linear_log_probs(h, w, y.clamp(max=3), softcap=-1.0)

# ---------------------------------------------------------------- (b) vs the torch backend in float64


def _random(seed, n=37, h=16, v=53, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64) + 0.01
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * (scale * 2 / h ** 0.5) + 0.001
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < 0.25] = -100
    assert (labels == -100).any() and (labels != -100).any()
    return hidden, weight, labels


@pytest.mark.parametrize("seed,temperature,softcap", [(1, 1.0, None), (2, 0.8, 3.0), (3, 1.7, 0.9)])
def test_linear_log_probs_vs_torch_backend_float64(poison, seed, temperature, softcap):
    hidden, weight, labels = _random(seed, scale=3.0)
    ref = reference_linear_log_probs(hidden, weight, labels, temperature=temperature, softcap=softcap,
                                     chunk_elements=7 * 53)
    lp, ent, lse, sq = torch_forward(hidden, weight, labels, _head(1.0 / temperature, True, softcap, True),
                                     torch.float64, chunk_elements=5 * 53)
    for got, want in ((ref.log_probs, lp), (ref.entropy, ent), (ref.sum_pi_squared, sq)):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert float(ref.log_probs.abs().max()) > 0.5 and float(ref.entropy.abs().min()) == 0.0
    lp_d, ent_d = dense_linear_log_probs(hidden, weight, labels, temperature, softcap=softcap)
    torch.testing.assert_close(lp_d, lp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ent_d, ent, rtol=1e-10, atol=1e-10)
    # the logits oracle on the same (uncapped, else capped by hand) logits: same lse as the head
    raw = hidden @ weight.T
    logits = raw if softcap is None else softcap * torch.tanh(raw / softcap)
    st = reference_logits_stats(logits, labels, temperature=temperature, chunk_elements=100)
    torch.testing.assert_close(st.lse, lse, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st.log_probs, lp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st.entropy, ent, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(st.sum_pi_squared, sq, rtol=1e-10, atol=1e-10)


def test_logits_stats_vs_public_torch_backend(poison):
    """The public ``logits_stats`` (torch backend, float32 accumulation) within float32 error."""
    hidden, weight, labels = _random(8)
    x = (hidden @ weight.T).float()
    got = logits_stats(x, labels, temperature=0.6, return_sum_pi_squared=True, backend="torch")
    ref = reference_logits_stats(x, labels, temperature=0.6)
    # float32 rounding bounds (tests/support/tolerances.py), from materialized logits: 1/T rounded and the product
    # by it (2), the row's sums over its V columns; sum p^2 a sum of positive terms, its error relative (floor 0):
    # each p's twice (the square) plus the sum's own
    v, m = x.shape[-1], logits_magnitude(x, 0.6)
    for name in ("log_probs", "entropy", "lse"):
        assert_close_f32(getattr(got, name), getattr(ref, name), depth=v + 2, logits=m, msg=name)
    assert_close_f32(got.sum_pi_squared, ref.sum_pi_squared, depth=2 * (v + 2) + v, logits=m, floor=0,
                     msg="sum_pi_squared")


@pytest.mark.parametrize("seed,temperature,softcap,grads", [
    (4, 1.0, None, "both"), (5, 0.7, 2.5, "both"), (6, 1.3, None, "log_probs"), (7, 0.9, 1.5, "entropy")])
def test_linear_grads_vs_torch_backend_float64(poison, seed, temperature, softcap, grads):
    """Autograd through the definition vs the torch twin's hand-derived dlogits, both float64."""
    hidden, weight, labels = _random(seed, scale=2.0)
    g = torch.Generator().manual_seed(seed + 100)
    g_lp = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64) if grads != "entropy" else None
    g_ent = torch.randn(hidden.shape[0], generator=g, dtype=torch.float64) if grads != "log_probs" else None
    dh, dw = reference_linear_grads(hidden, weight, labels, g_lp, g_ent, temperature, chunk=6, softcap=softcap)
    inv_t = 1.0 / temperature
    params = _head(inv_t, True, softcap)
    _, ent, lse, _ = torch_forward(hidden, weight, labels, params, torch.float64)
    dz = torch.zeros(hidden.shape[0], weight.shape[0], dtype=torch.float64)
    torch_dlogits(hidden, weight, labels, HeadOutputs(None, ent, lse), HeadOutputs(g_lp, g_ent),
                  slice(0, hidden.shape[0]), slice(0, weight.shape[0]), dz, params)
    torch.testing.assert_close(dh, dz @ weight, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dw, dz.T @ hidden, rtol=1e-10, atol=1e-10)
    assert float(dw.abs().max()) > 1e-2 and torch.equal(dh[labels == -100], torch.zeros_like(dh[labels == -100]))


@pytest.mark.parametrize("beta,temperature", [(0.0, 0.8), (0.5, 1.0), (0.2, 1.6), (1.0, 1.2)])
def test_jsd_vs_torch_backend_float64(poison, beta, temperature):
    hs, ws, labels = _random(9)
    ht, wt, _ = _random(10, h=12)
    inv_t = 1.0 / temperature
    none = torch.full_like(labels, -100)
    lse_s = torch_forward(hs, ws, none, _head(inv_t, False), torch.float64)[2]
    lse_t = torch_forward(ht, wt, none, _head(inv_t, False), torch.float64)[2]
    loss, _ = torch_jsd_sums(hs, ws, ht, wt, lse_s, lse_t, JSDParams(TORCH, inv_t, beta), torch.float64,
                             chunk_elements=8 * 53)
    want = torch.where(labels != -100, loss * temperature ** 2, 0.0)
    ref = reference_jsd(hs, ws, ht, wt, labels, beta, temperature, "none")
    torch.testing.assert_close(ref, want, rtol=1e-10, atol=1e-10)
    assert float(ref.max()) > 1e-2
    n_valid = int((labels != -100).sum())
    torch.testing.assert_close(reference_jsd(hs, ws, ht, wt, labels, beta, temperature, "mean"),
                               want.sum() / n_valid, rtol=1e-10, atol=0)

# ---------------------------------------------------------------- (c) independence


def test_reference_imports_nothing_of_the_backends():
    """reference.py imports only torch, the output NamedTuples and the argument checks: no
    ``rl_kernels.torch_ops``, ``rl_kernels.ops`` (Triton) or ``rl_kernels.autograd`` module, at
    module level or inside a function."""
    tree = ast.parse(Path(reference.__file__).read_text())
    allowed = {"rl_kernels.linear": {"LogProbsOutput"}, "rl_kernels.logits": {"LogitsStats"},
               "rl_kernels.core.validation": {"check_label_values", "check_softcap", "check_temperature"}}
    seen = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                seen.append(alias.name)
                assert alias.name in ("torch", "math"), alias.name
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:  # relative to reference's package
                mod = ".".join(reference.__name__.split(".")[:-node.level] + ([mod] if mod else []))
            seen.append(mod)
            assert not mod.startswith(("rl_kernels.torch_ops", "rl_kernels.ops", "rl_kernels.autograd")), mod
            if mod != "__future__":
                assert mod in allowed, mod
                names = {a.name for a in node.names}
                assert names <= allowed[mod], (mod, names - allowed[mod])
    assert "rl_kernels.linear" in seen  # the walk saw the imports
    src = Path(reference.__file__).read_text()
    for name in ("torch_ops", "capped_logits", "torch_forward", "torch_dlogits", "merge_lse", "soft_cap"):
        assert name not in src.replace("``rl_kernels.torch_ops``", ""), name
