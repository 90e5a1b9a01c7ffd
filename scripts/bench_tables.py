"""Regenerate the measured tables of BENCHMARKS.md, README.md and benchmarks/results/README.md, and the plots
beside them, from the result files committed in benchmarks/results/ (no GPU, torch or Triton needed; the
tables need the stdlib only, drawing the plots needs matplotlib: the ``bench`` extra).

    python scripts/bench_tables.py --check   # exit 1 and print a diff if a table or plot differs from its files
    python scripts/bench_tables.py --write   # rewrite every table and draw every plot from its files

A table sits between two marker lines, ``<!-- table: NAME -->`` and ``<!-- /table -->``; everything between
them is generated (a source line: device, date, the command that reproduces it and the result files,
then the table, then the image line of its plot if it has one). Text outside the markers is written by hand
and left alone. Every number in a generated cell or plot is read from a result file, or computed from
numbers read there (ratios, percentages). A new result: commit the file under benchmarks/results/, point
the table's entry in TABLES at it, run ``--write``; the index in benchmarks/results/README.md follows.

Plots are SVG files in benchmarks/results/ beside the result files they are drawn from (never in docs/).
SVG, not PNG: text that diffs and stays sharp at any zoom, and no rasterization (anti-aliasing, FreeType's
hinting), which is what changes a PNG's bytes most often between releases; glyphs are written as paths, so
the file looks the same in every browser without the font. A plot is computed in two steps: its spec (every
number, label and title it shows, from the result files, stdlib only) and the drawing of that spec
(:func:`draw`, styling only). The drawing is deterministic for one matplotlib: no date in the file, ids from
a fixed ``svg.hashsalt``, matplotlib's own defaults (no matplotlibrc of the machine), the DejaVu Sans that
matplotlib ships. The SVG records the spec (as JSON, ``<dc:description>``) and the renderer that drew it
(``matplotlib X, FreeType Y``, ``<dc:creator>``: the one version string in the file, kept on purpose).

The check of a plot, so that it is byte for byte and yet does not fail because CI installed a newer
matplotlib (the ``bench`` extra sets only a lower bound) that draws a byte differently:

* the spec recorded in the file must equal the spec computed from the result files, always (with or
  without matplotlib): a changed result, label or title fails with a diff of the spec;
* where this interpreter's renderer is the one recorded in the file, the file must equal a fresh drawing
  byte for byte (a change of the drawing code, or a nondeterministic drawing, fails);
* under another renderer (or without matplotlib) the bytes are not compared, and the closing line says so
  (``N by their data only``); ``--write`` draws them again with the renderer at hand.
"""
import argparse
import ast
import difflib
import io
import json
import os
import re
import sys
import textwrap
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "benchmarks/results"
DOCUMENTS = ("BENCHMARKS.md", "README.md", f"{RESULTS}/README.md")
MARKER = re.compile(r"^<!-- table: ([a-z0-9_]+) -->\n(.*?)^<!-- /table -->$", re.M | re.S)


class ResultError(Exception):
    """A result file is missing or does not hold what a table reads from it."""


# ----------------------------------------------------------------------------- number formats
def fixed(value, digits=2):
    return f"{value:.{digits}f}"


def sci(value):
    """One decimal in scientific notation without the exponent's padding: 6.4e-6."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def sig3(value):
    """Three significant digits, trailing zeros kept: 0.690, 5.78, 34.3."""
    return f"{value:#.3g}".rstrip(".")


def thousands(value):
    return f"{sig3(value / 1000)}k"


def tokens(value):
    return f"{value:,}"


def pct(fraction):
    return f"{round(100 * fraction)}%"


def bold(text, on=True):
    return f"**{text}**" if on else text


def wrap(text):
    """A paragraph in lines of at most 120 characters (a link or a word longer than that stays whole)."""
    return textwrap.fill(text, 120, break_long_words=False, break_on_hyphens=False) + "\n"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def shape_text(shape):
    return " × ".join(str(n) for n in shape)


# ----------------------------------------------------------------------------- result files
class Results:
    """The result files, each read once."""

    def __init__(self, root: Path):
        self.root = root
        self.cache = {}

    def path(self, name):
        return self.root / RESULTS / name

    def json(self, name):
        if name not in self.cache:
            path = self.path(name)
            if not path.is_file():
                raise ResultError(f"{RESULTS}/{name}: missing (a table reads it)")
            self.cache[name] = json.loads(path.read_text())
        return self.cache[name]

    def meta(self, name):
        """device and date of a result file: the device its content names where it names one, and the
        date of its name (<what>_<device>_<date>...), checked against the date its content gives."""
        found = re.search(r"_(h100|h200x2|h200)_(\d{4}-\d{2}-\d{2})", name)
        if not found:
            raise ResultError(f"{RESULTS}/{name}: the name does not say the device and date (<what>_<device>_<date>)")
        meta = {"device": {"h100": "H100", "h200": "H200", "h200x2": "2 × H200"}[found.group(1)],
                "date": found.group(2)}
        header = {}
        if name.endswith(".json"):
            data = self.json(name)
            header = data.get("header", data)
            if isinstance(header, str):  # "device[, notes] | torch X | date | ..."
                header = {"device": header.split(" | ")[0].split(", ")[0]}
        elif name.endswith(".log"):  # the diag scripts' logs start with their header dict
            path = self.path(name)
            if not path.is_file():
                raise ResultError(f"{RESULTS}/{name}: missing (a table's text cites it)")
            first = path.read_text().split("\n", 1)[0]
            header = ast.literal_eval(first) if first.startswith("{") else {}
        if header.get("date", meta["date"]) != meta["date"]:
            raise ResultError(f"{RESULTS}/{name}: dated {header['date']}, named {meta['date']}")
        meta["device"] = header.get("device", meta["device"])
        return meta


def slug(heading):
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def link(name, document):
    target = os.path.relpath(ROOT / RESULTS / name, (ROOT / document).parent)
    return f"[{name}]({target})"


def source_line(results, document, names, command, device=None):
    """'Device, date. `command` -> files' for the files a table reads (the first one's device and date)."""
    meta = results.meta(names[0])
    where = f"{device or meta['device']}, {meta['date']}"
    files = ", ".join(link(n, document) for n in names)
    return wrap(f"{where}. `{command}` → {files}")


# ----------------------------------------------------------------------------- the tables
class Table:
    """One generated table: its result files (in the order its source line names them), the command
    that reproduces it, the heading of BENCHMARKS.md's section that shows it (the index links it), and
    the function that renders it."""

    def __init__(self, name, files, command, section, render, device=None, extra_files=None, source=None,
                 plot=None, document="BENCHMARKS.md"):
        self.name, self.files, self.command, self.section = name, files, command, section
        self.render, self.device, self.plot, self.document = render, device, plot, document
        # cited by the text around the table, not read by the generator: {name: its command, None: the table's}
        self.extra_files = dict(extra_files or {})
        self.source = source or (lambda results, document: source_line(results, document, self.files,
                                                                       self.command, self.device))

    def text(self, results, document):
        """The source line, the table (if it has one), the plot's image line (if it has one)."""
        parts = [self.source(results, document)]
        if self.render is not None:
            parts.append(self.render(results, *self.files) + "\n")
        if self.plot is not None:
            parts.append(self.plot.image(document) + "\n")
        return "\n".join(parts)


LIGER_CUTE = "liger ppo (CuTe sm90)"
PEER_NAMES = {"rl_kernels": "rl_kernels", LIGER_CUTE: "Liger 0.8.5 CuTe sm90", "verl triton": "verl triton",
              "verl torch": "verl torch", "liger (CE only)": "Liger (CE only)", "cce (CE only)": "CCE (CE only)",
              "torch eager": "torch eager", "flash-attn (CE only)": "flash-attn (CE only)"}


def render_head_vs_liger(results, name):
    data = results.json(name)
    rows = []
    for entry in data["shapes"]:
        impls = entry["impls"]
        best = {key: min(v[key] for v in impls.values()) for key in
                ("fwd_x_mm", "fwd_bwd_x_mm", "fwd_bwd_extra_gb", "max_err", "max_ent_err")}
        for i, (impl, v) in enumerate(impls.items()):
            def cell(key, fmt):
                return bold(fmt(v[key]), fmt(v[key]) == fmt(best[key]))
            rows.append([shape_text(entry["shape"]) if i == 0 else "", bold(PEER_NAMES[impl], impl == "rl_kernels"),
                         cell("fwd_x_mm", fixed), cell("fwd_bwd_x_mm", fixed), fixed(v["fwd_bwd_ms"]),
                         cell("fwd_bwd_extra_gb", fixed), cell("max_err", sci),
                         f"{cell('max_ent_err', sci)} ({v['entropy_dtype']})"])
    return table(["N × H × V", "impl", "fwd ×mm", "fwd+bwd ×mm", "fwd+bwd ms", "extra GB fwd+bwd",
                  "max \\|Δlog p\\|", "max \\|Δentropy\\| (dtype)"], rows)


def render_varying_n(results, cold, warm):
    rows = []
    for name, cache in ((cold, "cold"), (warm, "warm")):
        data = results.json(name)["varying_n"]
        for impl, v in data["impls"].items():
            first, second = sum(v["first_s"]), sum(v["second_s"])
            rows.append([f"{results.meta(name)['date']}, Triton cache {cache}",
                         bold(PEER_NAMES[impl], impl == "rl_kernels"), bold(sig3(first), impl == "rl_kernels"),
                         sig3(second), sig3(first - second), " ".join(fixed(s) for s in v["first_s"])])
    return table(["run", "impl", "first pass s", "second pass s", "first − second s", "first pass per call s"], rows)


PEER_SHAPES = ([16384, 3584, 152064],)  # of the four the run measured
PEER_ERROR_IMPLS = ("torch eager", "liger (CE only)", "cce (CE only)")  # README's "torch eager, Liger, CCE"


def max_err_range(data, impl):
    """(smallest, largest) max |Δlog p| of ``impl`` over the run's shapes (those it ran at)."""
    errors = [s["impls"][impl]["max_err"] for s in data["shapes"] if "max_err" in s["impls"].get(impl, {})]
    return min(errors), max(errors)


def max_err_cell(data, impl, here):
    """'this shape's error (range over the run's shapes[; n of m shapes])'."""
    low, high = max_err_range(data, impl)
    ran = sum("max_err" in s["impls"].get(impl, {}) for s in data["shapes"])
    some = "" if ran == len(data["shapes"]) else f"; {ran} of {len(data['shapes'])} shapes"
    return f"{sci(here)} ({sci(low)} to {sci(high)}{some})"


def render_head_vs_peers(results, h100, h200):
    runs = [results.json(h100), results.json(h200)]
    rows = []
    for i, entry in enumerate(runs[0]["shapes"]):
        other = runs[1]["shapes"][i]
        if other["shape"] != entry["shape"]:
            raise ResultError(f"{h100} and {h200}: shape {i} differs")
        if entry["shape"] not in PEER_SHAPES:
            continue
        order = sorted(entry["impls"], key=lambda k: (k != "rl_kernels", entry["impls"][k].get("fwd_bwd_x_mm", 1e9)))
        for j, impl in enumerate(order):
            a, b = entry["impls"][impl], other["impls"].get(impl, {})
            if "fwd_bwd_x_mm" not in a:
                cells = [a.get("error", "no result"), "", "", "", "", ""]
            else:
                cells = [fixed(a["fwd_x_mm"]), fixed(a["fwd_bwd_x_mm"]),
                         fixed(b["fwd_x_mm"]) if "fwd_x_mm" in b else "", fixed(b["fwd_bwd_x_mm"]) if b else "",
                         fixed(a["fwd_bwd_extra_gb"]), max_err_cell(runs[0], impl, a["max_err"])]
            ours = impl == "rl_kernels"
            rows.append([shape_text(entry["shape"]) if j == 0 else "", bold(PEER_NAMES[impl], ours)]
                        + [bold(c, ours and c != "") for c in cells])
    return table(["N × H × V", "impl", "H100 fwd ×mm", "H100 fwd+bwd ×mm", "H200 fwd ×mm", "H200 fwd+bwd ×mm",
                  "H100 extra GB fwd+bwd", "max \\|Δlog p\\| (range over the run's shapes)"], rows)


def render_logits(results, *names):
    """One block of rows per result file (device): our call and the peers that read the logits once (torch eager,
    2-3% of the ceilings or out of memory, in the prose)."""
    rows, notes = [], []
    for name in names:
        data = results.json(name)
        device = results.meta(name)["device"].replace("NVIDIA ", "").replace(" 80GB HBM3", "")
        for entry in data["shapes"]:
            first = True
            for impl, v in entry["impls"].items():
                if impl == "torch eager" or "fwd_ms" not in v:
                    continue
                ours = impl == "rl_kernels"
                cells = [f"{bold(pct(v['fwd_frac_read']), ours)} ({fixed(v['fwd_ms'], 3)} ms)",
                         f"{bold(pct(v['bwd_frac_copy']), ours)} ({fixed(v['bwd_ms'], 3)} ms)",
                         f"{fixed(v['fwd_bwd_extra_gb'])}", sci(v["max_err"])]
                rows.append([f"{device}, {shape_text(entry['shape'])}" if first else "",
                             bold(PEER_NAMES.get(impl, impl), ours)] + cells)
                first = False
        c = data["ceilings"]
        notes.append(f"{device} read {round(c['read_gbps'])} GB/s, copy {round(c['copy_gbps'])} GB/s")
    text = table(["device, N × V bf16", "impl", "forward / read ceiling", "backward / copy ceiling",
                  "extra GB fwd+bwd", "max \\|Δlog p\\|"], rows)
    return text + "\n\n" + wrap(f"Ceilings measured in the same run (best of `x.sum` / `amax` over "
                                f"{c['bytes'] // 2**30} GiB): {'; '.join(notes)}.").rstrip("\n")


def render_tp(results, name):
    (r,) = results.json(name)["rows"]
    u, f64, lg, ms = r["vs_unsharded"], r["vs_float64"], r["logits_stats_shard"], r["ms"]
    same = r["bitwise_on_all_ranks"]
    rows = [["identical bits on both ranks (log-probs, entropy, all-reduced dh)",
             "yes" if all(same.values()) else f"no: {same}"],
            ["vs the unsharded kernel", f"max \\|Δlog p\\| {sci(u['log_probs'])}, max \\|Δentropy\\| "
             f"{sci(u['entropy'])}, dh rel {sci(u['dh_rel'])}, dW shard rel {sci(u['dw_shard_rel'])}"],
            [f"vs float64 (first {f64['tokens']} tokens)", f"max \\|Δlog p\\| {sci(f64['log_probs'])}, "
             f"max \\|Δentropy\\| {sci(f64['entropy'])}, dh rel {sci(f64['dh_rel'])} "
             f"(unsharded: {sci(f64['dh_rel_unsharded'])})"],
            ["`logits_stats` on a logits shard vs the unsharded logits",
             f"{'identical on both ranks' if lg['bitwise_on_all_ranks'] else 'ranks differ'}; max \\|Δlog p\\| "
             f"{sci(lg['log_probs'])}, max \\|Δentropy\\| {sci(lg['entropy'])}, max \\|Δlse\\| {sci(lg['lse'])}"],
            ["forward, 2 GPUs vs one (no grad)", f"{fixed(ms['fwd_tp'])} vs {fixed(ms['fwd_unsharded'])} ms: "
             f"**{fixed(ms['fwd_unsharded'] / ms['fwd_tp'])}×** speed-up"],
            ["forward+backward (dh all-reduced), 2 GPUs vs one",
             f"{fixed(ms['fwd_bwd_tp'])} vs {fixed(ms['fwd_bwd_unsharded'])} ms: "
             f"**{fixed(ms['fwd_bwd_unsharded'] / ms['fwd_bwd_tp'])}×** (partial dh, Megatron's convention: "
             f"{fixed(ms['fwd_bwd_tp_partial_dh'])} ms)"]]
    return table([f"{shape_text(r['shape'])} bf16, T = 0.9, shards {r['shards']}", "result"], rows)


def render_jsd(results, name):
    data = results.json(name)
    rows = []
    for r in data["rows"]:
        cells = [fixed(r["beta"], 1), f"**{fixed(r['ours_ms'])}** ({fixed(r['ours_ms'] / r['linear_log_probs_fwd_bwd_ms'])}×)",
                 bold(fixed(r["ours_peak_extra_gib"])), sci(abs(r["loss"] - r["loss_float64"]) / abs(r["loss_float64"])),
                 f"{sci(r['dh_rel'])} / {sci(r['dw_rel'])}"]
        for key in ("eager", "liger"):
            cells.append(f"{fixed(r[key + '_ms'])} / {fixed(r[key + '_peak_extra_gib'])}" if key + "_ms" in r
                         else "–")
        rows.append(cells)
    liger = data.get("liger") or "not importable"
    return table(["β", "ours fwd+bwd ms (× `linear_log_probs`)", "peak extra GiB", "loss rel. err",
                  "dh / dW rel. err", "torch eager ms / GiB", f"Liger `LigerFusedLinearJSD` ({liger}) ms / GiB"],
                 rows)


def render_small_calls(results, name):
    data = results.json(name)["rows"]
    columns = [("eager", "eager"), ("eager_b2b", "eager back to back"), ("graph", "CUDA graph replay"),
               ("kernels", "kernels alone"), ("matmul", "cuBLAS matmul"), ("compiled", "inductor"),
               ("reduce-overhead", "inductor `reduce-overhead`")]
    rows = [[call] + [fixed(v[key], 3) if key in v else "–" for key, _ in columns] for call, v in data.items()]
    return table(["call (ms)"] + [title for _, title in columns], rows)


MODELS = {"qwen2.5-0.5b": "Qwen2.5-0.5B", "gemma2-2b": "Gemma-2-2B shape (256k vocabulary)",
          "qwen2.5-7b": "Qwen2.5-7B", "llama3.1-8b": "Llama-3.1-8B"}
SHORT_MODELS = {"qwen2.5-0.5b": "Qwen2.5-0.5B", "gemma2-2b": "Gemma-2-2B shape\n(256k vocabulary)",
                "qwen2.5-7b": "Qwen2.5-7B", "llama3.1-8b": "Llama-3.1-8B"}  # the plots' labels
VARIANTS = ("verl logits", "verl fused torch", "verl fused triton", "fused rl_kernels", "logits + rl_kernels")


def by_model(rows):
    out = {}
    for row in rows:
        out.setdefault(row["model"], {})[row["variant"]] = row
    return out


def render_model_tokens(results, name):
    rows = []
    for model, variants in by_model(results.json(name)["rows"]).items():
        speed = {v: variants[v]["at_16384"]["tokens_per_s"] for v in VARIANTS}
        best = max(speed.values())
        base = speed["verl logits"]
        rows.append([MODELS[model]] + [bold(thousands(speed[v]), speed[v] == best) for v in VARIANTS]
                    + [f"{fixed(speed['fused rl_kernels'] / base)}× / {fixed(speed['logits + rl_kernels'] / base)}×"])
    return table(["model (tokens/s at 16k)", "verl default (logits)", "verl fused torch", "verl fused triton",
                  "fused rl_kernels", "logits + rl_kernels", "rl-kernels / verl default (fused / logits)"], rows)


def render_model_largest(results, *names):
    rows = []
    for name in names:
        for model, variants in by_model(results.json(name)["rows"]).items():
            largest = {v: variants[v]["largest_tokens"] for v in VARIANTS}
            rows.append([MODELS[model]] + [tokens(largest[v]) for v in VARIANTS]
                        + [f"{largest['fused rl_kernels'] / largest['verl logits']:.1f}×"])
    return table(["model (largest micro-batch, tokens)", "verl default (logits)", "verl fused torch",
                  "verl fused triton", "fused rl_kernels", "logits + rl_kernels", "fused rl_kernels / verl default"],
                 rows)


def render_model_fsdp(results, name):
    rows = []
    variants = by_model(results.json(name)["rows"])
    (model, rows_of), = variants.items()
    base = rows_of["verl logits"]["at_16384"]["tokens_per_s"]
    for variant in VARIANTS:
        v = rows_of[variant]
        largest = ("not searched" if "largest_tokens" not in v else
                   ("≤ " if "error" in v else "") + tokens(v["largest_tokens"]))
        rows.append([bold(variant, "rl_kernels" in variant),
                     f"{thousands(v['at_8192']['tokens_per_s'])} / {thousands(v['at_16384']['tokens_per_s'])}",
                     f"{fixed(v['at_16384']['tokens_per_s'] / base)}×",
                     f"{fixed(v['at_8192']['peak_gb'], 1)} / {fixed(v['at_16384']['peak_gb'], 1)}", largest])
    return table([f"{MODELS[model]}, per rank", "tokens/s @8k / @16k", "@16k vs verl default", "peak GB @8k / @16k",
                  "largest micro-batch (tokens)"], rows)


def render_parity(results, name):
    rows = []
    for head, v in results.json(name)["results"].items():
        if head == "float32 head":
            continue
        rows.append([bold(head, "rl_kernels" in head), sci(v["drift_vs_float32_head"]), f"{v['rerun_drift']:g}",
                     "yes" if v["rerun_bitwise"] else "no"])
    return table(["head", "drift from the float32-head run", "rerun drift", "rerun bitwise identical"], rows)


def render_distill_verl(results, *names):
    rows = []
    for name in names:
        data = results.json(name)
        clamp = data["header"]["log_prob_min_clamp"]
        base = next(r for r in data["rows"] if r["variant"] == "verl")["fwd_bwd_ms"]
        for r in data["rows"]:
            ours = r["variant"] == "rl_kernels"
            label = {"verl": "verl (`F.log_softmax`, default)", "verl chunked": "verl `use_chunked_topk=True`",
                     "rl_kernels": "rl-kernels"}[r["variant"]]
            rows.append(["None" if clamp is None else f"{clamp:g}", bold(label, ours)]
                        + [bold(c, ours) for c in (fixed(r["fwd_bwd_ms"]), fixed(r["fwd_bwd_ms"] / base),
                                                   fixed(r["peak_extra_gib"]), sci(r["max_abs_err_loss"]))]
                        + [sci(r["max_abs_err_grad"])])
    return table(["`log_prob_min_clamp`", "variant", "fwd+bwd ms", "× verl", "peak extra GiB", "max err loss",
                  "max err d/dlogits"], rows)


def rows_vs_mm(results, name, labels, bold_cells):
    data = results.json(name)["rows"]
    mm = data["mm"]["ms"]
    missing = set(data) - set(labels)
    if missing:
        raise ResultError(f"{name}: rows without a label here: {sorted(missing)}")
    rows = []
    for key, label in labels.items():
        if label is None:  # (a row another table shows from a newer run)
            continue
        v = data[key]
        cells = [fixed(v["ms"]), fixed(v["ms"] / mm), fixed(v["peak_extra_gib"])]
        rows.append([label] + [bold(c, (key, i) in bold_cells) for i, c in enumerate(cells)])
    return table(["row", "ms", "x mm", "peak extra GiB"], rows)


def render_fused_reach(results, name):
    labels = {
        "mm": "cuBLAS `hidden @ weight.T`",
        "(a) verl logits path log-probs + sum_pi_squared": "(a) no grad: verl logits path, log-probs + Σπ²",
        "(a) verl logits path sum_pi_squared alone": "(a) no grad: verl logits path, Σπ² alone",
        "(a) fused log-probs + sum_pi_squared": "(a) no grad: **fused**, log-probs + Σπ²",
        "(a) fused log-probs": "(a) no grad: fused, log-probs alone",
        "(b) fwd+bwd scalar temperature": "(b) fwd+bwd log-probs + entropy, scalar temperature",
        "(b) fwd+bwd per-row temperature": "(b) fwd+bwd log-probs + entropy, **per-row temperature**",
        # (c), top-K distillation: the distillation section's table, from a run of 2026-12-07
        "(c) verl logits path compute_forward_kl_topk fwd+bwd": None,
        "(c) fused, as the verl integration serves it, fwd+bwd": None,
        "(c) fused linear_topk_kl fwd+bwd": None,
    }
    fused_sum = "(a) fused log-probs + sum_pi_squared"
    return rows_vs_mm(results, name, labels, {(fused_sum, 0), (fused_sum, 1), (fused_sum, 2)})


def render_distill_tail(results, name):
    labels = {
        "mm": "cuBLAS `hidden @ weight.T`",
        "verl logits path forward_kl_topk fwd+bwd": "verl logits path, `forward_kl_topk`",
        "from logits fwd+bwd": "ours from logits, `topk_kl_from_logits`",
        "from logits, tail fwd+bwd": "ours from logits, **tail**",
        "fused fwd+bwd": "ours fused, `linear_topk_kl`",
        "fused, tail fwd+bwd": "ours fused, **tail**",
        "fused top-K selection (no grad)": "fused top-K selection, `linear_topk` (no grad)",
        "at ids fwd+bwd": "the integration's fused call, `linear_log_probs_at_ids`",
        "at ids + linear_topk fwd+bwd": "… + the student's top K by `linear_topk` (before)",
        "at ids, top_k in the forward fwd+bwd": "… the student's top K in the head's forward, `top_k=64`",
        "at ids, tail + linear_topk fwd+bwd": "… **tail** + `linear_topk` (before)",
        "at ids, tail, top_k in the forward fwd+bwd": "… **tail**, `top_k=64`",
    }
    return rows_vs_mm(results, name, labels, {("fused top-K selection (no grad)", 1),
                                              ("at ids, top_k in the forward fwd+bwd", 0),
                                              ("at ids, tail, top_k in the forward fwd+bwd", 0)})


def render_readme_gain(results, peers_liger, peers_all, varying_warm, model_rerun, model_7b, model_8b, distill,
                       loss_rows, bias):
    cute = results.json(peers_liger)
    big = next(s for s in cute["shapes"] if s["shape"] == [16384, 3584, 152064])["impls"]
    bias_rows = {r["what"]: r for r in results.json(bias)["rows"]["runs"]["0"]}  # (the shipped kernels' run)
    ratios = [bias_rows[f"T={t} rl_kernels"]["log_probs_mean"] / bias_rows[f"T={t} torch fp32 path"]["log_probs_mean"]
              for t in (1.0, 0.3)]
    ratio_text = f"{min(ratios):.0f}-{max(ratios):.0f}"
    older = next(s for s in results.json(peers_all)["shapes"] if s["shape"] == [16384, 3584, 152064])["impls"]
    largest = {}
    for name in (model_7b, model_8b):
        for model, variants in by_model(results.json(name)["rows"]).items():
            largest[model] = (variants["verl logits"]["largest_tokens"], variants["fused rl_kernels"]["largest_tokens"])
    small = by_model(results.json(model_rerun)["rows"])["qwen2.5-0.5b"]
    speed = {v: small[v]["at_16384"]["tokens_per_s"] for v in VARIANTS}
    cold = results.json(peers_liger)["varying_n"]["impls"]
    warm = results.json(varying_warm)["varying_n"]["impls"]
    peer_err = [e for impl in PEER_ERROR_IMPLS for e in max_err_range(results.json(peers_all), impl)]
    ours_err = [s["impls"]["rl_kernels"][k] for s in cute["shapes"] for k in ("max_err", "max_ent_err")]
    rows_d = {r["variant"]: r for r in results.json(distill)["rows"]}
    q7, l8 = largest["qwen2.5-7b"], largest["llama3.1-8b"]
    rows = [
        ["Qwen2.5-7B / Llama-3.1-8B verl actor step: largest micro-batch (H100)",
         f"{tokens(q7[0])} / {tokens(l8[0])} tokens",
         f"**{tokens(q7[1])} / {tokens(l8[1])}** tokens "
         f"(`+rl_kernels=fused`: {q7[1] / q7[0]:.1f}× / {l8[1] / l8[0]:.1f}×)"],
        ["Qwen2.5-0.5B verl actor step at 16k tokens: tokens/s (H100)", "1.00×",
         f"**{fixed(speed['fused rl_kernels'] / speed['verl logits'])}×** (fused) / "
         f"{fixed(speed['logits + rl_kernels'] / speed['verl logits'])}× (logits)"],
        ["fused head fwd+bwd, 16384 × 3584 × 152064 bf16, × one cuBLAS matmul (H100)",
         f"Liger 0.8.5 CuTe (verl's `impl_backend=liger` on Hopper) {fixed(big[LIGER_CUTE]['fwd_bwd_x_mm'])}×; "
         f"earlier run: verl triton {fixed(older['verl triton']['fwd_bwd_x_mm'])}×, "
         f"CCE {fixed(older['cce (CE only)']['fwd_bwd_x_mm'])}×",
         f"**{fixed(big['rl_kernels']['fwd_bwd_x_mm'])}×** "
         f"(earlier run: {fixed(older['rl_kernels']['fwd_bwd_x_mm'])}×)"],
        ["verl's dynamic micro-batches: 8 calls of 3000-20000 tokens, first pass with compilation (H100)",
         f"Liger CuTe: {sig3(sum(cold[LIGER_CUTE]['first_s']))} s (compiles per new N)",
         f"**{sig3(sum(warm['rl_kernels']['first_s']))} s** (Triton cache warm), "
         f"{sig3(sum(cold['rl_kernels']['first_s']))} s (cold)"],
        ["log-prob error vs float64, same bf16 inputs",
         f"torch eager, Liger, CCE over the peers' shapes: {sci(min(peer_err))} to {sci(max(peer_err))} "
         f"(bf16 logits); "
         f"Liger CuTe {sci(big[LIGER_CUTE]['max_err'])}, entropy in bf16 ({sci(big[LIGER_CUTE]['max_ent_err'])})",
         f"**{sci(min(ours_err))} to {sci(max(ours_err))}** (float32 logits; log-probs and entropy; T = 1, logits "
         f"std 1.2; at std 2 a tensor-core accumulation bias: {sci(bias_rows['T=1.0 rl_kernels']['log_probs_bias'])} "
         f"at T = 1, {sci(bias_rows['T=0.3 rl_kernels']['log_probs_bias'])} at T = 0.3, "
         f"[{ratio_text}× torch's fp32 path](BENCHMARKS.md#the-bf16-heads-accumulation-bias))"],
        ["verl's top-K distillation loss, 4096 × 152064, K = 64 (H100)",
         f"{fixed(rows_d['verl']['fwd_bwd_ms'])} ms, {fixed(rows_d['verl']['peak_extra_gib'])} GiB extra; "
         f"loss error {sci(rows_d['verl']['max_abs_err_loss'])}",
         f"**{fixed(rows_d['rl_kernels']['fwd_bwd_ms'])} ms, {fixed(rows_d['rl_kernels']['peak_extra_gib'])} GiB**; "
         f"loss error {sci(rows_d['rl_kernels']['max_abs_err_loss'])}"],
    ]
    lr = results.json(loss_rows)["rows"]
    sixty = lr["selected, 60% outside, random"]
    rows.append(["agentic traces, 60% of the rows outside the loss: fused head fwd+bwd, 16384 × 3584 × 152064 (H100)",
                 f"every row computed (no peer selects rows): {fixed(lr['full head']['ms'])} ms",
                 f"**{fixed(sixty['ms'])} ms** (`loss_rows_only`: {fixed(sixty['fraction_of_ideal'])} of the ideal)"])
    return table(["where", "verl's default or the best peer", "with rl-kernels"], rows)


def readme_gain_source(results, document):
    dates = sorted({results.meta(name)["date"] for name in README_GAIN_FILES})
    return wrap(f"Lent H100s, {dates[0]} to {dates[-1]}; each row comes from a table of [BENCHMARKS.md](BENCHMARKS.md)"
                f" (device, date and command there) and its result file in [{RESULTS}/]({RESULTS}/README.md).")


# ----------------------------------------------------------------------------- the plots
# A plot is drawn in two steps: its spec (a JSON-able dict: every number, label and title the figure shows,
# computed from the result files with the stdlib alone) and the drawing of that spec with matplotlib
# (``draw``: styling only, no number of its own). The SVG keeps the spec, as indented JSON, in its
# ``<dc:description>`` and the renderer that drew it in ``<dc:creator>`` (see the module docstring).
PLOT_RC = {"font.family": "DejaVu Sans", "font.size": 8.5, "svg.fonttype": "path", "svg.hashsalt": "rl-kernels",
           "axes.spines.top": False, "axes.spines.right": False, "axes.axisbelow": True, "axes.grid": True,
           "axes.grid.axis": "y", "grid.alpha": 0.35, "axes.titlesize": 9, "legend.frameon": False}
VARIANT_NAMES = {"verl logits": "verl default (logits)", "verl fused torch": "verl fused torch",
                 "verl fused triton": "verl fused triton", "fused rl_kernels": "fused rl_kernels",
                 "logits + rl_kernels": "logits + rl_kernels"}
VARIANT_COLORS = {"verl default (logits)": "#4d4d4d", "verl fused torch": "#9ecae1", "verl fused triton": "#4292c6",
                  "fused rl_kernels": "#d94801", "logits + rl_kernels": "#fdae6b"}
SVG_NS = {"dc": "http://purl.org/dc/elements/1.1/", "cc": "http://creativecommons.org/ns#"}
DRAWN_BY = ", drawn by scripts/bench_tables.py"


def renderer():
    """'matplotlib X, FreeType Y' of this interpreter, or None where matplotlib is not importable."""
    try:
        import matplotlib
        from matplotlib import ft2font
    except ImportError:
        return None
    return f"matplotlib {matplotlib.__version__}, FreeType {ft2font.__freetype_version__}"


class Plot:
    """One generated SVG under benchmarks/results/: its file name, the function that computes its spec from
    the table's result files, and the image's alt text."""

    def __init__(self, file, spec, alt):
        self.file, self.spec, self.alt = file, spec, alt

    def image(self, document):
        target = os.path.relpath(ROOT / RESULTS / self.file, (ROOT / document).parent)
        return f"![{self.alt}]({target})"


def spec_text(spec):
    return json.dumps(spec, indent=1, ensure_ascii=False) + "\n"


def recorded(svg):
    """(renderer, spec text) that an SVG of ours records, or None where it records none (or is no SVG)."""
    try:
        root = ElementTree.fromstring(svg)
    except ElementTree.ParseError:
        return None
    creator = root.find(".//dc:creator/cc:Agent/dc:title", SVG_NS)
    description = root.find(".//dc:description", SVG_NS)
    if creator is None or description is None or not (creator.text or "").endswith(DRAWN_BY):
        return None
    return creator.text[: -len(DRAWN_BY)], description.text or ""


def draw(spec):
    """The SVG bytes of a spec. Deterministic for one renderer: no date (metadata Date=None), ids from a
    fixed salt (svg.hashsalt), matplotlib's own defaults (rcdefaults: no matplotlibrc of the machine), the
    DejaVu Sans that matplotlib ships, glyphs as paths (no font needed to view it)."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter
    from matplotlib.transforms import blended_transform_factory

    with matplotlib.rc_context():
        matplotlib.rcdefaults()
        matplotlib.rcParams.update(PLOT_RC)
        fig = Figure(figsize=spec["size"], layout="constrained")
        widths = [len(panel.get("groups") or "x") for panel in spec["panels"]]  # bar panels: by their groups
        axes = fig.subplots(1, len(spec["panels"]), squeeze=False, sharey=bool(spec.get("sharey")),
                            width_ratios=widths)[0]
        for ax, panel in zip(axes, spec["panels"]):
            if panel["kind"] == "bars":
                groups = panel["groups"]
                width = 0.84 / len(panel["series"])
                for i, series in enumerate(panel["series"]):
                    offset = (i - (len(panel["series"]) - 1) / 2) * width
                    bars = ax.bar([g + offset for g in range(len(groups))], series["values"], width * 0.92,
                                  label=series["label"], color=VARIANT_COLORS[series["label"]])
                    texts = [t or "" for t in series.get("texts") or ()]
                    if any(texts) and panel.get("texts_inside"):  # at the foot of each bar, read upwards
                        color = VARIANT_COLORS[series["label"]]
                        dark = sum(int(color[i:i + 2], 16) * w for i, w in ((1, 0.3), (3, 0.59), (5, 0.11))) < 140
                        foot = blended_transform_factory(ax.transData, ax.transAxes)
                        for bar, text in zip(bars, texts):
                            ax.text(bar.get_x() + bar.get_width() / 2, 0.02, text, transform=foot, rotation=90,
                                    ha="center", va="bottom", fontsize=6.5, color="white" if dark else "black")
                    elif any(texts):
                        ax.bar_label(bars, labels=texts, padding=1.5, fontsize=6.5,
                                     rotation=90 if panel.get("vertical_texts") else 0)
                ax.set_xticks(range(len(groups)), groups)
                ax.margins(y=0.16)
            else:  # measured points joined by a solid line, the largest micro-batch by a dotted one
                for series in panel["series"]:
                    ours = "rl_kernels" in series["label"]
                    style = dict(color=VARIANT_COLORS[series["label"]], lw=2.0 if ours else 1.2,
                                 zorder=3 if ours else 2)
                    ax.plot(series["x"], series["y"], marker="o", markersize=3.5, label=series["label"], **style)
                    ax.plot([series["x"][-1], series["largest_x"]], [series["y"][-1], series["largest_y"]], ls=":",
                            **style)
                    ax.plot([series["largest_x"]], [series["largest_y"]], marker="*", markersize=8, **style)
                ax.set_xscale("log", base=2)
                ax.set_xticks(panel["xticks"], [f"{x // 1024}k" for x in panel["xticks"]])
                ax.set_ylim(bottom=0)
                ax.grid(True, axis="x", alpha=0.35)
            if panel.get("hline") is not None:
                ax.axhline(panel["hline"], color="#4d4d4d", lw=0.8, ls="--", zorder=1)
            digits = panel.get("ydigits", 0)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, digits=digits: f"{v:,.{digits}f}"))
            ax.set_title(panel["title"])
            ax.set_xlabel(panel["xlabel"])
            ax.set_ylabel(panel["ylabel"])
        fig.suptitle(spec["title"], fontsize=9.5)
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), fontsize=8,
                   title=spec.get("note"), title_fontsize=7.5)
        out = io.BytesIO()
        fig.savefig(out, format="svg", metadata={"Title": spec["title"], "Date": None,
                                                  "Creator": renderer() + DRAWN_BY, "Description": spec_text(spec)})
    return out.getvalue()


def plot_head(results, name, what):
    meta = results.meta(name)
    return f"verl actor step, {what}: {meta['device']}, {meta['date']}"


def bar_series(by, models, value, text=None):
    """One bar series per variant over ``models``: value(row) and text(row, row of verl's default)."""
    return [{"label": VARIANT_NAMES[v], "values": [value(by[m][v]) for m in models],
             "texts": [text(by[m][v], by[m]["verl logits"]) if text else None for m in models]} for v in VARIANTS]


def speed_panel(by, at, texts):
    models = list(by)
    ratio = lambda r, base: r[at]["tokens_per_s"] / base[at]["tokens_per_s"]  # noqa: E731
    series = bar_series(by, models, lambda r: ratio(r, by[r["model"]]["verl logits"]),
                        (lambda r, base: thousands(r[at]["tokens_per_s"])) if texts == "all" else
                        (lambda r, base: f"{fixed(ratio(r, base))}×" if "rl_kernels" in r["variant"] else None))
    return {"kind": "bars", "title": f"tokens/s at {tokens(int(at[3:]))} tokens per micro-batch",
            "xlabel": "", "ylabel": "tokens/s ÷ verl default's", "groups": [SHORT_MODELS[m] for m in models],
            "series": series, "hline": 1.0, "ydigits": 1, "vertical_texts": True, "texts_inside": texts == "all"}


def largest_rows(results, names):
    by = {}
    for name in names:
        by.update(by_model(results.json(name)["rows"]))
    return by


def spec_model_gain(results, speed_name, *largest_names):
    """README: the largest micro-batch per model (the model_largest table's files) and tokens/s at 16k
    relative to verl's default (the model_tokens table's file)."""
    by = largest_rows(results, largest_names)
    models = list(by)
    largest = {"kind": "bars", "title": "largest micro-batch that fits (memory)", "xlabel": "",
               "ylabel": "tokens per micro-batch", "groups": [SHORT_MODELS[m] for m in models],
               "series": bar_series(by, models, lambda r: r["largest_tokens"],
                                    lambda r, base: (f"{r['largest_tokens'] / base['largest_tokens']:.1f}×"
                                                     if r["variant"] == "fused rl_kernels" else None))}
    speed = speed_panel(by_model(results.json(speed_name)["rows"]), "at_16384", texts="ours")
    return {"title": plot_head(results, speed_name, "per model size (× verl default on the bars)"),
            "size": [9.6, 3.4], "panels": [largest, speed],
            "note": "Qwen2.5-0.5B: 262,144 tokens was the search's limit; Gemma-2-2B shape: verl's fused backends "
                    "skip its soft cap (wrong log-probs). Tables: BENCHMARKS.md, Model level."}


def spec_model_tokens(results, name):
    """BENCHMARKS' model_tokens table as bars: tokens/s at each timed micro-batch, relative to verl's default."""
    by = by_model(results.json(name)["rows"])
    ats = sorted({k for rows in by.values() for r in rows.values() for k in r if k.startswith("at_")},
                 key=lambda k: int(k[3:]))
    return {"title": plot_head(results, name, "tokens/s per model and micro-batch (tokens/s on the bars)"),
            "size": [9.6, 3.5], "panels": [speed_panel(by, at, texts="all") for at in ats], "sharey": True,
            "note": None}


def spec_model_memory(results, *names):
    """BENCHMARKS' model_largest table as lines: peak memory against micro-batch tokens per model, the timed
    points and the largest micro-batch that fits."""
    by = largest_rows(results, names)
    panels = []
    for model, rows in by.items():
        series = []
        for variant in VARIANTS:
            r = rows[variant]
            points = sorted((int(k[3:]), v["peak_gb"]) for k, v in r.items()
                            if k.startswith("at_") and k != "at_largest")
            series.append({"label": VARIANT_NAMES[variant], "x": [p[0] for p in points], "y": [p[1] for p in points],
                           "largest_x": r["largest_tokens"], "largest_y": r["at_largest"]["peak_gb"]})
        top = max(s["largest_x"] for s in series)
        ticks = [8192 * 2 ** i for i in range(12) if 8192 * 2 ** i <= top * 1.05]
        ylabel = "" if panels else "peak GPU memory allocated, GiB"
        panels.append({"kind": "lines", "title": SHORT_MODELS[model].replace("\n", " "),
                       "xlabel": "micro-batch, tokens", "ylabel": ylabel, "xticks": ticks, "series": series})
    return {"title": plot_head(results, names[0], "peak memory against micro-batch size"),
            "size": [9.6, 3.4], "panels": panels, "sharey": True,
            "note": "●: timed micro-batches; ★: the largest that fits (Qwen2.5-0.5B fused: 262,144 tokens, the "
                    "search's limit); k = 1,024 tokens\nverl's fused torch / triton lie under fused rl_kernels "
                    "(the same memory)"}


def readme_plot_source(results, document):
    meta = results.meta(README_PLOT_FILES[0])
    return wrap(f"Per model size, a verl actor step ({meta['device']}, {meta['date']}): the model-level tables of "
                f"[BENCHMARKS.md](BENCHMARKS.md#model-level-a-verl-actor-step), drawn from their result files by "
                f"`python scripts/bench_tables.py --write`.")

def pct_outside(fraction):
    return f"{fraction:.0%}"


def render_loss_rows_head(results, name):
    data = results.json(name)
    rows, head = data["rows"], data["header"]
    mm, full = rows["mm"]["ms"], rows["full head"]["ms"]
    lines = [["cuBLAS `hidden @ weight.T`", "–", fixed(mm), "1.00", "–", fixed(rows["mm"]["peak_extra_gib"])],
             ["full head (option off)", "100%", fixed(full), fixed(full / mm), "–",
              fixed(rows["full head"]["peak_extra_gib"])]]
    for key, r in rows.items():
        if "fraction_of_ideal" not in r:
            continue
        if key.startswith("selected"):
            label = f"**`loss_rows_only`**, {pct_outside(r['outside'])} outside, {r['mask']} mask"
            if r["outside"] == 0:
                label = "**`loss_rows_only`**, every row in the loss"
        else:
            label = f"plain head on the kept rows alone, {pct_outside(r['outside'])} outside (no selection)"
        lines.append([label, pct(r["kept"]), fixed(r["ms"]), fixed(r["ms"] / mm),
                      bold(fixed(r["fraction_of_ideal"]), key.startswith("selected")), fixed(r["peak_extra_gib"])])
    lines.sort(key=lambda c: 0 if "cuBLAS" in c[0] else 1 if "full" in c[0] else 3 if "plain" in c[0] else 2)
    return table([f"{head['n']} × {head['hidden']} × {head['vocab']} fwd+bwd", "rows kept", "ms", "x mm",
                  "fraction of ideal", "peak extra GiB"], lines)


def render_loss_rows_model(results, *names):
    by, at = {}, None
    for name in names:
        data = results.json(name)
        if at not in (None, f"at_{data['tokens'][0]}"):
            raise ResultError(f"{name}: timed at {data['tokens'][0]} tokens, the table's other file at {at[3:]}")
        at = f"at_{data['tokens'][0]}"
        for r in data["rows"]:
            by.setdefault((r["model"], r["loss_outside"]), {})[r["variant"]] = r
    lines = []
    for (model, outside), variants in by.items():
        logits, off, on = (variants[v] for v in ("verl logits", "fused rl_kernels", "fused rl_kernels, loss_rows_only"))
        step_off, step_on = off[at]["step_ms"], on[at]["step_ms"]
        predicted = outside * off["head_ms"] / step_off

        def cell(r, on_bold=False):
            return bold(f"{r[at]['step_ms']:.0f} ({thousands(r[at]['tokens_per_s'])})", on_bold)
        lines.append([MODELS[model], pct_outside(outside), cell(logits), cell(off), cell(on, step_on < step_off),
                      f"{fixed(step_on / step_off, 3)}", f"{pct(off['head_ms'] / step_off)}",
                      f"{predicted:.1%} / {1 - step_on / step_off:.1%}"])
    return table([f"{tokens(int(at[3:]))} tokens, ms (tokens/s)", "outside the loss", "verl default (logits)",
                  "fused rl_kernels", "fused, `loss_rows_only`", "on / off", "head's share (off)",
                  "step gain predicted / measured"], lines)



README_PLOT_FILES = ["model_bench_h100_2026-11-24_rerun.json", "model_bench_h100_2026-11-24_small.json",
                     "model_bench_h100_2026-11-24_7b.json", "model_bench_h100_2026-11-24_8b.json"]
README_GAIN_FILES = ["bench_h100_2026-11-26b_liger_cute.json", "bench_h100_2026-11-24b.json",
                     "bench_h100_2026-11-26_liger_cute.json", "model_bench_h100_2026-11-24_rerun.json",
                     "model_bench_h100_2026-11-24_7b.json", "model_bench_h100_2026-11-24_8b.json",
                     "distill_h100_2026-11-26.json", "loss_rows_h100_2026-12-07.json",
                     "accumulation_promotion_h100_2026-12-07.json"]
FP32_HEAD = "fp32_head_h100_2026-12-08.json"
FP32_LABELS = {  # fp32_head_bench.py's variant names -> rows
    "shipped": "**rl-kernels fp32: tf32x3 forward, tf32x3 backward split once (shipped)**",
    "SGEMM backward": "rl-kernels fp32: tf32x3 forward, SGEMM backward (before)",
    "tf32x3 backward (split once, promoted)": None, "tf32 (1 pass)": None}


def render_fp32_head(results, name):
    data = results.json(name)["rows"]
    by = {r["what"]: r for r in data["rows"]}
    mm, bf16 = by["torch fp32 matmul (highest)"]["ms"], by["bf16 head fwd+bwd"]["ms"]
    speed = [["cuBLAS `hidden @ weight.T`, fp32 (full fp32 products)", fixed(mm), "1.00", "–", "–", "–"],
             ["torch's fp32 path (logits materialized; verl's torch backend on fp32)",
              fixed(by["torch fp32 path fwd"]["ms"]), fixed(by["torch fp32 path fwd"]["ms"] / mm),
              fixed(by["torch fp32 path fwd+bwd"]["ms"]), fixed(by["torch fp32 path fwd+bwd"]["ms"] / bf16),
              fixed(by["torch fp32 path fwd+bwd"]["peak_extra_gib"])]]
    variants = [r["what"][len("fp32 head "):] for r in data["rows"]
                if r["what"].startswith("fp32 head ") and FP32_LABELS.get(r["what"][len("fp32 head "):])]
    for key in variants:
        r = by[f"fp32 head {key}"]
        speed.append([FP32_LABELS[key], fixed(r["fwd_ms"]),
                      fixed(r["fwd_ms"] / mm), fixed(r["fwd_bwd_ms"]), fixed(r["fwd_bwd_ms"] / bf16),
                      fixed(r["fwd_bwd_peak_extra_gib"])])
    speed.append(["rl-kernels bf16 (for the ratio)", "–", "–", fixed(bf16), "1.00", "–"])
    n, h, v = data["shape"]
    out = [table([f"{n} × {h} × {v}", "fwd ms", "fwd × fp32 mm", "fwd+bwd ms", "fwd+bwd × bf16 head",
                  "fwd+bwd peak extra GiB"], speed)]
    errors = []
    for t in (1.0, 0.3):
        for key in ["torch fp32 path"] + [f"fp32 head {k}" for k in variants]:
            r = by[f"error T={t} {key}"]
            text = "torch's fp32 path" if key == "torch fp32 path" else FP32_LABELS[key[len("fp32 head "):]]
            errors.append([f"{t:g}", text] + [f"{sci(r[f'{k}_mean'])} / {sci(r[f'{k}_max'])}"
                                            for k in ("log_probs", "entropy", "d_hidden", "d_weight")])
    n, h, v = data["check"]
    out.append(table([f"T ({n} × {h} × {v}, logits std 2)", "vs float64, mean / max", "log-probs", "entropy",
                      "dh (of max)", "dW (of max)"], errors))
    return "\n\n".join(out)


ACCUMULATION_BIAS = ["accumulation_promotion_h100_2026-12-07.json"]
PROMOTION_LABELS = {"0": "**rl-kernels bf16 head (shipped)**", "8": "… partials promoted every 8 K steps (not shipped)",
                    "4": "… partials promoted every 4 K steps (not shipped)"}


def render_accumulation_bias(results, name):
    """The bf16 head's log-prob errors beside torch's fp32 path, shipped and with the K loop's partial
    sums promoted into the float32 accumulator every P steps, and the head's fwd+bwd cost."""
    data = results.json(name)["rows"]
    runs = {p: {r["what"]: r for r in rows} for p, rows in data["runs"].items()}
    shipped = runs["0"]
    timings = {p: [r for k, r in by.items() if k.endswith("fwd+bwd")] for p, by in runs.items()}
    rows = []
    for t in (1.0, 0.3):
        ref = shipped[f"T={t} torch fp32 path"]
        entries = [("torch's fp32 path (bf16 inputs upcast, SGEMM)", ref, None)]
        entries += [(PROMOTION_LABELS[p], runs[p][f"T={t} rl_kernels"], p) for p in ("0", "8", "4")]
        for label, r, p in entries:
            cost = "–" if p is None else " / ".join(fixed(x["head_ms"] / x["mm_ms"]) for x in timings[p])
            rows.append([f"{t:g}", label, f"{sci(r['log_probs_mean'])} / {sci(r['log_probs_max'])}",
                         sci(r["log_probs_bias"]), f"{fixed(r['log_probs_mean'] / ref['log_probs_mean'], 1)} / "
                         f"{fixed(r['log_probs_max'] / ref['log_probs_max'], 1)}", cost])
    n, h, v = data["check"]
    shapes = " / ".join(x["what"].split("x")[0] for x in timings["0"])
    return table([f"T ({n} × {h} × {v} bf16, logits std 2)", "log-probs vs float64 on the same inputs", "mean / max",
                  "mean signed error", "× torch's fp32 path", f"head fwd+bwd ×mm ({shapes} rows)"], rows)


LOSS_ROWS_HEAD = "loss_rows_h100_2026-12-07.json"
LOSS_ROWS_MODEL = ["model_bench_h100_2026-12-07_loss_rows_small.json", "model_bench_h100_2026-12-07_loss_rows_7b.json"]

TABLES = [
    Table("head_vs_liger_cute", ["bench_h100_2026-11-26b_liger_cute.json"],
          'rl-kernels bench --varying-n --impls rl_kernels "liger ppo (CuTe sm90)" --shapes 4096,3584,152064 '
          "16384,3584,152064 32768,4096,128256 --json PATH", "The fused head against Liger's CuTe head",
          render_head_vs_liger),
    Table("varying_n", ["bench_h100_2026-11-26b_liger_cute.json", "bench_h100_2026-11-26_liger_cute.json"],
          'rl-kernels bench --varying-n --impls rl_kernels "liger ppo (CuTe sm90)" ... --json PATH',
          "The fused head against Liger's CuTe head", render_varying_n),
    Table("head_vs_peers", ["bench_h100_2026-11-24b.json", "bench_h200_2026-11-24.json"],
          "rl-kernels bench --stub-verl --shapes 4096,3584,152064 16384,3584,152064 32768,4096,128256 "
          "512,3584,152064 --json PATH", "The fused head against every other peer", render_head_vs_peers,
          device="NVIDIA H100 80GB HBM3 and NVIDIA H200"),
    Table("logits_ceilings", ["bench_logits_h200_2026-11-28.json", "bench_logits_h100_2026-11-26c.json"],
          "rl-kernels bench --logits --shapes 16384,152064 4096,152064 --json PATH",
          "From logits against the bandwidth ceilings", render_logits, device="NVIDIA H200 and H100 80GB HBM3",
          extra_files={"logits_sweep_h100_2026-11-26c.log": "python scripts/diag/logits_sweep.py"}),
    Table("small_calls", ["graph_launch_h100_2026-11-26_arch3.json"],
          "python scripts/diag/graph_launch.py 512,3584,152064 --json PATH",
          "Small calls: eager, CUDA graph, compiled", render_small_calls),
    Table("model_tokens", ["model_bench_h100_2026-11-24_rerun.json"],
          "python scripts/model_bench.py --models MODEL --steps 5 --warmup 2 --json PATH",
          "Model level: a verl actor step", render_model_tokens,
          plot=Plot("model_tokens_h100_2026-11-24.svg", spec_model_tokens,
                    "Bars: a verl actor step's tokens/s per model at 8k and 16k tokens, each path relative to "
                    "verl's default")),
    Table("model_largest", ["model_bench_h100_2026-11-24_small.json", "model_bench_h100_2026-11-24_7b.json",
                            "model_bench_h100_2026-11-24_8b.json"],
          "python scripts/model_bench.py --models MODEL ... --search --json PATH",
          "Model level: a verl actor step", render_model_largest,
          plot=Plot("model_memory_h100_2026-11-24.svg", spec_model_memory,
                    "Lines: a verl actor step's peak GPU memory against micro-batch tokens per model, each path's "
                    "line ending at its largest micro-batch")),
    Table("model_fsdp", ["model_bench_fsdp_h200x2_2026-11-24.json"],
          "torchrun --nproc_per_node 2 scripts/model_bench.py --fsdp --models qwen2.5-7b --tokens 8192 16384 "
          "--steps 5 --search --json PATH", "Model level: a verl actor step", render_model_fsdp),
    Table("distill_verl_topk", ["distill_h100_2026-11-26.json", "distill_clamp_h100_2026-11-26.json"],
          "python scripts/distill_bench.py [--clamp -10] --json PATH",
          "Distillation: verl's top-K loss on the logits path",
          render_distill_verl),
    Table("fused_reach", ["fused_reach_h200_2026-11-28.json"],
          "python scripts/diag/fused_reach_bench.py --json PATH", "verl's fused path where verl refuses it",
          render_fused_reach,
          extra_files=dict.fromkeys(("fused_reach_h200_2026-11-28.log", "fused_reach_h200_2026-11-28_run1.log"))),
    Table("fp32_head", [FP32_HEAD], "python scripts/diag/fp32_head_bench.py --json PATH",
          "The fp32 head on the tensor cores", render_fp32_head,
          extra_files={"fp32_split_gemm_h100_2026-12-08.json": "python scripts/diag/fp32_split_gemm.py --json PATH"}),
    Table("accumulation_bias", ACCUMULATION_BIAS,
          "[RLK_PROMOTE=P] python scripts/diag/accumulation_bias.py 4096,3584,152064 16384,3584,152064 --json PATH",
          "The bf16 head's accumulation bias", render_accumulation_bias,
          extra_files={"accumulation_promotion_h100_2026-12-07.patch":
                       "git apply PATH (the rows with P > 0: RLK_PROMOTE=P sets the K steps per promotion)"}),
    Table("loss_rows_head", [LOSS_ROWS_HEAD], "python scripts/diag/fused_reach_bench.py --loss-rows --rep 1000 --json PATH",
          "verl's loss_rows_only: the head on the loss rows alone", render_loss_rows_head),
    Table("loss_rows_model", LOSS_ROWS_MODEL,
          'python scripts/model_bench.py --models MODEL --variants "verl logits" "fused rl_kernels" --tokens 16384 '
          "--loss-outside 0.3 0.6 --steps 5 --warmup 2 --json PATH",
          "verl's loss_rows_only: the head on the loss rows alone", render_loss_rows_model),
    Table("distill_tail", ["distill_topk_h100_2026-12-07.json"],
          "python scripts/diag/distill_tail_bench.py --json PATH",
          "Distillation: the tail-aware top-K KL and the student's top K",
          render_distill_tail),
    Table("vocab_parallel", ["tp_h200x2_2026-11-28.json"],
          "torchrun --nproc_per_node=2 scripts/diag/tp_bench.py 16384,3584,152064 --json PATH",
          "Vocab tensor parallelism", render_tp, device="2 × NVIDIA H200 (NCCL)"),
    Table("jsd", ["jsd_h200_2026-11-28.json"], "python scripts/diag/jsd_bench.py 4096,3584,152064 --json PATH",
          "Distillation: fused linear JSD", render_jsd),
    Table("readme_gain", README_GAIN_FILES, "python scripts/bench_tables.py --write", "README: what you gain",
          render_readme_gain, source=readme_gain_source),
    Table("readme_model_plot", README_PLOT_FILES, "python scripts/bench_tables.py --write", "What you gain", None,
          source=readme_plot_source, document="README.md",
          plot=Plot("model_gain_h100_2026-11-24.svg", spec_model_gain,
                    "Bars: the largest micro-batch and the tokens/s at 16k tokens of a verl actor step per model "
                    "size, verl's paths and rl-kernels'")),
]


def render_index(results, document):
    """benchmarks/results/README.md's index: every file, the tables that read or cite it, device, date, command."""
    cited, commands, drawn_from = {}, {}, {}
    for t in TABLES:
        if t.plot is not None:  # a plot: the device and date of the first file it is drawn from
            cited.setdefault(t.plot.file, []).append(t)
            commands[t.plot.file] = "python scripts/bench_tables.py --write"
            drawn_from[t.plot.file] = t.files[0]
        if t.document == "README.md" or t.name == "readme_gain":  # its files are in BENCHMARKS' tables
            continue
        for name in list(t.files) + list(t.extra_files):
            cited.setdefault(name, []).append(t)
            commands.setdefault(name, t.extra_files.get(name) or t.command)
    rows = []
    for name in sorted(cited):
        meta = results.meta(drawn_from.get(name, name))
        sections = dict.fromkeys((t.document, t.section) for t in cited[name])
        links = [f"[{s}]({os.path.relpath(ROOT / d, (ROOT / document).parent)}#{slug(s)})" for d, s in sections]
        rows.append([link(name, document), "; ".join(links), meta["device"], meta["date"], f"`{commands[name]}`"])
    return table(["file", "section", "device", "date", "command"], rows) + "\n"


def generate(root: Path):
    """{document: (old text, new text)} for every document that holds a marker."""
    results = Results(root)
    by_name = {t.name: t for t in TABLES}
    seen, out = set(), {}
    for document in DOCUMENTS:
        path = root / document
        if not path.is_file():
            continue
        old = path.read_text()

        def replace(match):
            name = match.group(1)
            if name == "results_index":
                body = render_index(results, document)
            elif name in by_name:
                body = by_name[name].text(results, document)
            else:
                raise ResultError(f"{document}: unknown table {name!r} (known: {sorted(by_name)}, results_index)")
            seen.add(name)
            return f"<!-- table: {name} -->\n{body}\n<!-- /table -->"

        out[document] = (old, MARKER.sub(replace, old))
    missing = set(by_name) - seen
    if missing:
        raise ResultError(f"tables no document shows (add their markers): {sorted(missing)}")
    return out


def plot_specs(root: Path):
    """[(plot, its path, its bytes or None, its spec from the result files)] for every table's plot."""
    results = Results(root)
    out = []
    for t in TABLES:
        if t.plot is not None:
            path = root / RESULTS / t.plot.file
            out.append((t.plot, path, path.read_bytes() if path.is_file() else None, t.plot.spec(results, *t.files)))
    return out


def check_plot(plot, old, spec, here):
    """(what is wrong or None, the renderer that drew it when only its data could be compared, else None)."""
    name = f"{RESULTS}/{plot.file}"
    got = recorded(old) if old is not None else None
    if got is None:
        return f"{name}: {'missing' if old is None else 'records no spec of this script (not drawn by it)'}", None
    by, text = got
    if text != spec_text(spec):
        diff = difflib.unified_diff(text.splitlines(True), spec_text(spec).splitlines(True),
                                    f"{name} (its data)", f"{name} (from the result files)")
        sys.stdout.writelines(diff)
        return f"{name}: the data it shows differ from the result files", None
    if here is not None and by == here:
        if draw(spec) != old:
            return f"{name}: differs from a fresh drawing by the same renderer ({here})", None
        return None, None
    return None, by


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 with a diff if a table differs (the default)")
    mode.add_argument("--write", action="store_true", help="rewrite the tables from the result files")
    ap.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this script's checkout)")
    args = ap.parse_args(argv)
    try:
        documents = generate(args.root)
        drawn = plot_specs(args.root)
    except (ResultError, KeyError, ValueError) as exc:
        print(f"bench_tables: {exc}", file=sys.stderr)
        return 1
    here = renderer()
    stale = [(doc, old, new) for doc, (old, new) in documents.items() if old != new]
    if args.write:
        if here is None and drawn:
            print("bench_tables: --write draws the plots with matplotlib, which is not importable here "
                  "(pip install -e '.[bench]')", file=sys.stderr)
            return 1
        for doc, _, new in stale:
            (args.root / doc).write_text(new)
            print(f"rewrote the tables of {doc}")
        for plot, path, old, spec in drawn:
            new = draw(spec)
            if new != old:
                path.write_bytes(new)
                print(f"drew {RESULTS}/{plot.file} ({here})")
        return 0
    for doc, old, new in stale:
        diff = difflib.unified_diff(old.splitlines(True), new.splitlines(True), doc, f"{doc} (generated)")
        sys.stdout.writelines(diff)
    wrong, data_only = [], []
    for plot, _, old, spec in drawn:
        problem, by = check_plot(plot, old, spec, here)
        wrong += [problem] if problem else []
        data_only += [by] if by else []
    for problem in wrong:
        print(f"bench_tables: {problem}", file=sys.stderr)
    if stale or wrong:
        print(f"bench_tables: {len(stale)} document(s) and {len(wrong)} plot(s) differ from the result files; "
              "python scripts/bench_tables.py --write rewrites them", file=sys.stderr)
        return 1
    plots = f"plots: {len(drawn) - len(data_only)} match byte for byte ({here or 'no matplotlib here'})"
    if data_only:
        plots += (f", {len(data_only)} by their data only (drawn by {'; '.join(sorted(set(data_only)))}: the bytes "
                  f"are compared under the renderer that drew them)")
    print(f"tables match the result files in {RESULTS}/ ({', '.join(documents)}); {plots}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
