"""Training parity on the GPU (issue 27): 30 PPO updates of a bf16 Qwen2.5-0.5B-shaped model (random
weights) per log-prob path, and how far each path's parameters end from a run whose head is computed
in float32 from the same hidden states, next to the run-to-run floor (each path run twice).

    python scripts/gpu_parity.py [--steps 30 --json out.json]

The step: the body per sequence (eager attention, gradient checkpointing), the head of the variant,
verl's clipped PPO loss with an entropy bonus (two mini-batches per step: the second off-policy),
gradient clipping at 1.0 and AdamW (lr 1e-5, as RL fine-tuning uses), all under
``torch.use_deterministic_algorithms(True)``. Variants as in ``scripts/model_bench.py``, plus the
float32 head: logits = hidden.float() @ W.float().T, log_softmax in float32. Drift: ||theta_v -
theta_f32|| / ||theta_f32 - theta_0||, the distance between the two runs relative to how far training
moved the parameters.
"""
from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

from rl_kernels.tools import diag  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model_bench import MODELS, T, Bench, build, import_verl, per_sequence_body, ppo_loss  # noqa: E402

VARIANTS = ("float32 head", "verl logits", "logits + rl_kernels", "verl fused triton", "fused rl_kernels")


def run(variant, args, verl, device):
    """Train ``args.steps`` updates with ``variant``'s head; returns the final parameters (flat, bf16)
    and the per-step losses."""
    torch.manual_seed(0)
    model = build(args.model, device)
    model.config._attn_implementation = "eager"
    bench = Bench(model, verl, device)
    bench.set_variant("verl logits" if variant == "float32 head" else variant)  # float32 head: no verl code
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    seqs = args.tokens // args.seq
    losses = []
    for step in range(args.steps):
        g = torch.Generator(device=device).manual_seed(1000 + step)
        ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device=device, generator=g)
        adv = torch.randn(ids.shape, device=device, generator=g)
        labels = torch.roll(ids, -1, -1)
        old = None
        for _ in range(2):  # two mini-batches of the same rollout: the second is off-policy
            opt.zero_grad(set_to_none=True)
            if variant == "float32 head":
                with per_sequence_body(model, seqs):
                    h = model.model(input_ids=ids).last_hidden_state
                logits = (h.float() @ model.lm_head.weight.float().T) / T
                log_p = logits.log_softmax(-1)
                lp = log_p.gather(-1, labels[..., None])[..., 0]
                ent = -(log_p.exp() * log_p).sum(-1)
            else:
                lp, ent = bench.log_probs(ids, seqs)
            if old is None:
                old = lp.detach().float()
            loss = ppo_loss(lp, ent, adv, old)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            losses.append(loss.item())
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    bench.restore()
    del model, opt, bench
    torch.cuda.empty_cache()
    return flat, losses


def main(argv=None):
    ap = diag.parser(__doc__, json_out=True)
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-5)
    args = ap.parse_args(argv)
    diag.require_cuda(ap.prog)
    torch.use_deterministic_algorithms(True)
    device = torch.device("cuda")
    verl = import_verl()
    torch.manual_seed(0)
    theta0 = torch.cat([p.detach().flatten() for p in build(args.model, device).parameters()]).float()
    torch.cuda.empty_cache()
    results, ref = {}, None
    for variant in VARIANTS:
        first, losses = run(variant, args, verl, device)
        again, _ = run(variant, args, verl, device)
        rec = {"rerun_bitwise": bool(torch.equal(first, again)),
               "rerun_drift": None, "losses": losses}
        if ref is None:
            ref = first.float()
            moved = (ref - theta0).norm().item()
        rec["moved"] = (first.float() - theta0).norm().item() / moved
        rec["drift_vs_float32_head"] = (first.float() - ref).norm().item() / moved
        rec["rerun_drift"] = (first.float() - again.float()).norm().item() / moved
        results[variant] = rec
        print(json.dumps({"variant": variant, **{k: v for k, v in rec.items() if k != "losses"}}), flush=True)
        del first, again
    header = (f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.model} bf16 | {args.steps} steps x "
              f"2 mini-batches of {args.tokens} tokens | AdamW lr {args.lr} | deterministic | "
              f"verl logits path: {verl['verl_logits_path']}")
    print(header)
    for variant, rec in results.items():
        print(f"{variant:22s} drift vs float32 head {rec['drift_vs_float32_head']:.3e}   rerun drift "
              f"{rec['rerun_drift']:.3e} (bitwise {rec['rerun_bitwise']})   final loss {rec['losses'][-1]:+.4f}")
    if args.json:
        diag.write_json(args.json, results, header=header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
