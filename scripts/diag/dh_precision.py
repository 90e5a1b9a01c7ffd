"""dh precision of the fused backward vs float64 at one shape (H100 diagnosis of the split-K reduction setting)."""
import torch
from rl_kernels.reference import make_inputs, reference_linear_grads, rel_err
from rl_kernels import ops
n, h, v = 2048, 3584, 151937
hidden, weight, labels = make_inputs(n, h, v, torch.bfloat16, seed=0, device="cuda", w_scale=0.02)
g = torch.Generator(device="cuda").manual_seed(3)
g_lp = torch.randn(n, device="cuda", generator=g); g_ent = torch.randn(n, device="cuda", generator=g)
dh_ref, _ = reference_linear_grads(hidden, weight, labels, g_lp, g_ent, 1.0)
cfg = ops.default_config(hidden.device)
parts = ops.linear_split_stats(hidden, weight, labels, 1.0, True, cfg)
lp, ent, lse = ops.split_combine(*parts, labels, -100, True)
rows = 181
for pad in (False, True):
    ld = (v + 7) // 8 * 8 if pad else v
    for rpr in (True, False):
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = rpr
        dh = torch.empty_like(hidden)
        storage = torch.empty(rows * ld, dtype=torch.bfloat16, device="cuda")
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            dz = storage[: (r1 - r0) * ld].view(r1 - r0, ld)[:, :v]
            ops.linear_dlogits(hidden, weight, labels, lse, ent, g_lp, g_ent, slice(r0, r1), slice(0, v), 1.0, -100, dz, cfg, cfg.bwd_rows)
            torch.mm(dz, weight, out=dh[r0:r1])
        print(f"pad={pad} reduced_precision_reduction={rpr}: rel dh {rel_err(dh, dh_ref):.2e}", flush=True)
# also: full-batch window (all rows) at once
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
dz = torch.empty(n, v, dtype=torch.bfloat16, device="cuda")
ops.linear_dlogits(hidden, weight, labels, lse, ent, g_lp, g_ent, slice(0, n), slice(0, v), 1.0, -100, dz, cfg, cfg.bwd_rows)
print(f"one window, fp32 mm of bf16 dz: rel dh {rel_err(dz.float() @ weight.float(), dh_ref):.2e}; bf16 mm: {rel_err(dz @ weight, dh_ref):.2e}")
