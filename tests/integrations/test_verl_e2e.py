"""End to end, on every tested verl release (0.7.1, 0.8.0, 0.9.1): verl's own Ray worker,
``ActorRolloutRefWorker``, built from a config composed with our Hydra group (``+rl_kernels=fused``
/ ``logits``), imports ``external_lib`` and computes the reference's and the actor's log-probs and
entropy and one actor update with rl-kernels; the values match verl's unpatched path.

One Ray cluster and one saved model for the module, and three worker processes side by side:
one per option of the group and one unpatched (no ``external_lib``). Each hosts an actor (role
``actor``) and a reference policy (role ``ref``), colocated the way verl's trainer colocates them
(``create_colocated_worker_cls``), and runs ``compute_ref_log_prob``, ``compute_log_prob`` and one
``update_actor`` step (PPO loss with an entropy bonus; SGD with lr 1, so that the parameter update
is the clipped gradient). The process's own ``rl_kernels.integrations.verl.call_counts()``, read
through Ray's ``__ray_call__`` after each call, shows which rl-kernels path served that call.
Checked, for each option:

* log-probs (and entropy where verl returns it) against verl's unpatched logits path computed
  here, in the driver, to 1e-4; the unpatched worker's too;
* the counts: the fused option's calls on the fused kernel (Triton, all 18 tokens), the logits
  option's on the from-logits functions; the unpatched worker never imported rl-kernels;
* the update against the unpatched worker's: identical parameters before, updates equal to 1e-4
  relative;
* on the engine workers (0.8+), the actor's ``compute_log_prob`` once more with
  ``calculate_sum_pi_squared=True``: Σπ² on the fused path (which verl refuses without
  rl-kernels) and on the logits path against the unpatched worker's and float64;
* the anomaly capture on verl's logits path: the logits worker runs with it on (``anomaly_dir``, every
  call re-checked in float32), and no call of the run above leaves a sample; then a kernel bug is
  planted in that worker (a log-prob > 0 at one token, the phantom-column bug's symptom) and the
  actor's ``compute_log_prob`` runs once more: it leaves one sample, that token's logits as verl
  passed them, which ``rl-kernels repro`` replays (PASS against float64).

verl 0.7.x runs its legacy workers (``verl.workers.fsdp_workers``: ``DataProto`` batches; its
reference returns no entropy), 0.8.0 and 0.9.1 the engine workers (``verl.workers.engine_workers``:
``TensorDict`` batches). FSDP2 with fp32 parameters, padding removed (verl 0.8.0's engine slices
fused-path outputs wrongly without it), ``forward_only=False`` for the reference (verl's
reference offload policy pins memory, which needs an accelerator). The CPU scaffolding, none of
which touches rl-kernels, is in ``tests/support/verl_cpu.py``.
"""
import concurrent.futures
import os

import pytest
import torch

from verl_helpers import VOCAB, rollout_tensors

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[verl]')")

from verl_cpu import use_torch_padding, verl_version, worker_class  # noqa: E402
# shared with the other end-to-end tests (their fixtures, ray_cluster and model: tests/integrations/conftest.py)
from verl_ray import (LEGACY, T, _advantages, _compose, _counts, _delta, _engine_batches, _outputs,  # noqa: E402
                      _params, assert_same_updates, release)

pytestmark = [pytest.mark.verl_matrix, pytest.mark.filterwarnings("ignore::UserWarning")]

OPTIONS = ("fused", "logits")
FUSED_TOKENS = 18  # per forward through the fused head: 2 sequences of 9 real tokens (padding removed)


# ----------------------------------------------------------------------------- batches per API
def _asking_sum_pi_squared(infer):
    """The actor's compute_log_prob batch with ``calculate_sum_pi_squared=True``, as verl's trainer
    sends it for the optimal-token-baseline estimators (verl 0.8+'s engine workers)."""
    from verl.utils import tensordict_utils as tu

    infer = infer.copy()
    tu.assign_non_tensor(infer, calculate_sum_pi_squared=True)
    return infer


def _legacy_batches():
    """verl 0.7.x: padded DataProtos (the worker removes the padding, and sets the log-prob calls'
    meta_info itself)."""
    from verl import DataProto

    tensors = rollout_tensors()[0]
    keys = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
    infer = DataProto.from_dict(tensors={k: tensors[k] for k in keys})
    mask = tensors["response_mask"]
    update = DataProto.from_dict(
        tensors={**{k: tensors[k] for k in keys}, "advantages": _advantages(mask),
                 "old_log_probs": torch.zeros(mask.shape)},
        meta_info={"temperature": T, "global_token_num": tensors["attention_mask"].sum(-1).tolist()})
    return infer, update


# ----------------------------------------------------------------------------- in the worker
PLANTED_ROW = 4
"""The row of the from-logits log-prob call that the planted bug sets to 0.01: token 4 of the first
sequence (the rows are the unpadded tokens, sequence after sequence)."""


def _plant_anomaly(self):
    """In the worker: rl-kernels' from-logits log-probs get a planted kernel bug, a log-prob of 0.01 (a
    probability > 1) at row PLANTED_ROW of every call."""
    import rl_kernels.integrations.verl_impl.logits_path as rk_logits

    real = rk_logits._rk_log_probs_from_logits

    def planted(*args, **kwargs):
        out = real(*args, **kwargs).clone()
        out.view(-1)[PLANTED_ROW] = 0.01
        return out

    rk_logits._rk_log_probs_from_logits = planted


def _samples(directory):
    from rl_kernels.samples import sample_files

    return sample_files(directory) if os.path.isdir(directory) else []


def _run_worker(ray, config, anomaly_dir=None):
    """One worker process (actor + reference, colocated) with ``config``: its outputs, parameters
    before / after the update, and its counts after each call. With ``anomaly_dir`` (the capture on
    in ``config``), the samples there after those calls, and after one more compute_log_prob with
    a planted anomaly (:func:`_plant_anomaly`)."""
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls

    cls = ray.remote(worker_class())
    colocated = create_colocated_worker_cls({
        role: RayClassWithInitArgs(cls=cls, config=config.actor_rollout_ref, role=role) for role in ("actor", "ref")})
    pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=colocated, device_name="cpu")
    out = {}
    try:
        worker = group.workers[0]
        groups = group.spawn(prefix_set={"actor", "ref"})
        groups["ref"].init_model()  # the order of verl's trainer: the reference first
        groups["actor"].init_model()
        infer, update = _legacy_batches() if LEGACY else _engine_batches()
        out["counts_init"], out["backend"] = ray.get(worker.__ray_call__.remote(_counts))
        ref = groups["ref"].compute_ref_log_prob(infer)
        out["counts_ref"], _ = ray.get(worker.__ray_call__.remote(_counts))
        actor = groups["actor"].compute_log_prob(infer)
        out["counts_actor"], _ = ray.get(worker.__ray_call__.remote(_counts))
        if not LEGACY:  # once more, as verl's trainer asks for the optimal-token-baseline estimators
            try:
                asked = groups["actor"].compute_log_prob(_asking_sum_pi_squared(infer))
                out["sum_pi_squared"] = _outputs(asked, infer, "sum_pi_squared")
            except Exception as exc:  # noqa: BLE001 - verl's refusal, reported by the test that reads it
                out["sum_pi_squared"] = exc
            out["counts_sum_pi_squared"], _ = ray.get(worker.__ray_call__.remote(_counts))
        ref_key, actor_key, entropy_key = (("ref_log_prob", "old_log_probs", "entropys") if LEGACY
                                           else ("log_probs", "log_probs", "entropy"))
        out["ref"] = (_outputs(ref, infer, ref_key), _outputs(ref, infer, entropy_key))
        out["actor"] = (_outputs(actor, infer, actor_key), _outputs(actor, infer, entropy_key))
        out["before"] = ray.get(worker.__ray_call__.remote(_params))
        groups["actor"].update_actor(update)
        out["after"] = ray.get(worker.__ray_call__.remote(_params))
        out["counts_update"], _ = ray.get(worker.__ray_call__.remote(_counts))
        if anomaly_dir:
            out["anomalies_clean"] = _samples(anomaly_dir)
            ray.get(worker.__ray_call__.remote(_plant_anomaly))
            groups["actor"].compute_log_prob(infer)
            out["anomalies_planted"] = _samples(anomaly_dir)
    finally:  # the cluster has 3 CPUs, each run reserves one
        release(group, pool)
    return out


@pytest.fixture(scope="module")
def anomaly_dir(tmp_path_factory):
    """Where the logits worker's anomaly capture writes (an absolute path, as the workers need)."""
    return str(tmp_path_factory.mktemp("anomalies"))


@pytest.fixture(scope="module")
def runs(ray_cluster, model, anomaly_dir):
    """{None (unpatched), "fused", "logits"}: each worker process's results (or its exception),
    the three run side by side; the logits worker with the anomaly capture on."""
    with pytest.MonkeyPatch.context() as monkeypatch:  # the driver pads / unpads verl 0.8's batches
        use_torch_padding(monkeypatch)
        return _runs(ray_cluster, model, anomaly_dir)


def _runs(ray_cluster, model, anomaly_dir):
    dirs = {"logits": anomaly_dir}
    configs = {option: _compose(model[1], option, dirs.get(option)) for option in (None, *OPTIONS)}  # Hydra: one thread
    for option, config in configs.items():
        assert config.actor_rollout_ref.model.get("external_lib") == (option and "rl_kernels.integrations.verl")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {option: pool.submit(_run_worker, ray_cluster, config, dirs.get(option))
                   for option, config in configs.items()}
    results = {}
    for option, future in futures.items():
        exc = future.exception()
        results[option] = exc if exc is not None else future.result()
    return results


def _result(runs, option):
    result = runs[option]
    if isinstance(result, BaseException):
        raise result
    return result


@pytest.fixture(scope="module")
def driver_reference(model):
    """verl's unpatched logits path on each unpadded sequence, here in the driver: (B, 6) response
    log-probs and entropy."""
    from verl_helpers import verl_logits_path

    model = model[0]
    batch = rollout_tensors()[0]
    lps = torch.zeros(2, 6)
    ents = torch.zeros(2, 6)
    for b in range(2):
        mask = batch["attention_mask"][b].bool()
        ids = batch["input_ids"][b][mask][None]
        n_prompt = int(mask[:5].sum())
        n_resp = int(mask[5:].sum())
        lp, ent = verl_logits_path(model, type(model).forward, T, torch.roll(ids, -1, -1), input_ids=ids)
        lps[b, :n_resp] = lp[0, n_prompt - 1:n_prompt - 1 + n_resp]
        ents[b, :n_resp] = ent[0, n_prompt - 1:n_prompt - 1 + n_resp]
    return lps, ents


@pytest.fixture(scope="module")
def driver_sum_pi_squared(model):
    """float64 Σπ² of softmax(logits / T) of the response tokens, (B, 6), the model in float64."""
    import copy

    model64 = copy.deepcopy(model[0]).double()
    batch = rollout_tensors()[0]
    out = torch.zeros(2, 6, dtype=torch.float64)
    with torch.no_grad():
        for b in range(2):
            mask = batch["attention_mask"][b].bool()
            ids = batch["input_ids"][b][mask][None]
            n_prompt, n_resp = int(mask[:5].sum()), int(mask[5:].sum())
            p = torch.softmax(type(model64).forward(model64, input_ids=ids, return_dict=True).logits[0] / T, -1)
            out[b, :n_resp] = (p * p).sum(-1)[n_prompt - 1:n_prompt - 1 + n_resp]
    return out


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("role", ["ref", "actor"])
@pytest.mark.parametrize("option", ["fused", "logits", None], ids=["fused", "logits", "unpatched"])
def test_verl_worker_log_probs_on_ray(runs, driver_reference, option, role):
    """The reference's and the actor's log-probs (and entropy) from verl's Ray worker match verl's
    unpatched logits path; the worker's counts show which rl-kernels path served them (none for
    the unpatched worker)."""
    out = _result(runs, option)
    if option:
        assert out["counts_init"] is not None, "verl did not import external_lib in the worker"
    stage_before, stage_after = ("counts_init", "counts_ref") if role == "ref" else ("counts_ref", "counts_actor")
    counts = _delta(out[stage_after], out[stage_before]) if option else None
    log_probs, entropy = out[role]
    ref_lp, ref_ent = driver_reference
    mask = rollout_tensors()[0]["response_mask"].bool()
    assert int(mask.sum()) == 10
    torch.testing.assert_close(log_probs[mask], ref_lp[mask], atol=1e-4, rtol=0)
    if LEGACY and role == "ref":
        assert entropy is None  # verl 0.7.x's compute_ref_log_prob asks for no entropy
    else:
        torch.testing.assert_close(entropy[mask], ref_ent[mask], atol=1e-4, rtol=0)
    if option is None:  # unpatched: verl never imported rl-kernels, so it served nothing
        assert out[stage_after] is None, out[stage_after]
    elif option == "fused":  # all tokens of the two sequences, by the kernel the config asked for
        assert out["backend"] == "triton"
        assert counts["fused_fsdp_calls"] == 1 and counts["fused_tokens"] == FUSED_TOKENS, counts
        assert counts["logits_log_probs_calls"] == 0 and counts["logits_entropy_calls"] == 0, counts
    else:
        assert counts["fused_calls"] == 0, counts
        assert counts["logits_log_probs_calls"] >= 1, counts
        assert (counts["logits_entropy_calls"] >= 1) == (entropy is not None), counts


@pytest.mark.parametrize("option", OPTIONS)
def test_verl_update_actor_on_ray_matches_unpatched(runs, option):
    """verl's actor runs one update_actor step (PPO loss with entropy bonus, SGD) with rl-kernels
    and without (no external_lib): the parameter updates match to 1e-4 relative."""
    ref = _result(runs, None)
    out = _result(runs, option)
    assert out["counts_init"] is not None, "verl did not import external_lib in the worker"
    assert ref["counts_update"] is None, ref["counts_update"]  # unpatched worker: rl-kernels never imported
    counts = _delta(out["counts_update"], out["counts_actor"])
    if option == "fused":
        assert counts["fused_fsdp_calls"] >= 1 and counts["logits_log_probs_calls"] == 0, counts
    else:
        assert counts["fused_calls"] == 0 and counts["logits_log_probs_calls"] >= 1, counts
        assert counts["logits_entropy_calls"] >= 1, counts  # the entropy bonus
    assert_same_updates(ref, out, f" ({option}, verl {verl_version()})")


SUM_PI_SQUARED_ATOL = 5e-6
"""float32 tolerance of Σπ² (a probability) against float64: verl's own logits path must be within it
too (measured on verl 0.9.1: about 1e-6 for each path here)."""


@pytest.mark.parametrize("option", ["fused", "logits"])
def test_verl_worker_sum_pi_squared_on_ray(runs, driver_sum_pi_squared, option):
    """The actor's compute_log_prob with calculate_sum_pi_squared=True (issue 44): verl refuses it on
    its fused path; with rl-kernels' fused head it is served in the same pass. Each option's Σπ² is
    verl's unpatched logits path's (the unpatched worker) and float64's within SUM_PI_SQUARED_ATOL."""
    if LEGACY:
        pytest.skip("verl 0.7.x's legacy worker: Σπ² on the fused path is not served there")
    ref = _result(runs, None)["sum_pi_squared"]
    if ref is None:
        pytest.skip("this verl's engine returns no sum_pi_squared")
    out = _result(runs, option)
    mask = rollout_tensors()[0]["response_mask"].bool()
    want = driver_sum_pi_squared[mask]
    assert float((ref[mask].double() - want).abs().max()) < SUM_PI_SQUARED_ATOL  # verl's own logits path
    got = out["sum_pi_squared"]
    if isinstance(got, BaseException):
        raise got
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got[mask].double(), want, atol=SUM_PI_SQUARED_ATOL, rtol=0)
    torch.testing.assert_close(got[mask], ref[mask].float(), atol=SUM_PI_SQUARED_ATOL, rtol=0)
    counts = _delta(out["counts_sum_pi_squared"], out["counts_actor"])
    if option == "fused":  # computed by the fused head in its one pass over the 18 tokens
        assert counts["fused_fsdp_calls"] == 1 and counts["fused_sum_pi_squared_calls"] == 1, counts
        assert counts["sum_pi_squared_calls"] == 0, counts
    else:
        assert counts["sum_pi_squared_calls"] >= 1 and counts["fused_calls"] == 0, counts
    print(f"\nsum_pi_squared {option}: max |got - float64| {float((got[mask].double() - want).abs().max()):.1e}, "
          f"verl's logits path {float((ref[mask].double() - want).abs().max()):.1e}")


def test_planted_anomaly_on_verls_logits_path_leaves_a_sample_that_replays(runs, model, anomaly_dir, capsys):
    """verl's logits path in its Ray worker with the anomaly capture on: the run's clean calls (the
    reference's and the actor's log-probs, Σπ², one update; every call re-checked in float32) leave
    no sample. With a kernel bug planted in that worker (a log-prob > 0 at one token), one more
    compute_log_prob leaves one sample: that token's row of logits, as verl passed them (divided by
    T = 0.7), and its label, which `rl-kernels repro` replays: every rl-kernels backend PASS against
    float64 (the planted bug is not in the replay), and float64's log-prob is the true one."""
    from repro_rows import table_rows
    from rl_kernels.samples import LogitsSample, load_sample
    from rl_kernels.tools.cli import main

    out = _result(runs, "logits")
    assert out["anomalies_clean"] == [], out["anomalies_clean"]
    files = out["anomalies_planted"]
    assert len(files) == 1 and os.path.dirname(files[0]) == anomaly_dir, files
    sample = load_sample(files[0])
    assert isinstance(sample, LogitsSample) and sample.logits.shape == (1, VOCAB) and sample.temperature == 1.0
    meta = sample.metadata
    assert meta["reason"] == "log-prob above 1e-05 (max 0.01)", meta
    assert "logprobs_from_logits" in meta["function"] and meta["rows"].startswith(f"{PLANTED_ROW} of the call's")
    assert meta["source"] == "rl_kernels.integrations.verl" and meta["verl_version"] == verl_version()
    # the token: position PLANTED_ROW of the first sequence (its 9 real tokens come first), label the
    # next token; the logits of the model as the update left it (the planted call came after it)
    import copy

    updated = copy.deepcopy(model[0])
    assert set(out["after"]) == {n for n, _ in updated.named_parameters()}
    updated.load_state_dict(out["after"], strict=False)
    ids = rollout_tensors()[0]["input_ids"][0][:9]
    with torch.no_grad():
        want = type(updated).forward(updated, input_ids=ids[None], return_dict=True).logits[0, PLANTED_ROW] / T
    torch.testing.assert_close(sample.logits[0], want, atol=1e-4, rtol=0)
    assert sample.labels.tolist() == [int(ids[PLANTED_ROW + 1])]
    assert main(["repro", "--device", "cpu", files[0]]) == 0
    text = capsys.readouterr().out
    rows = table_rows(text)
    assert {r["backend"] for r in rows} >= {"rl_kernels torch", "torch eager"}, text
    assert all(r["result"] == "PASS" for r in rows if r["backend"].startswith("rl_kernels")), text
    true_lp = float(torch.log_softmax(want.double(), -1)[ids[PLANTED_ROW + 1]])
    assert true_lp < -1e-3  # the planted 0.01 is not what the replay computes
    import rl_kernels

    replayed = float(rl_kernels.log_probs_from_logits(sample.logits, sample.labels, backend="torch")[0])
    assert abs(replayed - true_lp) < 1e-4, (replayed, true_lp)
