"""Float64 oracle and input makers shared by the CPU and GPU tests."""
from __future__ import annotations

import torch

from rl_kernels.torch_backend import torch_dlogits, torch_forward


def make_inputs(n, h, v, dtype, *, seed=0, device="cpu", w_scale=None, ignore_frac=0.2,
                lead=None):
    """h ~ N(0, 1), W ~ N(0, w_scale^2) (default 2 / sqrt(H): logits spread of a few nats),
    labels uniform with ``ignore_frac`` of them -100. Never zeros."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (w_scale if w_scale is not None else 2.0 / h ** 0.5)
    labels = torch.randint(0, v, (n,), generator=g)
    labels[torch.rand(n, generator=g) < ignore_frac] = -100
    if lead is not None:
        hidden, labels = hidden.view(*lead, h), labels.view(*lead)
    return hidden.to(device, dtype), weight.to(device, dtype), labels.to(device)


def naive_reference(hidden, weight, labels, temperature=1.0, ignore_index=-100):
    """Materialized float64 log_softmax; differentiable (tests take dh, dW through autograd)."""
    z = (hidden.double() @ weight.double().T) / temperature
    log_p = torch.log_softmax(z, dim=-1)
    valid = labels != ignore_index
    lp = log_p.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    return torch.where(valid, lp, 0.0), torch.where(valid, ent, 0.0)


def reference_grads(hidden, weight, labels, g_lp, g_ent, temperature=1.0, ignore_index=-100,
                    chunk=256):
    """Float64 dh, dW of sum(g_lp * log_probs + g_ent * entropy), chunked over tokens (no N x V
    float64 buffer beyond ``chunk`` rows). hidden (N, H), weight (V, H), labels (N,)."""
    h64, w64 = hidden.double(), weight.double()
    inv_temperature = 1.0 / temperature
    _, ent, lse, _ = torch_forward(h64, w64, labels, inv_temperature, ignore_index, True, torch.float64)
    n, v = hidden.shape[0], weight.shape[0]
    dh = torch.empty_like(h64)
    dw = torch.zeros_like(w64)
    for r0 in range(0, n, chunk):
        rows = slice(r0, min(n, r0 + chunk))
        dz = torch.empty(rows.stop - r0, v, dtype=torch.float64, device=hidden.device)
        torch_dlogits(h64, w64, labels, lse, ent,
                      None if g_lp is None else g_lp.double(),
                      None if g_ent is None else g_ent.double(),
                      rows, slice(0, v), inv_temperature, ignore_index, dz)
        dh[rows] = dz @ w64
        dw += dz.T @ h64[rows]
    return dh, dw


def rel_err(a, b):
    """||a - b||_F / ||b||_F in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def jsd_reference(hs, ws, ht, wt, labels, beta, temperature, reduction):
    """Generalized JSD (beta 0 / 1: the two KLs) x T^2 from dense logits of both heads, in the
    inputs' dtype (float64 for an oracle), with autograd; 0 where labels == -100."""
    log_q = torch.log_softmax(hs @ ws.T / temperature, -1)
    log_p = torch.log_softmax(ht @ wt.T / temperature, -1)
    if beta == 0:
        per = torch.nn.functional.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    elif beta == 1:
        per = torch.nn.functional.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    else:
        m = beta * log_p.exp() + (1 - beta) * log_q.exp()
        per = (beta * (log_p.exp() * (log_p - m.log())).sum(-1)
               + (1 - beta) * (log_q.exp() * (log_q - m.log())).sum(-1))
    valid = labels != -100
    per = torch.where(valid, per * temperature**2, 0.0)
    return {"none": per, "sum": per.sum(), "mean": per.sum() / valid.sum(),
            "batchmean": per.sum() / per.shape[0]}[reduction]
