"""Model-level benchmark: a verl actor step (forward, PPO loss, backward) of a real architecture with
random weights, per log-prob path, on one GPU: step time and tokens/s at common micro-batch sizes,
peak memory, the largest micro-batch that fits, and the head's share of the step.

    python scripts/model_bench.py --models qwen2.5-0.5b qwen2.5-7b llama3.1-8b gemma2-2b \
        --tokens 8192 16384 --search --json benchmarks/results/model_bench_DEVICE_DATE.json
    python scripts/model_bench.py --smoke      # CPU: a tiny model, two steps per variant (a test runs it)
    torchrun --nproc_per_node 2 scripts/model_bench.py --fsdp --models qwen2.5-7b --tokens 8192 16384
    torchrun --nproc_per_node 2 scripts/model_bench.py --fsdp --smoke   # CPU (gloo): the same code path

``--fsdp`` (under ``torchrun``, one process a GPU): the step of verl's FSDP2 actor instead: float32
master parameters sharded over the ranks with ``fully_shard`` per decoder layer, the untied input
embedding and the root (bf16 compute, float32 gradient reduction), and the **optimizer in the step**:
gradient-norm clipping at 1.0 and an AdamW update. Every rank runs the same micro-batch size (tokens
per rank); all timing loops run a fixed, rank-agreed number of steps (never ``do_bench``: ranks would
pick different repeat counts and call different numbers of collectives); a point's time is the
slowest rank's median, its memory the largest rank's peak; the largest micro-batch search agrees on
"fits" over the ranks after each try.

What the step is: bf16 parameters, gradient checkpointing on (``gradient_checkpointing_enable``),
SDPA attention **per sequence** (the body runs on a (B, S) batch of S-token sequences; its hidden
states are then packed into one (1, B S) row, as verl's remove-padding layout packs them, so the head
and the label roll are verl's), the head, verl's clipped PPO loss with an entropy bonus, and the
backward into every parameter. Not in the step: the optimizer (no optimizer state, no update),
FSDP / data parallelism, the rollout. Peak memory is ``torch.cuda.max_memory_allocated`` during the
step (the model's parameters and gradients included).

Variants (the same weights and batch):

* ``verl logits``: the model's own forward materializes the logits, verl's ``logprobs_from_logits`` /
  ``entropy_from_logits`` (verl's default, ``use_fused_kernels=False``; with flash-attn's Triton
  cross-entropy when ``flash_attn`` is importable, as verl users have it: the table says which ran);
* ``logits + rl_kernels``: the same, with rl-kernels' verl patch (its from-logits functions);
* ``verl fused torch`` / ``verl fused triton``: verl's fused forward, ``impl_backend`` torch / triton;
* ``fused rl_kernels``: verl's fused forward with ``impl_backend=rl_kernels``;
* ``fused rl_kernels, loss_rows_only`` (with ``--loss-outside``): the same with the integration's
  option ``loss_rows_only`` on (verl #7686): a step request with ``loss_rows_only`` and the loss
  mask as its ``inputs['loss_rows']`` in force around the model's forward, as verl's engine hooks
  put them (``forward_step``'s wrapper, then the layout hook), so the fused head runs on the rows
  in the loss alone (0 and no gradient elsewhere).

``--loss-outside F ...``: each point once per fraction F of the tokens outside the loss: per
sequence its first round(F S) label rows (the prompt, an agentic trace's tool output) have loss
mask 0, and the PPO loss is the masked token-mean (verl's ``response_mask``, ``agg_loss``
token-mean); the rows' ``loss_outside`` says which. Tokens/s counts every token of the micro-batch.
The head's share then predicts the option's gain: ``F x head_ms`` of ``fused rl_kernels`` off the
step, if the head's time falls in proportion to the rows it skips (printed beside the measured gain).

The largest micro-batch: sequences of ``--seq`` tokens, doubling the count until two steps in a row
no longer run without running out of memory, then bisecting (OOM caught and freed). The head's
share: the head alone (last hidden state and lm_head weight in, loss and their gradients out) timed
at the same tokens, over the step time.
verl is imported as on the GPU machine without a package index
(``rl_kernels.tools.verl_kernels.import_verl_modules(stub=True)``).
"""
from __future__ import annotations

import contextlib
import json
import sys
import time

import torch

from rl_kernels.tools import diag

MODELS = {  # transformers config class, sizes of the released models (random weights)
    "qwen2.5-0.5b": ("Qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6)),
    "qwen2.5-7b": ("Qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6)),
    "llama3.1-8b": ("Llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  tie_word_embeddings=False, rope_theta=5e5, rms_norm_eps=1e-5)),
    "gemma2-2b": ("Gemma2", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
                                 final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                                 tie_word_embeddings=True)),
    "tiny": ("Qwen2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=1037, tie_word_embeddings=False)),
}
VARIANTS = ("verl logits", "logits + rl_kernels", "verl fused torch", "verl fused triton", "fused rl_kernels")
LOSS_ROWS = "fused rl_kernels, loss_rows_only"  # with --loss-outside
T = 0.7
WARMUP = 2  # untimed steps before each timed point


def build(name: str, device, dtype=None):
    import transformers

    family, sizes = MODELS[name]
    config = getattr(transformers, f"{family}Config")(**sizes, attn_implementation="sdpa", use_cache=False)
    with torch.device(device):  # on the device itself: buffers (rotary inv_freq) are initialized too
        model = getattr(transformers, f"{family}ForCausalLM")(config)
    model = model.to(dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32))
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g) if p.dim() > 1 else p.fill_(1.0)
    model.gradient_checkpointing_enable()
    model.train()
    return model


@contextlib.contextmanager
def per_sequence_body(model, seqs: int):
    """The base model runs on (seqs, S) sequences and returns its hidden states packed into one
    (1, seqs S) row: attention per sequence, the head sees verl's remove-padding layout."""
    body = model.model
    forward = body.forward

    def packed_forward(input_ids=None, position_ids=None, **kwargs):
        ids = input_ids.view(seqs, -1)
        out = forward(input_ids=ids, position_ids=torch.arange(ids.shape[1], device=ids.device).expand_as(ids),
                      **{k: v for k, v in kwargs.items() if k in ("output_hidden_states", "return_dict")})
        out.last_hidden_state = out.last_hidden_state.reshape(1, -1, out.last_hidden_state.shape[-1])
        return out

    body.forward = packed_forward
    try:
        yield
    finally:
        body.forward = forward


def ppo_loss(log_probs, entropy, adv, old, mask=None):
    """verl's vanilla clipped PPO policy loss (clip 0.2, token-mean) minus 0.01 x entropy; with a
    loss ``mask`` (bool, shaped like ``log_probs``) the token-mean over the tokens in the loss
    (verl's masked mean of ``agg_loss``)."""
    ratio = torch.exp(log_probs.float() - old)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    if mask is None:
        loss = per_token.mean()
        return loss - 0.01 * entropy.float().mean() if entropy is not None else loss
    keep = mask.float()
    count = keep.sum() + 1e-8

    def masked(x):
        return (x * keep).sum() / count
    loss = masked(per_token)
    return loss - 0.01 * masked(entropy.float()) if entropy is not None else loss


def loss_mask(tokens: int, seq: int, outside, device):
    """The loss mask of a packed micro-batch, (1, tokens) bool in the labels' layout, or None
    (``outside`` None: every token in the loss, the unmasked loss): per ``seq``-token sequence its
    first round(outside x seq) rows outside the loss."""
    if outside is None:
        return None
    return (torch.arange(tokens, device=device) % seq >= round(outside * seq)).view(1, tokens)


def shard(model, device):
    """verl's FSDP2 layout: ``fully_shard`` each decoder layer, the input embedding when it is not
    tied to the lm_head, then the root (which holds the lm_head); bf16 compute on CUDA, float32
    gradient reduction; an AdamW optimizer over the float32 master parameters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                  reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    if not model.config.tie_word_embeddings:
        fully_shard(model.model.embed_tokens, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)


def all_ranks(value: float, op: str) -> float:
    """``value`` reduced over the ranks (``max`` / ``min``); the value itself without a process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return value
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return float(t.item())


class Bench:
    def __init__(self, model, verl, device, optimizer=None):
        self.model, self.verl, self.device, self.optimizer = model, verl, device, optimizer
        self.cls = type(model)
        self.hf_forward = self.cls.forward
        self.loss_outside, self.loss_rows_only, self.last_loss = None, False, None

    def set_variant(self, variant: str):
        rkv, monkey_patch = self.verl["rkv"], self.verl["monkey_patch"]
        (rkv.unpatch if variant == "verl logits" else rkv.patch)()
        self.cls.forward = self.hf_forward
        if "fused" in variant:
            backend = {"verl fused torch": "torch", "verl fused triton": "triton"}.get(variant, rkv.BACKEND_NAME)
            monkey_patch.apply_monkey_patch(self.model, use_remove_padding=True, use_fused_kernels=True,
                                            fused_kernels_backend=backend)
        self.fused, self.variant = "fused" in variant, variant
        self.loss_rows_only = variant == LOSS_ROWS

    def inputs(self, tokens: int, seq: int):
        """(ids, advantages, sequences, loss mask or None) of a packed micro-batch."""
        g = torch.Generator(device=self.device).manual_seed(tokens)
        ids = torch.randint(0, self.model.config.vocab_size, (1, tokens), device=self.device, generator=g)
        adv = torch.randn(ids.shape, device=self.device, generator=g)
        return ids, adv, tokens // seq, loss_mask(tokens, seq, self.loss_outside, self.device)

    def restore(self):
        """rl-kernels' patch on and the model class's own forward back (after the variants)."""
        self.verl["rkv"].patch()
        self.cls.forward = self.hf_forward

    def log_probs(self, ids, seqs, mask=None):
        """(log_probs, entropy) of the (1, tokens) packed ``ids`` as the variant computes them: the
        body per sequence, then verl's fused forward or the logits and verl's from-logits functions.
        ``loss_rows_only``: during the forward a fresh step request with ``loss_rows_only`` and the loss
        ``mask`` as ``inputs['loss_rows']``, put in force and reset as verl's engine hooks do."""
        with per_sequence_body(self.model, seqs):
            if self.fused:
                token = None
                if self.loss_rows_only:  # verl's engine: forward_step's wrapper, then the layout hook's mask
                    patch_state = self.verl["patch_state"]
                    token = patch_state.new_step(loss_rows_only=True)
                    patch_state.step_request.get().inputs["loss_rows"] = mask
                try:
                    out = self.model(input_ids=ids, temperature=T, return_dict=True)
                finally:
                    if token is not None:
                        self.verl["patch_state"].step_request.reset(token)
                return out.log_probs, out.entropy
            verl_F = self.verl["verl_F"]
            logits = self.model(input_ids=ids, return_dict=True).logits / T  # the class's own forward
            labels = torch.roll(ids, -1, -1)
            return (verl_F.logprobs_from_logits(logits, labels, inplace_backward=False),
                    verl_F.entropy_from_logits(logits))

    def step(self, ids, adv, seqs, mask=None):
        self.model.zero_grad(set_to_none=True)
        lp, ent = self.log_probs(ids, seqs, mask)
        loss = ppo_loss(lp, ent, adv, lp.detach().float() + 0.01, mask)
        loss.backward()
        self.last_loss = loss.detach()
        if self.optimizer is not None:  # verl's actor: clip the gradient norm, then the update
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()

    def median_ms(self, fn, steps, warmup, host=False):
        """Median wall time of ``fn()`` over ``steps`` calls after ``warmup`` untimed ones (device
        synced around each call); with ``host``, also the median time until ``fn`` returned, before
        the closing sync (the host's share: equal to the wall time when the step is launch-bound)."""
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        times, host_times = [], []
        for i in range(steps + warmup):
            sync()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            sync()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                host_times.append(t1 - t0)
        median = sorted(times)[len(times) // 2] * 1e3
        return (median, sorted(host_times)[len(host_times) // 2] * 1e3) if host else median

    def timed(self, tokens, seq, steps, warmup=WARMUP):
        ids, adv, seqs, mask = self.inputs(tokens, seq)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        skipped = self.verl["patch_state"].call_counts()["loss_rows_skipped_tokens"]
        # warmup: Triton compiles the backward's window shapes over the first steps
        ms, host_ms = self.median_ms(lambda: self.step(ids, adv, seqs, mask), steps, warmup, host=True)
        skipped = self.verl["patch_state"].call_counts()["loss_rows_skipped_tokens"] - skipped
        peak = torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else 0.0
        ms, host_ms, peak = all_ranks(ms, "max"), all_ranks(host_ms, "max"), all_ranks(peak, "max")
        # the last step's loss (the same inputs every step): equal across the variants up to rounding
        out = {"step_ms": ms, "tokens_per_s": tokens / ms * 1e3, "peak_gb": peak, "host_ms": host_ms,
               "loss": float(self.last_loss)}
        if self.loss_rows_only:  # the rows the fused head left out per step (the integration's own count)
            out["skipped_tokens_per_step"] = skipped / (steps + warmup)
        return out

    def fits(self, tokens, seq) -> bool:
        """Two steps at ``tokens`` run without running out of memory (one step can fit where the
        steady state, with the allocator's cache and the optimizer's state, does not)."""
        ok = True
        try:
            for _ in range(2):
                self.step(*self.inputs(tokens, seq))
        except torch.OutOfMemoryError:
            ok = False
            self.reshard()
        finally:
            self.model.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return all_ranks(float(ok), "min") > 0  # every rank agrees

    def reshard(self):
        """After an OOM inside an FSDP2 step some modules still hold their gathered (plain tensor)
        parameters: put every module back to its sharded parameters before the next step."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.model, FSDPModule):
            return
        # the end-of-backward callback that the OOM skipped: it finishes every parameter group's
        # backward state (otherwise the next backward leaves plain-tensor gradients)
        self.model._get_fsdp_state()._root_post_backward_final_callback()
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def largest(self, seq, start, limit):
        n, fit = max(1, start // seq), 0
        while n * seq <= limit and self.fits(n * seq, seq):  # doubling
            fit, n = n, n * 2
        if fit == 0:
            return 0
        lo, hi = fit, min(n, limit // seq + 1)  # lo fits, hi does not (or is past the limit)
        while hi - lo > max(1, lo // 16):  # bisection to ~6% of the answer
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.fits(mid * seq, seq) else (lo, mid)
        return lo * seq

    def head_ms(self, tokens, steps, seq):
        """The head alone, as the variant computes it: hidden states and lm_head weight in, the PPO
        loss (masked as the step's at ``seq``-token sequences), their gradients out (fused: the
        kernel verl's fused forward calls, and for ``loss_rows_only`` the integration's row selection
        and scatter around it; logits: lm_head, then verl's from-logits functions)."""
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        h = torch.randn(1, tokens, self.model.config.hidden_size, device=self.device, dtype=dtype,
                        requires_grad=True)
        ids, adv, _, _ = self.inputs(tokens, tokens)
        mask = loss_mask(tokens, seq, self.loss_outside, self.device)  # the step's mask at these tokens
        labels = torch.roll(ids, -1, -1)
        w = self.model.lm_head.weight
        if hasattr(w, "full_tensor"):  # FSDP2 shard: the whole weight, as the root's forward gathers it
            w = w.full_tensor()
        w = w.detach().to(dtype).requires_grad_(True)
        verl_F = self.verl["verl_F"]
        head = self.variant

        def run():
            h.grad = w.grad = None
            if head == "verl fused torch":
                from verl.utils.experimental.torch_functional import FusedLinearForPPO

                lp, ent = FusedLinearForPPO(impl_backend="torch")(h, w, labels, T)
            elif head == "verl fused triton":
                from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

                lp, ent = linear_cross_entropy(h, w, labels, T, "none")
            elif head == "fused rl_kernels":
                import rl_kernels

                lp, ent = rl_kernels.linear_log_probs(h, w, labels, temperature=T)[:2]
            elif head == LOSS_ROWS:  # the fused head's loss_rows_only path: select, the head, scatter
                import rl_kernels

                patch_state = self.verl["patch_state"]
                index = patch_state.loss_row_index(mask, labels)
                hs, ys = (patch_state.select_rows(t, index, labels.numel()).unsqueeze(0) for t in (h, labels))
                out = rl_kernels.linear_log_probs(hs, w, ys, temperature=T)
                lp, ent = (patch_state.scatter_rows(t.reshape(-1), index, labels.shape)
                           for t in (out.log_probs, out.entropy))
            else:
                logits = torch.nn.functional.linear(h, w) / T
                lp = verl_F.logprobs_from_logits(logits, labels, inplace_backward=False)
                ent = verl_F.entropy_from_logits(logits)
            ppo_loss(lp, ent, adv, lp.detach().float() + 0.01, mask).backward()
        ms = self.median_ms(run, steps, 1)
        self.model.zero_grad(set_to_none=True)
        del h, w
        return ms


def import_verl():
    from rl_kernels.tools.verl_kernels import import_verl_modules

    how = import_verl_modules(stub=True)
    import rl_kernels.integrations.verl as rkv
    import verl.models.transformers.monkey_patch as monkey_patch
    import verl.utils.torch_functional as verl_F
    from rl_kernels.integrations.verl_impl import patch_state
    flash = bool(getattr(verl_F, "FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False))
    return {"rkv": rkv, "monkey_patch": monkey_patch, "verl_F": verl_F, "patch_state": patch_state, "how": how,
            "verl_logits_path": ("flash-attn Triton cross-entropy (float32 log-probs)" if flash else
                                 "verl's row-by-row fallback (no flash_attn: log-probs in the logits dtype)")}


def run_model(name, args, device, verl):
    import torch.distributed as dist

    fsdp = dist.is_initialized()
    model = build(name, device, dtype=torch.float32 if fsdp else None)
    bench = Bench(model, verl, device, optimizer=shard(model, device) if fsdp else None)
    params_b = sum(p.numel() for p in model.parameters()) / 1e9 * (dist.get_world_size() if fsdp else 1)
    rows = []

    def failed(rec, exc):
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    # pass 1: the timed points of every variant (per fraction of the tokens outside the loss, if asked)
    for outside, variant in ((f, v) for f in args.loss_outside or [None] for v in args.variants):
        if variant == LOSS_ROWS and outside is None:
            continue
        rec = {"model": name, "params_b": params_b, "variant": variant}
        if outside is not None:
            rec["loss_outside"] = outside
        if fsdp:
            rec["ranks"] = dist.get_world_size()
        try:
            bench.loss_outside = outside
            bench.set_variant(variant)
            for tokens in args.tokens:
                try:
                    rec[f"at_{tokens}"] = bench.timed(tokens, args.seq, args.steps, args.warmup)
                except torch.OutOfMemoryError:
                    rec[f"at_{tokens}"] = {"error": "out of memory"}
                    model.zero_grad(set_to_none=True)
                    torch.cuda.empty_cache()
            rec["head_ms"] = all_ranks(bench.head_ms(args.tokens[0], args.steps, args.seq), "max")
            if "step_ms" in rec.get(f"at_{args.tokens[0]}", {}):
                rec["head_share"] = rec["head_ms"] / rec[f"at_{args.tokens[0]}"]["step_ms"]
        except Exception as exc:  # noqa: BLE001 - a variant's failure is a result
            failed(rec, exc)
        if not fsdp or dist.get_rank() == 0:
            print(json.dumps(rec), flush=True)
        rows.append(rec)
    for rec in rows if args.search else ():  # pass 2: the largest micro-batch (timed points kept if it hangs)
        if "error" in rec or (args.search_variants and rec["variant"] not in args.search_variants):
            continue
        try:
            bench.loss_outside = rec.get("loss_outside")
            bench.set_variant(rec["variant"])
            rec["largest_tokens"] = bench.largest(args.seq, args.search_start or args.tokens[0], args.limit)
            if rec["largest_tokens"]:
                rec["at_largest"] = bench.timed(rec["largest_tokens"], args.seq, max(1, args.steps // 2), 1)
        except Exception as exc:  # noqa: BLE001
            failed(rec, exc)
        if not fsdp or dist.get_rank() == 0:
            print(json.dumps(rec), flush=True)
    bench.restore()
    del model, bench
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(rows, tokens) -> str:
    from tabulate import tabulate

    out = []
    for r in rows:
        cells = [r["model"], r["variant"] + (f" ({r['loss_outside']:.0%} outside the loss)" if "loss_outside" in r
                                             else "")]
        for t in tokens:
            at = r.get(f"at_{t}", {})
            cells += [f"{at['step_ms']:.0f} ({at['host_ms']:.0f})" if "step_ms" in at else at.get("error", "-"),
                      f"{at['tokens_per_s']:.0f}" if "tokens_per_s" in at else "-",
                      f"{at['peak_gb']:.1f}" if "peak_gb" in at else "-"]
        largest = r.get("at_largest", {})
        cells += [r.get("largest_tokens", "-"), f"{largest['tokens_per_s']:.0f}" if largest else "-",
                  f"{r['head_share']:.0%}" if "head_share" in r else "-", r.get("error", "")]
        out.append(cells)
    headers = ["model", "variant"]
    for t in tokens:
        headers += [f"ms (host ms) @{t}", f"tok/s @{t}", f"peak GB @{t}"]
    return tabulate(out, headers=headers + ["largest micro-batch", "tok/s there", "head share", "error"])


def loss_rows_gains(rows, tokens) -> list[str]:
    """Per model and fraction F outside the loss, at the first micro-batch size: ``loss_rows_only``'s
    measured step gain against the option off, and the gain the head's share predicts (F x the head's
    ms with the option off: the head's time in proportion to the rows it runs on)."""
    lines, t = [], tokens[0]
    off = {(r["model"], r.get("loss_outside")): r for r in rows if r["variant"] == "fused rl_kernels"}
    for r in rows:
        base = off.get((r["model"], r.get("loss_outside")))
        if r["variant"] != LOSS_ROWS or base is None or "step_ms" not in r.get(f"at_{t}", {}) \
                or "step_ms" not in base.get(f"at_{t}", {}) or "head_ms" not in base:
            continue
        f, step_off, step_on = r["loss_outside"], base[f"at_{t}"]["step_ms"], r[f"at_{t}"]["step_ms"]
        predicted = f * base["head_ms"]
        lines.append(f"{r['model']} @{t}, {f:.0%} outside the loss: loss_rows_only {step_on:.1f} ms vs off "
                     f"{step_off:.1f} ms: measured gain {step_off - step_on:.1f} ms ({1 - step_on / step_off:.1%}); "
                     f"predicted from the head's share {predicted:.1f} ms ({predicted / step_off:.1%}: "
                     f"{f:.0%} x head {base['head_ms']:.1f} ms); head alone on {1 - f:.0%}: {r.get('head_ms', 0):.1f} ms")
    return lines


def plot(paths, png) -> None:
    """tokens/s and peak memory against micro-batch tokens, one line per variant, one column of
    panels per model, from saved ``--json`` files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, header = [], ""
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        header = header or data["header"].split(" | verl logits")[0]
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7), squeeze=False)
    for col, name in enumerate(models):
        for r in (r for r in rows if r["model"] == name and "error" not in r):
            points = sorted((int(k[3:]), v) for k, v in r.items() if k.startswith("at_") and k != "at_largest"
                            and "step_ms" in v)
            if "at_largest" in r:
                points.append((r["largest_tokens"], r["at_largest"]))
            xs = [t / 1024 for t, _ in points]
            style = dict(marker="o", label=r["variant"], lw=2.2 if "rl_kernels" in r["variant"] else 1.2)
            axes[0][col].plot(xs, [v["tokens_per_s"] / 1e3 for _, v in points], **style)
            axes[1][col].plot(xs, [v["peak_gb"] for _, v in points], **style)
        axes[0][col].set_title(f"{name} ({rows[[r['model'] for r in rows].index(name)]['params_b']:.1f}B params)")
        axes[1][col].set_xlabel("micro-batch (k tokens); last point: the largest that fits")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("actor step, k tokens/s")
    axes[1][0].set_ylabel("peak GPU memory, GB")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"verl actor step (fwd + PPO loss + bwd, gradient checkpointing, no optimizer): {header}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None):
    ap = diag.parser(__doc__, json_out=True)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-0.5b"], choices=sorted(MODELS))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS + (LOSS_ROWS,),
                    help=f"default: all but {LOSS_ROWS!r}, which --loss-outside adds")
    ap.add_argument("--tokens", nargs="+", type=int, default=[8192, 16384], help="micro-batch sizes timed")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per point (median)")
    ap.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps before each timed point")
    ap.add_argument("--fsdp", action="store_true",
                    help="under torchrun: verl's FSDP2 actor step over the ranks, optimizer included")
    ap.add_argument("--search", action="store_true", help="find the largest micro-batch that fits")
    ap.add_argument("--search-variants", nargs="+", default=None, choices=VARIANTS,
                    help="search only these variants (default: every variant timed)")
    ap.add_argument("--search-start", type=int, default=None, help="tokens the search doubles from "
                    "(default: the first --tokens)")
    ap.add_argument("--limit", type=int, default=1 << 20, help="stop the search at this many tokens")
    ap.add_argument("--loss-outside", nargs="+", type=float, default=None, metavar="F",
                    help="time every point once per fraction F of the tokens outside the loss (the loss masked), "
                         f"and {LOSS_ROWS!r} beside 'fused rl_kernels'")
    ap.add_argument("--smoke", action="store_true", help="CPU: the tiny model, two steps per variant, no search")
    ap.add_argument("--plot", nargs="+", default=None, metavar="JSON", help="no timing: chart saved --json files")
    ap.add_argument("--png", default="model_bench.png", help="where --plot writes the chart")
    args = ap.parse_args(argv)
    if any(not 0 <= f < 1 for f in args.loss_outside or []):
        ap.error(f"--loss-outside: fractions in [0, 1), got {args.loss_outside}")
    if args.loss_outside and "fused rl_kernels" in args.variants and LOSS_ROWS not in args.variants:
        args.variants.append(LOSS_ROWS)
    if LOSS_ROWS in args.variants and not args.loss_outside:
        ap.error(f"--variants {LOSS_ROWS!r} needs --loss-outside F ...")
    if args.plot:
        plot(args.plot, args.png)
        print(f"wrote {args.png}")
        return 0
    if args.smoke:
        args.models, args.tokens, args.seq, args.steps, args.search = ["tiny"], [64], 16, 1, False
        args.variants = [v for v in args.variants if v != "verl fused triton"]  # verl's kernel needs CUDA
        device = torch.device("cpu")
    else:
        diag.require_cuda(ap.prog, "use --smoke for the CPU check")
        device = torch.device("cuda")
    rank, ranks = 0, 1
    if args.fsdp:
        import datetime
        import os

        import torch.distributed as dist

        if "RANK" not in os.environ:
            ap.error("--fsdp runs under torchrun (torchrun --nproc_per_node N scripts/model_bench.py --fsdp ...)")
        # a rank that dies or diverges makes the other time out instead of hanging the machine
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=300))
        rank, ranks = dist.get_rank(), dist.get_world_size()
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
            torch.cuda.set_device(device)
    verl = import_verl()
    rows = []
    for name in args.models:
        rows += run_model(name, args, device, verl)
    header = (f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}"
              f"{f' x {ranks}, FSDP2 with the optimizer step' if args.fsdp else ''} | torch {torch.__version__} | "
              f"{time.strftime('%Y-%m-%d')} | verl logits path: {verl['verl_logits_path']} | {verl['how']}")
    if args.fsdp:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank:
        return 0
    print(header)
    print(table(rows, args.tokens))
    for line in loss_rows_gains(rows, args.tokens):
        print(line)
    if args.json:
        diag.write_json(args.json, rows, device=device, header=header, tokens=args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
