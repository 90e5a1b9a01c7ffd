"""State shared by the verl patches (the FSDP parts, :mod:`.patching` and :mod:`.megatron`).

* the undo log of every attribute the patches set (:func:`set_attr`, :func:`restore`), including
  the functions replaced wherever they were imported by name (:func:`replace_by_name`);
* the per-consumer call counters (:func:`record`, :func:`call_counts`) and the one-time
  "served N calls" INFO line;
* the step request (:class:`StepRequest`): what a verl engine step asks of the heads and what they
  delivered, in one context variable; the loss-row selection of ``loss_rows_only``;
* signature checks (the error type, :class:`VerlIntegrationError`, is defined in
  :mod:`rl_kernels.integrations.verl_impl.schema`, which patches nothing on import);
* the drop-in guard of the replaced from-logits functions (:func:`verl_fallback`): inputs outside
  rl-kernels' kernels (:func:`outside_kernels`: float64 logits, ...) go to verl's own function.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import operator
import sys

import torch

from ...core._logging import log_once, logger
from ...core.validation import FLOAT_DTYPES
from .schema import VerlIntegrationError, loss_rows_refusal


def require_verl() -> None:
    """One clear ImportError, naming verl, where verl is not installed: called at this module's
    import, which every module of the package that needs verl goes through before verl's own
    dependencies (such as ``packaging``) are imported."""
    if "verl" in sys.modules:  # imported (or stubbed) already
        return
    try:
        missing = importlib.util.find_spec("verl") is None
    except ImportError:  # a finder that refuses it
        missing = True
    if missing:
        raise ImportError("rl_kernels.integrations.verl patches verl, and verl is not installed here: "
                          "pip install '/path/to/rl-kernels[verl]'", name="verl")


require_verl()

SUMMARY_AFTER_CALLS = 8
"""After this many calls served in a process, one INFO line says how many tokens rl-kernels
served and by which path (so the training log shows that it is on)."""


def verl_version() -> str:
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        missing = True  # raised outside the handler: one clear error, no chained traceback
    else:
        missing = False
    if missing:
        raise VerlIntegrationError("rl_kernels.integrations.verl: verl is not installed "
                                   "(pip install '/path/to/rl-kernels[verl]')")


def signature(fn) -> list[str]:
    """Parameter names, ``name=default`` for those with a default (``*args`` / ``**kwargs`` left out)."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return out


def check_signature(label: str, fn, expected, package: str = "verl") -> list[str]:
    """``fn``'s parameters (:func:`signature`) when they equal ``expected`` (one list) or one of
    ``expected`` (a tuple of lists: the variants handled); else VerlIntegrationError naming
    ``label``, the accepted and the found parameters."""
    got = signature(fn)
    variants = expected if isinstance(expected, tuple) else (expected,)
    if got not in variants:
        found = verl_version() if package == "verl" else _version(package)
        accepted = " or ".join(map(str, variants))
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: {package} {found} changed {label}: expected parameters "
            f"{accepted}, found {got}. rl-kernels handles the verl functions of verl 0.7.1, 0.8.0, 0.9.1 "
            f"and verl's main branch (0.10.0.dev0; Megatron with megatron-core 0.16); pin a verl whose "
            f"{label} has those parameters, or update rl-kernels.")
    return got


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


# ----------------------------------------------------------------------------- undo log
_undo: list = []             # (owner, attribute name, original value as stored), in patch order
_by_name: dict = {}          # id(replacement) -> (replacement, original), see replace_by_name
_originals: dict = {}        # (module name, attribute) -> verl's own value, for verl_fallback
_MISSING = object()


def set_attr(owner, name, value, *, restore_imports: bool = False) -> None:
    """setattr, remembered for :func:`restore`. On a class the raw ``__dict__`` entry is kept (a
    classmethod stays a classmethod when it is put back). ``restore_imports``: ``owner`` is a
    module that others import ``name`` from; :func:`restore` also puts the original back in
    modules that imported ``value`` while it was patched."""
    if isinstance(owner, type) and name in vars(owner):
        previous = vars(owner)[name]
    else:
        previous = getattr(owner, name, _MISSING)
    _undo.append((owner, name, previous))
    setattr(owner, name, value)
    if restore_imports and previous is not _MISSING:
        _by_name[id(value)] = (value, previous)
        _originals.setdefault((getattr(owner, "__name__", None), name), previous)


def replace_by_name(source, replacements: dict) -> list[str]:
    """Replace ``source.<name>`` by ``replacements[name]`` and every binding of the same function
    object in every loaded module (``from source import name``, under any alias). Modules imported
    later take the replacement from ``source``; :func:`restore` puts the originals back there too.
    Returns the by-name places patched (``module.name``), ``source`` itself not included."""
    originals = {id(getattr(source, name)): (getattr(source, name), fn) for name, fn in replacements.items()}
    places = []
    for mod_name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict) or mod is source or mod_name.startswith("rl_kernels."):
            continue
        for bound, value in list(namespace.items()):
            hit = originals.get(id(value))
            if hit is not None and hit[0] is value:
                set_attr(mod, bound, hit[1])
                places.append(f"{mod_name}.{bound}")
    for name, fn in replacements.items():
        set_attr(source, name, fn, restore_imports=True)
    return places


def restore() -> None:
    """Undo every :func:`set_attr`, newest first; then put the originals back in modules that
    imported a :func:`replace_by_name` replacement while it was patched."""
    while _undo:
        owner, name, value = _undo.pop()
        if value is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, value)
    if not _by_name:
        _originals.clear()
        return
    for mod_name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict) or mod_name.startswith("rl_kernels."):  # where they are defined
            continue
        for bound, value in list(namespace.items()):
            hit = _by_name.get(id(value))
            if hit is not None and hit[0] is value:
                setattr(mod, bound, hit[1])
    _by_name.clear()
    _originals.clear()


# ----------------------------------------------------------------------------- counters
COUNT_KEYS = (
    "fused_fsdp_calls", "fused_fsdp_tokens", "fused_megatron_calls", "fused_megatron_tokens",
    "entropy_skipped_calls",
    "logits_log_probs_calls", "logits_entropy_calls",
    "megatron_logits_log_probs_calls", "megatron_logits_entropy_calls", "sum_pi_squared_calls",
    "fused_sum_pi_squared_calls",
    "distillation_calls", "verl_fallback_calls", "loss_rows_skipped_tokens",
)
_counts = dict.fromkeys(COUNT_KEYS, 0)
_served = {}                 # path label -> [calls, tokens], for the summary line
_summary_logged = False


def record(key: str, path: str, tokens: int) -> None:
    """Count one call served by rl-kernels: ``_counts[key] += 1``, the path's token rows, and,
    for the fused paths, ``<path>_tokens``. Logs the summary line once, at the
    :data:`SUMMARY_AFTER_CALLS`-th call of the process."""
    global _summary_logged
    _counts[key] += 1
    if key.startswith("fused_"):
        _counts[key.replace("_calls", "_tokens")] += tokens
    served = _served.setdefault(path, [0, 0])
    served[0] += 1
    served[1] += tokens
    if not _summary_logged and sum(c for c, _ in _served.values()) >= SUMMARY_AFTER_CALLS:
        _summary_logged = True
        calls = sum(c for c, _ in _served.values())
        tokens_all = sum(t for _, t in _served.values())
        logger.info("rl_kernels: served %d calls / %d tokens in this process: %s", calls, tokens_all,
                    ", ".join(f"{p} {c} calls / {t} tokens" for p, (c, t) in _served.items()))


def count(key: str, n: int = 1) -> None:
    """Count an event that is not a served call (``entropy_skipped_calls``: fused calls whose
    entropy verl did not ask for; ``fused_sum_pi_squared_calls``: fused calls that computed Σπ²
    for verl's engine step, FSDP and Megatron; ``loss_rows_skipped_tokens``: rows the fused heads
    left out under ``loss_rows_only``), ``n`` at a time."""
    _counts[key] += n


def call_counts() -> dict:
    """Calls (and fused tokens) served by rl-kernels in this process, per consumer (keys in
    :data:`COUNT_KEYS`), plus ``fused_calls`` / ``fused_tokens``: both fused paths together."""
    out = dict(_counts)
    out["fused_calls"] = out["fused_fsdp_calls"] + out["fused_megatron_calls"]
    out["fused_tokens"] = out["fused_fsdp_tokens"] + out["fused_megatron_tokens"]
    return out


# ----------------------------------------------------------------------------- the step request
@dataclasses.dataclass(frozen=True, eq=False)
class StepRequest:
    """What the verl engine step (or model forward) that runs asks of rl-kernels' heads, and what
    they delivered, in the one context variable of the integration (:data:`step_request`). The
    engine's ``forward_step`` wrapper puts a fresh request in force per micro-batch (fresh
    ``inputs`` / ``outputs`` dicts: :func:`new_step`); narrower hooks replace single fields for the
    call they wrap (:class:`StepField`). Read by the fused heads (FSDP
    :func:`~.fsdp_fused.fused_log_probs_entropy`, Megatron :func:`~.megatron.linear_cross_entropy`)
    and the layout hooks. What is asked:

    * ``entropy``: verl's ``calculate_entropy`` (False: the heads skip the entropy, which verl's
      fused forwards always ask for, verl #2608);
    * ``sum_pi_squared``: the step asks Σπ² on the fused path (which verl refuses there; lifted
      where the head delivered it, :meth:`take`);
    * ``topk``: top-K distillation on the FSDP fused path, with ``micro_batch`` (the engine's
      micro-batch: the teacher's tensors) and ``loss_function`` (the one verl's engine got, which
      carries verl's distillation config);
    * ``engine``: ``"megatron"`` while the Megatron engine's forward_step runs a fused micro-batch
      (:mod:`.megatron_step` builds that request; its hooks and head read ``inputs`` / ``outputs``
      only then);
    * ``distillation``: verl's distillation loss config of a Megatron fused top-K micro-batch (the
      teacher's tensors are among its ``inputs``);
    * ``loss_rows_only``: the option, where the step is one the FSDP fused path serves (the Megatron
      step reads the option itself): the head runs on the rows whose loss mask is 1 only
      (``inputs['loss_rows']``: a bool tensor in the fused head's labels layout, this rank's rows,
      laid out by the engine's layout hook; :func:`loss_row_index`);
    * ``serving``: a model that rl-kernels serves runs its forward (FSDP fused path);
    * ``head``: that model's :class:`~rl_kernels.integrations.lm_heads.HeadTransform`;
    * ``model``: that model (where :func:`~.fsdp_fused.full_weight` finds its lm_head's FSDP2 unit).

    And per step: ``inputs``, the per-token inputs an engine's layout hook laid out for the head
    (Megatron: ``by_token``, what its forward_step asks to lay out; ``temperature_per_sample``,
    recorded at verl's ``_resolve_fused_temperature``; once laid out, ``temperature``,
    ``teacher_log_probs`` / ``teacher_ids`` / ``teacher_rows`` and ``loss_rows`` in the head's
    labels layout: the Megatron loss-row mask of ``loss_rows_only`` is laid out inside verl's fused
    forward, so there it is ``inputs['loss_rows']``, not the ``loss_rows`` field);
    ``outputs``, what the head delivered beside verl's log-probs (:meth:`deliver`) and what the
    engine's output hook laid out of them (Megatron: ``laid_out``)."""

    entropy: bool = True
    sum_pi_squared: bool = False
    topk: bool = False
    micro_batch: object = None
    loss_function: object = None
    engine: str | None = None
    distillation: object = None
    loss_rows_only: bool = False
    serving: bool = False
    head: object = None
    model: object = None
    inputs: dict = dataclasses.field(default_factory=dict)
    outputs: dict = dataclasses.field(default_factory=dict)

    def deliver(self, log_probs: torch.Tensor, **outputs) -> None:
        """Called by a fused head: the log-probs it hands verl and its other per-row outputs (Σπ²,
        distillation terms), each shaped like its labels. Counted: a second call in the step
        makes :meth:`take` refuse."""
        self.outputs.update(outputs, log_probs=log_probs, calls=self.outputs.get("calls", 0) + 1)

    def belongs_to(self, log_probs) -> bool:
        """Whether ``log_probs`` (as the engine holds them: the head's tensor, or a view of it) are
        the delivered ones: same storage, offset and number of elements, delivered once."""
        mine = self.outputs.get("log_probs")
        return (self.outputs.get("calls") == 1 and isinstance(log_probs, torch.Tensor) and mine is not None
                and log_probs.numel() == mine.numel() and log_probs.data_ptr() == mine.data_ptr()
                and log_probs.device == mine.device)

    def take(self, log_probs: torch.Tensor, key: str) -> torch.Tensor:
        """The output ``key`` delivered with ``log_probs``, shaped like them. VerlIntegrationError
        when the fused head ran other than once in the step or ``log_probs`` are not its output
        (never an output of other tokens)."""
        if not self.belongs_to(log_probs) or key not in self.outputs:
            raise VerlIntegrationError(
                f"rl_kernels.integrations.verl: {key} on the fused path: the fused head ran "
                f"{self.outputs.get('calls', 0)} time(s) in this forward step, or the model output's log_probs are "
                f"not the head's; rl-kernels cannot tell which {key} belongs to them")
        return self.outputs[key].view(log_probs.shape)


def new_step(**fields) -> contextvars.Token:
    """Put in force, for one engine micro-batch, the request in force with ``fields`` changed and
    fresh ``inputs`` / ``outputs``; returns the token for ``step_request.reset``."""
    return step_request.set(dataclasses.replace(step_request.get(), inputs={}, outputs={}, **fields))


step_request = contextvars.ContextVar("rl_kernels_step_request", default=StepRequest())
"""The :class:`StepRequest` in force (the integration's only context variable)."""


class StepField:
    """One field of the :data:`step_request`, with a context variable's ``get`` / ``set`` /
    ``reset``: ``set`` puts a copy of the request with that field changed in force, and ``reset``
    puts back the request that was in force before it (the hooks set and reset in nested
    try / finally blocks, so the fields the inner hooks set are undone with them)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        if name not in {f.name for f in dataclasses.fields(StepRequest)}:
            raise AttributeError(f"StepRequest has no field {name!r}")
        self.name = name

    def get(self):
        return getattr(step_request.get(), self.name)

    def set(self, value) -> contextvars.Token:
        return step_request.set(dataclasses.replace(step_request.get(), **{self.name: value}))

    @staticmethod
    def reset(token: contextvars.Token) -> None:
        step_request.reset(token)


entropy_wanted = StepField("entropy")
"""False while verl runs a forward with ``calculate_entropy=False`` (set by
:func:`entropy_on_request`): the fused heads (FSDP and Megatron) then skip the entropy, which
verl's fused forwards always ask for (verl #2608)."""


def log_head_precision(dtype: torch.dtype, engine: str) -> None:
    """Say once per engine and dtype in which precision rl-kernels' fused head runs (issue 54):
    float32 inputs stay float32 (no cast to bf16), the kernels' products on the tensor cores as three
    TF32 products with fp32 accumulation, the backward's two matmuls as the GPU class sets them
    (Hopper: three TF32 products from operands split once; other classes: SGEMM), SGEMM-class
    accuracy either way; 16-bit inputs, fp32 accumulation."""
    if dtype == torch.float32:
        what = ("float32: nothing cast to bf16; the kernels' products (forward, logits recompute) on the tensor "
                "cores as three TF32 products (tf32x3), the backward's two matmuls too on Hopper (from operands "
                "split once; SGEMM on other GPUs); errors at or below cuBLAS SGEMM's")
    else:
        what = f"{str(dtype).removeprefix('torch.')} inputs, fp32 accumulation and softmax"
    log_once(logging.INFO, f"rl_kernels: the {engine} fused head runs in {what}")


def with_step(method, put):
    """Wrap a verl function: while it runs, the step request that ``put(bound_arguments)`` puts in
    force is in force (``put`` returns the token of ``step_request.set``; the arguments by name, as
    ``inspect.signature(method).bind`` gives them); the one before is put back after it, also when
    it raises. ``_rl_kernels_original`` keeps ``method`` for the undo."""
    sig = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        token = put(sig.bind(*args, **kwargs).arguments)
        try:
            return method(*args, **kwargs)
        finally:
            step_request.reset(token)

    wrapper._rl_kernels_original = method
    return wrapper


def entropy_on_request(method, read_flag):
    """Wrap a verl function that runs one forward and knows ``calculate_entropy`` (the FSDP
    engine's ``forward_step``, verl 0.7.x's ``DataParallelPPOActor._forward_micro_batch``, the
    Megatron engine's fused forward): while it runs, the fused head computes entropy only when
    ``read_flag(bound_arguments)`` is true."""
    return with_step(method, lambda arguments: entropy_wanted.set(bool(read_flag(arguments))))


def entropy_placeholder(log_probs: torch.Tensor) -> torch.Tensor:
    """The entropy handed back to verl for a forward whose entropy it did not ask for (verl drops
    it): NaN like ``log_probs``, should anything read it anyway. Counted as
    ``entropy_skipped_calls``."""
    count("entropy_skipped_calls")
    return torch.full_like(log_probs, float("nan"))


def micro_batch_with(micro_batch, **values):
    """A shallow copy of the FSDP engine's micro-batch (a TensorDict) with these non-tensor entries
    set (``verl.utils.tensordict_utils.assign_non_tensor``); verl's micro-batch is left as it is."""
    from verl.utils import tensordict_utils as tu

    copy = micro_batch.copy()
    tu.assign_non_tensor(copy, **values)
    return copy


# ----------------------------------------------------------------------------- loss rows only
def refuse_loss_rows(why: str, fix: str) -> None:
    """VerlIntegrationError for a micro-batch ``loss_rows_only`` does not serve: ``why``, and ``fix``."""
    raise VerlIntegrationError(f"rl_kernels.integrations.verl: loss_rows_only: {why}; {fix}")


def check_loss_rows_audit(loss_function) -> None:
    """VerlIntegrationError where the losses verl's engine got (``loss_function``: the partial verl's
    worker binds, ``config=<ActorConfig>`` and, with distillation, ``distillation_config=``) are
    outside the audit of ``loss_rows_only`` (:func:`~rl_kernels.integrations.verl_impl.schema.loss_rows_refusal`).
    A loss function without verl's configs (a forward-only step: None) passes."""
    keywords = getattr(loss_function, "keywords", None) or {}
    actor, distillation = keywords.get("config"), keywords.get("distillation_config")
    loss = getattr(distillation, "distillation_loss", None)
    why = loss_rows_refusal(
        policy_loss_mode=getattr(getattr(actor, "policy_loss", None), "loss_mode", None),
        use_prefix_grouper=bool(getattr(actor, "use_prefix_grouper", False)),
        distillation_enabled=distillation is not None and loss is not None,
        distillation_loss_mode=getattr(loss, "loss_mode", None),
        use_policy_gradient=bool(getattr(loss, "use_policy_gradient", False)),
        distillation_policy_loss_mode=getattr(loss, "policy_loss_mode", None))
    if why is not None:
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: {why}")


def loss_mask_by_token(micro_batch) -> torch.Tensor:
    """The micro-batch's ``loss_mask`` laid out as its ``input_ids`` (a nested int64 tensor with
    their offsets: 0 on each prompt token, the response's loss mask on its tokens), from the two RL
    layouts verl's trainers give the engine: a nested ``(bsz, j_response)`` mask (v1 trainer,
    prompt length = sequence length - response length) or a dense right-padded ``(bsz, R)`` one
    (legacy trainer; prompt lengths from ``prompts`` and ``attention_mask`` as verl's
    ``no_padding_2_padding`` reads them). VerlIntegrationError for what the audit of docs/verl.md
    does not cover: no ``loss_mask``, a mask in the ``input_ids`` layout (SFT), a client that reads
    the raw model output (``return_model_output``), a ``response_mask`` with a 1 where ``loss_mask``
    has 0."""
    from verl.utils import tensordict_utils as tu

    off = "set fused_kernel_options.rl_kernels.loss_rows_only=false"
    keys = micro_batch.keys()
    if tu.get_non_tensor_data(data=micro_batch, key="return_model_output", default=False):
        refuse_loss_rows("this micro-batch asks for return_model_output (verl's Tinker split-training worker): its "
                          "client may read log-probs outside loss_mask", off)
    if "loss_mask" not in keys:
        refuse_loss_rows("the micro-batch has no loss_mask: rl-kernels cannot tell which rows the loss reads", off)
    input_ids, loss_mask = micro_batch["input_ids"], micro_batch["loss_mask"]
    if not input_ids.is_nested:
        refuse_loss_rows("input_ids are not nested (verl's no-padding layout)", off)
    offsets = input_ids.offsets()
    seq_lens = offsets.diff()
    if loss_mask.is_nested:
        if loss_mask.offsets().shape == offsets.shape and torch.equal(loss_mask.offsets().cpu(), offsets.cpu()):
            refuse_loss_rows("loss_mask has the input_ids layout (SFT), not the response layout", off)
        response_lens = loss_mask.offsets().diff().to(seq_lens.device)
        values = loss_mask.values()
    else:
        if loss_mask.dim() != 2 or loss_mask.shape[0] != seq_lens.numel() or "prompts" not in keys \
                or "attention_mask" not in keys:
            refuse_loss_rows(f"a dense loss_mask {tuple(loss_mask.shape)} without verl's prompts / attention_mask "
                              "beside it (the response layout is not known)", off)
        prompts = micro_batch["prompts"]
        attention_mask = micro_batch["attention_mask"]
        response_lens = attention_mask[:, prompts.shape[1]:].sum(dim=1).to(seq_lens.device)
        if bool((response_lens > loss_mask.shape[1]).any()):
            refuse_loss_rows("a response longer than the dense loss_mask", off)
        values = loss_mask[torch.arange(loss_mask.shape[1], device=loss_mask.device)[None, :]
                           < response_lens.to(loss_mask.device)[:, None]]
    prompt_lens = seq_lens - response_lens
    if bool((prompt_lens < 1).any()):
        refuse_loss_rows("a sequence whose response is not preceded by a prompt token", off)
    if "response_mask" in keys and micro_batch["response_mask"] is not loss_mask:
        response_mask = micro_batch["response_mask"]
        outside = (response_mask.values() if response_mask.is_nested else response_mask).bool()
        inside = (loss_mask.values() if loss_mask.is_nested else loss_mask).bool()
        if outside.shape == inside.shape and bool((outside & ~inside).any()):
            refuse_loss_rows("response_mask selects rows outside loss_mask; a consumer would read rows the head "
                              "skipped", off)
    starts = (offsets[:-1].to(seq_lens.device) + prompt_lens)
    within = torch.arange(int(response_lens.sum()), device=seq_lens.device) - torch.repeat_interleave(
        response_lens.cumsum(0) - response_lens, response_lens)
    by_token = torch.zeros(int(offsets[-1]), dtype=torch.int64, device=input_ids.device)
    by_token[(torch.repeat_interleave(starts, response_lens) + within).to(by_token.device)] = \
        values.to(by_token.device).long().ne(0).long()
    return torch.nested.nested_tensor_from_jagged(by_token, offsets)


def loss_row_index(loss_rows: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The flat int64 index (into ``labels.reshape(-1)``) of the rows the loss reads, from the step
    request's ``loss_rows`` (a bool tensor with one entry per label row, laid out as the labels by
    the engine hook). One host sync (``nonzero``). VerlIntegrationError when it has another number
    of rows than ``labels`` (never a selection of other rows)."""
    if loss_rows.numel() != labels.numel():
        raise VerlIntegrationError(
            f"rl_kernels.integrations.verl: loss_rows_only: the loss-row mask has {loss_rows.numel()} rows, the "
            f"fused head's labels {tuple(labels.shape)}; the mask was laid out for another forward. Set "
            f"fused_kernel_options.rl_kernels.loss_rows_only=false for this run")
    return loss_rows.reshape(-1).to(labels.device, non_blocking=True).nonzero().squeeze(1)


def select_rows(tensor, index: torch.Tensor, rows: int):
    """``tensor``'s rows at ``index`` when it has ``rows`` rows in its leading dimensions (a
    per-row tensor shaped like the labels, with trailing dimensions: ``(*labels.shape, K)``);
    anything else (a number, a one-element temperature) as it is."""
    if not isinstance(tensor, torch.Tensor) or rows == 0 or tensor.dim() == 0 or tensor.numel() % rows:
        return tensor
    trailing = tensor.numel() // rows
    flat = tensor.reshape(rows, trailing) if trailing > 1 else tensor.reshape(rows)
    return flat.index_select(0, index.to(flat.device))


def scatter_rows(values: torch.Tensor, index: torch.Tensor, shape) -> torch.Tensor:
    """``values`` (one per selected row, with trailing dimensions) back at ``index`` of a zero
    tensor shaped ``(*shape, *trailing)``: differentiable in ``values`` (the rows outside get
    no gradient)."""
    rows = 1
    for size in shape:
        rows *= size
    trailing = tuple(values.shape[1:])
    out = values.new_zeros((rows, *trailing)).index_copy(0, index.to(values.device), values)
    return out.reshape(*shape, *trailing)


# ----------------------------------------------------------------------------- drop-in guard
def outside_kernels(tensor, name: str = "logits") -> str | None:
    """Why ``tensor`` (the logits, or the hidden states, that a replaced verl function reads; named
    ``name`` in the reason) lies outside rl-kernels' kernels, or None when they compute it: a
    floating dtype other than bfloat16 / float16 / float32 (verl's functions take float64 too), a
    meta tensor (verl's compute its shape) or a nested / non-strided layout. Anything else, a
    non-tensor or integer tensor included, is rl-kernels' here (which raises TypeError / ValueError
    naming the argument). This is the guard of the fused paths' hidden states and of the
    distillation loss; the replaced from-logits functions add the inputs on which verl's own
    function returns a value that rl-kernels' refuses or shapes otherwise (:func:`outside_from_logits`:
    integer / bool logits, for which verl's return float32, 0-d, empty)."""
    if not isinstance(tensor, torch.Tensor):
        return None
    if tensor.is_nested or tensor.layout != torch.strided:
        return f"{'nested' if tensor.is_nested else tensor.layout} {name}"
    if tensor.device.type == "meta":
        return f"meta-device {name}"
    if tensor.is_floating_point() and tensor.dtype not in FLOAT_DTYPES:
        return f"{tensor.dtype} {name}"
    return None


def outside_from_logits(logits, name: str = "logits") -> str | None:
    """:func:`outside_kernels` for the replaced from-logits functions (:func:`verl_fallback`), plus
    the logits on which verl's own function returns a value (or raises its own error) where
    rl-kernels' would raise or give another shape: a non-floating dtype (integer or bool logits:
    verl's promote them, to float32), a 0-d tensor, and an empty one (no rows, or vocab_size 0).
    Found by the differential probe (tests/integrations/test_verl_dropin_probe.py), which calls both on the same
    inputs; rl-kernels keeps the rest (bfloat16 / float16 / float32 logits with rows)."""
    why = outside_kernels(logits, name)
    if why is not None or not isinstance(logits, torch.Tensor):
        return why
    if not (logits.is_floating_point()):
        return f"{logits.dtype} {name}"
    if logits.dim() == 0:
        return f"0-d {name}"
    if logits.numel() == 0:
        return f"empty {name} (shape {tuple(logits.shape)})"
    return None


LABEL_DTYPES = (torch.int64, torch.int32)


def outside_labels(labels, logits, vocab_size: int, name: str = "labels") -> str | None:
    """Why the ``labels`` of a replaced from-logits function (with ``logits`` inside the kernels:
    :func:`outside_from_logits`) go to verl's own function, or None: a tensor whose dtype is not
    int64 / int32, whose shape is not ``logits.shape[:-1]`` (verl's broadcast or raise theirs), on
    the meta device, or with a value outside [0, ``vocab_size``) (the whole vocabulary: the
    vocab-parallel functions' shards together). verl's own function decides what such a label
    means (its flash-attn cross-entropy gives 0 for -100, its torch path raises, Megatron's
    vocab-parallel cross-entropy gives -logsumexp for a label in no shard). The value check reads
    the labels once on the host (one sync). A non-tensor stays rl-kernels' (its TypeError)."""
    if not isinstance(labels, torch.Tensor):
        return None
    if labels.dtype not in LABEL_DTYPES:
        return f"{labels.dtype} {name}"
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        return f"{name} of shape {tuple(labels.shape)} against logits {tuple(logits.shape)}"
    if labels.device.type == "meta" or labels.is_nested or labels.layout != torch.strided:
        return f"meta / nested {name}"
    if labels.numel() and bool(((labels < 0) | (labels >= vocab_size)).any()):
        return f"{name} outside [0, {vocab_size}) (an ignore_index, or a label in no vocabulary shard)"
    return None


def left_to_verl(label: str, why: str | None) -> bool:
    """Whether a call goes to verl's own ``label`` because of ``why`` (:func:`outside_kernels`'
    reason, None: it does not): the first such call per function and reason logs a WARNING, each is
    counted as ``verl_fallback_calls``."""
    if why is None:
        return False
    short = label.rsplit(".", 1)[-1]
    log_once(logging.WARNING, lambda: f"rl_kernels: {label} got {why}, outside rl-kernels' kernels: verl's own "
             f"{short} computes it (this and every such call)", key=("verl_fallback", label, why))
    count("verl_fallback_calls")
    return True


def check_chunk_size(chunk_size) -> None:
    """The ``chunk_size`` of verl's ``*_with_chunking`` entropy functions, which rl-kernels only
    validates (it always chunks, by elements): any integer verl's ``range`` step takes (a Python or
    NumPy int, ...) above 0; TypeError for a non-integer (as verl's ``range`` raises), ValueError
    for 0 or less (verl's raises for 0 and returns zeros for a negative one)."""
    try:
        value = operator.index(chunk_size)
    except TypeError:
        raise TypeError(f"chunk_size: expected a positive int, got {chunk_size!r}") from None
    if value <= 0:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")


def verl_original(module: str, name: str):
    """verl's own ``module.name``: the value the patch replaced (kept by :func:`set_attr`), or,
    while unpatched, the module's attribute."""
    original = _originals.get((module, name))
    if original is None:
        original = getattr(importlib.import_module(module), name)
    if getattr(original, "_rl_kernels_fallback", None) is not None:  # ours, without verl's behind it
        raise VerlIntegrationError(f"rl_kernels.integrations.verl: verl's own {module}.{name} is not known "
                                   f"(its attribute is rl-kernels' replacement and no original was kept)")
    return original


def verl_fallback(module: str, name: str, domain=None):
    """Decorator of rl-kernels' replacement of verl's ``module.name`` (the drop-in contract): a
    call whose first argument (the logits) is :func:`outside_from_logits`, or for which
    ``domain(arguments)`` (the call's arguments by name, defaults applied; run only on logits
    inside the kernels) gives a reason, runs verl's own function (:func:`verl_original`) with the
    same arguments, so it returns what verl's returns and raises what verl's raises (logged once
    and counted: :func:`left_to_verl`). Other calls run the replacement. The result runs eagerly
    (``torch.compiler.disable``) and keeps the replacement's name, docstring and signature."""

    def decorate(replacement):
        signature = inspect.signature(replacement)
        first = next(iter(signature.parameters))

        def why_outside(args, kwargs):
            why = outside_from_logits(args[0] if args else kwargs.get(first))
            if why is not None or domain is None:
                return why
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return None  # the replacement raises Python's error for these arguments
            bound.apply_defaults()
            return domain(bound.arguments)

        @functools.wraps(replacement)
        def guarded(*args, **kwargs):
            if not left_to_verl(f"{module}.{name}", why_outside(args, kwargs)):
                return replacement(*args, **kwargs)
            return verl_original(module, name)(*args, **kwargs)

        guarded._rl_kernels_fallback = (module, name)
        return torch.compiler.disable(guarded)

    return decorate


# The storage of the logits that rl-kernels' top-K distillation saved for its backward (the last
# logits-path top-K call: verl's FSDP engine computes the top-K terms on its logits, then the
# log-probs with inplace_backward=True, whose backward runs first and would overwrite them; the
# top-K backward would then raise autograd's "modified by an inplace operation"). The log-probs
# replacement writes its gradient elsewhere for those logits (:func:`saved_for_backward`).
_SAVED_LOGITS_STORAGE: list[int] = []


def save_logits_for_backward(logits: torch.Tensor) -> None:
    """Record that ``logits``' storage is saved for a backward (replacing the previous record)."""
    _SAVED_LOGITS_STORAGE[:] = [logits.untyped_storage().data_ptr()]


def saved_for_backward(logits: torch.Tensor) -> bool:
    """Whether ``logits`` share the storage recorded by :func:`save_logits_for_backward` (a stale
    record that matches a later allocation only costs that call its in-place gradient)."""
    return logits.untyped_storage().data_ptr() in _SAVED_LOGITS_STORAGE
