"""``rl-kernels verl-check [OVERRIDES...]``: is rl-kernels on in the verl run these overrides make?

verl's config is composed the way the run composes it: ``python -m verl.trainer.main_ppo --cfg job
OVERRIDES`` (verl's own entry point and Hydra, run in this process; nothing is trained), then
:func:`diagnose` reads the composed ``actor_rollout_ref.model`` section and says in one line
whether rl-kernels is on (which path, which backend, which options) or off and why, with the
likely fix (exit status 1 when off or an option is lost). Hydra composes several mistakes without
an error, each leaving rl-kernels off or an option unset:

* a misspelt group (``+rl_kernel=fused``): a plain top-level key;
* the group without its search path (or a ``pkg://`` path that does not resolve): a plain
  top-level ``rl_kernels: fused`` (and, for the path, Hydra's "is not available" UserWarning);
* an option put where nothing reads it (``+rl_kernels.backend=triton``, which Hydra suggests for
  ``rl_kernels.backend=triton``; ``++actor_rollout_ref.model.rl_kernels.backend=...``;
  ``+actor_rollout_ref.model.fused_kernel_options.backend=...``): with or without the group
  selected, a key that nothing reads (:func:`stray_keys`), so the run keeps the option's default;
* an unknown option of the group (``+rl_kernels=logit``): Hydra's error, with every option and the
  nearest one;
* ``impl_backend`` misspelt (``rl_kernel``): verl prints "Skipping monkey patch" and runs its
  plain forward;
* a bad value under ``fused_kernel_options.rl_kernels`` (``backend=tritn``): otherwise refused only
  in a Ray worker, when it builds the model.

The ON line describes what verl will run for the config, so it is OFF (exit 1) as well for: a value
verl's config classes refuse at start (:func:`bad_values`: ``use_fused_kernels=Flase``), a
distillation loss mode verl does not know (:func:`known_loss_modes`), a ``+`` / ``++`` key under
``SCHEMA_ROOTS`` that verl's config classes have no field for (:func:`_added_keys`), the fused path
of an engine the patch does not reach (VeOmni, torchtitan, ...), and an entry point that fails to
import. The ON line names the engine.

After that line, one line per optional feature the config asks for that rl-kernels serves only on
some engines and paths: Σπ² (``actor.calculate_sum_pi_squared=True``, :func:`sum_pi_squared_note`),
top-K distillation on the logits paths and the ``forward_kl_topk_tail`` loss mode that rl-kernels
adds to verl (:func:`distillation_note`), with ``WARNING:`` where verl would refuse it or compute it
with its own code.

verl offers no hook in the driver before Ray starts its workers that could run rl-kernels' checks
(its ``external_lib`` is imported in the workers), so this command is the check before launch.
It is tooling: it reads the composed config and patches nothing in this process.
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import sys
from typing import NamedTuple

from ..integrations.verl_impl.modes import TAIL_MODE
from ..integrations.verl_impl.schema import (BACKEND_NAME, VerlOptions, loss_rows_refusal, names_rl_kernels,
                                             refused_together, validated_options)
from ..core.validation import MAX_TOPK

GROUP = "rl_kernels"
"""The Hydra group (``+rl_kernels=fused``) and its package on the search path."""
SEARCH_PATH = "pkg://rl_kernels.integrations.conf"
ENTRY = "verl.trainer.main_ppo"
EXTERNAL_LIB = "rl_kernels.integrations.verl"
OPTIONS_KEY = "actor_rollout_ref.model.fused_kernel_options.rl_kernels"
"""Where rl-kernels reads its options (:class:`VerlOptions`); the group's files set them there."""
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(VerlOptions))


class Verdict(NamedTuple):
    on: bool
    line: str  # one line: "rl-kernels is ON: ..." / "rl-kernels is OFF: ... Fix: ..."
    notes: tuple = ()  # one line each, after it: what is served of an optional feature the config asks for


class ComposeError(RuntimeError):
    """verl's entry point could not compose the config (Hydra's message, one line)."""


def compose(overrides: list[str], entry: str = ENTRY, flags: tuple[str, ...] = ()) -> tuple[dict, str]:
    """(the composed config as a dict, what Hydra printed to stderr, logged and warned) of ``python
    -m ENTRY --cfg job FLAGS OVERRIDES``, run in this process (``runpy``, as ``python -m`` runs it;
    ``--cfg job`` makes verl's Hydra main print the config and return before anything starts;
    ``flags``: Hydra's own, e.g. ``("--config-dir", "conf")``). Raises ComposeError with Hydra's
    own message when the overrides do not compose."""
    import contextlib
    import io
    import runpy
    import warnings

    import yaml

    argv, out, err = sys.argv, io.StringIO(), io.StringIO()
    sys.argv = [entry, "--cfg", "job", *flags, *overrides]
    root = logging.getLogger()
    handlers = root.handlers[:]
    captured = logging.StreamHandler(err)  # what verl logs at import: into ``stderr``, not the terminal
    captured.setFormatter(logging.Formatter("%(levelname)s: %(name)s: %(message)s"))
    root.handlers = [captured]
    code = 0
    try:
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out), \
                contextlib.redirect_stderr(err):
            warnings.simplefilter("always")
            try:
                runpy.run_module(entry, run_name="__main__", alter_sys=False)
            except ImportError as exc:  # the entry exists (the CLI checked) but what it imports does not
                missing = getattr(exc, "name", None)
                raise ComposeError(f"{entry} fails to import: " +
                                   (f"no module named {missing!r}" if missing else " ".join(str(exc).split())) +
                                   ". Fix: pip install -e \".[verl]\" (from the root of a clone of rl-kernels: "
                                   f"verl and its dependencies)") from None
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
        root.handlers = handlers
        _clear_hydra()
    stderr = err.getvalue() + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
    if code != 0:
        raise ComposeError(_hydra_error(err.getvalue()) or f"{entry} --cfg job exited {code}")
    try:
        cfg = yaml.safe_load(out.getvalue())
    except yaml.YAMLError as exc:
        raise ComposeError(f"{entry} --cfg job printed no config ({exc.__class__.__name__})") from exc
    if not isinstance(cfg, dict):
        raise ComposeError(f"{entry} --cfg job printed no config")
    return cfg, stderr


def _clear_hydra() -> None:
    """Hydra's global state after a run (a second compose in the same process starts clean)."""
    try:
        from hydra.core.global_hydra import GlobalHydra
    except ImportError:
        return
    GlobalHydra.instance().clear()


def _hydra_error(stderr: str) -> str:
    """Hydra's error message (not the log lines and warnings around it) on one line: every line of
    it, a list (a line ending in ':' and the indented lines under it) as ``head: a, b, c``; the
    config search path Hydra lists after a missing group option is left out."""
    skip = ("WARNING:", "INFO:", "Set the environment variable HYDRA_FULL_ERROR", "warnings.warn")
    lines = [ln.rstrip() for ln in stderr.splitlines()
             if ln.strip() and not ln.lstrip().startswith(skip) and "Warning:" not in ln]
    parts: list[str] = []
    i = 0
    while i < len(lines):
        head, i = lines[i].strip(), i + 1
        items = []
        while head.endswith(":") and i < len(lines) and lines[i][:1] in ("\t", " "):
            items.append(lines[i].strip())
            i += 1
        if head != "Config search path:":
            parts.append(f"{head} {', '.join(items)}" if items else head)
    return "; ".join(parts)


def _close(word: str, choices, cutoff: float = 0.75) -> str | None:
    """The nearest of ``choices`` to ``word`` (difflib's ratio >= ``cutoff``), or None."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=cutoff)
    return match[0] if match else None


_MISSING = object()


def _lookup(cfg: dict, dotted: str):
    """The value at ``dotted`` in ``cfg``, ``_MISSING`` where there is no such key (a value may be None)."""
    node = cfg
    for key in dotted.split("."):
        if not isinstance(node, dict) or key not in node:
            return _MISSING
        node = node[key]
    return node


def _section(cfg: dict, dotted: str):
    value = _lookup(cfg, dotted)
    return None if value is _MISSING else value


def group_options() -> list[str]:
    """The options of the Hydra group (``fused``, ...): the group's files in this installation."""
    from importlib import resources

    try:
        folder = resources.files(SEARCH_PATH.removeprefix("pkg://")) / GROUP
        return sorted(f.name.removesuffix(".yaml") for f in folder.iterdir() if f.name.endswith(".yaml"))
    except (ImportError, OSError):
        return []


def _hydra_value(value) -> str:
    """``value`` spelt as a Hydra override's value (``true``, ``null``, ``'a b'``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    if re.fullmatch(r"[\w./:+-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _option_spelling(rest: tuple[str, ...], value: str) -> str:
    """The override that sets rl-kernels' option ``rest`` (its name as given, the path below an
    ``rl_kernels`` key, or a misspelling of one) to ``value`` (already spelt): ``++OPTIONS_KEY.NAME=VALUE``
    (``++`` adds or overrides: it works with and without the group selected), or, for no option of
    that name, what the options are."""
    name = rest[0] if len(rest) == 1 else None
    option = name if name in OPTION_NAMES else _close(str(name), OPTION_NAMES) if name else None
    if option is None:
        return (f"rl-kernels has no option {'.'.join(rest)!r} (its options, under {OPTIONS_KEY}: "
                f"{', '.join(OPTION_NAMES)})")
    return f"++{OPTIONS_KEY}.{option}={value}"


def _is_group_name(key) -> bool:
    return key == GROUP or _close(str(key), [GROUP]) is not None


def stray_keys(cfg: dict, added: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(``key=value`` as composed, the override that works) per key of ``cfg`` that nothing reads:

    * every key named ``rl_kernels`` (or a near spelling) except ``OPTIONS_KEY`` itself, at any
      depth (verl's config has no such key: only an override or a user's config file makes one),
      each value under it with the option it names;
    * each key of ``added``: a key an override added that verl's own config does not have, named
      as one of rl-kernels' options (``backend``, ...) outside ``OPTIONS_KEY`` (:func:`check` finds them).

    Options under ``OPTIONS_KEY`` itself are checked by :func:`validated_options` (unknown names too)."""
    found: list[tuple[str, str]] = []

    def leaves(node, path: tuple[str, ...]):
        if isinstance(node, dict) and node:
            for key, value in node.items():
                yield from leaves(value, path + (str(key),))
        else:
            yield path, node

    def walk(node: dict, path: tuple[str, ...]) -> None:
        for key, value in node.items():
            here = path + (str(key),)
            if ".".join(here) == OPTIONS_KEY:
                continue
            if _is_group_name(key):
                for rest, leaf in leaves(value, ()):
                    shown = f"{'.'.join(here + rest)}={_hydra_value(leaf)}"
                    if rest:
                        found.append((shown, _option_spelling(rest, _hydra_value(leaf))))
                    elif str(leaf) in group_options():
                        found.append((shown, f"+{GROUP}={leaf} (the group, with hydra.searchpath=[{SEARCH_PATH}])"))
                    else:
                        found.append((shown, "remove it"))
            elif isinstance(value, dict):
                walk(value, here)

    walk(cfg, ())
    for key in added:
        value = _lookup(cfg, key)
        if value is not _MISSING:
            found.append((f"{key}={_hydra_value(value)}",
                          _option_spelling((key.rsplit(".", 1)[-1],), _hydra_value(value))))
    return found


def _stray_text(strays: list[tuple[str, str]]) -> tuple[str, str]:
    """(what the stray keys are, their fix) for a verdict's line."""
    keys = "; ".join(key for key, _ in strays)
    fixes = " ".join(dict.fromkeys(fix for _, fix in strays))
    return (f"{'a key' if len(strays) == 1 else 'keys'} that nothing reads: {keys} (rl-kernels reads its options "
            f"only under {OPTIONS_KEY})", fixes)


_SCALARS = {bool: ("BooleanNode", "a bool (true or false)"), int: ("IntegerNode", "an integer"),
            float: ("FloatNode", "a float")}


def _dataclass_of(target) -> type | None:
    """The dataclass that a config node's ``_target_`` names (verl builds the node into it), or None."""
    import importlib

    if not isinstance(target, str) or "." not in target:
        return None
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - a target this process cannot import: nothing to check it against
        return None
    return cls if dataclasses.is_dataclass(cls) else None


def _field_type(hint):
    """(the scalar type or Enum class of a dataclass field's type hint, Optional[...] unwrapped), or None."""
    import enum
    import typing

    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        hint = args[0]
    if hint in _SCALARS or (isinstance(hint, type) and issubclass(hint, enum.Enum)):
        return hint
    return None


def bad_values(cfg: dict) -> list[tuple[str, object, str, str | None]]:
    """(key, composed value, what verl expects, the nearest valid spelling or None) per value that verl's
    own config classes refuse when verl builds them: for every node whose ``_target_`` names a
    dataclass (``HFModelConfig``, ``ActorConfig``, ...), each field typed bool, int, float or an Enum,
    converted as verl converts it (``omega_conf_to_dataclass`` merges the node into
    ``OmegaConf.structured(cls)``: OmegaConf's ``BooleanNode`` / ``IntegerNode`` / ``FloatNode`` /
    ``EnumNode``, here one field at a time). Interpolations (``${...}``) are left to verl."""
    import enum
    import typing

    import omegaconf

    found: list[tuple[str, object, str, str | None]] = []

    def walk(node, path: tuple[str, ...]) -> None:
        if not isinstance(node, dict):
            return
        cls = _dataclass_of(node.get("_target_"))
        hints = {}
        if cls is not None:
            try:
                hints = typing.get_type_hints(cls)
            except Exception:  # noqa: BLE001 - unresolvable annotations: nothing to check against
                hints = {}
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, path + (str(key),))
                continue
            kind = _field_type(hints.get(key)) if key != "_target_" else None
            if kind is None or value is None or (isinstance(value, str) and "${" in value):
                continue
            if isinstance(kind, type) and issubclass(kind, enum.Enum):
                choices = [m.name for m in kind]
                try:
                    omegaconf.EnumNode(enum_type=kind, value=value)
                    continue
                except omegaconf.errors.ValidationError:
                    pass
                found.append((".".join(path + (str(key),)), value, f"one of {', '.join(choices)} ({kind.__name__})",
                              _close(str(value), choices, cutoff=0.6)))
                continue
            node_name, expected = _SCALARS[kind]
            try:
                getattr(omegaconf, node_name)(value=value)
                continue
            except omegaconf.errors.ValidationError:
                pass
            near = _close(str(value), ["true", "false", "True", "False"], cutoff=0.6) if kind is bool else None
            found.append((".".join(path + (str(key),)), value,
                          f"{expected}, as {cls.__name__}.{key} is typed", near))

    walk(cfg, ())
    return found


def _bad_values_verdict(found) -> Verdict:
    """OFF: verl refuses the config at start (its dataclass conversion), naming each key, value and what is expected."""
    parts, fixes = [], []
    for key, value, expected, near in found:
        parts.append(f"{key}={value!r} (verl expects {expected})")
        if near is not None:
            fixes.append(f"{key}={near}")
    fix = f"did you mean {' '.join(fixes)}?" if fixes else "correct " + ", ".join(k for k, *_ in found)
    return Verdict(False, f"rl-kernels is OFF: verl would refuse this config at start (its config classes do not "
                          f"convert {'; '.join(parts)}). Fix: {fix}")


LOSS_MODE_KEY = "distillation.distillation_loss.loss_mode"


def known_loss_modes() -> list[str] | None:
    """The distillation loss modes verl will accept: verl's own registry
    (``verl.trainer.distillation.losses``, what ``DistillationLossConfig.__post_init__`` looks the
    mode up in) plus rl-kernels' ``forward_kl_topk_tail`` (registered there by the ``external_lib``
    import and the plugin); None for a verl without distillation."""
    try:
        from verl.trainer.distillation.losses import DISTILLATION_SETTINGS_REGISTRY
    except ImportError:
        return None
    return sorted(set(DISTILLATION_SETTINGS_REGISTRY) | {TAIL_MODE})


def _unknown_loss_mode_verdict(cfg: dict) -> Verdict | None:
    """OFF when distillation is on with a loss mode verl does not know (verl refuses it at start,
    'Unsupported loss mode'), with every known mode and the nearest spelling; None otherwise."""
    if _section(cfg, "distillation.enabled") is not True:
        return None
    mode, modes = _lookup(cfg, LOSS_MODE_KEY), known_loss_modes()
    if mode is _MISSING or modes is None or mode in modes:
        return None
    near = _close(str(mode), modes, cutoff=0.6)
    fix = f"did you mean {LOSS_MODE_KEY}={near}?" if near else f"{LOSS_MODE_KEY}=<one of these modes>"
    return Verdict(False, f"rl-kernels is OFF: verl would refuse this config at start: {LOSS_MODE_KEY}={mode!r} is "
                          f"no distillation loss mode verl knows (DistillationLossConfig raises 'Unsupported loss "
                          f"mode'; the modes: {', '.join(modes)}, {TAIL_MODE} being rl-kernels'). Fix: {fix}")


def diagnose(cfg: dict, stderr: str = "", overrides: list[str] = (), added: tuple[str, ...] = ()) -> Verdict:
    """The verdict on a composed verl config (``cfg``: ``--cfg job``'s YAML as a dict; ``stderr``:
    what Hydra printed while composing; ``overrides``: the user's, for the hints; ``added``: for
    :func:`stray_keys`). A key that nothing reads (:func:`stray_keys`) makes the verdict negative
    (exit status 1) even when rl-kernels is on: the run would not have the option asked for."""
    model = _section(cfg, "actor_rollout_ref.model")
    if not isinstance(model, dict):
        return Verdict(False, "rl-kernels is OFF: the composed config has no actor_rollout_ref.model section "
                              "(is this verl's PPO entry point?)")
    bad = bad_values(cfg)
    if bad:
        return _bad_values_verdict(bad)
    unknown_mode = _unknown_loss_mode_verdict(cfg)
    if unknown_mode is not None:
        return unknown_mode
    strays = stray_keys(cfg, added)
    external_lib = model.get("external_lib")
    if external_lib != EXTERNAL_LIB:  # the reason names the stray keys too
        return Verdict(False, f"rl-kernels is OFF: actor_rollout_ref.model.external_lib is {external_lib!r}, not "
                              f"{EXTERNAL_LIB!r}: {_why_not_imported(cfg, stderr, overrides, strays)}")
    verdict = _imported_verdict(cfg, model)
    if not strays:
        return verdict
    what, fix = _stray_text(strays)
    if verdict.on:
        summary = verdict.line.removeprefix("rl-kernels is ON: ").split(";")[0]
        return Verdict(False, f"rl-kernels is ON but not as asked: the composed config has {what}, so the run has "
                              f"{summary}. Fix: {fix}")
    return Verdict(False, f"{verdict.line}. Also, the composed config has {what}. Fix: {fix}")


def _imported_verdict(cfg: dict, model: dict) -> Verdict:
    """The verdict when ``external_lib`` imports rl-kernels: which path, with which options, or off and why."""
    fused_options = model.get("fused_kernel_options") or {}
    try:
        section = fused_options.get(BACKEND_NAME) if isinstance(fused_options, dict) else None
        opts = validated_options(section or {})
    except (TypeError, ValueError) as exc:
        return Verdict(False, f"rl-kernels is OFF: a Ray worker would refuse these options when it builds the "
                              f"model: {exc}. Fix: correct {OPTIONS_KEY}")
    changed = {f.name: getattr(opts, f.name) for f in dataclasses.fields(VerlOptions)
               if getattr(opts, f.name) != f.default}
    options_text = f"options {changed}" if changed else "default options"
    if model.get("use_fused_kernels"):
        impl_backend = fused_options.get("impl_backend") if isinstance(fused_options, dict) else None
        if not names_rl_kernels(impl_backend):
            hint = _close(str(impl_backend), [BACKEND_NAME])
            fix = (f"did you mean actor_rollout_ref.model.fused_kernel_options.impl_backend={BACKEND_NAME}?" if hint
                   else f"set actor_rollout_ref.model.fused_kernel_options.impl_backend={BACKEND_NAME}, or "
                        f"use_fused_kernels=False for rl-kernels' logits path")
            return Verdict(False, f"rl-kernels is OFF on the fused path: use_fused_kernels=True with impl_backend="
                                  f"{impl_backend!r}, so verl's own fused kernel (or, for an unknown name, verl's "
                                  f"plain forward, after printing 'Skipping monkey patch') computes the log-probs; "
                                  f"rl-kernels is imported but replaces nothing on this path. Fix: {fix}")
        strategy = _section(cfg, "actor_rollout_ref.actor.strategy")
        if isinstance(strategy, str) and strategy not in FSDP_STRATEGIES + ("megatron",):
            own = "VeOmni's own chunk_logprobs" if strategy == "veomni" else "that engine's own fused forward"
            fix = ("use_fused_kernels=False (rl-kernels serves VeOmni's logits path)" if strategy == "veomni" else
                   "model_engine=dp (FSDP) or model_engine=megatron for rl-kernels' fused head")
            return Verdict(False, f"rl-kernels is OFF on the fused path: WARNING: engine {strategy!r} "
                                  f"(actor_rollout_ref.actor.strategy={strategy}): its fused micro-batches go to "
                                  f"{own}, which no rl-kernels patch reaches, so nothing on this path is served "
                                  f"(rl-kernels' fused head serves the FSDP and Megatron engines). Fix: {fix}")
        return Verdict(True, f"rl-kernels is ON: fused path (use_fused_kernels=True, impl_backend={BACKEND_NAME}), "
                             f"backend={opts.backend}, {options_text}; the actor and the reference model "
                             f"(actor_rollout_ref.model){_engine_text(cfg)}{_fused_distillation_note(cfg, model, opts)}"
                             f"{_per_sample_temperature_note(cfg, opts)}{anomaly_dir_note(cfg, opts)}")
    if not opts.patch_logits_path:
        return Verdict(False, "rl-kernels is OFF: use_fused_kernels=False (verl's logits path) with "
                              "patch_logits_path=False, so nothing is replaced. Fix: use_fused_kernels=True with "
                              f"impl_backend={BACKEND_NAME}, or drop patch_logits_path=False")
    return Verdict(True, f"rl-kernels is ON: logits path (use_fused_kernels=False: verl's from-logits functions "
                         f"replaced), {options_text}; the actor and the reference model (actor_rollout_ref.model)"
                         f"{_engine_text(cfg)}{anomaly_dir_note(cfg, opts)}")


ENGINE_NAMES = {"fsdp": "FSDP", "fsdp2": "FSDP", "megatron": "Megatron", "veomni": "VeOmni"}


def _engine_text(cfg: dict) -> str:
    """`` on verl's Megatron engine (strategy=megatron)`` for the ON line: the engine the actor's
    strategy selects ('' where the config names none)."""
    strategy = _section(cfg, "actor_rollout_ref.actor.strategy")
    if not isinstance(strategy, str):
        return ""
    name = ENGINE_NAMES.get(strategy, repr(strategy))
    return f" on verl's {name} engine (actor_rollout_ref.actor.strategy={strategy})"


def anomaly_dir_note(cfg: dict, opts: VerlOptions) -> str:
    """For the ON line, with anomaly capture on (``anomaly_dir`` set; '' otherwise): the directory
    the workers will write to, absolute. The composed value (``--cfg job`` leaves ``${oc.env:...}``
    unresolved) is resolved here, in the whole config, with this process's environment: verl resolves
    it once, in its TaskRunner (a Ray actor), and hands the result to every worker; the TaskRunner
    has this environment when verl starts Ray itself (one node), not on a cluster started with
    ``ray start``. A WARNING, with the fix, for a relative directory (each worker would resolve it
    against its own working directory) or one that does not resolve here."""
    if opts.anomaly_dir is None:
        return ""
    import os

    from omegaconf import OmegaConf

    fix = f"Fix: an absolute path, ++{OPTIONS_KEY}.anomaly_dir=/path/to/anomalies"
    try:
        value = OmegaConf.select(OmegaConf.create(cfg), f"{OPTIONS_KEY}.anomaly_dir",
                                 throw_on_resolution_failure=True)
    except Exception as exc:  # noqa: BLE001 - OmegaConf's resolution errors (a missing variable, ...)
        return f". WARNING: anomaly_dir={opts.anomaly_dir!r} does not resolve here ({' '.join(str(exc).split())}). {fix}"
    path = os.path.expanduser(str(value))
    if not os.path.isabs(path):
        return (f". WARNING: anomaly_dir={value!r} is relative: each Ray worker resolves it against its own working "
                f"directory (from here: {os.path.abspath(path)}). Fix: an absolute path, ++{OPTIONS_KEY}.anomaly_dir="
                f"{os.path.abspath(path)}")
    return (f"; anomaly capture on every path served, samples to {os.path.normpath(path)} on every worker (with "
            f"several nodes, on each node's own disk unless that directory is shared)")


def _topk_distillation(cfg: dict) -> str | None:
    """The distillation loss mode when the composed config turns on a top-K distillation loss
    (verl's registry says which modes use top-K; a mode it does not know, by its name), else None."""
    section = cfg.get("distillation")
    if not isinstance(section, dict) or not section.get("enabled"):
        return None
    mode = str(_section(section, "distillation_loss.loss_mode"))
    try:
        from verl.trainer.distillation.losses import get_distillation_loss_settings

        return mode if get_distillation_loss_settings(mode).use_topk else None
    except (ImportError, ValueError):
        return mode if "topk" in mode else None


def _fused_distillation_note(cfg: dict, model: dict, opts: VerlOptions) -> str:
    """What the fused path does with top-K distillation, for the ON line ('' without it): served on
    verl's FSDP engine with remove-padding and on its Megatron engine (rl-kernels' fused head,
    ``patch_megatron_fused``); a WARNING where it is not (verl's loss then finds no
    distillation_losses)."""
    mode = _topk_distillation(cfg)
    if mode is None:
        return ""
    strategy = _section(cfg, "actor_rollout_ref.actor.strategy")
    fix = "Fix: use_fused_kernels=False (the logits path) for distillation runs"
    if strategy == "megatron" and not opts.patch_megatron_fused:
        return (f". WARNING: top-K distillation (loss_mode={mode}) is NOT served on the Megatron fused path with "
                f"patch_megatron_fused=False (verl's fused forward computes no distillation outputs). Fix: drop "
                f"patch_megatron_fused=False, or use_fused_kernels=False")
    topk = _section(cfg, "distillation.distillation_loss.topk")
    if opts.overlap_metrics and isinstance(topk, int) and not isinstance(topk, bool) and topk > MAX_TOPK:
        overlap = (f"WARNING: no overlap metrics for topk={topk}: K > {MAX_TOPK}, the largest K the fused "
                   f"head selects, gets no overlap metrics (overlap_count, overlap_token_advantage) on the "
                   f"fused paths, so verl logs no distillation/overlap_ratio. Fix: distillation.distillation_loss."
                   f"topk={MAX_TOPK} or less for them, or overlap_metrics=false")
    else:
        overlap = None
    overlap = overlap or (
        "the overlap metrics too (overlap_count, overlap_token_advantage: the student's top K selected in the "
        "fused head's forward; overlap_metrics=false turns them off)" if opts.overlap_metrics
        else "the overlap metrics off (overlap_metrics=false: verl logs no distillation/overlap_ratio)")
    if strategy == "megatron":
        return (f"; top-K distillation (loss_mode={mode}) served on the Megatron fused path (distillation_losses, "
                f"student_mass, teacher_mass from rl-kernels' vocab-parallel fused head; needs "
                f"patch_megatron_fused, the default; {overlap})")
    if strategy not in ("fsdp", "fsdp2"):
        return (f". WARNING: top-K distillation (loss_mode={mode}) is NOT served by rl-kernels on the fused path of "
                f"strategy {strategy!r} (that engine's own fused forward). {fix}")
    if not model.get("use_remove_padding", True):
        return (f". WARNING: top-K distillation (loss_mode={mode}) is NOT served on the fused path with "
                f"use_remove_padding=False (verl's engine reads no fused distillation outputs then). Fix: "
                f"use_remove_padding=True, or use_fused_kernels=False")
    return (f"; top-K distillation (loss_mode={mode}) served on the fused path (distillation_losses, student_mass, "
            f"teacher_mass from rl-kernels' fused head; {overlap})")


def _per_sample_temperature_note(cfg: dict, opts: VerlOptions) -> str:
    """What the fused path does with a per-sample temperature (a float tensor per sample in the
    batch, which verl's fused paths refuse): served on verl's FSDP engine and on its Megatron engine
    while ``patch_megatron_fused`` (the default) holds (other engines' own fused routes: nothing
    said), for the ON line."""
    strategy = _section(cfg, "actor_rollout_ref.actor.strategy")
    if strategy == "megatron" and not opts.patch_megatron_fused:
        return ("; a per-sample temperature (a tensor) is NOT served on the Megatron fused path with "
                "patch_megatron_fused=False (verl refuses it there)")
    if strategy in ("fsdp", "fsdp2", "megatron"):
        return "; a per-sample temperature (a tensor) is served on the fused path"
    return ""


def _option_hint(value) -> str:
    """``+rl_kernels=VALUE`` for an option of the group; for another value the nearest option, and
    every option."""
    options = group_options()
    if str(value) in options or not options:
        return f"+{GROUP}={value}"
    return (f"+{GROUP}={_close(str(value), options, cutoff=0.6) or options[0]} ('{value}' is no option of the group; "
            f"its options: {', '.join(options)})")


def _why_not_imported(cfg: dict, stderr: str, overrides, strays: list[tuple[str, str]]) -> str:
    """Why external_lib is not ours, from the top-level keys and Hydra's warnings; with the fix."""
    unavailable = re.findall(r"path=(\S+?) is not available", stderr)
    top = cfg.get(GROUP)
    if unavailable:
        paths = ", ".join(unavailable)
        return (f"Hydra could not read the search path {paths} (its 'is not available' warning), so the group "
                f"'{GROUP}' was not found. Fix: hydra.searchpath=[{SEARCH_PATH}]")
    if isinstance(top, str):
        return (f"a plain top-level '{GROUP}: {top}' was composed: Hydra did not find the group '{GROUP}' (no "
                f"search path to it). Fix: add 'hydra.searchpath=[{SEARCH_PATH}]' (or --config-dir conf from a "
                f"clone's root), with {_option_hint(top)}")
    near = [k for k in cfg if k != GROUP and _close(str(k), [GROUP]) and not isinstance(cfg[k], dict)]
    if near:
        return (f"a top-level '{near[0]}: {cfg[near[0]]}' was composed, which nothing reads. Fix: did you mean "
                f"{_option_hint(cfg[near[0]])}? (with hydra.searchpath=[{SEARCH_PATH}])")
    if strays:
        what, fix = _stray_text(strays)
        return (f"the group is not selected, and the composed config has {what}. Fix: {fix}, with "
                f"hydra.searchpath=[{SEARCH_PATH}] +{GROUP}=fused (or logits)")
    return (f"Fix: hydra.searchpath=[{SEARCH_PATH}] +{GROUP}=fused, or "
            f"actor_rollout_ref.model.external_lib={EXTERNAL_LIB} with use_fused_kernels=True and "
            f"fused_kernel_options.impl_backend={BACKEND_NAME}")


def _parsed(overrides: list[str]) -> list:
    """Hydra's parse of ``overrides`` (its ``Override`` objects); [] where Hydra cannot parse them."""
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        return OverridesParser.create().parse_overrides(list(overrides))
    except Exception:  # noqa: BLE001 - Hydra's own parse errors: the composition reports them
        return []


SCHEMA_ROOTS = ("actor_rollout_ref", "algorithm", "distillation")
"""The sections where a ``+`` / ``++`` key must be one verl's config classes have (:func:`_added_keys`)."""


def _unknown_field(key: str, cfg: dict, base: dict) -> str | None:
    """For a key an override added (present in ``cfg``, absent from ``base``, verl's config composed
    without those overrides): the nearest existing spelling ('' for none) where its first component
    that ``base`` lacks sits under a node built into a dataclass (``_target_``) that has no such field;
    None where it sits in a free-form dict (``override_config``, ``engine_kwargs``, ...), which verl passes on."""
    path = key.split(".")
    node, base_node = cfg, base
    for i, part in enumerate(path):
        if not isinstance(base_node, dict) or part not in base_node:
            cls = _dataclass_of(node.get("_target_")) if isinstance(node, dict) else None
            if cls is None or part in {f.name for f in dataclasses.fields(cls)}:
                return None
            names = sorted({f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")} |
                           {str(k) for k in (base_node if isinstance(base_node, dict) else {})})
            near = _close(part, names)
            return ("" if i == len(path) - 1 else "+") + ".".join(path[:i] + [near] + path[i + 1:]) if near else ""
        node, base_node = node.get(part) if isinstance(node, dict) else None, base_node[part]
    return None


def _added_keys(overrides: list[str], cfg: dict, entry: str,
                flags: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The keys that a ``+KEY=...`` / ``++KEY=...`` override put into ``cfg`` and verl's config composed
    without those overrides does not have: (those named as one of rl-kernels' options, or a near
    spelling, outside ``OPTIONS_KEY``: for :func:`stray_keys`; (key, nearest existing spelling or '')
    for each other one under ``SCHEMA_ROOTS`` that verl's config classes have no field for,
    :func:`_unknown_field`). verl has keys named ``backend`` of its own: the base compose tells them apart."""
    options, schema = {}, {}
    for o in _parsed(overrides):
        key = o.key_or_group
        if not ((o.is_add() or o.is_force_add()) and o.package is None and "/" not in key
                and not key.startswith(f"{OPTIONS_KEY}.") and not any(_is_group_name(k) for k in key.split("."))
                and _lookup(cfg, key) is not _MISSING):
            continue
        if _close(key.rsplit(".", 1)[-1], OPTION_NAMES):
            options[o.input_line] = key
        elif key.split(".", 1)[0] in SCHEMA_ROOTS:
            schema[o.input_line] = key
    if not options and not schema:
        return (), ()
    try:
        base, _ = compose([o for o in overrides if o not in options and o not in schema], entry, flags)
    except ComposeError:  # the others need these keys: verl's config cannot say; none is called stray
        return (), ()
    unknown = []
    for key in schema.values():
        near = _unknown_field(key, cfg, base) if _lookup(base, key) is _MISSING else None
        if near is not None:
            unknown.append((key, near))
    return tuple(key for key in options.values() if _lookup(base, key) is _MISSING), tuple(unknown)


def _unknown_keys_verdict(unknown, cfg: dict) -> Verdict:
    """OFF: an added key that verl's config classes have no field for (verl refuses it when it builds
    the dataclass, or nothing reads it), with the nearest existing spelling (``unknown``: :func:`_added_keys`)."""
    parts, fixes = [], []
    for key, near in unknown:
        parts.append(f"{key}={_hydra_value(_lookup(cfg, key))}")
        if near:
            fixes.append(f"{near}={_hydra_value(_lookup(cfg, key))}")
    fix = f"did you mean {' '.join(fixes)}?" if fixes else "remove " + ", ".join(f"+{k}" for k, _ in unknown)
    return Verdict(False, f"rl-kernels is OFF: the overrides add {'a key' if len(parts) == 1 else 'keys'} that verl's "
                          f"config has no field for: {'; '.join(parts)} (verl refuses it when it builds its config "
                          f"classes, or nothing reads it). Fix: {fix}")


def _failed_verdict(message: str, overrides: list[str]) -> Verdict:
    """The verdict when the overrides do not compose (Hydra's ``message``), with the fix where the
    message shows what was meant: an unknown option of a group (the nearest, every option), an
    rl-kernels option given where Hydra finds no key (``++`` under ``OPTIONS_KEY``)."""
    head = f"rl-kernels is OFF: verl's config did not compose: {message}"
    missing = re.search(r"Could not find '([^']+)/([^'/]+)'", message)
    listed = re.search(r"Available options in '[^']+': ([^;]*)", message)
    if missing and listed:
        group, value = missing.groups()
        near = _close(value, [o.strip() for o in listed.group(1).split(",")], cutoff=0.6)
        typed = next((o.split("=", 1)[0] for o in overrides
                      if "=" in o and o.split("=", 1)[0].lstrip("+~").split("@")[0] == group), f"+{group}")
        return Verdict(False, f"{head}. Fix: did you mean {typed}={near}?" if near else head)
    failed = re.search(r"Could not override '([\w.]+)'", message)
    if failed:
        key = failed.group(1)
        path = key.split(".")
        typed = next((o.split("=", 1)[1] for o in overrides if "=" in o and o.split("=", 1)[0].lstrip("+~") == key),
                     "...")
        at = next((i for i, k in enumerate(path) if _is_group_name(k)), None)
        rest = tuple(path[at + 1:]) if at is not None else (path[-1],) if _close(path[-1], OPTION_NAMES) else None
        if rest:
            why = ("" if key.startswith(f"{OPTIONS_KEY}.") else
                   f" Hydra's '+{key}' would compose a key that nothing reads (rl-kernels reads its options only under "
                   f"{OPTIONS_KEY}).")
            selected = any(o.split("=", 1)[0].lstrip("+") == GROUP or "external_lib=" in o for o in overrides)
            turn_on = "" if selected else f", with hydra.searchpath=[{SEARCH_PATH}] +{GROUP}=fused (or logits)"
            return Verdict(False, f"{head}.{why} Fix: {_option_spelling(rest, typed)} ('++' adds or overrides)"
                                  f"{turn_on}")
    return Verdict(False, head)


def check(overrides: list[str], entry: str = ENTRY, flags: tuple[str, ...] = ()) -> Verdict:
    """Compose (:func:`compose`; ``flags``: Hydra's own, e.g. ``("--config-dir", "conf")``) and
    :func:`diagnose`. A failed composition is a verdict too: OFF, with Hydra's message and, where it
    shows what was meant, the fix (:func:`_failed_verdict`)."""
    try:
        cfg, stderr = compose(overrides, entry, flags)
    except ComposeError as exc:
        return _failed_verdict(str(exc), overrides)
    added, unknown = _added_keys(overrides, cfg, entry, flags)
    if unknown:
        verdict = _unknown_keys_verdict(unknown, cfg)
        return verdict if bad_values(cfg) == [] else diagnose(cfg, stderr, overrides, added)
    verdict = diagnose(cfg, stderr, overrides, added)
    notes = verdict.notes + tuple(filter(None, [sum_pi_squared_note(cfg), distillation_note(cfg, entry),
                                                ignored_distillation_note(cfg, overrides)]))
    together = combination_refusal(cfg)
    if together is not None and verdict.on:
        return Verdict(False, f"rl-kernels is OFF: {together} (the workers raise VerlIntegrationError at the first "
                              f"micro-batch)", notes)
    rows = loss_rows_note(cfg, entry)
    if rows is not None and rows.startswith("REFUSED") and verdict.on:
        return Verdict(False, f"rl-kernels is OFF: {rows[len('REFUSED: '):]}", notes)
    return verdict._replace(notes=notes + ((rows,) if rows else ()))


def combination_refusal(cfg: dict) -> str | None:
    """The message of the engine step's refusal of two features asked together on this config's
    path (the integration's one table: :func:`~rl_kernels.integrations.verl_impl.schema.refused_together`),
    or None: Σπ² (``actor.calculate_sum_pi_squared``), top-K distillation and ``loss_rows_only``
    as the composed config asks them, on the FSDP / Megatron fused or logits path."""
    model, actor = _section(cfg, "actor_rollout_ref.model"), _section(cfg, "actor_rollout_ref.actor")
    if not isinstance(model, dict) or not isinstance(actor, dict) or model.get("external_lib") != EXTERNAL_LIB:
        return None
    strategy = actor.get("strategy")
    opts = _note_options(model)
    if opts is None or strategy not in FSDP_STRATEGIES + ("megatron",):
        return None
    fused = bool(model.get("use_fused_kernels"))
    asked = {name for name, on in (("sum_pi_squared", actor.get("calculate_sum_pi_squared") is True),
                                   ("topk", _topk_distillation(cfg) is not None),
                                   ("loss_rows_only", opts.loss_rows_only)) if on}
    path = f"{'FSDP' if strategy in FSDP_STRATEGIES else 'Megatron'} {'fused' if fused else 'logits'}"
    return refused_together(asked, path)


def loss_rows_note(cfg: dict, entry: str = ENTRY) -> str | None:
    """What the option ``loss_rows_only`` does in the run this composed config makes (None where it
    is off or rl-kernels is not imported): served on the fused and logits paths of the FSDP and
    Megatron engines; a line starting with ``REFUSED:`` where the integration would refuse it at
    the first engine step (a loss outside the audit of docs/verl.md, PrefixGrouper, the padded
    layout, top-K distillation on a logits path, MTP training on the Megatron logits path: the
    workers raise, so the verdict turns OFF), a ``WARNING:`` where it is not served (another
    engine, a switch that turns rl-kernels' path off, a trainer entry point outside the audit)."""
    model, actor = _section(cfg, "actor_rollout_ref.model"), _section(cfg, "actor_rollout_ref.actor")
    if not isinstance(model, dict) or model.get("external_lib") != EXTERNAL_LIB:
        return None
    opts = _note_options(model)
    if opts is None:
        return None  # the verdict names the bad option
    if not opts.loss_rows_only:
        return None
    actor = actor if isinstance(actor, dict) else {}
    distillation = cfg.get("distillation") if isinstance(cfg.get("distillation"), dict) else {}
    loss = distillation.get("distillation_loss") if isinstance(distillation.get("distillation_loss"), dict) else {}
    why = loss_rows_refusal(policy_loss_mode=_section(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode"),
                            use_prefix_grouper=actor.get("use_prefix_grouper") is True,
                            distillation_enabled=distillation.get("enabled") is True,
                            distillation_loss_mode=loss.get("loss_mode"),
                            use_policy_gradient=loss.get("use_policy_gradient") is True,
                            distillation_policy_loss_mode=loss.get("policy_loss_mode"))
    if why is not None:
        return f"REFUSED: {why} (the workers raise VerlIntegrationError at the first micro-batch)"
    strategy = actor.get("strategy")
    fused = bool(model.get("use_fused_kernels"))
    served_engine = strategy in FSDP_STRATEGIES + ("megatron",)
    if not model.get("use_remove_padding", True) and (strategy in FSDP_STRATEGIES or strategy == "megatron" and not fused):
        return ("REFUSED: loss_rows_only: use_remove_padding=False is not served (the padded layout); set "
                "use_remove_padding=True or fused_kernel_options.rl_kernels.loss_rows_only=false")
    if not fused and served_engine:
        if not opts.patch_logits_path:
            return ("WARNING: loss_rows_only=true is not served on the logits path with patch_logits_path=False: the "
                    "LM head computes every row")
        mtp = model.get("mtp") if isinstance(model.get("mtp"), dict) else {}
        if strategy == "megatron" and mtp.get("enable") is True and mtp.get("enable_train") is True:
            return ("REFUSED: loss_rows_only: MTP training (model.mtp.enable_train=True) runs the output layer on "
                    "other rows too; set fused_kernel_options.rl_kernels.loss_rows_only=false")
    elif not fused:
        return (f"WARNING: loss_rows_only=true is not served on the logits path of engine {strategy!r} "
                f"(use_fused_kernels=False): the LM head computes every row. Fix: +rl_kernels=fused")
    if strategy not in FSDP_STRATEGIES + ("megatron",):
        return (f"WARNING: loss_rows_only=true is not served on engine {strategy!r}: the LM head computes every row "
                f"(rl-kernels' fused head serves the FSDP and Megatron engines)")
    if strategy == "megatron" and not opts.patch_megatron_fused:
        return ("WARNING: loss_rows_only=true is not served on the Megatron fused path with patch_megatron_fused=False "
                "(verl's own fused kernel computes every row)")
    note = (f"loss_rows_only (strategy={strategy}, {'fused' if fused else 'logits'} path): the LM head runs only on the "
            f"rows whose loss_mask is 1 (prompt, tool-output and padding rows: log-prob, entropy, sum_pi_squared 0, no "
            f"distillation term, no gradient; every verl loss and metric audited reads them through response_mask)")
    if entry not in PPO_ENTRIES:
        note += (f". WARNING: entry {entry} is not audited for loss_rows_only; its trainer may read log-probs outside "
                 f"loss_mask")
    return note


def ignored_distillation_note(cfg: dict, overrides) -> str | None:
    """A WARNING line when the overrides set distillation loss options (``distillation.distillation_loss.*``,
    ``loss_mode`` first) while ``distillation.enabled`` is not true: verl runs no distillation, the
    values are ignored. None otherwise."""
    if not isinstance(cfg.get("distillation"), dict) or _section(cfg, "distillation.enabled") is True:
        return None
    keys = [o.key_or_group for o in _parsed(overrides) if o.key_or_group.startswith("distillation.distillation_loss.")
            and not o.is_delete()]
    if not keys:
        return None
    keys.sort(key=lambda k: k != LOSS_MODE_KEY)
    shown = ", ".join(f"{k}={_hydra_value(_lookup(cfg, k))}" for k in dict.fromkeys(keys))
    return (f"WARNING: {shown} {'is' if len(set(keys)) == 1 else 'are'} ignored: distillation.enabled="
            f"{_hydra_value(_section(cfg, 'distillation.enabled'))}, so verl runs no distillation. Fix: "
            f"distillation.enabled=True")


FSDP_STRATEGIES = ("fsdp", "fsdp2")


def _note_options(model: dict) -> VerlOptions | None:
    """The options of the model config's ``fused_kernel_options.rl_kernels`` section, for the notes
    after the verdict; None where one is bad (the verdict names it)."""
    fused_options = model.get("fused_kernel_options") or {}
    try:
        return validated_options((fused_options.get(BACKEND_NAME) if isinstance(fused_options, dict) else None) or {})
    except (TypeError, ValueError):
        return None


def sum_pi_squared_note(cfg: dict) -> str | None:
    """What serves Σπ² (``actor_rollout_ref.actor.calculate_sum_pi_squared=True``, for verl's
    optimal-token-baseline estimators) in the run this composed config makes; a line starting with
    ``WARNING:`` where verl would refuse it or compute it with its own code although rl-kernels is
    on. None when the config does not ask for it or does not import rl-kernels (the verdict says so)."""
    model, actor = _section(cfg, "actor_rollout_ref.model"), _section(cfg, "actor_rollout_ref.actor")
    if not isinstance(model, dict) or not isinstance(actor, dict) or not actor.get("calculate_sum_pi_squared"):
        return None
    if model.get("external_lib") != EXTERNAL_LIB:
        return None
    opts = _note_options(model)
    if opts is None:
        return None  # the verdict names the bad option
    fused_options = model.get("fused_kernel_options") or {}
    strategy = actor.get("strategy")
    what = f"sum_pi_squared (actor.calculate_sum_pi_squared=True, strategy={strategy}"
    if not model.get("use_fused_kernels"):
        what += ", logits path)"
        if strategy not in FSDP_STRATEGIES + ("megatron",):
            return f"WARNING: {what}: computed by verl's own code (rl-kernels does not serve this engine)"
        if not opts.patch_logits_path:
            return f"{what}: computed by verl's own code (patch_logits_path=False)"
        return f"{what}: served by rl-kernels (sum_pi_squared_from_logits)"
    what += ", fused path)"
    refused = "verl refuses it (NotImplementedError at the first compute_log_prob)"
    if strategy in FSDP_STRATEGIES:
        impl_backend = fused_options.get("impl_backend") if isinstance(fused_options, dict) else None
        if names_rl_kernels(impl_backend):
            return f"{what}: served by rl-kernels' fused head in the same pass (verl's refusal lifted)"
        return (f"WARNING: {what}: with impl_backend={impl_backend!r} {refused}. Fix: impl_backend={BACKEND_NAME}, "
                f"or use_fused_kernels=False")
    if strategy == "megatron":
        if opts.patch_megatron_fused:
            return f"{what}: served by rl-kernels' fused head in the same pass, vocab-parallel (verl's refusal lifted)"
        return f"WARNING: {what}: with patch_megatron_fused=False {refused}. Fix: drop patch_megatron_fused=False"
    if strategy == "veomni":
        return (f"WARNING: {what}: VeOmni's fused route (its own chunk_logprobs) is not rl-kernels', so {refused}. "
                f"Fix: use_fused_kernels=False (rl-kernels serves VeOmni's logits path)")
    return (f"WARNING: {what}: rl-kernels does not serve this engine; verl's own code decides (it refuses it on "
            f"its fused paths)")


PLUGIN = "rl_kernels.integrations.verl_plugin"
"""rl-kernels' ``verl.plugins`` entry point (pyproject.toml): registers ``forward_kl_topk_tail`` in
verl's registry in every process that imports verl."""
PPO_ENTRIES = ("verl.trainer.main_ppo", "verl.trainer.main_ppo_v0")
"""verl entry points whose trainer builds the distillation config after the model config (which
imports external_lib) in every process: ``external_lib`` alone registers the tail mode in time
(:mod:`rl_kernels.integrations.verl_impl.modes` lists where, file:line)."""


def plugin_unloaded() -> str | None:
    """Why verl will not load rl-kernels' ``verl.plugins`` entry point at ``import verl`` (None: it
    will): not installed (an install before the entry point existed), verl's plugin policy
    (``VERL_USE_EXTERNAL_PLUGINS``), or a verl without plugin loading; ``VERL_USE_EXTERNAL_MODULES``
    naming the plugin counts as loaded."""
    import importlib.metadata
    import importlib.util
    import os

    if PLUGIN in [m.strip() for m in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(",")]:
        return None
    names = [ep.name for ep in importlib.metadata.entry_points(group="verl.plugins") if ep.value == PLUGIN]
    if not names:
        return "rl-kernels' verl.plugins entry point is not installed (reinstall rl-kernels)"
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if policy == "none" or (policy != "auto" and names[0] not in {n.strip() for n in policy.split(",")}):
        return f"VERL_USE_EXTERNAL_PLUGINS={policy} skips rl-kernels' verl.plugins entry point"
    spec = importlib.util.find_spec("verl")
    try:
        with open(spec.origin, encoding="utf-8") as f:
            loads = "verl.plugins" in f.read()
    except (OSError, AttributeError, TypeError):  # no verl (spec None), or no source file
        loads = False
    return None if loads else "this verl loads no verl.plugins entry points at import"


def distillation_note(cfg: dict, entry: str = ENTRY) -> str | None:
    """What serves the top-K distillation loss the composed config asks for on the logits path, and,
    for ``forward_kl_topk_tail`` (which rl-kernels adds to verl), whether verl will know the mode in
    every process that validates it and whether the run will compute it (``WARNING:`` lines: the
    patch not imported, a ``log_prob_min_clamp``, or an entry point whose trainer validates the
    config in a process that imports no ``external_lib`` while the plugin is not loaded). None when
    there is nothing to say (no top-K loss; forward_kl_topk without rl-kernels: the verdict says so)."""
    mode = _topk_distillation(cfg)
    if mode is None:
        return None
    model = _section(cfg, "actor_rollout_ref.model") or {}
    strategy = _section(cfg, "actor_rollout_ref.actor.strategy")
    fused = bool(model.get("use_fused_kernels"))
    what = f"top-K distillation (loss_mode={mode}, strategy={strategy}, {'fused' if fused else 'logits'} path)"
    tail = mode == TAIL_MODE
    if model.get("external_lib") != EXTERNAL_LIB:
        if not tail:
            return None
        return (f"WARNING: {what}: rl-kernels' patch is not imported (external_lib={model.get('external_lib')!r}): "
                f"verl's own top-K computation has no tail-aware terms, the update raises VerlIntegrationError. "
                f"Fix: actor_rollout_ref.model.external_lib={EXTERNAL_LIB}")
    clamp = _section(cfg, "distillation.distillation_loss.log_prob_min_clamp")
    if tail and clamp is not None:
        return (f"WARNING: {what}: log_prob_min_clamp={clamp} is refused (ValueError at the first micro-batch: the "
                f"mode takes no per-entry clamp, as verl PR #7855). Fix: distillation.distillation_loss."
                f"log_prob_min_clamp=null")
    why_not = plugin_unloaded() if tail else None
    if tail and why_not is not None and entry not in PPO_ENTRIES:
        return (f"WARNING: {what}: {entry} may validate the distillation config in a process that imports no "
                f"external_lib (verl's fully-async trainer does), and {why_not}: verl would refuse the mode there "
                f"('Unsupported loss mode'). Fix: VERL_USE_EXTERNAL_MODULES={PLUGIN} in the driver's environment and "
                f"in +ray_kwargs.ray_init.runtime_env.env_vars")
    opts = _note_options(model)
    if opts is None:
        return None  # the verdict names the bad option
    registered = ("; the mode is registered in verl by the external_lib import" +
                  ("" if why_not else " and by rl-kernels' verl.plugins entry point")) if tail else ""
    if fused:  # the verdict's fused line says what serves it; only the registration is left to say
        return f"{what}: see the fused line{registered}" if tail else None
    if strategy not in FSDP_STRATEGIES + ("megatron",):
        return (f"WARNING: {what}: rl-kernels does not serve this engine" +
                (", the update raises VerlIntegrationError (no tail-aware terms)" if tail else
                 ": verl's own code computes it"))
    if not opts.patch_logits_path:
        return (f"{'WARNING: ' if tail else ''}{what}: computed by verl's own code (patch_logits_path=False)" +
                ("; the update raises VerlIntegrationError (no tail-aware terms)" if tail else ""))
    return (f"{what}: served by rl-kernels (compute_forward_kl_topk replaced"
            f"{', vocab-parallel over the TP group' if strategy == 'megatron' else ''}){registered}")
