"""A verl step of a random ~0.5B Qwen2 (Qwen2.5-0.5B shape, bf16) on the GPU: forward + backward
through verl's patched model, per log-prob backend: step time, peak memory, accuracy.

Variants (same weights, same batch, PPO-style clipped loss minus an entropy bonus):
  logits/verl       use_fused_kernels=False, verl's own logprobs_from_logits + entropy_from_logits
  logits/rl_kernels use_fused_kernels=False, the functions as patched by rl-kernels
  fused/torch       verl's fused forward, impl_backend='torch' (verl's chunked torch)
  fused/triton      verl's fused forward, impl_backend='triton' (verl's linear_cross_entropy)
  fused/rl_kernels  verl's fused forward, impl_backend='rl_kernels'
Accuracy: max |log-prob error| and |entropy error| against float64 computed from the same final
hidden states and lm_head weight.

The GPU machine has no package index: verl's wheel is installed with --no-deps, and when its
package imports fail (Ray / tensordict / omegaconf stack), ``verl/__init__`` and a few package
``__init__`` files are bypassed and tensordict is stubbed; this affects this check only.

    python scripts/verl_qwen_step.py [--batch 8 --seq 1024 --json out.json]
"""
from __future__ import annotations

import sys
import time

import torch

from rl_kernels.tools import diag
from rl_kernels.tools.verl_kernels import import_verl_modules


def qwen2_half_b(device):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                      max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      attn_implementation="sdpa")
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16)


def ppo_loss(log_probs, entropy, adv, old):
    ratio = torch.exp(log_probs - old)
    return -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean() - 0.01 * entropy.float().mean()


def main(argv=None):
    ap = diag.parser(__doc__, json_out=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    diag.require_cuda(ap.prog)
    how = import_verl_modules(stub=True)
    import rl_kernels.integrations.verl as rkv
    import verl.utils.torch_functional as verl_F
    from tabulate import tabulate
    from transformers import Qwen2ForCausalLM
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    dev = torch.device("cuda")
    hf_forward = Qwen2ForCausalLM.forward
    model = qwen2_half_b(dev)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=dev).manual_seed(1)
    # verl's default layout (use_remove_padding=True): the batch packed into one row, positions
    # restarting per sequence (verl's triton backend fails on a padded (B, T) batch: 3-D hidden
    # with 2-D labels)
    ids = torch.randint(0, model.config.vocab_size, (1, args.batch * args.seq), device=dev, generator=g)
    positions = torch.arange(args.seq, device=dev).repeat(args.batch)[None]
    labels = torch.roll(ids, -1, -1)
    adv = torch.randn(ids.shape, device=dev, generator=g)
    T = args.temperature

    # float64 truth from the final hidden states (what the fused head receives)
    captured = {}
    hook = model.model.register_forward_hook(lambda m, i, o: captured.update(h=o[0].detach()))
    with torch.no_grad():
        Qwen2ForCausalLM.forward = hf_forward
        model(input_ids=ids, position_ids=positions)
    hook.remove()
    h = captured["h"].reshape(-1, model.config.hidden_size)
    w = model.lm_head.weight.detach().double()
    ref_lp = torch.empty(h.shape[0], dtype=torch.float64, device=dev)
    ref_ent = torch.empty_like(ref_lp)
    for r0 in range(0, h.shape[0], 1024):
        z = (h[r0:r0 + 1024].double() @ w.T) / T
        log_p = z.log_softmax(-1)
        ref_lp[r0:r0 + 1024] = log_p.gather(1, labels.reshape(-1)[r0:r0 + 1024, None])[:, 0]
        ref_ent[r0:r0 + 1024] = -(log_p.exp() * log_p).sum(-1)
        del z, log_p
    del w
    ref_lp, ref_ent = ref_lp.view(ids.shape), ref_ent.view(ids.shape)
    old = ref_lp.float() + 0.05 * torch.randn(ids.shape, device=dev, generator=g)

    def logits_step(model):
        out = hf_forward(model, input_ids=ids, position_ids=positions, return_dict=True)
        logits = out.logits / T
        return verl_F.logprobs_from_logits(logits, labels, inplace_backward=False), \
            verl_F.entropy_from_logits(logits)

    def fused_step(model):
        out = model(input_ids=ids, position_ids=positions, temperature=T, return_dict=True)
        return out.log_probs, out.entropy

    variants = [("logits/verl", None, False), ("logits/rl_kernels", None, True),
                ("fused/torch", "torch", True), ("fused/triton", "triton", True),
                ("fused/rl_kernels", rkv.BACKEND_NAME, True),
                # a GRPO step with entropy_coeff=0: verl's micro-batch says calculate_entropy=False
                # (the patched engine's forward_step sets what this context variable holds)
                ("fused/rl_kernels, entropy unused", rkv.BACKEND_NAME, True),
                ("fused/rl_kernels, no entropy", rkv.BACKEND_NAME, True)]
    rows, results = [], []
    for name, backend, patched in variants:
        (rkv.patch if patched else rkv.unpatch)()
        Qwen2ForCausalLM.forward = hf_forward
        if backend is not None:
            apply_monkey_patch(model, use_remove_padding=True, use_fused_kernels=True,
                               fused_kernels_backend=backend)
        step = fused_step if backend is not None else logits_step
        no_entropy, unused = name.endswith("no entropy"), name.endswith("unused")
        rec = {"variant": name}
        try:
            times = []
            for i in range(args.steps + 2):
                model.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                t0 = time.perf_counter()
                if no_entropy:
                    token = rkv.entropy_wanted.set(False)
                    lp, ent = step(model)
                    rkv.entropy_wanted.reset(token)
                    ppo_loss(lp.float(), torch.zeros_like(lp.float()), adv, old).backward()
                else:  # (entropy unused: computed, as verl's fused forward asks, but out of the loss)
                    lp, ent = step(model)
                    ppo_loss(lp.float(), torch.zeros_like(ent) if unused else ent, adv, old).backward()
                torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
                if i == 0:
                    rec["lp_err"] = (lp.double() - ref_lp).abs().max().item()
                    if not no_entropy:
                        rec["ent_err"] = (ent.double() - ref_ent).abs().max().item()
                    rec["lp_dtype"] = str(lp.dtype).replace("torch.", "")
                    rec["peak_extra_gb"] = (torch.cuda.max_memory_allocated() - base) / 2**30
                del lp, ent
            rec["step_ms"] = sorted(times)[len(times) // 2] * 1e3
        except Exception as exc:  # noqa: BLE001 - a peer's failure is a result, not a crash
            rec["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            torch.cuda.empty_cache()
        results.append(rec)
    rkv.patch()
    Qwen2ForCausalLM.forward = hf_forward
    base_ms = next((r["step_ms"] for r in results if r["variant"] == "fused/rl_kernels" and "step_ms" in r), None)
    for r in results:
        rows.append([r["variant"], f"{r['step_ms']:.1f}" if "step_ms" in r else "-",
                     f"{r['step_ms'] / base_ms:.2f}" if "step_ms" in r and base_ms else "-",
                     f"{r['peak_extra_gb']:.2f}" if "peak_extra_gb" in r else "-",
                     f"{r['lp_err']:.2e}" if "lp_err" in r else "-",
                     f"{r['ent_err']:.2e}" if "ent_err" in r else "-",
                     r.get("lp_dtype", "-"), r.get("error", "")])
    header = (f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {time.strftime('%Y-%m-%d')} | "
              f"Qwen2 {n_params / 1e9:.2f}B random bf16, {args.batch} x {args.seq} tokens packed (rmpad), "
              f"T={T} | {how}")
    print(header)
    print(tabulate(rows, headers=["variant", "fwd+bwd ms", "x rl_kernels", "peak extra GB",
                                  "max |logp err|", "max |H err|", "logp dtype", "error"]))
    if args.json:
        diag.write_json(args.json, results, header=header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
