"""Worker for tests/integrations/test_verl_megatron.py: one process per rank of a gloo group (CPU), with
Megatron's parallel state initialized for tensor parallelism over all ranks.

Every rank builds the same full inputs from one seed and keeps its even vocab shard, as Megatron
does. verl's own code is called: ``MegatronEngineWithLMHead._lm_head_logits_processor`` (logits
path, through the by-name imports of ``transformer_impl``) and ``fused_output_processor`` (fused
path), and checked against the unsharded float64 reference (values, gradients), against verl's
original functions where they run on CPU, and for identical bits on every rank. Σπ² on the fused
path goes through verl's ``MegatronEngineWithLMHead.forward_step`` and its fused forward, on a
stand-in GPT model (:class:`_StandInGPT`).
"""
import logging
import os
import sys
import types

import torch
import torch.distributed as dist

T_SEQ, H, V_R = 12, 16, 37          # tokens (divisible by 2 and 3), hidden, vocab rows per rank (odd)
TEMPERATURE = 0.7
VAL = dict(atol=2e-5, rtol=1e-4)     # float32 values
GRAD = dict(atol=1e-5, rtol=1e-4)    # float32 gradients


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, level=logging.INFO):
        return [r.getMessage() for r in self.records if r.levelno == level]


# ----------------------------------------------------------------------------- CPU stand-in
class _CpuGather(torch.autograd.Function):
    """Megatron's _GatherFromSequenceParallelRegion on CPU: all-gather along dim 0 forward;
    backward reduce-scatter (sum over the group, then this rank's rows) or, without
    tensor_parallel_output_grad, only this rank's rows."""

    @staticmethod
    def forward(ctx, x, group, sum_grad):
        ctx.group, ctx.sum_grad = group, sum_grad
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, 0)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        if ctx.sum_grad:
            dist.all_reduce(grad, group=ctx.group)
        world, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        rows = grad.shape[0] // world
        return grad[rank * rows:(rank + 1) * rows], None, None


def gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True, group=None,
                                         output_split_sizes=None, use_global_buffer=False):
    from megatron.core import parallel_state

    group = group if group is not None else parallel_state.get_tensor_model_parallel_group()
    return _CpuGather.apply(input_, group, tensor_parallel_output_grad)


def _same_on_all_ranks(t):
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return all(torch.equal(o, out[0]) for o in out)


# ----------------------------------------------------------------------------- run
def run(rank, world, init_file):
    # verl's _VocabParallelEntropy wraps a two-op product in torch.compile (about 25 s of CPU
    # compilation per process): run it eagerly, same math
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    assert parallel_state.get_tensor_model_parallel_rank() == rank

    # Megatron's gather_from_sequence_parallel_region allocates its output on CUDA; put the CPU
    # stand-in (same semantics) where verl looks it up BEFORE rl-kernels' patch wraps it
    import megatron.core.tensor_parallel as mcore_tp
    import megatron.core.tensor_parallel.mappings as mappings
    import verl.models.mcore as mcore
    import verl.models.mcore.model_forward_1f1b_overlap as overlap
    import verl.models.mcore.model_forward_fused as fused
    import verl.trainer.distillation.megatron.losses as megatron_losses
    import verl.utils.megatron.tensor_parallel as vtp
    import verl.utils.torch_functional as verl_F
    import verl.workers.engine.megatron.transformer_impl as mti
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy as verl_lce

    for mod in (mcore_tp, mappings, fused):
        mod.gather_from_sequence_parallel_region = gather_from_sequence_parallel_region
    originals = {
        (vtp, n): getattr(vtp, n) for n in ("vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy",
                                              "vocab_parallel_entropy_with_chunking", "vocab_parallel_sum_pi_squared")}
    originals.update({(mti, n): getattr(mti, n) for _, n in list(originals)})
    originals.update({(fused, "linear_cross_entropy"): verl_lce, (overlap, "linear_cross_entropy"): verl_lce,
                      (fused, "gather_from_sequence_parallel_region"): gather_from_sequence_parallel_region,
                      (mcore_tp, "gather_from_sequence_parallel_region"): gather_from_sequence_parallel_region,
                      (verl_F, "calculate_sum_pi_squared_from_logits"): verl_F.calculate_sum_pi_squared_from_logits,
                      (mcore, "get_mcore_forward_fused_model_engine_fn"): mcore.get_mcore_forward_fused_model_engine_fn,
                      (fused, "postprocess_thd_engine"): fused.postprocess_thd_engine,
                      (fused, "preprocess_thd_engine"): fused.preprocess_thd_engine,
                      (mti.MegatronEngineWithLMHead, "forward_step"): mti.MegatronEngineWithLMHead.forward_step,
                      (megatron_losses, "compute_forward_kl_topk"): megatron_losses.compute_forward_kl_topk})

    records = _Records()
    logging.getLogger("rl_kernels").addHandler(records)
    import rl_kernels.integrations.verl as rkv  # the import patches verl
    import rl_kernels.integrations.verl_impl.megatron as rkm

    try:
        _check_patched(rkv, rkm, vtp, mti, fused, overlap, verl_F, mcore_tp)
        before = rkv.call_counts()
        for dtype in (torch.float32, torch.bfloat16):
            _check_logits_path(rkv, mti, rank, world, dtype)
        for sp in (False, True):
            _check_fused(rank, world, sp, torch.float32)
        _check_fused(rank, world, False, torch.bfloat16)
        _check_fused_arguments(rkm, rank, world)
        after = rkv.call_counts()
        # per dtype: the processor twice (plain, chunked entropy); verl's own run is not counted
        assert after["megatron_logits_log_probs_calls"] - before["megatron_logits_log_probs_calls"] == 4, after
        assert after["megatron_logits_entropy_calls"] - before["megatron_logits_entropy_calls"] == 4, after
        assert after["sum_pi_squared_calls"] - before["sum_pi_squared_calls"] == 4, after
        assert after["fused_megatron_calls"] - before["fused_megatron_calls"] == 5, after
        assert after["fused_megatron_tokens"] - before["fused_megatron_tokens"] == 5 * T_SEQ, after
        assert after["fused_calls"] == after["fused_fsdp_calls"] + after["fused_megatron_calls"]
        summary = [m for m in records.messages() if m.startswith("rl_kernels: served 8 calls")]
        assert len(summary) == 1 and "megatron" in summary[0], records.messages()
        _check_engine_entropy_on_request(rkv, rkm, mcore, rank, world)
        _check_engine_fused_sum_pi_squared(rkv, mti, rank, world)
        _check_engine_fused_topk(rkv, mti, rank, world)
        _check_topk_function(rkv, megatron_losses, originals[(megatron_losses, "compute_forward_kl_topk")], rank, world)
        _check_engine_tail(rkv, mti, rank, world)
        _check_engine_per_sample_temperature(rkv, mti, rank, world)
        _check_engine_loss_rows(rkv, mti, rank, world)
        _check_anomaly_capture(rkv, rkm, rank, world, os.path.join(os.path.dirname(init_file), "anomalies"))

        _check_unpatch_restores(rkv, rkm, originals)
        if rank == 0:
            _check_engine_report(rkv, records)
            _check_signature_change_rolls_back(rkv, vtp, verl_F, originals)
            _check_without_megatron(rkv, vtp, originals, records)
        dist.barrier()
    finally:
        logging.getLogger("rl_kernels").removeHandler(records)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _check_patched(rkv, rkm, vtp, mti, fused, overlap, verl_F, mcore_tp):
    assert rkv.is_patched()
    for name in ("vocab_parallel_log_probs_from_logits", "vocab_parallel_entropy",
                 "vocab_parallel_entropy_with_chunking", "vocab_parallel_sum_pi_squared"):
        ours = getattr(rkm, name)
        assert getattr(vtp, name) is ours, name
        assert getattr(mti, name) is ours, f"transformer_impl.{name} (imported by name) not patched"
    assert fused.linear_cross_entropy is rkm.linear_cross_entropy
    assert overlap.linear_cross_entropy is rkm.linear_cross_entropy
    assert verl_F.calculate_sum_pi_squared_from_logits is rkv.calculate_sum_pi_squared_from_logits
    # the tagging wrappers around the stand-in, where the two fused forwards look the gather up
    assert fused.gather_from_sequence_parallel_region._rl_kernels_original is gather_from_sequence_parallel_region
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region as late_import  # 1F1B's
    assert late_import is mcore_tp.gather_from_sequence_parallel_region
    assert late_import._rl_kernels_original is gather_from_sequence_parallel_region
    x = torch.randn(2, 1, 3)
    assert late_import(x)._rl_kernels_dh_summed is True
    assert not hasattr(late_import(x, tensor_parallel_output_grad=False), "_rl_kernels_dh_summed")
    report = rkv.report()
    for part in ("Megatron logits path", "Megatron fused path", "sum_pi_squared (Megatron)",
                 "Megatron fused sum_pi_squared", "FSDP fused path", "FSDP logits path", "sum_pi_squared (FSDP)"):
        assert report[part][0], (part, report[part])
    assert "verl.workers.engine.megatron.transformer_impl.vocab_parallel_entropy" in report["Megatron logits path"][1]
    assert "entropy only when verl's calculate_entropy asks" in report["Megatron fused path"][1], report


# ----------------------------------------------------------------------------- logits path
def _logits_reference(full, labels, temps, g, dtype):
    """float64 log-probs, entropy, sum p^2 of softmax(full / T) and d(loss)/d(full) (loss = g . outputs);
    the division by T is rounded to the logits dtype first, as verl's in-place div_ does."""
    z = (full.to(dtype) / temps.unsqueeze(-1).to(dtype)).double().requires_grad_()
    log_p = z.log_softmax(-1)
    lp = log_p.gather(-1, labels[..., None])[..., 0]
    ent = -(log_p.exp() * log_p).sum(-1)
    sq = log_p.exp().pow(2).sum(-1)
    (g[0] * lp + g[1] * ent + g[2] * sq).sum().backward()
    return lp.detach(), ent.detach(), sq.detach(), z.grad / temps.unsqueeze(-1).double()


def _processor(mti, shard, labels, temps, g, chunking=False):
    """verl's own Megatron logits processor on this rank's shard; returns outputs and d/d(shard)."""
    engine = types.SimpleNamespace(engine_config=types.SimpleNamespace(
        entropy_from_logits_with_chunking=chunking, entropy_from_logits_chunk_size=4))
    leaf = shard.clone().requires_grad_()
    logits = leaf * 1  # a non-leaf like the model's output: verl divides it by T in place
    ret = mti.MegatronEngineWithLMHead._lm_head_logits_processor(
        engine, logits, labels, temps.clone(), calculate_sum_pi_squared=True, calculate_entropy=True,
        distillation_use_topk=False, distillation_only=False, logits_processor_func=None, batch=None,
        data_format="thd")
    (g[0] * ret["log_probs"] + g[1] * ret["entropy"] + g[2] * ret["sum_pi_squared"]).sum().backward()
    return ret["log_probs"], ret["entropy"], ret["sum_pi_squared"], leaf.grad


def _check_logits_path(rkv, mti, rank, world, dtype):
    from verl_helpers import verl_unpatched

    gen = torch.Generator().manual_seed(1)
    full = torch.randn(1, T_SEQ, world * V_R, generator=gen) * 3
    labels = torch.randint(0, world * V_R, (1, T_SEQ), generator=gen)
    labels[0, 0], labels[0, 1] = world * V_R - 1, 0  # last (padded-shard) and first id
    temps = 0.5 + torch.rand(1, T_SEQ, generator=gen)  # per-token temperatures, != 1
    g = torch.randn(3, 1, T_SEQ, generator=gen)
    lo, hi = rank * V_R, (rank + 1) * V_R
    shard = full[..., lo:hi].to(dtype)

    ours = _processor(mti, shard, labels, temps, g)
    ref_lp, ref_ent, ref_sq, ref_grad = _logits_reference(full, labels, temps, g, dtype)
    for got, want in zip(ours[:3], (ref_lp, ref_ent, ref_sq)):
        assert got.dtype == torch.float32 and got.shape == labels.shape
        torch.testing.assert_close(got.double(), want, **VAL)
        assert _same_on_all_ranks(got)
    # bf16: each of the three gradients is rounded to bf16, autograd adds them in bf16 and verl's
    # in-place division by T rounds again: up to about one bf16 ulp (2^-8) of a term of size 1
    grad_tol = GRAD if dtype == torch.float32 else dict(atol=2 ** -8, rtol=2 ** -7)
    torch.testing.assert_close(ours[3].double(), ref_grad[..., lo:hi], **grad_tol)
    chunked = _processor(mti, shard, labels, temps, g, chunking=True)
    assert torch.equal(chunked[1], ours[1])

    # verl's own functions (Megatron's cross-entropy, _VocabParallelEntropy). Its sum p^2 is plain
    # torch ops around in-place all_reduces, whose backward autograd does not sum over the group:
    # its gradient is left out of the loss here (verl uses sum p^2 as a detached baseline)
    g_no_sq = torch.cat([g[:2], torch.zeros_like(g[2:])])
    with verl_unpatched():
        theirs = _processor(mti, shard, labels, temps, g_no_sq)
    if dtype == torch.float32:
        for got, want in zip(ours[:3], theirs[:3]):
            torch.testing.assert_close(got, want.float(), **VAL)
        ref_grad_no_sq = _logits_reference(full, labels, temps, g_no_sq, dtype)[3]
        torch.testing.assert_close(theirs[3].double(), ref_grad_no_sq[..., lo:hi], **GRAD)
    else:  # verl's entropy and sum p^2 come back in bf16: ours must be no worse against float64
        for got, base, want in zip(ours[:3], theirs[:3], (ref_lp, ref_ent, ref_sq)):
            assert (got.double() - want).abs().max() <= (base.double() - want).abs().max() + 1e-6


# ----------------------------------------------------------------------------- fused path
def _fused_inputs(world):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(T_SEQ, 1, H, generator=gen)             # Megatron (S, B, H), packed: B = 1
    weight = torch.randn(world * V_R, H, generator=gen) * 0.5
    labels = torch.randint(0, world * V_R, (1, T_SEQ), generator=gen)  # (B, S) like verl's labels_rmpad
    labels[0, 0] = world * V_R - 1
    g_lp, g_ent = torch.randn(2, 1, T_SEQ, generator=gen)
    return hidden, weight, labels, g_lp, g_ent


def _fused_reference(hidden, weight, labels, g_lp, g_ent):
    h64 = hidden.double()[:, 0].requires_grad_()
    w64 = weight.double().requires_grad_()
    log_p = (h64 @ w64.T / TEMPERATURE).log_softmax(-1)
    lp = log_p.gather(1, labels[0][:, None])[:, 0]
    ent = -(log_p.exp() * log_p).sum(-1)
    (g_lp[0].double() * lp + g_ent[0].double() * ent).sum().backward()
    return lp.detach(), ent.detach(), h64.grad[:, None], w64.grad


def _check_fused(rank, world, sequence_parallel, dtype):
    """verl's fused_output_processor (hook mode) with real tensors. SP off: hidden replicated, dh
    must be the full gradient on every rank (rl-kernels all-reduces). SP on: each rank holds its
    sequence chunk; the gather's backward sums dh, rl-kernels must not sum it again."""
    from megatron.core import parallel_state
    from verl.models.mcore.model_forward_fused import FusedOutputProcessorContext, fused_output_processor

    hidden, weight, labels, g_lp, g_ent = _fused_inputs(world)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    lo, hi = rank * V_R, (rank + 1) * V_R
    rows = T_SEQ // world
    local = (hidden[rank * rows:(rank + 1) * rows] if sequence_parallel else hidden).clone().requires_grad_()
    w_shard = weight[lo:hi].clone().requires_grad_()
    config = types.SimpleNamespace(sequence_parallel=sequence_parallel, config_logger_dir="")
    out = fused_output_processor(hidden_states=local, output_layer=None, output_weight=w_shard, labels=labels,
                                 context=FusedOutputProcessorContext(temperature=TEMPERATURE), config=config)
    assert out.log_probs.shape == labels.shape and out.log_probs.dtype == torch.float32
    (g_lp * out.log_probs + g_ent * out.entropy).sum().backward()

    ref_lp, ref_ent, ref_dh, ref_dw = _fused_reference(hidden, weight, labels, g_lp, g_ent)
    torch.testing.assert_close(out.log_probs[0].double(), ref_lp, **VAL)
    torch.testing.assert_close(out.entropy[0].double(), ref_ent, **VAL)
    assert _same_on_all_ranks(out.log_probs) and _same_on_all_ranks(out.entropy)
    grad_tol = GRAD if dtype == torch.float32 else dict(atol=1e-3, rtol=2 ** -7)
    want_dh = ref_dh[rank * rows:(rank + 1) * rows] if sequence_parallel else ref_dh
    torch.testing.assert_close(local.grad.double(), want_dh, **grad_tol)
    torch.testing.assert_close(w_shard.grad.double(), ref_dw[lo:hi], **grad_tol)
    assert parallel_state.get_tensor_model_parallel_world_size() == world


def _check_fused_arguments(rkm, rank, world):
    from megatron.core import parallel_state

    hidden, weight, labels, _, _ = _fused_inputs(world)
    group = parallel_state.get_tensor_model_parallel_group()
    w_shard = weight[rank * V_R:(rank + 1) * V_R]
    a = rkm.linear_cross_entropy(hidden, w_shard, labels, TEMPERATURE, "none", group)
    b = rkm.linear_cross_entropy(hidden, w_shard, labels, torch.tensor([TEMPERATURE]), "none", group)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for bad, match in (({"reduction": "mean"}, "reduction"),
                       ({"temperature": torch.tensor([0.5, 0.7])}, "one temperature")):
        kwargs = {"temperature": TEMPERATURE, "reduction": "none", "dist_process_group": group, **bad}
        try:
            rkm.linear_cross_entropy(hidden, w_shard, labels, **kwargs)
        except ValueError as e:
            assert match in str(e), e
        else:
            raise AssertionError(f"{bad} did not raise")


def _check_engine_entropy_on_request(rkv, rkm, mcore, rank, world):
    """verl's Megatron engine gets its fused forward from verl.models.mcore's factory and calls it
    with calculate_entropy: with False, the fused head inside computes no entropy (NaN placeholder,
    counted), log-probs unchanged (verl #2608). The engine forward is a stand-in that calls the
    fused head as verl's does (a real one needs a Megatron model)."""
    import verl.models.mcore.registry as registry
    from megatron.core import parallel_state

    hidden, weight, labels, _, _ = _fused_inputs(world)
    group = parallel_state.get_tensor_model_parallel_group()
    w_shard = weight[rank * V_R:(rank + 1) * V_R]

    def engine_forward(model, input_ids, labels, multi_modal_inputs, temperature, calculate_entropy,
                       pad_token_id, **kwargs):
        return rkm.linear_cross_entropy(hidden, w_shard, labels, temperature, "none", group)

    original = registry.fused_forward_model_engine
    registry.fused_forward_model_engine = lambda vision_model: engine_forward
    try:
        forward = mcore.get_mcore_forward_fused_model_engine_fn(types.SimpleNamespace(architectures=["Qwen2ForCausalLM"]))
        skipped = rkv.call_counts()["entropy_skipped_calls"]
        lp_on, ent_on = forward(None, None, labels, {}, TEMPERATURE, True, 0)
        lp_off, ent_off = forward(None, None, labels, {}, TEMPERATURE, calculate_entropy=False, pad_token_id=0)
    finally:
        registry.fused_forward_model_engine = original
    assert torch.equal(lp_on, lp_off) and torch.isfinite(ent_on).all() and ent_on.abs().sum() > 0
    assert torch.isnan(ent_off).all() and ent_off.shape == ent_on.shape
    assert rkv.call_counts()["entropy_skipped_calls"] == skipped + 1
    # outside the engine's forward, the fused head computes entropy as before
    assert torch.equal(rkm.linear_cross_entropy(hidden, w_shard, labels, TEMPERATURE, "none", group)[1], ent_on)


# ----------------------------------------------------------------------------- Σπ² on the fused path
class _StandInOutputLayer(torch.nn.Module):
    """What verl's logits path needs of Megatron's ColumnParallelLinear output layer: this rank's
    vocab shard of the logits, ``(S, 1, V_r)``, and ``(logits, bias)`` returned; with
    ``sequence_parallel`` its input is this rank's ``S / tp`` rows, all-gathered first (backward:
    summed over the group, this rank's rows)."""

    def __init__(self, weight_shard, sequence_parallel=False):
        super().__init__()
        self.weight_shard, self.sequence_parallel = weight_shard, sequence_parallel

    def forward(self, hidden):
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden)
        return hidden @ self.weight_shard.T, None


class _StandInGPT(torch.nn.Module):
    """What verl's Megatron engine forwards need of a GPTModel on the last pipeline stage: packed
    THD input ids -> hidden (S, 1, H) from a random embedding, then either Megatron's output
    processor hook (the fused path: verl's fused_output_processor on this rank's vocab shard) or
    its ``output_layer`` (the logits path: this rank's logits shard (1, S, V_r); with
    ``sequence_parallel`` the layer gets this rank's S / tp rows of the hidden states)."""

    def __init__(self, embedding, weight_shard, sequence_parallel=False):
        super().__init__()
        self.embedding, self.weight_shard = embedding, weight_shard
        self.output_layer = _StandInOutputLayer(weight_shard, sequence_parallel)
        self.pre_process = self.post_process = True
        self.config = types.SimpleNamespace(fp8=None, sequence_parallel=False, config_logger_dir="")
        self._verl_fused_forward_mode = "hook"  # verl's mode for Megatron-Core >= 0.18's output processor

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None, labels=None,
                output_processor=None, output_processor_context=None, **kwargs):
        hidden = self.embedding[input_ids].transpose(0, 1)  # (S, 1, H), Megatron's layout
        if output_processor is not None:
            return output_processor(hidden_states=hidden, output_layer=None, output_weight=self.weight_shard,
                                    labels=labels, context=output_processor_context, config=self.config)
        if self.output_layer.sequence_parallel:
            hidden = hidden.chunk(dist.get_world_size())[dist.get_rank()]
        return self.output_layer(hidden)[0].transpose(0, 1)


ENGINE_LENGTHS = (7, 5)  # the two packed sequences of _engine_step


def _engine_input_ids(vocab):
    """The input ids of :func:`_engine_step` (nested, ENGINE_LENGTHS), the same on every call."""
    gen = torch.Generator().manual_seed(7)
    return torch.nested.nested_tensor([torch.randint(0, vocab, (n,), generator=gen) for n in ENGINE_LENGTHS],
                                      layout=torch.jagged)


def _engine_step(mti, model, fused, tensors=None, flags=None, logits_processor_func=None, grad=False,
                 temperature=TEMPERATURE):
    """verl's MegatronEngineWithLMHead.forward_step (without its __init__) on two packed sequences,
    with calculate_sum_pi_squared=True unless ``flags`` say otherwise (``tensors``: more nested
    tensors of the micro-batch, or its loss_mask; ``temperature``: a number, or a (2,) tensor: one
    per sample); returns the output dict of the last stage and the input ids."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    ids = _engine_input_ids(model.embedding.shape[0])
    mask = torch.nested.nested_tensor([torch.ones(n) for n in ENGINE_LENGTHS], layout=torch.jagged)
    per_sample = {"temperature": temperature} if isinstance(temperature, torch.Tensor) else {}
    batch = TensorDict({"input_ids": ids, "loss_mask": mask, **per_sample, **(tensors or {})}, batch_size=[2])
    flags = {"calculate_entropy": True, "calculate_sum_pi_squared": True, **(flags or {})}
    if not per_sample:
        flags["temperature"] = temperature
    tu.assign_non_tensor(batch, use_fused_kernels=fused, **flags)
    engine = mti.MegatronEngineWithLMHead.__new__(mti.MegatronEngineWithLMHead)
    engine.engine_config = types.SimpleNamespace(
        use_fused_kernels=fused, pad_to_length=False, use_remove_padding=True, dynamic_context_parallel=False,
        entropy_from_logits_with_chunking=False)
    from megatron.core.transformer import TransformerConfig

    # verl main asks its router-replay helper about the (here absent) MoE routers on every step
    engine.enable_routing_replay = False
    engine.tf_config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1,
                                         use_cpu_initialization=True)
    engine.model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
        tokenizer=types.SimpleNamespace(pad_token_id=0), mtp=types.SimpleNamespace(enable=False, enable_train=False))
    device_id, mti.get_device_id = mti.get_device_id, lambda: "cpu"  # verl asks its platform (CUDA)
    try:
        with torch.set_grad_enabled(grad):
            output, _ = engine.forward_step(iter([batch]), model, logits_processor_func, lambda *a, **k: None)
    finally:
        mti.get_device_id = device_id
    assert tu.get_non_tensor_data(batch, "calculate_sum_pi_squared", None) is flags["calculate_sum_pi_squared"]
    return output, ids


def _check_engine_fused_sum_pi_squared(rkv, mti, rank, world):
    """calculate_sum_pi_squared=True with use_fused_kernels=True through verl's own Megatron engine
    forward_step and fused forward (preprocess_thd_engine, the output processor, postprocess_thd_engine),
    vocab-parallel over the TP group: the fused head's Σπ² comes back where verl's logits path puts
    it, equal to verl's own vocab_parallel_sum_pi_squared (the logits path, rl-kernels unpatched) and to
    float64 within the float32 tolerance that logits path has against float64 (2e-6, below). A fused
    head that computes none (a stand-in for verl's own) leaves verl's refusal."""
    from verl_helpers import verl_unpatched

    gen = torch.Generator().manual_seed(8)
    vocab = world * V_R
    embedding = torch.randn(vocab, H, generator=gen)
    weight = torch.randn(vocab, H, generator=gen) * 0.5
    model = _StandInGPT(embedding, weight[rank * V_R:(rank + 1) * V_R])
    before = rkv.call_counts()
    got, ids = _engine_step(mti, model, fused=True)
    after = rkv.call_counts()
    assert after["fused_megatron_calls"] == before["fused_megatron_calls"] + 1, after  # one pass for all three
    assert after["fused_sum_pi_squared_calls"] == before["fused_sum_pi_squared_calls"] + 1, after
    with verl_unpatched():  # verl's logits path as installed: its vocab_parallel_sum_pi_squared
        ref, _ = _engine_step(mti, model, fused=False)
    p = torch.softmax(embedding.double()[ids.values()] @ weight.double().T / TEMPERATURE, -1)
    want64 = (p * p).sum(-1)
    sq, ref_sq = got["sum_pi_squared"], ref["sum_pi_squared"]
    assert sq.is_nested and ref_sq.is_nested and torch.equal(sq.offsets(), ref_sq.offsets()), (sq, ref_sq)
    assert torch.equal(sq.offsets(), ids.offsets())
    # float32: Σπ² = Σ exp(2 log p) from float32 logits z / T carries about 2^-24 * 2 max|z / T| ~ 1e-6
    # relative error (max|z / T| ~ 9 here); measured 6.9e-7 (fused) and 1.1e-7 (verl's logits path) from float64
    torch.testing.assert_close(sq.values().double(), want64, atol=2e-6, rtol=0)
    torch.testing.assert_close(ref_sq.values().double(), want64, atol=2e-6, rtol=0)  # the logits path's own
    torch.testing.assert_close(sq.values().float(), ref_sq.values().float(), atol=2e-6, rtol=0)
    assert float(want64.min()) > 2 / vocab  # a spread softmax, not a uniform one
    torch.testing.assert_close(got["log_probs"].values(), ref["log_probs"].values().float(), **VAL)
    assert _same_on_all_ranks(sq.values())
    # verl's error where rl-kernels' fused head does not run (here: its output processor is verl's own)
    import verl.models.mcore.model_forward_fused as fused_module

    original = fused_module.fused_output_processor
    fused_module.fused_output_processor = lambda **kwargs: types.SimpleNamespace(
        log_probs=torch.zeros_like(kwargs["labels"], dtype=torch.float32),
        entropy=torch.zeros_like(kwargs["labels"], dtype=torch.float32))
    try:
        _engine_step(mti, model, fused=True)
    except NotImplementedError as e:
        assert "calculate_sum_pi_squared=True is not supported with use_fused_kernels=True" in str(e), e
    else:
        raise AssertionError("verl's refusal did not stay for a fused head that computes no sum_pi_squared")
    finally:
        fused_module.fused_output_processor = original


# ----------------------------------------------------------------------------- top-K distillation, fused path
TOPK, CLAMP = 4, -9.5


def _topk_step(mti, fused, embedding, weight, rank, tensors, flags, g, loss_mode="forward_kl_topk", clamp=CLAMP):
    """One forward_step of verl's engine with top-K distillation (verl's own loss function as the
    logits processor) and the backward of sum(g * distillation_losses): (output, d embedding
    summed over the TP group, d weight shard)."""
    import functools

    from verl.trainer.distillation import losses as verl_losses

    emb = embedding.clone().requires_grad_()
    shard = weight[rank * V_R:(rank + 1) * V_R].clone().requires_grad_()
    config = types.SimpleNamespace(strategy="megatron")
    distillation_config = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(log_prob_min_clamp=clamp,
                                                                                        loss_mode=loss_mode))
    loss_function = functools.partial(verl_losses.distillation_ppo_loss, config=config,
                                      distillation_config=distillation_config)
    output, ids = _engine_step(mti, _StandInGPT(emb, shard), fused, tensors, flags, loss_function, grad=True)
    (output["distillation_losses"].values() * g).sum().backward()
    if not fused:  # verl's logits path leaves each rank's partial dh (Megatron's output layer would sum it)
        dist.all_reduce(emb.grad)
    return output, emb.grad, shard.grad, ids


def _check_engine_fused_topk(rkv, mti, rank, world):
    """Top-K distillation with use_fused_kernels=True through verl's own Megatron engine forward_step
    and fused forward (preprocess_thd_engine, the output processor, postprocess_thd_engine), the
    vocab-parallel head over the TP group: distillation_losses, student_mass and teacher_mass (and
    log_probs / entropy) equal verl's Megatron logits path on the same inputs (verl's own
    _lm_head_logits_processor and megatron.losses.compute_forward_kl_topk, rl-kernels unpatched),
    and so do the gradients of sum(g * distillation_losses) w.r.t. the hidden states (the
    embedding rows) and this rank's weight shard; float32 tolerances VAL / GRAD. Twice: without
    entropy (one head call for log-probs and the teacher's ids), and with entropy and
    distillation_only (log_probs dropped as verl's logits path computes none)."""
    from verl_helpers import verl_unpatched

    gen = torch.Generator().manual_seed(9)
    vocab = world * V_R
    embedding = torch.randn(vocab, H, generator=gen)
    weight = torch.randn(vocab, H, generator=gen) * 0.5
    teacher = [torch.log_softmax(torch.randn(n, vocab, generator=gen) * 2, -1).topk(TOPK, -1) for n in (7, 5)]
    teacher[0].values[:, -1] -= 8.0  # the first sequence's last slot below the clamp: the teacher's side clamped too
    tensors = {"teacher_logprobs": torch.nested.nested_tensor([t.values for t in teacher], layout=torch.jagged),
               "teacher_ids": torch.nested.nested_tensor([t.indices for t in teacher], layout=torch.jagged)}
    g = torch.rand(12, generator=gen) + 0.5  # the tokens of the two sequences
    for flags in ({"calculate_entropy": False, "distillation_only": False},
                  {"calculate_entropy": True, "distillation_only": True}):
        flags = {**flags, "calculate_sum_pi_squared": False, "distillation_use_topk": True}
        before = rkv.call_counts()
        got, d_emb, d_w, ids = _topk_step(mti, True, embedding, weight, rank, tensors, flags, g)
        after = rkv.call_counts()
        assert after["distillation_calls"] == before["distillation_calls"] + 1, after
        assert after["fused_megatron_calls"] == before["fused_megatron_calls"] + 1, after
        with verl_unpatched():  # verl's Megatron logits path as installed
            ref, ref_emb, ref_w, _ = _topk_step(mti, False, embedding, weight, rank, tensors, flags, g)
        # the logits path with rl-kernels' compute_forward_kl_topk (vocab-parallel): every output of verl's,
        # overlap metrics included, and the gradients
        before = rkv.call_counts()["distillation_calls"]
        ours, ours_emb, ours_w, _ = _topk_step(mti, False, embedding, weight, rank, tensors, flags, g)
        assert rkv.call_counts()["distillation_calls"] == before + 1
        assert set(ours) == set(ref), (set(ours), set(ref))
        for key in ours:
            if key == "overlap_count":
                assert torch.equal(ours[key].values(), ref[key].values())
            else:
                torch.testing.assert_close(ours[key].values(), ref[key].values(), **VAL, msg=key)
            assert _same_on_all_ranks(ours[key].values().detach())
        torch.testing.assert_close(ours_emb, ref_emb, **GRAD)
        torch.testing.assert_close(ours_w, ref_w, **GRAD)
        # the fused path: every output of verl's logits path, the overlap metrics included (the student's top K
        # selected in the fused head's forward, merged over the TP group)
        assert set(got) == set(ref), (set(got), set(ref))
        assert ("log_probs" in got) is not flags["distillation_only"]
        for key in got:
            assert got[key].is_nested and torch.equal(got[key].offsets(), ids.offsets()), key
            if key == "overlap_count":
                assert got[key].dtype == ref[key].dtype and torch.equal(got[key].values(), ref[key].values())
            else:
                torch.testing.assert_close(got[key].values(), ref[key].values().float(), **VAL, msg=key)
            assert _same_on_all_ranks(got[key].values().detach())
        counts = got["overlap_count"].values()
        assert int(counts.min()) < int(counts.max()) and float(got["overlap_token_advantage"].values().abs().max()) > 0
        torch.testing.assert_close(d_emb, ref_emb, **GRAD)
        torch.testing.assert_close(d_w, ref_w, **GRAD)
        assert float(d_w.abs().max()) > 1e-2 and float(got["distillation_losses"].values().abs().max()) > 1e-2
    # the option off: the fused path leaves the overlap metrics out, the rest as it was
    rkv.configure(overlap_metrics=False)
    try:
        off, _, _, _ = _topk_step(mti, True, embedding, weight, rank, tensors, flags, g)
    finally:
        rkv.configure(overlap_metrics=True)
    assert set(off) == set(got) - {"overlap_count", "overlap_token_advantage"}, set(off)
    assert torch.equal(off["distillation_losses"].values(), got["distillation_losses"].values())
    # the clamp matters here: some (not most) of the student's log-probs at the teacher's ids lie below it
    log_q = torch.log_softmax(embedding.double()[ids.values()] @ weight.double().T / TEMPERATURE, -1)
    below = (log_q.gather(1, tensors["teacher_ids"].values()) < CLAMP).double().mean()
    assert 0.05 < float(below) < 0.5, float(below)
    assert float(tensors["teacher_logprobs"].values().min()) < CLAMP


# ----------------------------------------------------------------------------- patch mechanics
def _check_unpatch_restores(rkv, rkm, originals):
    rkv.unpatch()
    for (owner, name), value in originals.items():
        assert getattr(owner, name) is value, f"{owner.__name__}.{name} not restored"
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region as g
    assert g is gather_from_sequence_parallel_region
    from verl.workers.engine.base import EngineRegistry
    assert not hasattr(vars(EngineRegistry)["get_engine_cls"].__func__, "_rl_kernels_original")
    rkv.patch()
    for (owner, name), value in originals.items():
        assert getattr(owner, name) is not value, f"{owner.__name__}.{name} not re-patched"


def _check_engine_report(rkv, records):
    from verl.workers.engine.base import BaseEngine, EngineRegistry

    os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # megatron is registered for CUDA
    try:
        cls = EngineRegistry.get_engine_cls("language_model", "megatron")
        assert cls.__name__ == "MegatronEngineWithLMHead"
        served = [m for m in records.messages() if "verl engine 'megatron'" in m]
        assert len(served) == 1 and "is served by rl-kernels: Megatron logits path" in served[0], served
        assert "Megatron fused path (use_fused_kernels=True)" in served[0] and "sum_pi_squared" in served[0]
        assert "Megatron fused sum_pi_squared (calculate_sum_pi_squared=True, use_fused_kernels=True)" in served[0]
        assert EngineRegistry.get_engine_cls("value_model", "megatron").__name__ == "MegatronEngineWithValueHead"
        assert not [m for m in records.messages() if "(MegatronEngineWithValueHead)" in m]  # no log-probs there

        class VeOmniLikeEngine(BaseEngine):  # an engine rl-kernels does not serve
            pass

        EngineRegistry.register(model_type="language_model", backend="rlk_test_unserved", device="cuda")(
            VeOmniLikeEngine)
        try:
            for _ in range(2):
                assert EngineRegistry.get_engine_cls("language_model", "rlk_test_unserved") is VeOmniLikeEngine
        finally:
            del EngineRegistry._engines["language_model"]["rlk_test_unserved"]
        warned = [m for m in records.messages(logging.WARNING) if "rlk_test_unserved" in m]
        assert len(warned) == 1 and "VeOmniLikeEngine" in warned[0] and "not an engine" in warned[0], warned
    finally:
        del os.environ["VERL_ENGINE_DEVICE"]


def _check_signature_change_rolls_back(rkv, vtp, verl_F, originals):
    import verl.models.transformers.monkey_patch as monkey_patch

    def vocab_parallel_entropy(vocab_parallel_logits, group=None):  # a hypothetical future verl
        return vocab_parallel_logits

    rkv.unpatch()
    vtp.vocab_parallel_entropy = vocab_parallel_entropy
    try:
        rkv.patch()
    except rkv.VerlIntegrationError as e:
        assert "vocab_parallel_entropy" in str(e) and "group=None" in str(e), e
    else:
        raise AssertionError("a changed signature did not raise")
    finally:
        vtp.vocab_parallel_entropy = originals[(vtp, "vocab_parallel_entropy")]
    assert not rkv.is_patched()
    assert not hasattr(monkey_patch.patch_forward_with_backends, "_rl_kernels_original")  # rolled back
    for (owner, name), value in originals.items():
        assert getattr(owner, name) is value, f"{owner.__name__}.{name} not rolled back"
    rkv.patch()


def _check_without_megatron(rkv, vtp, originals, records):
    rkv.unpatch()
    saved = {name: sys.modules[name] for name in ("megatron.core.parallel_state", "megatron.core.tensor_parallel")}
    sys.modules.update(dict.fromkeys(saved))  # None: "import megatron.core..." raises ImportError
    try:
        rkv.patch()
    finally:
        sys.modules.update(saved)
    report = rkv.report()
    for part in ("Megatron logits path", "Megatron fused path", "sum_pi_squared (Megatron)",
                 "Megatron fused sum_pi_squared"):
        assert not report[part][0] and "megatron.core not importable" in report[part][1], report[part]
    assert report["FSDP logits path"][0]
    assert vtp.vocab_parallel_entropy is originals[(vtp, "vocab_parallel_entropy")]
    assert any("megatron.core is not importable" in m for m in records.messages())
    rkv.unpatch()
    rkv.patch()


# ----------------------------------------------------------------------------- per-sample temperature
def _check_engine_per_sample_temperature(rkv, mti, rank, world):
    """verl's Megatron engine with a per-sample temperature (0.5 and 1.3, issue 44), through verl's
    own ``MegatronEngineWithLMHead.forward_step``: its ``_resolve_fused_temperature`` (recorded in
    the step request), the fused forward its factory returns (verl's own
    ``fused_forward_model_engine``: packing with the TP alignment pad, the labels' roll, the
    output-processor hook, unpacking) on the stand-in GPTModel whose decoder is an embedding
    lookup. Each sequence's log-probs (not its last token's, whose label verl drops) and entropy
    against float64 with its own temperature; the embedding's and the weight shard's gradients too.
    A uniform tensor and a call outside the engine's forward_step still go to verl's function; a
    per-sample temperature not laid out for the head is refused there."""
    from rl_kernels.integrations.verl_impl import megatron, megatron_step, patch_state
    gen = torch.Generator().manual_seed(7)
    temps, vocab = torch.tensor([0.5, 1.3]), world * V_R
    embedding, weight = torch.randn(vocab, H, generator=gen), torch.randn(vocab, H, generator=gen) * 0.5
    g_lp, g_ent = torch.randn(2, sum(ENGINE_LENGTHS), generator=gen)
    emb = embedding.clone().requires_grad_()
    w_shard = weight[rank * V_R:(rank + 1) * V_R].clone().requires_grad_()
    uniform = mti._resolve_fused_temperature(torch.tensor([0.7, 0.7]))  # verl's own: a float
    assert type(uniform) is float and abs(uniform - 0.7) < 1e-6
    try:  # outside the engine's forward_step: verl's own refusal
        mti._resolve_fused_temperature(temps)
    except NotImplementedError as e:
        assert "uniform temperature" in str(e), e
    else:
        raise AssertionError("a per-sample temperature outside the engine's forward_step was not verl's")
    out, input_ids = _engine_step(mti, _StandInGPT(emb, w_shard), True, flags={"calculate_sum_pi_squared": False},
                                  grad=True, temperature=temps)
    lp, ent = out["log_probs"].values(), out["entropy"].values()
    keep = torch.ones(sum(ENGINE_LENGTHS), dtype=torch.bool)
    keep[torch.tensor(ENGINE_LENGTHS).cumsum(0) - 1] = False
    (g_lp * lp * keep + g_ent * ent).sum().backward()

    e64, w64 = embedding.double().requires_grad_(), weight.double().requires_grad_()
    ids = input_ids.unbind()
    h64 = torch.cat([e64[s] for s in ids])
    z = h64 @ w64.T / torch.repeat_interleave(temps.double(), torch.tensor(ENGINE_LENGTHS))[:, None]
    log_p = z.log_softmax(-1)
    labels = torch.cat([torch.roll(s, -1) for s in ids])
    ref_lp = log_p.gather(1, labels[:, None])[:, 0]
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    (g_lp.double() * ref_lp * keep + g_ent.double() * ref_ent).sum().backward()
    torch.testing.assert_close(lp[keep].double(), ref_lp[keep].detach(), **VAL)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), **VAL)
    torch.testing.assert_close(emb.grad.double(), e64.grad, **GRAD)
    torch.testing.assert_close(w_shard.grad.double(), w64.grad[rank * V_R:(rank + 1) * V_R], **GRAD)
    token = patch_state.new_step(engine=megatron_step.ENGINE)  # a fused Megatron step that laid nothing out
    try:
        assert mti._resolve_fused_temperature(temps) == megatron_step.STAND_IN
        megatron.linear_cross_entropy(torch.zeros(3, 1, H), w_shard, torch.zeros(1, 3, dtype=torch.long),
                                          megatron_step.STAND_IN)
    except rkv.VerlIntegrationError as e:
        assert "outside the engine forward" in str(e), e
    else:
        raise AssertionError("a per-sample temperature not laid out for the head was not refused")
    finally:
        patch_state.step_request.reset(token)


# ----------------------------------------------------------------------------- loss rows only
PROMPT_LENGTHS = (3, 2)                      # of ENGINE_LENGTHS (7, 5): responses of 4 and 3 tokens
RESPONSE_LOSS_MASK = ((1, 0, 1, 1), (0, 1, 1))  # v1's nested response-layout loss_mask (0: a tool token)


def _label_rows(response_mask):
    """The rows of verl's per-sequence outputs (nested, input_ids layout: row t is the log-prob of
    token t + 1) that the loss reads: row P_i - 1 + j of sequence i where loss_mask[i][j] is 1."""
    rows = []
    for n, p, mask in zip(ENGINE_LENGTHS, PROMPT_LENGTHS, response_mask):
        row = torch.zeros(n, dtype=torch.bool)
        row[p - 1:p - 1 + len(mask)] = torch.tensor(mask, dtype=torch.bool)
        rows.append(row)
    return torch.cat(rows)


def _check_engine_loss_rows(rkv, mti, rank, world):
    """``loss_rows_only`` through verl's own Megatron engine forward_step and fused forward (issue 53
    item 3), TP over every rank: the loss mask (v1's nested response layout, with tool tokens at 0)
    laid out by verl's preprocess_thd_engine as the labels (rolled, TP-padded), the head run on the
    loss rows only. Option on vs off, with a per-sample temperature and Σπ² in the same step: on
    the loss rows, log-probs, entropy and Σπ² equal (float32 tolerance VAL), elsewhere exactly 0;
    the gradients (embedding rows, this rank's weight shard) of a loss that reads only the loss rows
    equal (GRAD); the skipped rows counted (every packed row, pads included, minus the loss rows). A
    micro-batch with no loss row still runs the head on every rank (0 rows; the TP collectives
    matched): all 0, zero gradients. Σπ² with top-K distillation is refused, naming both. The
    logits path the same way, with and without sequence parallelism (the output layer's hidden
    states selected per rank, verl's logits 0 outside the loss rows); with top-K distillation it
    is refused, naming the option."""
    gen = torch.Generator().manual_seed(13)
    vocab, n = world * V_R, sum(ENGINE_LENGTHS)
    embedding, weight = torch.randn(vocab, H, generator=gen), torch.randn(vocab, H, generator=gen) * 0.5
    g = torch.randn(3, n, generator=gen)
    temps = torch.tensor([0.6, 1.2])
    flags = {"calculate_entropy": True, "calculate_sum_pi_squared": True}
    packed_rows = sum(-(-length // world) * world for length in ENGINE_LENGTHS)  # verl's TP alignment pad

    def step(response_mask, only, fused=True, sequence_parallel=False):
        emb, shard = embedding.clone().requires_grad_(), weight[rank * V_R:(rank + 1) * V_R].clone().requires_grad_()
        loss_mask = torch.nested.nested_tensor([torch.tensor(m, dtype=torch.int64) for m in response_mask],
                                               layout=torch.jagged)
        rkv.configure(loss_rows_only=only)
        before = rkv.call_counts()["loss_rows_skipped_tokens"]
        try:
            out, _ = _engine_step(mti, _StandInGPT(emb, shard, sequence_parallel), fused, {"loss_mask": loss_mask},
                                  flags, grad=True, temperature=temps)
        finally:
            rkv.configure(loss_rows_only=False)
        skipped = rkv.call_counts()["loss_rows_skipped_tokens"] - before
        values = [out[k].values() for k in ("log_probs", "entropy", "sum_pi_squared")]
        rows = _label_rows(response_mask)
        sum(gk * v * rows for gk, v in zip(g, values)).sum().backward()
        return values, emb.grad, shard.grad, skipped, rows

    (lp, ent, sq), d_emb, d_w, skipped, rows = step(RESPONSE_LOSS_MASK, True)
    (lp0, ent0, sq0), d_emb0, d_w0, skipped0, _ = step(RESPONSE_LOSS_MASK, False)
    assert skipped0 == 0 and skipped == packed_rows - int(rows.sum()) > 0, (skipped, packed_rows)
    for got, want in ((lp, lp0), (ent, ent0), (sq, sq0)):
        torch.testing.assert_close(got[rows], want[rows], **VAL)
        assert bool((got[~rows] == 0).all()), got
        assert bool((want[~rows] != 0).any())  # (the option off computes them)
        assert _same_on_all_ranks(got.detach())
    torch.testing.assert_close(d_emb, d_emb0, **GRAD)
    torch.testing.assert_close(d_w, d_w0, **GRAD)
    assert float(d_w.abs().max()) > 1e-2
    # top-K distillation in the same head: the teacher's rows selected with the same index
    teacher = [torch.log_softmax(torch.randn(length, vocab, generator=gen) * 2, -1).topk(TOPK, -1)
               for length in ENGINE_LENGTHS]
    tensors = {"teacher_logprobs": torch.nested.nested_tensor([t.values for t in teacher], layout=torch.jagged),
               "teacher_ids": torch.nested.nested_tensor([t.indices for t in teacher], layout=torch.jagged),
               "loss_mask": torch.nested.nested_tensor([torch.tensor(m) for m in RESPONSE_LOSS_MASK],
                                                       layout=torch.jagged)}
    topk_flags = {"calculate_entropy": False, "distillation_only": False, "calculate_sum_pi_squared": False,
                  "distillation_use_topk": True}
    runs = {}
    for only in (True, False):
        rkv.configure(loss_rows_only=only)
        try:
            runs[only] = _topk_step(mti, True, embedding, weight, rank, tensors, topk_flags, (g[0] + 2) * rows)
        finally:
            rkv.configure(loss_rows_only=False)
    (got, d_emb, d_w, _), (want, d_emb0, d_w0, _) = runs[True], runs[False]
    assert set(got) == set(want) and {"distillation_losses", "log_probs", "overlap_count"} <= set(got), set(got)
    for key in got:
        torch.testing.assert_close(got[key].values()[rows], want[key].values()[rows], **VAL, msg=key)
        assert bool((got[key].values()[~rows] == 0).all()), key
    torch.testing.assert_close(d_emb, d_emb0, **GRAD)
    torch.testing.assert_close(d_w, d_w0, **GRAD)
    # no loss row in the micro-batch: the head still runs (0 rows) on every rank, all 0
    none = tuple(tuple(0 for _ in m) for m in RESPONSE_LOSS_MASK)
    before = rkv.call_counts()["fused_megatron_calls"]
    (lp, ent, sq), d_emb, d_w, skipped, _ = step(none, True)
    assert rkv.call_counts()["fused_megatron_calls"] == before + 1 and skipped == packed_rows
    assert all(bool((t == 0).all()) for t in (lp, ent, sq))
    assert float(d_w.abs().max()) == 0 and (d_emb is None or float(d_emb.abs().max()) == 0)
    try:  # one combination refused before the model runs, naming both features
        _engine_step(mti, _StandInGPT(embedding, weight[rank * V_R:(rank + 1) * V_R]), True,
                     flags={"calculate_sum_pi_squared": True, "distillation_use_topk": True})
    except rkv.VerlIntegrationError as e:
        assert "calculate_sum_pi_squared=True" in str(e) and "top-K distillation" in str(e), e
    else:
        raise AssertionError("Σπ² with top-K distillation on the Megatron fused path was not refused")
    # the logits path: the output layer runs on the loss rows (with sequence parallelism: each rank's
    # own rows' loss rows, padded to the group's largest count), verl's logits keep every row (0 outside)
    calls = rkv.call_counts()["megatron_logits_log_probs_calls"]
    for sequence_parallel in (False, True):
        (lp, ent, sq), d_emb, d_w, skipped, rows = step(RESPONSE_LOSS_MASK, True, False, sequence_parallel)
        (lp0, ent0, sq0), d_emb0, d_w0, skipped0, _ = step(RESPONSE_LOSS_MASK, False, False, sequence_parallel)
        assert skipped0 == 0 and skipped == packed_rows - int(rows.sum()) > 0, (skipped, packed_rows)
        for got, want in ((lp, lp0), (ent, ent0), (sq, sq0)):
            torch.testing.assert_close(got[rows], want[rows], **VAL)
            assert bool((got[~rows] == 0).all()), got
            assert bool((want[~rows] != 0).any())
            assert _same_on_all_ranks(got.detach())
        torch.testing.assert_close(d_emb, d_emb0, **GRAD)
        torch.testing.assert_close(d_w, d_w0, **GRAD)
        assert float(d_w.abs().max()) > 1e-2
        (lp, ent, sq), d_emb, d_w, skipped, _ = step(none, True, False, sequence_parallel)
        assert skipped == packed_rows and all(bool((t == 0).all()) for t in (lp, ent, sq))
        assert float(d_w.abs().max()) == 0 and (d_emb is None or float(d_emb.abs().max()) == 0)
    assert rkv.call_counts()["megatron_logits_log_probs_calls"] == calls + 4  # rl-kernels' functions computed them
    rkv.configure(loss_rows_only=True)
    try:  # verl's distillation reads every row's logits: refused, naming the option
        _engine_step(mti, _StandInGPT(embedding, weight[rank * V_R:(rank + 1) * V_R]), False,
                     {"loss_mask": tensors["loss_mask"], "teacher_logprobs": tensors["teacher_logprobs"],
                      "teacher_ids": tensors["teacher_ids"]}, flags=topk_flags)
    except rkv.VerlIntegrationError as e:
        assert "loss_rows_only" in str(e) and "top-K distillation" in str(e), e
    else:
        raise AssertionError("loss_rows_only with top-K distillation on the Megatron logits path was not refused")
    finally:
        rkv.configure(loss_rows_only=False)


# ----------------------------------------------------------------------------- anomaly capture
def _check_anomaly_capture(rkv, rkm, rank, world, directory):
    """The anomaly capture on both Megatron paths, TP over every rank. Clean calls (re-checked every
    call) save nothing. A planted kernel bug, the same on every rank (a log-prob > 0 at token 5),
    saves on the logits path that token's bf16 logits gathered over the TP group (the whole
    vocabulary, as one row), and on the fused path the call with the weight gathered over the group
    and its per-token temperature (as the engine forward lays verl's per-sample temperature out:
    stood in for here, tested in _check_engine_per_sample_temperature). Only TP rank 0 writes; each
    sample replays in this one process with every CPU backend against float64: PASS."""
    from megatron.core import parallel_state

    import rl_kernels
    from rl_kernels.integrations.verl_impl import megatron_step, patch_state
    from rl_kernels.samples import LogitsSample, load_sample, sample_files
    from rl_kernels.tools import repro

    gen = torch.Generator().manual_seed(5)
    full = torch.randn(1, T_SEQ, world * V_R, generator=gen) * 3
    labels = torch.randint(0, world * V_R, (1, T_SEQ), generator=gen)
    shard = full[..., rank * V_R:(rank + 1) * V_R].bfloat16()
    hidden, weight, fused_labels, _, _ = _fused_inputs(world)
    w_shard = weight[rank * V_R:(rank + 1) * V_R]
    per_token = 0.5 + torch.rand(1, T_SEQ, generator=gen)
    group = parallel_state.get_tensor_model_parallel_group()
    real_log_probs, real_linear = rl_kernels.log_probs_from_logits, rl_kernels.linear_log_probs

    def planted(t):
        t = t.clone()
        t.view(-1)[5] = 0.01
        return t

    def fused_call():  # in a fused Megatron step whose per-sample temperature is laid out as per_token
        token = patch_state.new_step(engine=megatron_step.ENGINE)
        patch_state.step_request.get().inputs.update(temperature_per_sample=torch.tensor([0.5, 1.3]),
                                                     temperature=per_token)
        try:
            return rkm.linear_cross_entropy(hidden, w_shard, fused_labels, megatron_step.STAND_IN, "none", group)
        finally:
            patch_state.step_request.reset(token)

    previous = rkv.options()
    try:
        rkv.configure(anomaly_dir=directory, anomaly_recheck_every=1, anomaly_recheck_rows=T_SEQ)
        rkm.vocab_parallel_log_probs_from_logits(shard, labels)
        rkm.vocab_parallel_entropy(shard)
        fused_call()
        dist.barrier()
        assert not os.path.isdir(directory) or sample_files(directory) == [], sample_files(directory)
        rl_kernels.log_probs_from_logits = lambda *a, **k: planted(real_log_probs(*a, **k))
        rkm.vocab_parallel_log_probs_from_logits(shard, labels)
        rl_kernels.log_probs_from_logits = real_log_probs
        rl_kernels.linear_log_probs = lambda *a, **k: (lambda out: out._replace(log_probs=planted(out.log_probs)))(
            real_linear(*a, **k))
        fused_call()
    finally:
        rl_kernels.log_probs_from_logits, rl_kernels.linear_log_probs = real_log_probs, real_linear
        rkv.configure(**{f: getattr(previous, f) for f in previous.__dataclass_fields__})
    dist.barrier()
    files = sample_files(directory)
    assert len(files) == 2 and all("-rank0-" in f for f in files), files  # TP rank 0 (global rank 0) wrote both
    if rank != 0:
        return
    by_kind = {isinstance(s, LogitsSample): s for s in map(load_sample, files)}
    logits_sample, fused_sample = by_kind[True], by_kind[False]
    assert torch.equal(logits_sample.logits, full[0, 5][None].bfloat16())  # the whole row, in the shards' dtype
    assert torch.equal(logits_sample.labels, labels[0, 5][None]) and logits_sample.temperature == 1.0
    assert "Megatron logits path" in logits_sample.metadata["function"]
    assert torch.equal(fused_sample.weight, weight) and torch.equal(fused_sample.hidden_states, hidden[:, 0])
    assert torch.equal(fused_sample.labels, fused_labels[0]) and torch.equal(fused_sample.temperature, per_token[0])
    for sample in (logits_sample, fused_sample):
        assert sample.metadata["reason"] == "log-prob above 1e-05 (max 0.01)", sample.metadata
        assert f"a process group of {world} ranks" in sample.metadata["vocab_parallel"]
        rows = repro.check_sample(sample, torch.device("cpu"))
        assert rows and all(r.passed for r in rows if r.ours), rows


# ----------------------------------------------------------------------------- top-K distillation, logits path
def _topk_inputs(megatron_losses, rank, world, seed):
    """Nested teacher top-K (log-probs, ids) of two sequences (one slot per third token at -12, below
    the clamp), the full logits for their laid-out tokens (verl's preprocess_thd_engine may pad),
    this rank's shard of them, a random weighting of the tokens (0 on the padding rows, whose
    outputs verl's layout drops), and which rows are tokens."""
    gen = torch.Generator().manual_seed(seed)
    vocab = world * V_R
    teacher = [torch.log_softmax(torch.randn(n, vocab, generator=gen) * 2, -1).topk(TOPK, -1) for n in (7, 5)]
    for t in teacher:
        t.values[::3, 1] = -12.0
    t_lp = torch.nested.nested_tensor([t.values for t in teacher], layout=torch.jagged)
    t_ids = torch.nested.nested_tensor([t.indices for t in teacher], layout=torch.jagged)
    ones = torch.nested.nested_tensor_from_jagged(torch.ones(12), offsets=t_ids.offsets())
    rows = megatron_losses.preprocess_thd_engine(ones, pre_process=True)[0].bool()
    assert rows.shape[1] > 12 and int(rows.sum()) == 12  # the layout pads (rows of K zero ids)
    full = torch.randn(1, rows.shape[1], vocab, generator=gen) * 3
    g = (torch.rand(1, rows.shape[1], generator=gen) + 0.5) * rows
    return t_lp, t_ids, full, full[..., rank * V_R:(rank + 1) * V_R].contiguous(), g, rows


def _call(fn, shard, t_lp, t_ids, loss_mode, clamp, g):
    config = types.SimpleNamespace(distillation_loss=types.SimpleNamespace(log_prob_min_clamp=clamp,
                                                                           loss_mode=loss_mode))
    leaf = shard.clone().requires_grad_()
    out = fn(student_logits=leaf, teacher_topk_log_probs=t_lp, teacher_topk_ids=t_ids, config=config,
             data_format="thd")
    (out["distillation_losses"] * g).sum().backward()
    return {k: v.detach() for k, v in out.items()}, leaf.grad


def _check_topk_function(rkv, megatron_losses, original, rank, world):
    """rl-kernels' Megatron compute_forward_kl_topk against verl's own (captured before the patch:
    _VocabParallelKLDivergence over the gloo TP group) on this rank's vocab shard: every output
    (overlap_count equal) and the gradient w.r.t. the shard within 1e-5, without and with the clamp
    (active on both sides); the outputs identical on every rank. forward_kl_topk_tail against
    float64 from the full logits: the (K+1)-category KL, its tail term, the masses, and each rank's
    shard of the gradient; a clamp is refused. Float64 logits go to verl's own function."""
    ours = megatron_losses.compute_forward_kl_topk
    assert ours is not original and ours._rl_kernels_original is original
    t_lp, t_ids, full, shard, g, rows = _topk_inputs(megatron_losses, rank, world, seed=11)
    for clamp in (None, CLAMP):
        got, grad = _call(ours, shard, t_lp, t_ids, "forward_kl_topk", clamp, g)
        want, want_grad = _call(original, shard, t_lp, t_ids, "forward_kl_topk", clamp, g)
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
            if key == "overlap_count":
                assert torch.equal(got[key], value)
            else:
                torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0, msg=key)
            assert _same_on_all_ranks(got[key])
        torch.testing.assert_close(grad, want_grad, atol=1e-5, rtol=0)
        assert float(grad.abs().max()) > 1e-2 and 0 < int(want["overlap_count"].sum())
    lq = torch.log_softmax(full, -1).gather(-1, megatron_losses.preprocess_thd_engine(t_ids, pre_process=True)[0])
    assert bool((lq < CLAMP).any()) and bool((lq > CLAMP).any())  # the clamp acts on some student slots
    # forward_kl_topk_tail, against float64
    got, grad = _call(ours, shard, t_lp, t_ids, "forward_kl_topk_tail", None, g)
    z = full.double().requires_grad_()
    log_p = z.log_softmax(-1)
    # the teacher as laid out with the student's tokens (verl's own helper; its padding rows included)
    lp_laid, ids = (megatron_losses.preprocess_thd_engine(t, pre_process=True)[0] for t in (t_lp, t_ids))
    log_q = log_p.gather(-1, ids)
    log_q_tail = log_p.masked_fill(torch.zeros(z.shape, dtype=torch.bool).scatter(-1, ids, True),
                                   float("-inf")).logsumexp(-1)
    p = lp_laid.double().exp()
    p_tail = (1 - p.sum(-1)).clamp_min(0)  # 0 on padding rows (log-probs 0): no tail term there
    tail = torch.where(p_tail > 0, p_tail * (p_tail.log() - log_q_tail), torch.zeros((), dtype=torch.float64))
    kl = (p * (p.log() - log_q)).sum(-1) + tail
    (kl * g).sum().backward()
    for key, value in {"distillation_losses": kl, "tail_loss": tail, "student_tail_mass": log_q_tail.exp(),
                       "student_mass": log_q.exp().sum(-1), "teacher_mass": p.sum(-1)}.items():
        # the token rows (the padding rows' ids, K zeros, are made distinct for the tail; verl drops those rows)
        torch.testing.assert_close(got[key][rows].double(), value[rows].detach(), **VAL, msg=key)
        assert _same_on_all_ranks(got[key])
    torch.testing.assert_close(grad.double(), z.grad[..., rank * V_R:(rank + 1) * V_R], **GRAD)
    assert float((tail[rows].abs() > 1e-3).double().mean()) > 0.5  # the tail term matters
    try:
        _call(ours, shard, t_lp, t_ids, "forward_kl_topk_tail", CLAMP, g)
    except ValueError as e:
        assert "log_prob_min_clamp" in str(e), e
    else:
        raise AssertionError("a clamp with forward_kl_topk_tail was not refused")
    before = rkv.call_counts()["verl_fallback_calls"]  # float64 logits: verl's own function
    got64, _ = _call(ours, shard.double(), t_lp, t_ids, "forward_kl_topk", CLAMP, g)
    assert rkv.call_counts()["verl_fallback_calls"] == before + 1
    theirs64, _ = _call(original, shard.double(), t_lp, t_ids, "forward_kl_topk", CLAMP, g)
    torch.testing.assert_close(got64["distillation_losses"], theirs64["distillation_losses"])


def _check_engine_tail(rkv, mti, rank, world):
    """forward_kl_topk_tail through verl's own Megatron engine forward_step, on the fused path
    (rl-kernels' vocab-parallel fused head) and on the logits path (rl-kernels' compute_forward_kl_topk):
    both equal the float64 (K+1)-category KL of the stand-in GPT's logits / T, and so do the
    gradients w.r.t. the embedding (summed over the group) and this rank's weight shard; the tail
    outputs come back laid out per sequence under their keys."""
    gen = torch.Generator().manual_seed(12)
    vocab = world * V_R
    embedding = torch.randn(vocab, H, generator=gen)
    weight = torch.randn(vocab, H, generator=gen) * 0.5
    # the teacher's top K from the student's logits plus noise: some of its ids among the student's top K
    student = (embedding[_engine_input_ids(vocab).values()] @ weight.T / TEMPERATURE).split(list(ENGINE_LENGTHS))
    teacher = [torch.log_softmax(z + torch.randn(z.shape, generator=gen) * 2, -1).topk(TOPK, -1) for z in student]
    tensors = {"teacher_logprobs": torch.nested.nested_tensor([t.values for t in teacher], layout=torch.jagged),
               "teacher_ids": torch.nested.nested_tensor([t.indices for t in teacher], layout=torch.jagged)}
    g = torch.rand(12, generator=gen) + 0.5
    flags = {"calculate_entropy": False, "distillation_only": True, "calculate_sum_pi_squared": False,
             "distillation_use_topk": True}
    results = {}
    for fused in (True, False):
        results[fused] = _topk_step(mti, fused, embedding, weight, rank, tensors, flags, g,
                                    loss_mode="forward_kl_topk_tail", clamp=None)
    ids = results[True][3]
    e64, w64 = embedding.double().requires_grad_(), weight.double().requires_grad_()
    log_p = (e64[ids.values()] @ w64.T / TEMPERATURE).log_softmax(-1)
    t_ids = tensors["teacher_ids"].values()
    log_q = log_p.gather(-1, t_ids)
    log_q_tail = log_p.masked_fill(torch.zeros(log_p.shape, dtype=torch.bool).scatter(-1, t_ids, True),
                                   float("-inf")).logsumexp(-1)
    p = tensors["teacher_logprobs"].values().double().exp()
    p_tail = (1 - p.sum(-1)).clamp_min(0)
    tail = p_tail * (p_tail.log() - log_q_tail)
    kl = (p * (p.log() - log_q)).sum(-1) + tail
    (kl * g.double()).sum().backward()
    for fused, (out, d_emb, d_w, _) in results.items():
        assert {"distillation_losses", "tail_loss", "student_tail_mass"} <= set(out), (fused, set(out))
        torch.testing.assert_close(out["distillation_losses"].values().double(), kl.detach(), **VAL)
        torch.testing.assert_close(out["tail_loss"].values().double(), tail.detach(), **VAL)
        assert out["tail_loss"].is_nested and torch.equal(out["tail_loss"].offsets(), ids.offsets())
        torch.testing.assert_close(d_emb.double(), e64.grad, **GRAD)
        torch.testing.assert_close(d_w.double(), w64.grad[rank * V_R:(rank + 1) * V_R], **GRAD)
        assert _same_on_all_ranks(out["distillation_losses"].values().detach())
    # the overlap metrics of the tail mode (its unclamped terms): the fused path's (the fused head's top K over the
    # TP group) equal the logits path's (the student's top K from the logits shards)
    fused, logits = results[True][0], results[False][0]
    assert torch.equal(fused["overlap_count"].values(), logits["overlap_count"].values())
    torch.testing.assert_close(fused["overlap_token_advantage"].values(), logits["overlap_token_advantage"].values(),
                               **VAL)
    assert torch.equal(fused["overlap_count"].offsets(), ids.offsets())
    assert int(fused["overlap_count"].values().max()) > 0
