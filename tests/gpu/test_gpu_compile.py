"""GPU: the Triton backend under torch.compile (inductor, fullgraph) and inside CUDA graphs.

* compiled = eager, bitwise, for the fused head, the from-logits statistics and the top-K
  from-logits functions (values and gradients): the compiled route calls the same kernels through the rl_kernels custom ops;
* a training step that uses the fused head (a linear layer before it, the head's log-probs and
  entropy in the loss, backward) is captured in a CUDA graph and replayed with new inputs: the loss
  and every gradient equal an eager step on the same inputs, bitwise; the same for the from-logits
  forward+backward. A bad label inside a replay makes its row NaN and raises at the next eager
  rl_kernels call (the kernels report it through host memory; a replay runs no Python).
"""
import pytest
import torch

import rl_kernels
from rl_kernels.core.label_check import raise_label_errors

pytestmark = pytest.mark.gpu

N, D, H, V = 384, 256, 512, 50_257  # odd vocabulary: partial tiles


def _data(seed, n=N):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, D, device="cuda", generator=g).bfloat16()
    labels = torch.randint(0, V, (n,), device="cuda", generator=g)
    labels[::7] = -100
    logits = (3 * torch.randn(n, V, device="cuda", generator=g)).bfloat16()
    return x, labels, logits


def _model():
    g = torch.Generator(device="cuda").manual_seed(123)
    body = torch.nn.Linear(D, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        body.weight.copy_(torch.randn(H, D, device="cuda", generator=g) * D ** -0.5)
        body.bias.copy_(torch.randn(H, device="cuda", generator=g) * 0.1)
    head = (0.02 * torch.randn(V, H, device="cuda", generator=g)).bfloat16().requires_grad_()
    return body, head


def _head_step(body, head, x, labels):
    out = rl_kernels.linear_log_probs(body(x), head, labels, temperature=0.9)
    loss = -(out.log_probs.sum() + 0.01 * out.entropy.sum()) / N
    loss.backward()
    return loss


def _grads(body, head):
    return [p.grad.clone() for p in (*body.parameters(), head)]


def _zero(body, head):
    for p in (*body.parameters(), head):
        p.grad = None


def test_compiled_equals_eager_bitwise():
    torch.manual_seed(0)
    body, head = _model()
    x, labels, logits = _data(1)

    def head_fn(h, w, y):
        o = rl_kernels.linear_log_probs(h, w, y, temperature=0.9, return_sum_pi_squared=True)
        return o.log_probs, o.entropy, o.sum_pi_squared

    def logits_fn(z, y):
        o = rl_kernels.logits_stats(z, y, temperature=0.9)
        return o.log_probs, o.entropy, o.lse

    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, V, (N, 5), device="cuda", generator=g)
    ids[::5, 1] = ids[::5, 0]  # duplicate ids
    teacher = torch.log_softmax(torch.randn(N, 5, device="cuda", generator=g), -1)

    def topk_fn(z, y):
        return (rl_kernels.topk_log_probs_from_logits(z, ids, temperature=0.9),
                rl_kernels.topk_kl_from_logits(z, ids, teacher, temperature=0.9, labels=y, reduction="none"))

    h = body(x).detach()
    for fn, inputs, diff in ((head_fn, (h, head.detach(), labels), (0, 1)), (logits_fn, (logits, labels), (0,)),
                             (topk_fn, (logits, torch.where(labels == -100, -100, ids[:, 2])), (0,))):
        results = []
        for f in (fn, torch.compile(fn, fullgraph=True, dynamic=True)):
            leaves = [t.clone().requires_grad_() if i in diff else t for i, t in enumerate(inputs)]
            outs = f(*leaves)
            grads = torch.autograd.grad([o.sum() * (k + 1) for k, o in enumerate(outs)],
                                        [leaves[i] for i in diff])
            results.append([o.detach() for o in outs] + list(grads))
        for a, b in zip(*results):
            assert torch.equal(a, b), (fn.__name__, (a.float() - b.float()).abs().max())


def test_cuda_graph_training_step_equals_eager():
    body, head = _model()
    static_x, static_labels, _ = _data(2)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, allocates) off the capture
        for _ in range(3):
            _zero(body, head)
            _head_step(body, head, static_x, static_labels)
    torch.cuda.current_stream().wait_stream(side)
    _zero(body, head)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _head_step(body, head, static_x, static_labels)
    static_grads = [p.grad for p in (*body.parameters(), head)]  # written by every replay
    for seed in (3, 4):
        x, labels, _ = _data(seed)
        static_x.copy_(x)
        static_labels.copy_(labels)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [static_loss.clone()] + [g.clone() for g in static_grads]
        _zero(body, head)
        eager = [_head_step(body, head, x, labels).detach()] + _grads(body, head)
        _zero(body, head)
        for a, b in zip(replayed, eager):
            assert torch.equal(a, b), (a.float() - b.float()).abs().max()

    # a bad label in a replay: its row is NaN, the next eager call raises naming labels
    static_labels[5] = V + 1
    graph.replay()
    torch.cuda.synchronize()
    assert torch.isnan(static_loss)
    with pytest.raises(ValueError, match="labels"):
        raise_label_errors()


def test_cuda_graph_from_logits_equals_eager():
    _, labels, logits = _data(5)
    static_logits = logits.clone().requires_grad_()
    static_labels = labels.clone()
    g_lp = torch.randn(N, device="cuda")

    def step(z, y):
        z.grad = None
        out = rl_kernels.logits_stats(z, y)
        torch.autograd.backward([out.log_probs, out.entropy], [g_lp, 0.5 * g_lp])
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_logits, static_labels)
    torch.cuda.current_stream().wait_stream(side)
    static_logits.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_logits, static_labels)
    _, labels2, logits2 = _data(6)
    with torch.no_grad():
        static_logits.copy_(logits2)
    static_labels.copy_(labels2)
    graph.replay()
    torch.cuda.synchronize()
    replayed = [static_out.log_probs.clone(), static_out.entropy.clone(), static_logits.grad.clone()]
    z = logits2.clone().requires_grad_()
    eager_out = step(z, labels2)
    for a, b in zip(replayed, [eager_out.log_probs, eager_out.entropy, z.grad]):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()


def test_reduce_overhead_from_logits_equals_eager():
    """inductor with its own CUDA graphs (``mode="reduce-overhead"``, cudagraph trees, which warm
    up in a private memory pool that no tensor may outlive): the from-logits forward+backward, few
    rows (the two-level forward), replayed several times with new values, equals eager bitwise."""
    _, labels, logits = _data(11, n=200)
    x = logits.clone().requires_grad_()
    g_lp = torch.randn(200, device="cuda")

    def step(f):
        x.grad = None
        out = f(x, labels)
        torch.autograd.backward([out.log_probs, out.entropy], [g_lp, torch.ones_like(g_lp)])
        return out.log_probs.clone(), out.entropy.clone(), x.grad.clone()

    compiled = torch.compile(lambda z, y: rl_kernels.logits_stats(z, y), fullgraph=True, mode="reduce-overhead")
    for i in range(4):
        with torch.no_grad():
            x.copy_((3 * torch.randn(200, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(i)))
                    .bfloat16())
        got, want = step(compiled), step(rl_kernels.logits_stats)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
