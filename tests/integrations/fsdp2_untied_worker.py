"""Per-rank body of tests/integrations/test_verl_fsdp2_untied.py (verl #7520): a tiny untied Qwen2 under FSDP2,
gradient accumulation over micro-batches, one SGD step, on the fused path (impl_backend=rl_kernels)
and on verl's unfused logits path; returns what each rank measured."""
from __future__ import annotations

import datetime
import os
import traceback

import torch
import torch.distributed as dist

V, H, I, LAYERS = 97, 32, 64, 2          # V odd: uneven Shard(0) slices of lm_head (49 + 48 rows)
B, S = 2, 7                              # each micro-batch: B sequences of S tokens per rank
MICRO = 3                                # micro-batches of gradient accumulation per step
T = 0.7                                  # verl's temperature
LR = 0.5                                 # plain SGD: p' = p - LR * g


def tiny_untied(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, tie_word_embeddings=False,
                      max_position_embeddings=64, attn_implementation="sdpa")
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():  # logits spread over several nats (see tests/integrations/verl_helpers.tiny_qwen2)
        model.lm_head.weight.normal_(0.0, 0.5)
    return model


def micro_batches(rank: int, loss_rows: bool = False):
    """MICRO micro-batches of this rank: (input_ids (B, S), advantages (B, S), loss rows (B, S) bool or
    None), float32 advantages. ``loss_rows``: about half the rows in the loss (advantage 0 elsewhere,
    as verl's masked losses give them no gradient), and none at all in rank 1's first micro-batch
    (the ranks then run the head on different numbers of rows, 0 on one)."""
    g = torch.Generator().manual_seed(1000 + rank)
    out = []
    for i in range(MICRO):
        ids, adv = torch.randint(0, V, (B, S), generator=g), torch.randn(B, S, generator=g)
        rows = None
        if loss_rows:
            rows = torch.rand(B, S, generator=g) < 0.5
            if rank == 1 and i == 0:
                rows[:] = False
            adv = adv * rows
        out.append((ids, adv, rows))
    return out


def loss_of(log_probs: torch.Tensor, adv: torch.Tensor) -> torch.Tensor:
    """A policy-gradient loss on the log-probs, summed per micro-batch and divided by the step's
    tokens of this rank (verl's token-mean over the accumulated micro-batches)."""
    return -(adv * log_probs).sum() / (MICRO * B * S)


def shard(model, *, head_unit: bool, reshard_after_forward: bool, param_dtype, mesh):
    """FSDP2 as verl's ``apply_fsdp2`` wraps an untied model: decoder layers, embed_tokens and (when
    ``head_unit``) lm_head each their own unit, then the root; MixedPrecisionPolicy(param_dtype,
    reduce_dtype=float32, cast_forward_inputs=True) as verl's FSDP engine builds it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from verl.utils.fsdp_utils import apply_fsdp2

    kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "offload_policy": None,
              "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                                cast_forward_inputs=True)}
    if head_unit:
        apply_fsdp2(model, kwargs, {})  # verl's own wrapping (lm_head its own unit when untied)
        assert type(model.lm_head).__name__.startswith("FSDP"), type(model.lm_head)
    else:  # the head's parameter in the root's unit
        for layer in model.model.layers:
            fully_shard(layer, **kwargs)
        fully_shard(model.model.embed_tokens, **kwargs)
        fully_shard(model, **kwargs)
    return model


class Counter:
    """Counts FSDP2's collectives that carry the lm_head weight (its all-gathers, its gradient's
    reduce-scatters), and DTensor ``full_tensor`` calls on it, by patching the functions FSDP2's
    param groups call."""

    def __init__(self, model):
        import torch.distributed.fsdp._fully_shard._fsdp_param_group as pg
        from torch.distributed.tensor import DTensor

        self.pg, self.dtensor = pg, DTensor
        self.weight_ids = {id(model.lm_head.weight)}
        self.gathers = self.reduces = self.full_tensors = 0
        counter = self
        self._ag, self._rs, self._ft = pg.foreach_all_gather, pg.foreach_reduce, DTensor.full_tensor

        def carries_head(fsdp_params):
            return any(id(p.sharded_param) in counter.weight_ids for p in fsdp_params)

        def all_gather(fsdp_params, *args, **kwargs):
            counter.gathers += carries_head(fsdp_params)
            return counter._ag(fsdp_params, *args, **kwargs)

        def reduce(fsdp_params, *args, **kwargs):
            counter.reduces += carries_head(fsdp_params)
            return counter._rs(fsdp_params, *args, **kwargs)

        def full_tensor(self_, *args, **kwargs):
            counter.full_tensors += id(self_) in counter.weight_ids
            return counter._ft(self_, *args, **kwargs)

        pg.foreach_all_gather, pg.foreach_reduce, DTensor.full_tensor = all_gather, reduce, full_tensor

    def close(self):
        self.pg.foreach_all_gather, self.pg.foreach_reduce, self.dtensor.full_tensor = self._ag, self._rs, self._ft

    def snapshot(self):
        return self.gathers, self.reduces, self.full_tensors


def log_probs_of(model, ids, fused: bool, rows=None) -> torch.Tensor:
    """(B, S) float32 log-probs at the rolled labels: verl's fused forward, or its unfused logits path.
    ``rows``: the fused head runs on those rows only (``loss_rows_only``, the step request as verl's
    engine hook lays it out)."""
    if fused and rows is not None:
        from rl_kernels.integrations.verl_impl import patch_state
        token = patch_state.new_step(loss_rows_only=True)
        patch_state.step_request.get().inputs["loss_rows"] = rows
        try:
            return model(input_ids=ids, temperature=T, return_dict=True).log_probs
        finally:
            patch_state.step_request.reset(token)
    if fused:
        return model(input_ids=ids, temperature=T, return_dict=True).log_probs
    logits = model(input_ids=ids, return_dict=True).logits.float() / T
    labels = torch.roll(ids, shifts=-1, dims=-1)
    return logits.log_softmax(-1).gather(-1, labels[..., None])[..., 0]


def train_step(model, batches, *, fused: bool, no_sync: bool, counter: Counter):
    """MICRO forward/backward micro-batches (verl's FSDP engine: gradient sync deferred to the last one
    when ``no_sync``), then one SGD step. Returns the per-micro-batch counter deltas and the gradients
    (full tensors, float64) before the step."""
    per_micro = []
    for i, (ids, adv, rows) in enumerate(batches):
        before = counter.snapshot()
        last = i == len(batches) - 1
        if no_sync:
            model.set_requires_gradient_sync(last)
        loss_of(log_probs_of(model, ids, fused, rows), adv).backward()
        per_micro.append(tuple(a - b for a, b in zip(counter.snapshot(), before)))
    if no_sync:
        model.set_requires_gradient_sync(True)
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().double().clone()
             for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    opt.step()
    opt.zero_grad(set_to_none=True)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().clone()
              for n, p in model.named_parameters()}
    with torch.no_grad():  # verl's log-prob computation after the step (forward only)
        after = log_probs_of(model, batches[0][0], fused).double()
    return per_micro, grads, params, after


def run_config(cfg: dict, rank: int, mesh) -> dict:
    from transformers import Qwen2ForCausalLM
    from verl.models.transformers.monkey_patch import apply_monkey_patch

    import rl_kernels.integrations.verl as rkv

    plain_forward = cfg["plain_forward"]
    param_dtype = {"float32": None, "bfloat16": torch.bfloat16}[cfg["param_dtype"]]
    import time

    batches = micro_batches(rank, cfg.get("loss_rows", False))
    result = {"cfg": cfg}
    start = time.perf_counter()
    w_init = tiny_untied().lm_head.weight.detach()
    hidden = []
    for fused in (False, True):
        Qwen2ForCausalLM.forward = plain_forward  # the class forward verl's patch replaces
        model = tiny_untied()
        if fused:
            apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                               fused_kernels_backend=rkv.BACKEND_NAME)
            assert model._rl_kernels_fused
        shard(model, head_unit=cfg["head_unit"], reshard_after_forward=cfg["reshard_after_forward"],
              param_dtype=param_dtype, mesh=mesh)
        if not fused:  # the final hidden states (the head's input), for the logits' magnitude
            hook = model.model.norm.register_forward_hook(lambda m, a, out: hidden.append(out.detach()))
        counter = Counter(model)
        calls, skipped = rkv.call_counts()["fused_fsdp_calls"], rkv.call_counts()["loss_rows_skipped_tokens"]
        try:
            per_micro, grads, params, after = train_step(model, batches, fused=fused, no_sync=cfg["no_sync"],
                                                  counter=counter)
        finally:
            counter.close()
            if not fused:
                hook.remove()
        served = rkv.call_counts()["fused_fsdp_calls"] - calls
        result["fused" if fused else "unfused"] = {"per_micro": per_micro, "grads": grads, "params": params,
                                                  "after": after, "served": served,
                                                  "skipped": rkv.call_counts()["loss_rows_skipped_tokens"] - skipped}
    if cfg.get("loss_rows"):
        result["outside"] = sum(int((~rows).sum()) for _, _, rows in batches)
    Qwen2ForCausalLM.forward = plain_forward
    from tolerances import head_magnitude

    m = torch.tensor(head_magnitude(torch.cat([h.float() for h in hidden[:MICRO]]), w_init, T), dtype=torch.float64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    result["logits"] = float(m)
    result["seconds"] = time.perf_counter() - start
    return result


def run(rank: int, init_file: str, configs: list, out_dir: str):
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from transformers import Qwen2ForCausalLM

        import rl_kernels.integrations.verl as rkv

        rkv.configure(backend="torch")
        mesh = init_device_mesh("cpu", (2,))
        plain_forward = Qwen2ForCausalLM.forward
        results = []
        for cfg in configs:
            try:
                results.append(run_config({**cfg, "plain_forward": plain_forward}, rank, mesh))
            except Exception as exc:  # reported per configuration (the other rank fails the same way)
                results.append({"cfg": cfg, "error": f"{type(exc).__name__}: {exc}",
                                "traceback": traceback.format_exc()})
                dist.barrier()
            results[-1]["cfg"] = cfg
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
