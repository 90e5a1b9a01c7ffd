"""The public API's shape: one convention per concept, as rl_kernels/__init__.py states it."""
import inspect
import pathlib
import re

import pytest
import torch

import rl_kernels
from heads import HEADS

# every public function is a head of the registry (tests/support/heads.py); one that is not would be
# listed here beside them: linear_topk (no gradient, an int output: tests/api/test_linear_topk.py holds
# its compile, non-finite and GPU tests)
FUNCTIONS = [*HEADS, "linear_topk"]
# the keyword-only order every function follows (a function takes a subsequence of it)
KEYWORD_ORDER = ["temperature", "softcap", "labels", "ignore_index", "mask", "k",
                 "return_entropy", "return_sum_pi_squared", "return_tail", "kind", "renormalize_teacher", "tail",
                 "beta",
                 "label_smoothing", "inplace_backward",
                 "reduction", "backend", "process_group", "vocab_start_index", "reduce_hidden_grad"]
# the positional (tensor) order: the student's tensors (what the gradient reaches) first, then
# which tokens (labels, ids), then the teacher's values
POSITIONAL_ORDER = ["hidden_states", "weight", "student_hidden", "student_weight", "teacher_hidden",
                    "teacher_weight", "logits", "labels", "token_ids", "teacher_token_ids", "teacher_log_probs"]
# from-logits twins of fused-head functions: the same keywords, less reduce_hidden_grad (the
# head's: a logits shard's gradient is its own) and, until the fused head has it too, ``tail``
# (issue 45: the tail-aware top-K KL lands on both, in either order)
TWINS = {"topk_kl_from_logits": "linear_topk_kl"}
DEFAULTS = {"temperature": 1.0, "softcap": None, "ignore_index": -100, "labels": None, "mask": None, "reduction": "mean",
            "backend": "auto", "process_group": None, "vocab_start_index": None, "reduce_hidden_grad": False,
            "return_entropy": True, "return_sum_pi_squared": False, "inplace_backward": False, "tail": False,
            "return_tail": False}


def test_every_public_function_is_exported_and_summarized_with_its_real_signature():
    """__all__ holds exactly the public functions (and their output records); the docstring's
    summary (generated at import) has one line per function naming every parameter, keyword-only
    ones after the ``*``, with their defaults."""
    assert sorted(FUNCTIONS) == sorted(n for n in rl_kernels.__all__ if n[0].islower() and n != "__version__")
    lines = {line.strip().split("(", 1)[0]: line.strip() for line in rl_kernels.__doc__.splitlines() if "(" in line}
    for name in FUNCTIONS:
        line = lines[name]
        star = line.index("*") if "*" in line else len(line)
        for p in inspect.signature(getattr(rl_kernels, name)).parameters.values():
            text = p.name if p.default is p.empty else f"{p.name}={p.default!r}"
            found = re.search(rf"[(, ]{re.escape(text)}[,)]", line)  # (a bare name: "k", not the k of "topk")
            assert found, (name, text, line)
            assert (found.start() > star) == (p.kind == p.KEYWORD_ONLY), (name, p.name)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_one_argument_order_and_one_default_per_concept(name):
    params = inspect.signature(getattr(rl_kernels, name)).parameters.values()
    keyword = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    assert [k for k in KEYWORD_ORDER if k in keyword] == keyword, f"{name}: {keyword}"
    assert set(keyword) <= set(KEYWORD_ORDER), set(keyword) - set(KEYWORD_ORDER)
    for p in params:
        if p.name in DEFAULTS and p.default is not p.empty:
            assert p.default == DEFAULTS[p.name], (name, p.name, p.default)
    # every tensor argument is positional; nothing positional after the tensors
    assert all(p.kind != p.VAR_POSITIONAL and p.kind != p.VAR_KEYWORD for p in params)
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [a for a in POSITIONAL_ORDER if a in positional] == positional, f"{name}: {positional}"
    if name in TWINS:
        twin = inspect.signature(getattr(rl_kernels, TWINS[name])).parameters.values()
        twin_keyword = [p.name for p in twin if p.kind == p.KEYWORD_ONLY and p.name != "reduce_hidden_grad"]
        if "tail" not in twin_keyword:
            keyword = [k for k in keyword if k != "tail"]
        assert keyword == twin_keyword, name


@pytest.mark.parametrize("name", FUNCTIONS)
def test_a_positional_keyword_argument_names_the_function_and_spells_the_keyword(name):
    """Tensors are positional, every other argument keyword-only: a call that passes the
    temperature (or any argument after the tensors) by position gets a TypeError naming the
    function, saying that those arguments are keyword-only and spelling the call with keywords,
    instead of Python's bare "takes 3 positional arguments but 4 were given" (issue 35). The
    catch-all that finds them is hidden from inspect.signature (the tests above). A function with a
    required keyword-only argument (``linear_topk``'s ``k``) reads the first extras as those (issue
    52: ``linear_topk(h, W, 5)`` suggested ``temperature=5``)."""
    fn = getattr(rl_kernels, name)
    params = inspect.signature(fn).parameters.values()
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    keyword = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    required = [p.name for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    meant = required + [k for k in keyword if k not in required]
    tensors = [torch.zeros(2, 5)] * len(positional)
    for extra in ((0.7,), (0.7, -100)):
        with pytest.raises(TypeError) as info:
            fn(*tensors, *extra)
        message = str(info.value)
        assert message.startswith(f"{name}() takes {len(positional)} positional argument"), message
        assert f"({', '.join(positional)}) but {len(positional) + len(extra)} were given" in message, message
        if required:
            said = f"{' and '.join(required)} {'is' if len(required) == 1 else 'are'} required and keyword-only, " \
                   f"as is every other argument after the tensors ({', '.join(keyword)})"
        else:
            said = ("temperature and every other argument" if "temperature" in keyword else "every argument") \
                + f" after the tensors is keyword-only ({', '.join(keyword)})"
        assert said in message, message
        spelled = ", ".join(f"{k}={v!r}" for k, v in zip(meant, extra))
        assert f"write {name}({', '.join(positional)}, {spelled})" in message, message
        if "temperature" in keyword and not required:
            assert keyword[0] == "temperature" and "temperature=0.7" in message
    with pytest.raises(TypeError, match="more arguments than it takes"):
        fn(*tensors, *range(len(keyword) + 1))


def test_a_positional_temperature_under_torch_compile_keeps_the_message():
    """The catch-all is an empty tuple on a normal call (no graph break: tests/autograd/test_compile.py);
    a positional temperature in compiled code raises with the same message (fullgraph: inside
    torch's "Observed exception" RuntimeError)."""
    def f(logits):
        return rl_kernels.logsumexp(logits, 0.7, backend="torch")

    torch._dynamo.reset()
    for fullgraph in (False, True):
        with pytest.raises((TypeError, RuntimeError)) as info:
            torch.compile(f, backend="eager", fullgraph=fullgraph)(torch.randn(3, 5))
        assert "write logsumexp(logits, temperature=0.7)" in str(info.value), str(info.value)[:300]


MAX_DOC_LINES = 40  # a public docstring is a contract (issue 46): the reasoning lives in docs/design.md
# every parameter name of the public functions: a docstring that names one its function does not take
# documents an argument (or an error of an argument) that is not there
ALL_PARAMETERS = {p for name in FUNCTIONS for p in inspect.signature(getattr(rl_kernels, name)).parameters}
# those that the Raises section may not even name in plain words ("k", "kind", "tail", "logits", "weight" and
# "backend" are also ordinary words there); "label" counts as "labels"
PLAIN_NAMES = {p for p in ALL_PARAMETERS if "_" in p} | {"temperature", "softcap", "labels", "mask", "beta",
                                                          "reduction"}


def _sections(doc: str) -> dict:
    """{"Args": [...], "Returns": [...], "Raises": [...]}: the body lines of each Google-style section
    of the cleaned docstring (indented lines after the header, up to the next unindented line)."""
    sections, current = {}, None
    for line in inspect.cleandoc(doc).splitlines():
        header = re.fullmatch(r"(Args|Returns|Raises):", line)
        if header:
            current = sections.setdefault(header.group(1), [])
        elif line and not line[0].isspace():
            current = None
        elif current is not None:
            current.append(line)
    return sections


@pytest.mark.parametrize("name", FUNCTIONS)
def test_docstrings_are_contracts_with_args_returns_raises(name):
    """At most MAX_DOC_LINES lines, with an Args section holding exactly one entry per parameter (in
    the signature's order), a Returns section and a Raises section naming exception types."""
    fn = getattr(rl_kernels, name)
    lines = inspect.cleandoc(fn.__doc__).splitlines()
    assert len(lines) <= MAX_DOC_LINES, f"{name}: {len(lines)} docstring lines > {MAX_DOC_LINES}"
    sections = _sections(fn.__doc__)
    assert set(sections) == {"Args", "Returns", "Raises"}, (name, set(sections))
    entries = [m.group(1) for line in sections["Args"] if (m := re.match(r"    (\w+): ", line))]
    assert entries == list(inspect.signature(fn).parameters), (name, entries)
    raised = re.findall(r"^    (\w+Error):", "\n".join(sections["Raises"]), re.M)
    assert raised and {"TypeError", "ValueError"} <= set(raised), (name, raised)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_docstrings_name_no_argument_the_function_does_not_take(name):
    """A ``name`` in the docstring that is a public function's parameter is one of this function's; the
    Raises section does not even name another function's parameter in plain words (issue 46: the
    errors of ``labels`` in sum_pi_squared_from_logits' docstring, of a temperature in cross_entropy's)."""
    fn = getattr(rl_kernels, name)
    own = set(inspect.signature(fn).parameters)
    quoted = set(re.findall(r"``(\w+)``", fn.__doc__)) & ALL_PARAMETERS
    assert quoted <= own, f"{name}'s docstring names {sorted(quoted - own)}, which it does not take"
    raises = " ".join(_sections(fn.__doc__)["Raises"])
    words = {"labels" if w == "label" else w for w in re.findall(r"\w+", raises)} & PLAIN_NAMES
    assert words <= own, f"{name}'s Raises names {sorted(words - own)}, which it does not take"


@pytest.mark.parametrize("module", ["linear", "logits", "distill"])
def test_module_docstrings_are_short(module):
    doc = getattr(rl_kernels, f"_{module}").__doc__
    assert len(inspect.cleandoc(doc).splitlines()) <= MAX_DOC_LINES, module


def test_one_internal_name_per_concept():
    """The package source uses the public names for what it passes around (no want_entropy /
    compute_entropy / inv_t / want_sum_sq twins of return_entropy / inv_temperature ...)."""
    root = pathlib.Path(rl_kernels.__file__).parent
    banned = re.compile(r"\b(want_entropy|compute_entropy|inv_t|want_sum_sq|compute_sum_sq|want_smoothing)\b")
    hits = [f"{path.relative_to(root)}:{i}" for path in root.rglob("*.py")
            for i, line in enumerate(path.read_text().splitlines(), 1) if banned.search(line)]
    assert not hits, hits
