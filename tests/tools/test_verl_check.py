"""``rl-kernels verl-check``: each override mistake that leaves rl-kernels off without an error (issue
35) is caught, with its fix, and the right overrides read as on. verl's own entry point composes the
config (``main_ppo --cfg job``, in process), as the run would.

Marked ``verl_matrix``: the same overrides on verl 0.7.1 and 0.8.0 (.ci/run).
"""
import importlib.util
import os
import subprocess
import sys

import pytest

pytest.importorskip("verl", reason="verl is not installed (pip install -e '.[verl]')")

import rl_kernels
from rl_kernels.integrations.verl_impl.schema import REFUSED_TOGETHER, refused_together
from rl_kernels.tools.cli import main
from rl_kernels.tools.verl_check import compose, diagnose, distillation_note, sum_pi_squared_note

pytestmark = pytest.mark.verl_matrix

SEARCH = "hydra.searchpath=[pkg://rl_kernels.integrations.conf]"
MODEL = "actor_rollout_ref.model"


def _check(capsys, *overrides):
    code = main(["verl-check", *overrides])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out  # one line
    return code, out[0]


@pytest.mark.parametrize("overrides,path", [
    ((SEARCH, "+rl_kernels=fused"), "fused path (use_fused_kernels=True, impl_backend=rl_kernels), backend=auto"),
    ((SEARCH, "+rl_kernels=logits"), "logits path"),
    ((f"{MODEL}.external_lib=rl_kernels.integrations.verl", f"{MODEL}.use_fused_kernels=True",
      f"{MODEL}.fused_kernel_options.impl_backend=rl_kernels",
      f"+{MODEL}.fused_kernel_options.rl_kernels.backend=torch"), "backend=torch, options {'backend': 'torch'}"),
])
def test_on(capsys, overrides, path):
    code, line = _check(capsys, *overrides)
    assert code == 0 and line.startswith("rl-kernels is ON: ") and path in line, line


@pytest.mark.parametrize("overrides,expected", [
    # the group's name misspelt: a plain top-level key
    ((SEARCH, "+rl_kernel=fused"), ["top-level 'rl_kernel: fused'", "did you mean +rl_kernels=fused?"]),
    # an option without its path: Hydra refuses, and its hint (+rl_kernels.backend=...) composes a stray section
    ((SEARCH, "rl_kernels.backend=tritn"),
     ["did not compose", f"Fix: ++{MODEL}.fused_kernel_options.rl_kernels.backend=tritn"]),
    ((SEARCH, "+rl_kernels.backend=tritn"),
     ["a key that nothing reads: rl_kernels.backend=tritn", f"++{MODEL}.fused_kernel_options.rl_kernels.backend=tritn",
      "+rl_kernels=fused (or logits)"]),
    # the package of the search path misspelt: Hydra only warns
    (("hydra.searchpath=[pkg://rl_kernels.integration.conf]", "+rl_kernels=fused"),
     ["could not read the search path rl_kernels.integration.conf", f"Fix: {SEARCH}"]),
    # no search path at all
    (("+rl_kernels=fused",), ["plain top-level 'rl_kernels: fused'", f"Fix: add '{SEARCH}'"]),
    # impl_backend misspelt: verl prints "Skipping monkey patch" and runs the plain forward
    ((f"{MODEL}.external_lib=rl_kernels.integrations.verl", f"{MODEL}.use_fused_kernels=True",
      f"{MODEL}.fused_kernel_options.impl_backend=rl_kernel"),
     ["OFF on the fused path", "impl_backend='rl_kernel'", "did you mean "
      f"{MODEL}.fused_kernel_options.impl_backend=rl_kernels?"]),
    # a bad value where it belongs: otherwise refused only in a Ray worker
    ((SEARCH, "+rl_kernels=fused", f"{MODEL}.fused_kernel_options.rl_kernels.backend=tritn"),
     ["a Ray worker would refuse these options", "fused_kernel_options.rl_kernels.backend: expected one of"]),
    ((SEARCH, "+rl_kernels=fused", f"++{MODEL}.fused_kernel_options.rl_kernels.anomaly_dirr=/tmp/x"),
     ["unknown option(s) ['anomaly_dirr']", "did you mean 'anomaly_dir'"]),
])
def test_each_mistake_is_off_with_its_fix(capsys, overrides, expected):
    code, line = _check(capsys, *overrides)
    assert code == 1 and line.startswith("rl-kernels is OFF"), line
    for text in expected:
        assert text in line, (text, line)


OPTIONS = f"{MODEL}.fused_kernel_options.rl_kernels"


@pytest.mark.parametrize("stray,shown", [
    ("+rl_kernels.backend=torch", "rl_kernels.backend=torch"),  # Hydra's own hint for rl_kernels.backend=torch
    ("++rl_kernels.backend=torch", "rl_kernels.backend=torch"),
    ("++rl_kernels.bakend=torch", "rl_kernels.bakend=torch"),  # and the option misspelt too
    (f"++{MODEL}.rl_kernels.backend=torch", f"{MODEL}.rl_kernels.backend=torch"),
    (f"++{MODEL}.fused_kernel_options.rl_kernel.backend=torch",
     f"{MODEL}.fused_kernel_options.rl_kernel.backend=torch"),
    (f"+{MODEL}.fused_kernel_options.backend=torch", f"{MODEL}.fused_kernel_options.backend=torch"),
    ("+backend=torch", "backend=torch"),
])
@pytest.mark.parametrize("group", ["before", "after", "none"])
def test_an_option_nothing_reads_is_caught_with_the_spelling_that_works(capsys, stray, shown, group):
    """An option put where nothing reads it composes without an error and the run keeps the option's
    default (issue 46: 'ON ... backend=auto', exit 0): exit 1, the line names the key as composed
    and the override that works, and that override, in its place, makes the run ON with the option."""
    selected = {"before": [SEARCH, "+rl_kernels=fused", stray], "after": [SEARCH, stray, "+rl_kernels=fused"],
                "none": [SEARCH, stray]}[group]
    code, line = _check(capsys, *selected)
    fix = f"++{OPTIONS}.backend=torch"
    assert code == 1 and f"nothing reads: {shown} (" in line and f"Fix: {fix}" in line, line
    if group == "none":
        assert line.startswith("rl-kernels is OFF") and "+rl_kernels=fused (or logits)" in line, line
    else:
        assert line.startswith("rl-kernels is ON but not as asked: ") and "backend=auto" in line, line
    fixed = [fix if o == stray else o for o in selected] + (["+rl_kernels=fused"] if group == "none" else [])
    code, line = _check(capsys, *fixed)
    assert code == 0 and line.startswith("rl-kernels is ON: fused path") and "backend=torch" in line, line


def test_a_key_of_verl_named_like_an_option_is_not_stray(capsys):
    """verl has keys named 'backend' of its own (which ones depends on its version): overriding one
    is not a mistake."""
    def keys(node, path=()):
        for key, value in node.items():
            yield path + (key,), value
            if isinstance(value, dict):
                yield from keys(value, path + (key,))

    verl_config, _ = compose([])
    own = next(".".join(path) for path, value in keys(verl_config)
               if path[-1] == "backend" and "fused_kernel_options" not in path and isinstance(value, (str, type(None))))
    code, line = _check(capsys, SEARCH, "+rl_kernels=fused", f"++{own}=simple")
    assert code == 0 and line.startswith("rl-kernels is ON: fused path"), (own, line)


@pytest.mark.parametrize("override,fix", [
    ("rl_kernels.backend=torch", f"++{OPTIONS}.backend=torch"),  # Hydra refuses; its hint would be stray
    (f"{OPTIONS}.backnd=torch", f"++{OPTIONS}.backend=torch"),  # an option misspelt where it belongs
])
def test_an_option_hydra_refuses_gets_the_spelling_that_works(capsys, override, fix):
    code, line = _check(capsys, SEARCH, "+rl_kernels=fused", override)
    assert code == 1 and "did not compose" in line and f"Fix: {fix} " in line, line
    code, line = _check(capsys, SEARCH, "+rl_kernels=fused", fix)
    assert code == 0 and "backend=torch" in line, line


CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "conf")
GROUP_OPTIONS = sorted(f.removesuffix(".yaml") for f in os.listdir(os.path.join(CONF, "rl_kernels")))


@pytest.mark.parametrize("where", [(SEARCH,), ("--config-dir", CONF)])
def test_an_unknown_group_option_lists_every_option_and_the_nearest(capsys, where):
    """Hydra lists the group's options on several lines: every one is in the line, with a did-you-mean."""
    code, line = _check(capsys, *where, "+rl_kernels=logit")
    assert code == 1 and "Could not find 'rl_kernels/logit'" in line, line
    assert f"options in 'rl_kernels': {', '.join(GROUP_OPTIONS)}." in line, line
    assert line.endswith("Fix: did you mean +rl_kernels=logits?"), line
    assert "logits" in GROUP_OPTIONS and len(GROUP_OPTIONS) >= 3


def test_an_unknown_group_option_without_the_search_path_gets_the_nearest(capsys):
    code, line = _check(capsys, "+rl_kernels=logit")
    assert code == 1 and "with +rl_kernels=logits ('logit' is no option of the group; its options: " \
        f"{', '.join(GROUP_OPTIONS)})" in line, line


@pytest.mark.parametrize("argv", [
    ["--config-dir", CONF, "+rl_kernels=fused"],
    ["+rl_kernels=fused", "--config-dir", CONF],
    [f"--config-dir={CONF}", "+rl_kernels=fused", "--entry", "verl.trainer.main_ppo", "-v",
     f"{MODEL}.use_fused_kernels=False"],
    ["-cd", CONF, "--config-name", "ppo_trainer", "+rl_kernels=fused", f"{MODEL}.use_fused_kernels=False"],
])
def test_own_options_anywhere_among_the_overrides(capsys, argv):
    """verl-check's options (--config-dir first, as its help shows it) mix with the overrides in any order."""
    code, line = _check(capsys, *argv)
    path = "logits path" if f"{MODEL}.use_fused_kernels=False" in argv else "fused path"
    assert code == 0 and line.startswith(f"rl-kernels is ON: {path}"), line


@pytest.mark.parametrize("argv,message", [
    (["+rl_kernels=fused", "--cfg", "job"], "unrecognized arguments: --cfg"),
    (["--config-dir", "/no/such/dir", "+rl_kernels=fused"], "argument --config-dir: '/no/such/dir' is not a directory"),
])
def test_a_bad_flag_is_a_one_line_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as err:
        main(["verl-check", *argv])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert err.value.code == 2 and len(lines) == 1 and message in lines[0] and not captured.out, lines


def test_logits_path_switched_off_is_off():
    cfg = {"actor_rollout_ref": {"model": {"external_lib": "rl_kernels.integrations.verl", "use_fused_kernels": False,
                                           "fused_kernel_options": {"rl_kernels": {"patch_logits_path": False}}}}}
    verdict = diagnose(cfg)
    assert not verdict.on and "patch_logits_path=False" in verdict.line


def test_sum_pi_squared_is_reported_for_the_composed_config(capsys):
    """actor.calculate_sum_pi_squared=True (issue 44): one more line, after the verdict, says what serves it."""
    code = main(["verl-check", SEARCH, "+rl_kernels=fused", "actor_rollout_ref.actor.calculate_sum_pi_squared=True"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(out) == 2 and out[0].startswith("rl-kernels is ON: fused path"), out
    assert out[1] == ("sum_pi_squared (actor.calculate_sum_pi_squared=True, strategy=fsdp, fused path): served by "
                      "rl-kernels' fused head in the same pass (verl's refusal lifted)"), out


def _sum_pi_squared_config(strategy, fused, impl_backend="rl_kernels", **options):
    return {"actor_rollout_ref": {
        "actor": {"strategy": strategy, "calculate_sum_pi_squared": True},
        "model": {"external_lib": "rl_kernels.integrations.verl", "use_fused_kernels": fused,
                  "fused_kernel_options": {"impl_backend": impl_backend, "rl_kernels": options}}}}


@pytest.mark.parametrize("cfg,expected", [
    (_sum_pi_squared_config("fsdp2", True), "fsdp2, fused path): served by rl-kernels' fused head"),
    (_sum_pi_squared_config("megatron", True), "megatron, fused path): served by rl-kernels' fused head in the same "
                                               "pass, vocab-parallel"),
    (_sum_pi_squared_config("fsdp", False), "fsdp, logits path): served by rl-kernels (sum_pi_squared_from_logits)"),
    (_sum_pi_squared_config("fsdp", False, patch_logits_path=False), "computed by verl's own code (patch_logits_path"),
    (_sum_pi_squared_config("fsdp", True, impl_backend="triton"), "WARNING: sum_pi_squared (actor.calculate_sum_pi_"
                                                                  "squared=True, strategy=fsdp, fused path): with "
                                                                  "impl_backend='triton' verl refuses it"),
    (_sum_pi_squared_config("megatron", True, patch_megatron_fused=False), "WARNING: "),
    (_sum_pi_squared_config("veomni", True), "WARNING: sum_pi_squared (actor.calculate_sum_pi_squared=True, strategy="
                                             "veomni, fused path): VeOmni's fused route"),
    (_sum_pi_squared_config("torchtitan", False), "WARNING: "),
])
def test_sum_pi_squared_note_per_engine_and_path(cfg, expected):
    note = sum_pi_squared_note(cfg)
    assert note is not None and (note.startswith(expected) or expected in note), note
    assert note.startswith("WARNING: ") == expected.startswith("WARNING: "), note
    cfg["actor_rollout_ref"]["actor"]["calculate_sum_pi_squared"] = False
    assert sum_pi_squared_note(cfg) is None  # not asked: no line


@pytest.mark.parametrize("strategy,options,expected", [
    ("fsdp2", {}, "; a per-sample temperature (a tensor) is served on the fused path"),
    ("megatron", {}, "; a per-sample temperature (a tensor) is served on the fused path"),
    ("megatron", {"patch_megatron_fused": False}, "; a per-sample temperature (a tensor) is NOT served on the "
                                                  "Megatron fused path with patch_megatron_fused=False"),
])
def test_the_fused_line_says_what_serves_a_per_sample_temperature(strategy, options, expected):
    cfg = {"actor_rollout_ref": {"actor": {"strategy": strategy},
                                 "model": {"external_lib": "rl_kernels.integrations.verl", "use_fused_kernels": True,
                                           "fused_kernel_options": {"impl_backend": "rl_kernels",
                                                                    "rl_kernels": options}}}}
    verdict = diagnose(cfg)
    assert verdict.on and (expected in verdict.line if expected else "per-sample" not in verdict.line), verdict.line


def test_a_bad_entry_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as err:
        main(["verl-check", "--entry", "no.such.module", "+rl_kernels=fused"])
    assert err.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--entry: no module named 'no.such.module'" in lines[0], lines


def test_the_check_leaves_verl_unpatched():
    """verl-check composes verl's config in the CLI process and must leave verl as installed: it
    never imports the integration's switch (rl_kernels.integrations.verl, whose import patches verl),
    and verl's functions stay verl's."""
    code = ("import sys\n"
            "from rl_kernels.tools.cli import main\n"
            f"code = main(['verl-check', {SEARCH!r}, '+rl_kernels=fused'])\n"
            "loaded = sorted(m for m in sys.modules if m == 'rl_kernels.integrations.verl')\n"
            "print('integration modules loaded:', loaded)\n"
            "F = sys.modules.get('verl.utils.torch_functional')\n"
            "print('patched:', F is not None and F.logprobs_from_logits.__module__ != F.__name__)\n"
            "sys.exit(code)\n")
    env = dict(os.environ)  # the subprocess imports the rl_kernels this test imports
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(rl_kernels.__file__)),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "rl-kernels is ON: fused path" in proc.stdout, proc.stdout
    assert "integration modules loaded: []" in proc.stdout and "patched: False" in proc.stdout, proc.stdout


@pytest.mark.parametrize("strategy,rmpad,options,expected", [
    ("fsdp2", True, {}, "; top-K distillation (loss_mode=forward_kl_topk) served on the fused path"),
    ("megatron", True, {}, "; top-K distillation (loss_mode=forward_kl_topk) served on the Megatron fused path"),
    ("megatron", True, {"patch_megatron_fused": False}, "WARNING: top-K distillation (loss_mode=forward_kl_topk) is "
                                                        "NOT served on the Megatron fused path with "
                                                        "patch_megatron_fused=False"),
    ("fsdp", False, {}, "WARNING: top-K distillation (loss_mode=forward_kl_topk) is NOT served on the fused path with "
                        "use_remove_padding=False"),
    ("fsdp2", True, {}, "; the overlap metrics too (overlap_count, overlap_token_advantage: the student's top K "
                        "selected in the fused head's forward"),
    ("megatron", True, {}, "; the overlap metrics too (overlap_count, overlap_token_advantage: the student's top K "
                           "selected in the fused head's forward"),
    ("fsdp2", True, {"overlap_metrics": False}, "; the overlap metrics off (overlap_metrics=false: verl logs no "
                                                "distillation/overlap_ratio)"),
    ("megatron", True, {"overlap_metrics": False}, "; the overlap metrics off (overlap_metrics=false"),
])
def test_fused_line_says_whether_top_k_distillation_is_served(strategy, rmpad, options, expected):
    model = {"external_lib": "rl_kernels.integrations.verl", "use_fused_kernels": True, "use_remove_padding": rmpad,
             "fused_kernel_options": {"impl_backend": "rl_kernels", "rl_kernels": options}}
    cfg = {"actor_rollout_ref": {"model": model, "actor": {"strategy": strategy}},
           "distillation": {"enabled": True, "distillation_loss": {"loss_mode": "forward_kl_topk"}}}
    verdict = diagnose(cfg)
    assert verdict.on and expected in verdict.line, verdict.line
    cfg["distillation"]["distillation_loss"]["loss_mode"] = "k3"  # a single-sample estimator: nothing to say
    assert "distillation" not in diagnose(cfg).line


def _distillation_config(strategy, fused, mode="forward_kl_topk_tail", clamp=None,
                         external_lib="rl_kernels.integrations.verl", **options):
    return {"actor_rollout_ref": {"actor": {"strategy": strategy},
                                  "model": {"external_lib": external_lib, "use_fused_kernels": fused,
                                            "fused_kernel_options": {"impl_backend": "rl_kernels",
                                                                     "rl_kernels": options}}},
            "distillation": {"enabled": True, "distillation_loss": {"loss_mode": mode, "log_prob_min_clamp": clamp}}}


@pytest.mark.parametrize("cfg,entry,expected", [
    (_distillation_config("fsdp2", False), "verl.trainer.main_ppo",
     "top-K distillation (loss_mode=forward_kl_topk_tail, strategy=fsdp2, logits path): served by rl-kernels "
     "(compute_forward_kl_topk replaced); the mode is registered in verl by the external_lib import"),
    (_distillation_config("megatron", False, "forward_kl_topk", -10.0), "verl.trainer.main_ppo",
     "top-K distillation (loss_mode=forward_kl_topk, strategy=megatron, logits path): served by rl-kernels "
     "(compute_forward_kl_topk replaced, vocab-parallel over the TP group)"),
    (_distillation_config("megatron", True), "verl.trainer.main_ppo", "fused path): see the fused line"),
    (_distillation_config("fsdp", False, clamp=-10.0), "verl.trainer.main_ppo",
     "WARNING: top-K distillation (loss_mode=forward_kl_topk_tail, strategy=fsdp, logits path): log_prob_min_clamp="
     "-10.0 is refused"),
    (_distillation_config("fsdp", False, external_lib=None), "verl.trainer.main_ppo",
     "WARNING: top-K distillation (loss_mode=forward_kl_topk_tail, strategy=fsdp, logits path): rl-kernels' patch is "
     "not imported"),
    (_distillation_config("fsdp", False, patch_logits_path=False), "verl.trainer.main_ppo",
     "WARNING: top-K distillation (loss_mode=forward_kl_topk_tail, strategy=fsdp, logits path): computed by verl's "
     "own code (patch_logits_path=False)"),
    (_distillation_config("fsdp", False), "verl.experimental.fully_async_policy.fully_async_main",
     "WARNING: top-K distillation (loss_mode=forward_kl_topk_tail, strategy=fsdp, logits path): verl.experimental."
     "fully_async_policy.fully_async_main may validate the distillation config in a process that imports no "
     "external_lib"),
])
def test_distillation_note_per_engine_path_and_entry(cfg, entry, expected, monkeypatch):
    """The note on top-K distillation (issue 45): the logits paths served on both engines, and
    forward_kl_topk_tail's conditions; the fully-async entry without the plugin loaded is warned
    with the VERL_USE_EXTERNAL_MODULES alternative."""
    monkeypatch.setenv("VERL_USE_EXTERNAL_PLUGINS", "none")  # the plugin, even where installed, not loaded
    monkeypatch.delenv("VERL_USE_EXTERNAL_MODULES", raising=False)
    note = distillation_note(cfg, entry)
    assert note is not None and (note.startswith(expected) or expected in note), note
    assert note.startswith("WARNING: ") == expected.startswith("WARNING: "), note
    if "fully_async" in entry:
        assert "Fix: VERL_USE_EXTERNAL_MODULES=rl_kernels.integrations.verl_plugin" in note, note
        monkeypatch.setenv("VERL_USE_EXTERNAL_MODULES", "rl_kernels.integrations.verl_plugin")
        assert not distillation_note(cfg, entry).startswith("WARNING")
    cfg["distillation"]["distillation_loss"]["loss_mode"] = "k3"
    assert distillation_note(cfg, entry) is None


def _has_distillation() -> bool:
    try:
        return importlib.util.find_spec("verl.trainer.distillation") is not None
    except ModuleNotFoundError:  # (no verl at all)
        return False


@pytest.mark.skipif(not _has_distillation(),
                    reason="this verl has no distillation (0.7.x): its config has no distillation group")
def test_the_tail_mode_is_reported_for_the_composed_config(capsys):
    code = main(["verl-check", SEARCH, "+rl_kernels=logits", "distillation.enabled=True",
                 "distillation.distillation_loss.loss_mode=forward_kl_topk_tail",
                 "distillation.distillation_loss.log_prob_min_clamp=null"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(out) == 2 and out[0].startswith("rl-kernels is ON: logits path"), out
    assert out[1].startswith("top-K distillation (loss_mode=forward_kl_topk_tail, strategy=fsdp, logits path): served "
                             "by rl-kernels"), out


BASE = (SEARCH, "+rl_kernels=fused")


@pytest.mark.parametrize("override,shown,expected,fix", [
    (f"{MODEL}.use_fused_kernels=Flase", f"{MODEL}.use_fused_kernels='Flase'", "a bool (true or false), as "
     "HFModelConfig.use_fused_kernels is typed", f"Fix: did you mean {MODEL}.use_fused_kernels=False?"),
    (f"{MODEL}.use_remove_padding=ture", f"{MODEL}.use_remove_padding='ture'", "a bool (true or false)",
     f"Fix: did you mean {MODEL}.use_remove_padding=true?"),
    ("actor_rollout_ref.actor.ppo_epochs=1.5", "actor_rollout_ref.actor.ppo_epochs=1.5", "an integer, as ",
     "Fix: correct actor_rollout_ref.actor.ppo_epochs"),
])
def test_a_value_verls_config_classes_refuse_is_off_naming_key_value_and_type(capsys, override, shown, expected, fix):
    """A value that verl's dataclass conversion refuses at start (issue 52: 'use_fused_kernels=Flase' read as
    the fused path, exit 0): exit 1, the key, the value and what verl's field type expects, converted as verl
    converts it (OmegaConf's nodes on the dataclass field's type)."""
    code, line = _check(capsys, *BASE, override)
    assert code == 1 and line.startswith("rl-kernels is OFF: verl would refuse this config at start"), line
    assert f"{shown} (verl expects {expected}" in line and line.endswith(fix), line
    if "did you mean" in fix:  # the fix composes and is on
        code, line = _check(capsys, *BASE, fix.removeprefix("Fix: did you mean ").removesuffix("?"))
        assert code == 0 and line.startswith("rl-kernels is ON"), line


DISTILL = ("distillation.enabled=True",)
LOSS_MODE = "distillation.distillation_loss.loss_mode"


@pytest.mark.skipif(not _has_distillation(), reason="this verl has no distillation (0.7.x)")
@pytest.mark.parametrize("mode,near", [("forward_kl_topk_tial", "forward_kl_topk_tail"),
                                       ("forward_kl_topK", "forward_kl_topk"), ("low_var_k", "low_var_kl")])
def test_a_loss_mode_verl_does_not_know_is_off_with_the_nearest(capsys, mode, near):
    """issue 52: 'forward_kl_topk_tial' was reported served (the check matched 'topk' in the name); verl
    refuses it at start. The known modes are verl's registry's plus rl-kernels' tail mode."""
    from verl.trainer.distillation.losses import DISTILLATION_SETTINGS_REGISTRY

    code, line = _check(capsys, *BASE, *DISTILL, f"{LOSS_MODE}={mode}")
    assert code == 1 and line.startswith("rl-kernels is OFF: verl would refuse this config at start"), line
    assert f"{LOSS_MODE}='{mode}' is no distillation loss mode verl knows" in line, line
    for known in set(DISTILLATION_SETTINGS_REGISTRY) | {"forward_kl_topk_tail"}:
        assert known in line, (known, line)
    assert line.endswith(f"Fix: did you mean {LOSS_MODE}={near}?"), line
    code = main(["verl-check", *BASE, *DISTILL, f"{LOSS_MODE}={near}"])
    assert code == 0 and capsys.readouterr().out.startswith("rl-kernels is ON"), near


@pytest.mark.skipif(not _has_distillation(), reason="this verl has no distillation (0.7.x)")
@pytest.mark.parametrize("topk,metrics", [(128, True), (129, False), (256, False)])
def test_the_fused_line_claims_overlap_metrics_only_up_to_the_fused_selections_limit(capsys, topk, metrics):
    """issue 52: topk=256 was reported with 'the overlap metrics too', although K above the fused top-K
    selection's limit gets none on the fused paths."""
    from rl_kernels.core.validation import MAX_TOPK

    code = main(["verl-check", *BASE, *DISTILL, f"{LOSS_MODE}=forward_kl_topk",
                 f"distillation.distillation_loss.topk={topk}"])
    line = capsys.readouterr().out.strip().splitlines()[0]
    assert code == 0 and "top-K distillation (loss_mode=forward_kl_topk) served on the fused path" in line, line
    assert ("the overlap metrics too" in line) == metrics, line
    if not metrics:
        assert f"WARNING: no overlap metrics for topk={topk}: K > {MAX_TOPK}, the largest K the fused head selects" \
            in line, line
        assert "Fix: distillation.distillation_loss.topk=128 or less for them, or overlap_metrics=false" in line, line


@pytest.mark.parametrize("engine,own,fix", [
    ("veomni", "VeOmni's own chunk_logprobs", "Fix: use_fused_kernels=False (rl-kernels serves VeOmni's logits path)"),
])
def test_the_fused_path_of_an_engine_the_patch_does_not_reach_is_not_on(capsys, engine, own, fix):
    if not _has_model_engine(engine):
        pytest.skip(f"this verl's config has no model_engine={engine}")
    """issue 52: model_engine=veomni read 'ON: fused path', exit 0, although VeOmni's fused micro-batches go to
    its own chunk_logprobs: OFF on the fused path (exit 1, as for a fused path verl's own kernel serves), a
    WARNING naming the engine and where its fused micro-batches go, with the fix."""
    code, line = _check(capsys, *BASE, f"model_engine={engine}")
    assert code == 1 and line.startswith(f"rl-kernels is OFF on the fused path: WARNING: engine '{engine}' "
                                         f"(actor_rollout_ref.actor.strategy={engine}): its fused micro-batches go "
                                         f"to {own}, which no rl-kernels patch reaches"), line
    assert line.endswith(fix), line
    code, line = _check(capsys, *BASE, f"model_engine={engine}", f"{MODEL}.use_fused_kernels=False")
    assert code == 0 and line.startswith("rl-kernels is ON: logits path"), line


def test_the_fused_path_of_an_unknown_engine_is_not_on():
    cfg = {"actor_rollout_ref": {"actor": {"strategy": "torchtitan"},
                                 "model": {"external_lib": "rl_kernels.integrations.verl", "use_fused_kernels": True,
                                           "fused_kernel_options": {"impl_backend": "rl_kernels"}}}}
    verdict = diagnose(cfg)
    assert not verdict.on and "WARNING: engine 'torchtitan'" in verdict.line, verdict.line
    assert "that engine's own fused forward" in verdict.line, verdict.line
    assert verdict.line.endswith("Fix: model_engine=dp (FSDP) or model_engine=megatron for rl-kernels' fused head"), \
        verdict.line


@pytest.mark.parametrize("override,shown,fix", [
    ("+actor_rollout_ref.actor.calculate_sum_pi_square=True", "actor_rollout_ref.actor.calculate_sum_pi_square=true",
     "Fix: did you mean actor_rollout_ref.actor.calculate_sum_pi_squared=true?"),
    ("++algorithm.gama=0.9", "algorithm.gama=0.9", "Fix: did you mean algorithm.gamma=0.9?"),
    (f"+{MODEL}.use_remove_paddin=True", f"{MODEL}.use_remove_paddin=true",
     f"Fix: did you mean {MODEL}.use_remove_padding=true?"),
    ("+actor_rollout_ref.actor.zzz.q=1", "actor_rollout_ref.actor.zzz.q=1",
     "Fix: remove +actor_rollout_ref.actor.zzz.q"),
])
def test_an_added_key_verls_config_has_no_field_for_is_off_with_the_nearest(capsys, override, shown, fix):
    """issue 52: a misspelt '+' key under actor_rollout_ref / algorithm / distillation read ON with no remark."""
    code, line = _check(capsys, *BASE, override)
    assert code == 1 and line.startswith("rl-kernels is OFF: the overrides add a key that verl's config has no field "
                                         f"for: {shown} ("), line
    assert line.endswith(fix), line
    if "did you mean" in fix:  # the fix composes and is on (a second line may say what serves the feature)
        code = main(["verl-check", *BASE, fix.removeprefix("Fix: did you mean ").removesuffix("?")])
        out = capsys.readouterr().out
        assert code == 0 and out.startswith("rl-kernels is ON"), out


@pytest.mark.parametrize("override", [f"+{MODEL}.override_config.attention_dropout=0.0", "++algorithm.gamma=0.9"])
def test_an_added_key_in_a_free_form_dict_or_an_existing_key_is_not_flagged(capsys, override):
    code, line = _check(capsys, *BASE, override)
    assert code == 0 and line.startswith("rl-kernels is ON"), line


@pytest.mark.skipif(not _has_distillation(), reason="this verl has no distillation (0.7.x)")
def test_a_loss_mode_without_distillation_enabled_is_said_to_be_ignored(capsys):
    code = main(["verl-check", *BASE, f"{LOSS_MODE}=forward_kl_topk", "distillation.distillation_loss.topk=64"])
    out = capsys.readouterr().out.strip().splitlines()
    assert code == 0 and len(out) == 2 and out[0].startswith("rl-kernels is ON"), out
    assert out[1] == (f"WARNING: {LOSS_MODE}=forward_kl_topk, distillation.distillation_loss.topk=64 are ignored: "
                      "distillation.enabled=false, so verl runs no distillation. Fix: distillation.enabled=True"), out
    code = main(["verl-check", *BASE, *DISTILL, f"{LOSS_MODE}=forward_kl_topk"])
    assert code == 0 and "ignored" not in capsys.readouterr().out


def _has_model_engine(name: str) -> bool:
    """Whether this verl's config has the option ``model_engine=name`` (the group came with the engine workers)."""
    spec = importlib.util.find_spec("verl")
    folder = os.path.join(os.path.dirname(spec.origin), "trainer", "config", "model_engine")
    return os.path.isfile(os.path.join(folder, f"{name}.yaml"))


@pytest.mark.parametrize("engine,path,name,strategy", [("megatron", "fused", "Megatron", "megatron"),
                                                       ("megatron", "logits", "Megatron", "megatron"),
                                                       ("dp", "fused", "FSDP", "fsdp")])
def test_the_on_line_names_the_engine(capsys, engine, path, name, strategy):
    if not _has_model_engine(engine):
        pytest.skip(f"this verl's config has no model_engine={engine}")
    code, line = _check(capsys, SEARCH, f"+rl_kernels={path}", f"model_engine={engine}")
    assert code == 0 and line.startswith(f"rl-kernels is ON: {path} path"), line
    assert f"(actor_rollout_ref.model) on verl's {name} engine (actor_rollout_ref.actor.strategy={strategy})" in line, \
        line


def test_an_entry_that_fails_to_import_names_the_missing_module_and_the_install(capsys, tmp_path, monkeypatch):
    (tmp_path / "entry_missing_dep.py").write_text("import rl_kernels_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["verl-check", "--entry", "entry_missing_dep", *BASE])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in captured.out + captured.err, captured
    assert "entry_missing_dep fails to import: no module named 'rl_kernels_no_such_dependency'. Fix: pip install -e " \
        '".[verl]"' in lines[0], lines


def _group_options():
    """Every option the group's files set under fused_kernel_options.rl_kernels (conf/rl_kernels/*.yaml)."""
    import pathlib

    import yaml

    options = set()
    for path in (pathlib.Path(__file__).parents[2] / "conf" / "rl_kernels").glob("*.yaml"):
        node = yaml.safe_load(path.read_text()) or {}
        for key in ("actor_rollout_ref", "model", "fused_kernel_options", "rl_kernels"):
            node = (node or {}).get(key, {})
        options |= set(node)
    return options


# one bad value per option of the group: the check refuses it (as a Ray worker would) and names the option
BAD_VALUE = {"backend": "tritn", "patch_logits_path": 3, "overlap_metrics": "maybe", "loss_rows_only": "yes please",
             "anomaly_dir": 7,
             "anomaly_max_count": -1, "anomaly_max_bytes": "x", "anomaly_max_log_prob": -1,
             "anomaly_recheck_every": -1, "anomaly_recheck_rows": -2, "anomaly_recheck_tolerance": -1}


def test_every_option_of_the_group_has_a_case():
    assert _group_options() == set(BAD_VALUE), "an option of conf/rl_kernels/*.yaml without a bad-value case here"


@pytest.mark.parametrize("option", sorted(BAD_VALUE))
def test_a_bad_value_of_each_group_option_is_off_naming_it(capsys, option):
    code, line = _check(capsys, SEARCH, "+rl_kernels=fused_anomaly",
                        f"{MODEL}.fused_kernel_options.rl_kernels.{option}={BAD_VALUE[option]}")
    assert code == 1 and line.startswith("rl-kernels is OFF: ") and f"rl_kernels.{option}: expected" in line, line


def test_the_anomaly_group_names_the_absolute_directory_of_every_worker(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("RL_KERNELS_ANOMALY_DIR", str(tmp_path))
    code, line = _check(capsys, SEARCH, "+rl_kernels=fused_anomaly")
    assert code == 0 and f"samples to {tmp_path} on every worker" in line, line
    code, line = _check(capsys, SEARCH, "+rl_kernels=fused_anomaly",
                        f"{MODEL}.fused_kernel_options.rl_kernels.anomaly_dir=relative/dir")
    assert code == 0 and "WARNING: anomaly_dir='relative/dir' is relative" in line, line


ROWS = f"++{MODEL}.fused_kernel_options.rl_kernels.loss_rows_only=true"


@pytest.mark.parametrize("overrides, code, first, note", [
    (("+rl_kernels=fused", ROWS), 0, "rl-kernels is ON: fused path",
     "loss_rows_only (strategy=fsdp, fused path): the LM head runs only on the rows whose loss_mask is 1"),
    (("+rl_kernels=logits", ROWS), 0, "rl-kernels is ON: logits path",
     "loss_rows_only (strategy=fsdp, logits path): the LM head runs only on the rows whose loss_mask is 1"),
    (("+rl_kernels=logits", ROWS, "actor_rollout_ref.actor.strategy=megatron"), 0, "rl-kernels is ON: logits path",
     "loss_rows_only (strategy=megatron, logits path): the LM head runs only on the rows whose loss_mask is 1"),
    (("+rl_kernels=logits", ROWS, "actor_rollout_ref.actor.strategy=megatron", f"++{MODEL}.mtp.enable=True",
      f"++{MODEL}.mtp.enable_train=True"), 1,
     "rl-kernels is OFF: loss_rows_only: MTP training (model.mtp.enable_train=True) runs the output layer", None),
    (("+rl_kernels=logits", ROWS, "actor_rollout_ref.actor.strategy=dp2"), 0, "rl-kernels is ON: logits path",
     "WARNING: loss_rows_only=true is not served on the logits path of engine 'dp2' (use_fused_kernels=False): "
     "the LM head computes every row. Fix: +rl_kernels=fused"),
    (("+rl_kernels=fused", ROWS, "actor_rollout_ref.actor.policy_loss.loss_mode=my_loss"), 1,
     "rl-kernels is OFF: loss_rows_only: actor.policy_loss.loss_mode=my_loss is not one audited for loss_rows_only",
     None),
    (("+rl_kernels=fused", ROWS, "actor_rollout_ref.actor.use_prefix_grouper=True"), 1,
     "rl-kernels is OFF: loss_rows_only: actor.use_prefix_grouper=True changes the packed row layout", None),
    (("+rl_kernels=fused", ROWS, f"{MODEL}.use_remove_padding=False"), 1,
     "rl-kernels is OFF: loss_rows_only: use_remove_padding=False is not served", None),
])
def test_loss_rows_only_is_reported_or_refused_as_the_workers_would(capsys, overrides, code, first, note):
    """verl-check says what loss_rows_only does in the composed run (issue 53 item 3): served on the fused
    and logits paths of FSDP and Megatron (a note), not served on another engine (a WARNING), and OFF,
    naming the key, where the workers would refuse it (a loss outside the audit of docs/verl.md,
    PrefixGrouper, the padded layout, MTP training on the Megatron logits path)."""
    got = main(["verl-check", SEARCH, *overrides])
    lines = capsys.readouterr().out.strip().splitlines()
    assert got == code and lines[0].startswith(first), lines
    assert (note is None and not any("loss_rows_only" in line for line in lines[1:])) or \
        any(line.startswith(note) for line in lines[1:]), lines


@pytest.mark.skipif(not _has_distillation(), reason="this verl has no distillation (0.7.x)")
@pytest.mark.parametrize("first, second, path", [(a, b, path) for a, b, paths, _ in REFUSED_TOGETHER for path in paths])
def test_each_refused_combination_is_off_with_the_engine_steps_message(capsys, first, second, path):
    """A config that asks two features the integration refuses together on its path (the one table,
    schema.REFUSED_TOGETHER, which the engine steps read too) is OFF with that table's message;
    either feature alone is not."""
    asks = {"sum_pi_squared": ("actor_rollout_ref.actor.calculate_sum_pi_squared=True",),
            "topk": DISTILL + (f"{LOSS_MODE}=forward_kl_topk",), "loss_rows_only": (ROWS,)}
    engine = ("actor_rollout_ref.actor.strategy=megatron",) if path.startswith("Megatron") else ()
    group = "+rl_kernels=fused" if path.endswith("fused") else "+rl_kernels=logits"
    got = main(["verl-check", SEARCH, group, *engine, *asks[first], *asks[second]])
    lines = capsys.readouterr().out.strip().splitlines()
    assert got == 1 and lines[0] == f"rl-kernels is OFF: {refused_together({first, second}, path)} (the workers " \
        f"raise VerlIntegrationError at the first micro-batch)", lines
    for alone in (first, second):
        assert main(["verl-check", SEARCH, group, *engine, *asks[alone]]) == 0, capsys.readouterr().out
