"""The Hydra group (the repository's conf/, package data of rl_kernels.integrations.conf) composes with verl's own entry
point (`--cfg job` prints the job config without training), from the clone (--config-dir) and from
the installed package (pkg://), and every option file sets the keys the integration reads.

verl's entry point costs a ~12 s process start (verl, Ray, torch imports) on CI's CPUs, so three
tests run it as users do (--config-dir, pkg://, the recipe) and the others compose verl's
``ppo_trainer`` in-process with Hydra's compose API: the same primary config, search path and
overrides that ``main_ppo`` hands to Hydra."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")
import yaml

import rl_kernels.integrations.verl as rkv

pytestmark = pytest.mark.verl_matrix  # also run on verl 0.7.1 and 0.8.0 by .ci/run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compose_cli(*overrides):
    # as a user types it in a clone: from the repository's root, the top-level conf/
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-dir", "conf", *overrides, "--cfg", "job"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return yaml.safe_load(proc.stdout)


def _compose_in_process(*overrides):
    """verl's ppo_trainer composed as main_ppo does, with the group's folder on the search path."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    conf = os.path.join(REPO, "conf")  # the repository's Hydra group folder
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose("ppo_trainer", overrides=[f"hydra.searchpath=[file://{conf}]", *overrides])
    return OmegaConf.to_container(cfg)


@pytest.mark.parametrize("option,how", [("fused", "main_ppo"), ("logits", "compose"), ("fused_anomaly", "compose")])
def test_main_ppo_composes_option(option, how):
    compose_fn = _compose_cli if how == "main_ppo" else _compose_in_process
    cfg = compose_fn(f"+rl_kernels={option}", "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct")
    model = cfg["actor_rollout_ref"]["model"]
    assert model["external_lib"] == "rl_kernels.integrations.verl"
    assert model["path"] == "Qwen/Qwen2.5-0.5B-Instruct"  # user overrides still apply
    options = model["fused_kernel_options"]["rl_kernels"]
    rkv.VerlOptions(**options)  # every key is a known option with a valid value
    if option.startswith("fused"):
        assert model["use_fused_kernels"] is True
        assert model["fused_kernel_options"]["impl_backend"] == rkv.BACKEND_NAME
    else:
        assert model["use_fused_kernels"] is False
    if option == "fused_anomaly":
        assert options["anomaly_dir"] and options["anomaly_recheck_every"] > 0
    # the critic has no log-prob head: untouched (verl 0.7.x's default interpolates the actor's
    # external_lib: its critic worker imports the module too, which changes nothing it computes)
    assert cfg["critic"]["model"]["external_lib"] in (
        None, "${oc.select:actor_rollout_ref.model.external_lib,null}")


def test_main_ppo_composes_group_from_the_installed_package(tmp_path):
    """An installed user's form: no clone, no --config-dir; the group is package data found on
    Hydra's pkg:// search path, from any working directory."""
    import rl_kernels

    package_root = os.path.dirname(os.path.dirname(rl_kernels.__file__))  # this rl_kernels, not another
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo",
           "hydra.searchpath=[pkg://rl_kernels.integrations.conf]", "+rl_kernels=fused_anomaly",
           "--cfg", "job"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is not available" not in proc.stderr  # Hydra's warning for a search path it cannot read
    cfg = yaml.safe_load(proc.stdout)
    model = cfg["actor_rollout_ref"]["model"]
    assert model["external_lib"] == "rl_kernels.integrations.verl"
    assert model["use_fused_kernels"] is True
    assert model["fused_kernel_options"]["impl_backend"] == rkv.BACKEND_NAME
    rkv.VerlOptions(**model["fused_kernel_options"]["rl_kernels"])
    assert "rl_kernels" not in cfg  # no stray top-level `rl_kernels: fused_anomaly` (group not found)


def test_override_lines_alone_compose():
    """The recipe's form: plain overrides, no config group."""
    cfg = _compose_in_process("actor_rollout_ref.model.external_lib=rl_kernels.integrations.verl",
                       "actor_rollout_ref.model.use_fused_kernels=True",
                       "actor_rollout_ref.model.fused_kernel_options.impl_backend=rl_kernels",
                       "+actor_rollout_ref.model.fused_kernel_options.rl_kernels.backend=triton")
    model = cfg["actor_rollout_ref"]["model"]
    assert model["fused_kernel_options"] == {"impl_backend": "rl_kernels", "rl_kernels": {"backend": "triton"}}


def test_recipe_composes():
    """integrations/verl/run_qwen2_5_grpo.sh, run with --cfg job, composes with the overrides."""
    script = os.path.join(REPO, "integrations", "verl", "run_qwen2_5_grpo.sh")
    proc = subprocess.run(["bash", script, "--cfg", "job"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = yaml.safe_load(proc.stdout)
    model = cfg["actor_rollout_ref"]["model"]
    assert model["external_lib"] == "rl_kernels.integrations.verl"
    assert model["use_fused_kernels"] is True
    assert model["fused_kernel_options"]["impl_backend"] == rkv.BACKEND_NAME
    assert cfg["algorithm"]["adv_estimator"] == "grpo"


def test_fused_anomaly_directory_is_absolute_and_the_same_on_every_worker(tmp_path, monkeypatch):
    """fused_anomaly's default directory as verl hands it to its workers: main_ppo's TaskRunner
    resolves the config once (``OmegaConf.resolve(config)``, in verl's source on every tested
    release) and every worker gets the resolved string: ``$HOME/rl_kernels_anomalies``, absolute,
    whatever a worker's own working directory or environment (``$RL_KERNELS_ANOMALY_DIR`` wins).
    verl-check's ON line names that directory, on the fused and the logits path; a relative one
    gets a WARNING with the absolute fix."""
    import inspect
    import pickle

    import verl.trainer.main_ppo as main_ppo
    from omegaconf import OmegaConf

    from rl_kernels.integrations.anomaly import AnomalyCapture
    from rl_kernels.tools import verl_check

    assert "OmegaConf.resolve(config)" in inspect.getsource(main_ppo)
    home = tmp_path / "home"
    default = str(home / "rl_kernels_anomalies")
    monkeypatch.delenv("RL_KERNELS_ANOMALY_DIR", raising=False)
    monkeypatch.setenv("HOME", str(home))
    cfg = _compose_in_process("+rl_kernels=fused_anomaly")
    resolved = OmegaConf.create(cfg)
    OmegaConf.resolve(resolved)  # verl's TaskRunner, once
    handed = pickle.loads(pickle.dumps(resolved.actor_rollout_ref))  # Ray pickles it to each worker
    monkeypatch.setenv("HOME", "/elsewhere")  # a worker's own environment and working directory
    monkeypatch.chdir(tmp_path)
    directory = handed.model.fused_kernel_options.rl_kernels.anomaly_dir
    assert directory == default and AnomalyCapture(directory).directory == default

    monkeypatch.setenv("HOME", str(home))  # verl-check, in the launching shell
    verdict = verl_check.diagnose(cfg)
    assert verdict.on and verdict.line.endswith(
        f"; anomaly capture on every path served, samples to {default} on every worker (with several nodes, on "
        f"each node's own disk unless that directory is shared)"), verdict.line
    monkeypatch.setenv("RL_KERNELS_ANOMALY_DIR", "/data/anomalies")
    logits = _compose_in_process("+rl_kernels=fused_anomaly", "actor_rollout_ref.model.use_fused_kernels=False")
    verdict = verl_check.diagnose(logits)
    assert verdict.on and "logits path" in verdict.line and "samples to /data/anomalies on every worker" in verdict.line
    monkeypatch.setenv("RL_KERNELS_ANOMALY_DIR", "anomalies")
    verdict = verl_check.diagnose(cfg)
    assert verdict.on and ("WARNING: anomaly_dir='anomalies' is relative: each Ray worker resolves it against its "
                           "own working directory") in verdict.line, verdict.line
    assert verdict.line.endswith(f"Fix: an absolute path, ++{verl_check.OPTIONS_KEY}.anomaly_dir={tmp_path}/anomalies")
    assert verl_check.diagnose(_compose_in_process("+rl_kernels=fused")).line.count("anomaly") == 0
