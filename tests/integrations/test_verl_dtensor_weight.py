"""The fused path with an FSDP2-sharded lm_head weight (a DTensor), two gloo ranks on CPU.

Each rank holds its own tokens and a Shard(0) slice of the fp32 weight, and the hidden states are
bf16-free float32 here (the cast path is covered by the end-to-end test). The weight's gradient
must come back as FSDP2 would produce it: each rank's shard of the average over ranks of the
full-weight gradients; dh must be the rank's own gradient. Reference: float64 autograd.
"""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tolerances import gamma  # noqa: F401 - the numerical mark (tests/conftest.py): the bounds are checked in the workers

V, H, N = 103, 16, 11  # V odd: uneven Shard(0) slices (52 + 51 rows)
# float32 rounding bounds vs float64 (tests/support/tolerances.py): a log-prob / entropy through a logit's
# dot product (H), the normalizer's sum over V and the entropy's; dh then a sum over V, dW one over both
# ranks' N rows (gloo's all-reduce of the two shards' partial sums one rounding more)
FWD = H + 2 * V
GRAD = FWD + max(V, 2 * N + 1)


def _data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    hidden = torch.randn(N, H, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    g_lp, g_ent = torch.randn(N, generator=g), torch.randn(N, generator=g)
    return hidden, labels, g_lp, g_ent


def _weight():
    return torch.randn(V, H, generator=torch.Generator().manual_seed(7)) * 0.5


def _reference_grads(rank):
    w = _weight().double().requires_grad_()
    dh = None
    for r in range(2):
        hidden, labels, g_lp, g_ent = _data(r)
        h = hidden.double().requires_grad_()
        log_p = (h @ w.T / 0.7).log_softmax(-1)
        lp = log_p.gather(1, labels[:, None])[:, 0]
        ent = -(log_p.exp() * log_p).sum(-1)
        ((g_lp * lp + g_ent * ent).sum() / 2).backward()  # averaged over the two ranks
        if r == rank:
            dh = h.grad * 2  # this rank's own (unaveraged) gradient
    return dh, w.grad


def _worker(rank, init_file):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        import rl_kernels.integrations.verl as rkv

        mesh = init_device_mesh("cpu", (2,))
        weight = distribute_tensor(_weight(), mesh, [Shard(0)]).requires_grad_()
        hidden, labels, g_lp, g_ent = _data(rank)
        hidden.requires_grad_()
        rkv.configure(backend="torch")
        lp, ent = rkv.fused_log_probs_entropy(hidden, weight, labels, 0.7)
        (g_lp * lp + g_ent * ent).sum().backward()
        ref_dh, ref_dw = _reference_grads(rank)
        from tolerances import assert_close_f32, head_magnitude

        m = head_magnitude(torch.cat([_data(r)[0] for r in range(2)]), _weight(), 0.7)
        assert_close_f32(hidden.grad, ref_dh, depth=GRAD, logits=m, floor=0, msg=f"rank {rank}'s dh")
        local = weight.grad.to_local()
        rows = torch.arange(V).chunk(2)[rank]
        assert_close_f32(local, ref_dw[rows], depth=GRAD, logits=m, floor=0, msg=f"rank {rank}'s dW shard")
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsdp2_sharded_weight_gradient_is_averaged_shard(tmp_path):
    mp.spawn(_worker, args=(str(tmp_path / "init"),), nprocs=2, join=True)
