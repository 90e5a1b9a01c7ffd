"""Under TRITON_INTERPRET=1 the kernels run as numpy code, which warns (RuntimeWarning: divide by
zero in log, invalid value in multiply / divide) wherever a lane computes log 0, 0 / 0 or
0 x inf, even a lane that is masked out of every store (issue 46: 38 such lines from
``linear_log_probs``, ``linear_topk_kl`` and ``linear_jsd`` in one small script). Every public
function, forward and backward on the Triton backend, must run without a single warning (the
``python -W error`` of the issue, as a test): on finite input no lane may compute a non-finite
intermediate."""
import warnings

import pytest
import torch

import rl_kernels
from heads import HEADS, K, inputs, teacher
from rl_kernels.core.backends import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="the interpreter's numpy warnings (no GPU run)")


def _no_warnings(f, *leaves):
    """Run ``f()`` (a tuple of outputs) and a backward through every differentiable output with
    every warning recorded; assert none was raised and something reached the leaves."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [o for o in f() if o is not None and o.requires_grad]
        sum((o.float() * torch.linspace(-1, 1, o.numel()).view(o.shape)).sum() for o in outs).backward()
    assert not caught, [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]
    assert any(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves)


@pytest.mark.parametrize("name", sorted(HEADS))
def test_every_public_function_runs_without_a_warning(name):
    """Each head of the registry as the shared tests call it (a row labelled ignore_index, an odd
    vocabulary: the padded columns of the last tile and the masked rows of the last row block)."""
    hidden, weight, logits, labels = inputs()
    _no_warnings(lambda: HEADS[name].call("triton")(hidden, weight, logits, labels), hidden, weight, logits)


def test_linear_topk_runs_without_a_warning():
    hidden, weight, _, _ = inputs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log_probs, _ = rl_kernels.linear_topk(hidden, weight, temperature=0.7, softcap=3.0, k=K, backend="triton")
    assert not caught, [str(w.message) for w in caught]
    assert torch.isfinite(log_probs).all()


@pytest.mark.parametrize("options", [dict(softcap=3.0, return_entropy=False, return_sum_pi_squared=True),
                                     dict(per_row_temperature=True)])
def test_linear_log_probs_options_run_without_a_warning(options):
    hidden, weight, _, labels = inputs()
    options = dict(options)
    temperature = torch.linspace(0.5, 2.0, labels.numel()) if options.pop("per_row_temperature", False) else 0.7
    _no_warnings(lambda: rl_kernels.linear_log_probs(hidden, weight, labels, temperature=temperature, **options,
                                                     backend="triton"), hidden, weight)


@pytest.mark.parametrize("kind", ["forward", "reverse"])
@pytest.mark.parametrize("k", [K, 11])
def test_tail_aware_topk_kl_runs_without_a_warning(kind, k):
    """The tail-aware loss, also with K = V (no tail: its lse is -inf by definition, computed
    without a log of 0)."""
    hidden, weight, logits, labels = inputs(v=11) if k == 11 else inputs()
    ids, teacher_log_probs = teacher(hidden.shape[0], weight.shape[0], k=k)
    for fn, student in ((rl_kernels.linear_topk_kl, (hidden, weight)), (rl_kernels.topk_kl_from_logits, (logits,))):
        _no_warnings(lambda: (fn(*student, ids, teacher_log_probs, temperature=0.7, labels=labels, kind=kind,
                                 tail=True, backend="triton"),), *student)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_linear_jsd_kl_limits_run_without_a_warning(beta):
    hidden, weight, _, labels = inputs()
    _no_warnings(lambda: (rl_kernels.linear_jsd(hidden, weight, hidden.detach().flip(-1), weight.detach().flip(0),
                                                beta=beta, labels=labels, backend="triton"),), hidden, weight)
