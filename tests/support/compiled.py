"""A shared check of the compiled route: a function traced by torch.compile(fullgraph=True) with no
graph break gives eager's bits, values and gradients, at two batch sizes without recompiling."""
import torch
import torch._dynamo.testing


def assert_compiled_equals_eager(f, inputs, sizes=((9, 8), (13, 9))):
    """``f(x, *rest)`` -> one tensor; ``inputs(n, seed)`` -> (x, *rest), x a leaf that requires grad.
    No graph break; for each (n, seed) of ``sizes`` the compiled function's output and x's gradient
    (of a random weighting of the output) bitwise equal eager's (the same ops' bodies run); the second
    size reuses the first's graph (dynamic shapes). Returns the compiled function."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(*inputs(*sizes[0]))
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for n, seed in sizes:
        args = inputs(n, seed)
        x = args[0]
        up = torch.randn(f(*args).shape, generator=torch.Generator().manual_seed(n))
        outs, grads = [], []
        for fn in (f, compiled):
            x.grad = None
            out = fn(*args)
            (out * up).sum().backward()
            outs.append(out.detach())
            grads.append(x.grad)
        assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
        frames.append(counter.frame_count)
    assert frames[0] == frames[1], "recompiled for a new batch size"
    return compiled
