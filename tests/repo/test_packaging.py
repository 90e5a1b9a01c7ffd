"""What a user gets from `pip install .`: the metadata (SPDX license, LICENSE file, Triton's
platform marker, numpy), every package listed, the Hydra group: the repository's top-level `conf/`
(`--config-dir conf` in a clone) shipped from those same files as the package
`rl_kernels.integrations.conf` (pkg:// search path), and the torch backend where Triton is missing."""
import os
import subprocess
import sys

import pytest

import rl_kernels

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE_CONF = os.path.join(REPO, "conf")  # the package rl_kernels.integrations.conf (pyproject's package-dir)
GROUP = ("fused", "logits", "fused_anomaly")


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib: Python 3.11+")
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirements(project: dict) -> dict:
    requirements = pytest.importorskip("packaging.requirements")
    reqs = [requirements.Requirement(r) for r in project["dependencies"]]
    return {r.name: r for r in reqs}


def test_license_is_spdx_with_the_apache_text():
    data = _pyproject()
    project = data["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX string, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project.get("classifiers", ())), \
        "a license classifier next to an SPDX license is deprecated"
    # the SPDX form needs setuptools >= 77
    (setuptools_req,) = [r for r in data["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools_req.replace(" ", "") == "setuptools>=77"
    with open(os.path.join(REPO, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply" in text
    assert set(project["urls"]) >= {"Repository", "Issues"}


@pytest.mark.parametrize("platform, machine, wanted", [
    ("linux", "x86_64", True), ("linux", "aarch64", True),
    ("darwin", "arm64", False), ("win32", "AMD64", False), ("linux", "ppc64le", False)])
def test_triton_only_where_it_has_wheels(platform, machine, wanted):
    deps = _requirements(_pyproject()["project"])
    marker = deps["triton"].marker
    assert marker is not None
    assert marker.evaluate({"sys_platform": platform, "platform_machine": machine}) is wanted
    # numpy (Triton's CPU interpreter needs it) comes with the package, on every platform
    assert "numpy" in deps and deps["numpy"].marker is None


def test_every_package_is_listed_and_conf_is_shipped_from_the_top_level_folder():
    """pyproject lists its packages (a mapped folder rules out automatic discovery): the list must
    hold every folder of rl_kernels/ with Python files, and map rl_kernels.integrations.conf to
    the top-level conf/ (the files users pass to --config-dir are the files in the wheel)."""
    setuptools_cfg = _pyproject()["tool"]["setuptools"]
    assert setuptools_cfg["package-dir"] == {"rl_kernels.integrations.conf": "conf"}
    tree = sorted(os.path.relpath(root, REPO).replace(os.sep, ".")
                  for root, dirs, files in os.walk(os.path.join(REPO, "rl_kernels"))
                  if "__pycache__" not in root and any(f.endswith(".py") for f in files))
    assert sorted(setuptools_cfg["packages"]) == sorted(tree + ["rl_kernels.integrations.conf"])
    import rl_kernels.integrations.conf as conf

    assert os.path.realpath(os.path.dirname(conf.__file__)) == os.path.realpath(PACKAGE_CONF)


def test_package_data_holds_the_hydra_group():
    """Every option of the group is matched by the package-data glob (so it is in the wheel), and
    the directory is a package (Hydra's pkg:// source needs its __init__.py)."""
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]
    globs = package_data["rl_kernels.integrations.conf"]
    assert os.path.isfile(os.path.join(PACKAGE_CONF, "__init__.py"))
    found = sorted(os.listdir(os.path.join(PACKAGE_CONF, "rl_kernels")))
    assert found == sorted(f"{name}.yaml" for name in GROUP)
    import fnmatch

    for name in found:
        assert any(fnmatch.fnmatch(f"rl_kernels/{name}", g) for g in globs), name


def _compose(tmp_path, overrides):
    hydra = pytest.importorskip("hydra", reason="hydra-core: pip install -e '.[verl]'")
    from omegaconf import OmegaConf

    (tmp_path / "main.yaml").write_text("actor_rollout_ref:\n  model:\n    external_lib: null\n"
                                        "    use_fused_kernels: false\n")
    with hydra.initialize_config_dir(config_dir=str(tmp_path), version_base=None):
        return OmegaConf.to_container(hydra.compose("main", overrides=overrides))


@pytest.mark.parametrize("option", GROUP)
def test_group_composes_from_the_package(tmp_path, option):
    cfg = _compose(tmp_path, ["hydra.searchpath=[pkg://rl_kernels.integrations.conf]", f"+rl_kernels={option}"])
    model = cfg["actor_rollout_ref"]["model"]
    assert model["external_lib"] == "rl_kernels.integrations.verl"
    assert model["use_fused_kernels"] is (option != "logits")
    assert "rl_kernels" not in cfg  # the group was found: no stray top-level key
    if option == "fused_anomaly":  # its `defaults: [fused]` resolves inside the package too
        assert model["fused_kernel_options"]["impl_backend"] == "rl_kernels"
        assert "anomaly_dir" in model["fused_kernel_options"]["rl_kernels"]


def test_group_without_search_path_composes_to_nothing(tmp_path):
    """The pitfall the READMEs describe: without the group on the search path, Hydra takes
    `+rl_kernels=fused` for a plain value: no error, only a top-level `rl_kernels: fused`, and
    external_lib stays unset."""
    cfg = _compose(tmp_path, ["+rl_kernels=fused"])
    assert cfg["rl_kernels"] == "fused"
    assert cfg["actor_rollout_ref"]["model"]["external_lib"] is None


def test_torch_backend_and_repro_without_triton(tmp_path):
    """Where Triton has no wheel (the dependency's marker leaves it out) the package imports,
    backend="auto" runs the torch backend, and `rl-kernels repro` lists Triton as skipped."""
    script = f"""
import sys
sys.modules["triton"] = None  # as if not installed: `import triton` raises ImportError
import torch
import rl_kernels
from rl_kernels.tools.cli import main
from rl_kernels.samples import save_sample
g = torch.Generator().manual_seed(0)
h, w = torch.randn(6, 16, generator=g), torch.randn(40, 16, generator=g)
labels = torch.randint(0, 40, (6,), generator=g)
out = rl_kernels.linear_log_probs(h, w, labels)
ref = torch.log_softmax(h.double() @ w.double().T, -1).gather(-1, labels[:, None])[:, 0]
assert (out.log_probs.double() - ref).abs().max() < 1e-5
save_sample({str(tmp_path / "s.safetensors")!r}, h, w, labels)
sys.exit(main(["repro", "--device", "cpu", {str(tmp_path / "s.safetensors")!r}]))
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # would run the Triton rows if it were there
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(rl_kernels.__file__)),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "skipped: rl_kernels triton" in proc.stdout and "triton is not installed" in proc.stdout
    assert "all rl_kernels backends PASS" in proc.stdout


def test_the_verl_plugin_entry_point_names_a_module_that_patches_nothing():
    """``[project.entry-points."verl.plugins"]`` (verl 0.9.1 and main load the group at ``import
    verl``) names rl-kernels' plugin module: it exists, is outside the patching package, and its
    import only registers (checked in a fresh process by tests/integrations/test_verl_distill.py; the installed
    entry point by hand in a throwaway venv, see the integration README)."""
    import importlib.util

    plugins = _pyproject()["project"]["entry-points"]["verl.plugins"]
    assert plugins == {"rl_kernels": "rl_kernels.integrations.verl_plugin"}, plugins
    assert importlib.util.find_spec(plugins["rl_kernels"]) is not None
    assert not plugins["rl_kernels"].startswith("rl_kernels.integrations.verl.")
