"""verl #7520 on rl-kernels' fused path: FSDP2, an untied lm_head, gradient accumulation, reduce_dtype=float32.

Two gloo ranks on CPU (``tests/integrations/fsdp2_untied_worker.py`` holds the per-rank body), a tiny untied
Qwen2 (H=32, I=64, 2 layers, V=97 odd: uneven Shard(0) slices), wrapped as verl's FSDP2 path wraps
it (``verl.utils.fsdp_utils.apply_fsdp2``: decoder layers, embed_tokens and lm_head each a unit,
then the root; or the head in the root's unit), ``MixedPrecisionPolicy(param_dtype, reduce_dtype=
float32)``, ``reshard_after_forward`` True and False. One step: 3 micro-batches with gradient sync
deferred to the last (verl's ``use_no_sync_for_gradient_accumulation``, default on:
``set_requires_gradient_sync(False)``) or synced each, then plain SGD. (a) verl's fused forward
patched by ``patch_forward_with_backends`` with ``impl_backend=rl_kernels``; (b) verl's unfused
path (the model's logits, float32 ``log_softmax / T`` gathered at the rolled labels), the same
micro-batches, the same initial weights. Before the fix both failed at the first backward with
verl's error, "'FSDPParam' object has no attribute '_unsharded_param'" (FSDP2's end-of-backward
callback ran the never-gathered head unit's post-backward, which under ``reduce_dtype`` reads the
unsharded parameter).

Bounds (tests/support/tolerances.py). The two paths run the same body ops on the same inputs; they
differ in the head, whose float32 rounding enters dh and dW (depth ``HEAD = H + 2V + max(V, N + 1)``,
N = 84 the step's token rows over both ranks, as tests/integrations/test_verl_dtensor_weight.py counts it), and
then in the body's backward, which carries that difference through each layer's chain of dependent
sums (``BODY = LAYERS * (3H + I + 2S)``: the two norms and o_proj over H, the MLP over I, the
attention's softmax and value sums over S). A gradient: ``gamma_(HEAD+BODY) * m * max|g|``, m the
head's logit magnitude (``head_magnitude``), per parameter tensor. A parameter after the step,
``p' = fl(p - LR g)``: ``LR`` times that plus the two updates' own roundings, ``2 u max|p'|``. The
no-grad log-probs after the step: ``gamma_(H+2V) * m`` (floor 1). With ``param_dtype=bfloat16``
(verl's default) the unfused logits are rounded to bf16 and each of the body backward's bf16
outputs (about 10 a layer) rounds again: ``u_bf16 * (m + 3 + 10 LAYERS) * max|g|``.

Communication: FSDP2's all-gathers carrying lm_head.weight and its gradient's reduce-scatters are
counted per micro-batch (the param groups' ``foreach_all_gather`` / ``foreach_reduce``), and
``DTensor.full_tensor`` on it. The head in its own unit, fused: one all-gather per micro-batch, a
reduce-scatter only on the synced backward(s), no ``full_tensor``. The head in the root's unit:
the root's own schedule, the same counts as the unfused path.
"""
import time

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
pytest.importorskip("torch.distributed.fsdp", reason="torch without FSDP2")

import fsdp2_untied_worker as w  # noqa: E402
from tolerances import U32, gamma  # noqa: E402 - gamma: the numerical mark (tests/conftest.py)

N_STEP = 2 * w.MICRO * w.B * w.S
HEAD = w.H + 2 * w.V + max(w.V, N_STEP + 1)
BODY = w.LAYERS * (3 * w.H + w.I + 2 * w.S)
U_BF16 = torch.finfo(torch.bfloat16).eps / 2

CONFIGS = [  # verl's default first: the head its own unit, reshard_after_forward, sync deferred
    dict(head_unit=True, reshard_after_forward=True, param_dtype="float32", no_sync=True),
    dict(head_unit=True, reshard_after_forward=False, param_dtype="float32", no_sync=True),
    dict(head_unit=False, reshard_after_forward=True, param_dtype="float32", no_sync=True),
    dict(head_unit=False, reshard_after_forward=False, param_dtype="float32", no_sync=True),
    dict(head_unit=True, reshard_after_forward=True, param_dtype="float32", no_sync=False),
    dict(head_unit=True, reshard_after_forward=True, param_dtype="bfloat16", no_sync=True),
    # loss_rows_only (issue 53 item 3): the head on the loss rows alone, none on rank 1's first micro-batch
    dict(head_unit=True, reshard_after_forward=True, param_dtype="float32", no_sync=True, loss_rows=True),
]


def _name(cfg):
    return (f"head {'own unit' if cfg['head_unit'] else 'in root'}, reshard_after_forward="
            f"{cfg['reshard_after_forward']}, param_dtype={cfg['param_dtype']}, "
            f"{'sync deferred' if cfg['no_sync'] else 'synced each micro-batch'}"
            f"{', loss_rows_only' if cfg.get('loss_rows') else ''}")


def _check(result) -> float:
    """Asserts one configuration's counts and bounds; returns its worst error / bound."""
    cfg, name = result["cfg"], _name(result["cfg"])
    assert "error" not in result, f"{name}: {result.get('error')}\n{result.get('traceback')}"
    fused, unfused, m = result["fused"], result["unfused"], result["logits"]
    assert fused["served"] == w.MICRO + 1, f"{name}: rl-kernels served {fused['served']} fused calls"
    if cfg.get("loss_rows"):  # every row outside the loss skipped (none without the option)
        assert fused["skipped"] == result["outside"] > 0, f"{name}: {fused['skipped']} rows skipped"
    synced = [not cfg["no_sync"] or i == w.MICRO - 1 for i in range(w.MICRO)]
    for i, ((gathers, reduces, full_tensors), (u_gathers, u_reduces, _)) in enumerate(
            zip(fused["per_micro"], unfused["per_micro"])):
        where = f"{name}, micro-batch {i}"
        assert full_tensors == 0, f"{where}: lm_head.weight gathered with full_tensor {full_tensors}x"
        if cfg["head_unit"]:
            assert gathers == 1, f"{where}: lm_head unit all-gathered {gathers}x, expected once"
            assert reduces == int(synced[i]), f"{where}: lm_head gradient reduce-scattered {reduces}x"
        else:  # the root unit's own schedule, as on the unfused path
            assert (gathers, reduces) == (u_gathers, u_reduces), f"{where}: {(gathers, reduces)} vs unfused"
    bf16 = cfg["param_dtype"] == "bfloat16"
    worst = 0.0
    for pname, g_ref in unfused["grads"].items():
        scale = float(g_ref.abs().max())
        bound = (U_BF16 * (m + 3 + 10 * w.LAYERS) if bf16 else gamma(HEAD + BODY) * m) * scale
        err = float((fused["grads"][pname] - g_ref).abs().max())
        worst = max(worst, err / bound)
        assert err <= bound, f"{name}: {pname} gradient max |error| {err:.3e} > {bound:.3e}"
        p_ref = unfused["params"][pname]
        p_bound = w.LR * bound + 2 * U32 * float(p_ref.abs().max())
        p_err = float((fused["params"][pname] - p_ref).abs().max())
        worst = max(worst, p_err / p_bound)
        assert p_err <= p_bound, f"{name}: {pname} after the step max |error| {p_err:.3e} > {p_bound:.3e}"
    lp_bound = (U_BF16 * (m + 3) if bf16 else gamma(w.H + 2 * w.V) * m) * max(
        float(unfused["after"].abs().max()), 1.0)
    lp_err = float((fused["after"] - unfused["after"]).abs().max())
    assert lp_err <= lp_bound, f"{name}: no-grad log-probs after the step max |error| {lp_err:.3e} > {lp_bound:.3e}"
    return max(worst, lp_err / lp_bound)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsdp2_untied_head_gradient_accumulation_trains_like_the_unfused_path(tmp_path):
    start = time.perf_counter()
    mp.spawn(w.run, args=(str(tmp_path / "init"), CONFIGS, str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert [r["cfg"] for r in results] == CONFIGS
        worst = [_check(result) for result in results]
    print(f"{len(CONFIGS)} configurations x 2 paths in {time.perf_counter() - start:.1f} s; per configuration "
          + ", ".join(f"{r['seconds']:.1f} s (m {r['logits']:.1f}, worst error/bound {x:.1e})"
                      for r, x in zip(results, worst)))
