"""Per-element instruction counts of the kernels' elementwise work, from the sm90 SASS that this
machine's Triton compiles (no GPU needed: ``triton.compile`` for a ``cuda:90`` target, then the
bundled ``nvdisasm``).

python scripts/diag/sass_counts.py

For each kernel (the shipped Hopper launch meta-parameters, bf16 input, log-prob + entropy
outputs / gradients) it prints the instructions per element of the hot region: the innermost loop
body of the from-logits forward (one BLOCK_V chunk), the whole program of the from-logits backward
and, for the fused kernels, the floating-point / special-function / select instructions of the
program (the GEMM mainloop issues none of those: its work is HGMMA), each divided by the elements
one thread handles. A bandwidth-bound kernel on a part with more bytes per second than its
multiprocessors can issue for is bound by this count instead (e.g. the H200: the same 132 SMs as
the H100 at 1.43x the bytes).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

# compiled for the GPU even where the test suite interprets (TRITON_INTERPRET=1), with the FP fusion
# (mul + add -> fma) that Triton 3.6 on the GPU machine applies by default (3.9 warns that its
# default will change)
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402 - after the environment above
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from rl_kernels.tools import diag  # noqa: E402

FP = ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "MUFU", "F2FP", "FCHK", "FRND")


# integer arguments that a launch at the benchmark shapes (16384 x 152064 ...) passes as multiples
# of 16, which Triton's launcher specializes (16-byte vector loads and stores depend on it)
MULTIPLES_OF_16 = {"N", "V", "H", "stride_n", "stride_gn", "stride_hn", "stride_wv", "stride_dzm", "n_rows",
                   "n_cols", "row_start", "col_start"}


def compile_sass(fn, types: dict, consts: dict, num_warps: int, num_stages: int = 3) -> str:
    """nvdisasm text of ``fn`` compiled for sm90; arguments not in ``types`` / ``consts`` are i32,
    a name ending in _ptr is a float32 pointer unless ``types`` says otherwise. Pointers and the
    ``MULTIPLES_OF_16`` integers carry the divisibility-by-16 attribute, as at a real launch."""
    sig = {name: "constexpr" if name in consts else types.get(name, "*fp32" if name.endswith("_ptr") else "i32")
           for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name not in consts and (sig[name].startswith("*") or name in MULTIPLES_OF_16)}
    kernel = triton.compile(ASTSource(fn, signature=sig, constexprs=consts, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    path = os.path.join(tempfile.mkdtemp(), "k.cubin")
    with open(path, "wb") as f:
        f.write(kernel.asm["cubin"])
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    return subprocess.run([nvdisasm, "-c", path], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> list[tuple[str, str]]:
    """(label or '', opcode) per line: labels mark loop heads; a branch's target is in its text."""
    out = []
    for line in sass.splitlines():
        line = line.strip()
        if re.match(r"^\.L_x_\d+:", line):
            out.append((line[:-1], "LABEL"))
            continue
        m = re.match(r"^/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)$", line)
        if m:
            out.append((m.group(3), m.group(2).split(".")[0]))
    return out


def innermost_loop(ins: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The shortest region (over 24 instructions: not a spin) between a label and a later branch
    back to it."""
    labels = {text: i for i, (text, op) in enumerate(ins) if op == "LABEL"}
    best = None
    for i, (text, op) in enumerate(ins):
        if op == "BRA":
            target = re.search(r"\.L_x_\d+", text)
            j = labels.get(target.group(0)) if target else None
            if j is not None and i - j > 24 and (best is None or i - j < best[1] - best[0]):
                best = (j, i)
    return ins[best[0]:best[1] + 1] if best else ins


def report(name: str, ins: list[tuple[str, str]], elements: int, only_fp: bool) -> None:
    counts = collections.Counter(op for _, op in ins if op != "LABEL")
    if only_fp:
        counts = collections.Counter({k: v for k, v in counts.items() if k in FP or k == "ISETP"})
    total = sum(counts.values())
    top = ", ".join(f"{k} {v / elements:.2f}" for k, v in counts.most_common(9))
    print(f"{name:44s} {total / elements:5.2f} per element  ({top})", flush=True)


def main() -> None:
    diag.parser(__doc__).parse_args()
    lc = diag.ops.config.LOGITS_CUDA_CONFIG
    fwd = compile_sass(
        diag.jit_kernel("logits_fwd"),
        dict(x_ptr="*bf16", labels_ptr="*i64", counter_ptr="*i32", label_flag_ptr="*i32",
             inv_temperature="fp32", stride_n="i64"),
        dict(SPLIT_V=lc.split_v, BLOCK_V=lc.block_v, TWO_LEVEL=False, LAST_COMBINES=False, LOG_PROBS=True,
             ENTROPY=True, MEAN_LOG_P=False, SUM_PI_SQUARED=False, PREFETCH=lc.prefetch, stride_v=1,
             ROW_TEMPERATURE=False, TAIL=False, BLOCK_IDS=1),
        lc.num_warps)
    report("from logits, forward (chunk loop body)", innermost_loop(instructions(fwd)),
           lc.block_v // (32 * lc.num_warps), only_fp=False)
    bwd = compile_sass(
        diag.jit_kernel("logits_bwd"),
        dict(x_ptr="*bf16", grad_ptr="*bf16", labels_ptr="*i64", inv_temperature="fp32",
             stride_n="i64", stride_gn="i64"),
        dict(BLOCK_V=lc.bwd_block_v, HAS_LABELS=True, HAS_GRAD_LOG_PROBS=True, HAS_GRAD_ENTROPY=True,
             HAS_GRAD_LSE=False, HAS_GRAD_MEAN_LOG_P=False, HAS_GRAD_SUM_PI_SQUARED=False,
             BLOCKS_PER_PROGRAM=lc.bwd_blocks_per_program, stride_v=1, stride_gv=1, ROW_TEMPERATURE=False,
             HAS_GRAD_TAIL_LSE=False),
        lc.bwd_num_warps)
    report("from logits, backward (whole program)", instructions(bwd),
           lc.bwd_block_v * lc.bwd_blocks_per_program // (32 * lc.bwd_num_warps), only_fp=False)
    cfg = diag.ops.CUDA_CONFIG
    gemm = dict(h_ptr="*bf16", w_ptr="*bf16", logit_scale="fp32", softcap_scale="fp32",
                stride_hn="i64", stride_wv="i64")
    meta = dict(BLOCK_K=cfg.block_k, UPCAST=False, DOT_PRECISION="tf32", GROUP_M=cfg.group_m, USE_TMA=False,
                stride_hk=1, stride_wk=1)
    tile = cfg.bwd_cols
    dl = compile_sass(
        diag.jit_kernel("linear_dlogits"),
        dict(gemm, labels_ptr="*i64", dz_ptr="*bf16", inv_temperature="fp32", stride_dzm="i64"),
        dict(meta, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, HAS_GRAD_LOG_PROBS=True, HAS_GRAD_ENTROPY=True,
             HAS_GRAD_LSE=False, HAS_GRAD_SUM_PI_SQUARED=False, FLATTEN=False, STORE_TMA=False, OUT_DTYPE=None,
             SOFTCAP=False, LIBDEVICE=False, stride_dzn=1, ROW_TEMPERATURE=False, TAIL=False, BLOCK_IDS=1),
        tile.num_warps, tile.num_stages)
    report("fused dlogits (fp / select / compare)", instructions(dl),
           tile.block_m * tile.block_n // (32 * tile.num_warps), only_fp=True)
    fs = compile_sass(
        diag.jit_kernel("linear_split_stats"), gemm,
        dict(meta, SPLIT_V=cfg.split_v, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ENTROPY=True, EVEN_V=True,
             FLATTEN=False, WARP_SPEC=False, SUM_PI_SQUARED=False, SOFTCAP=False, LIBDEVICE=False,
             ROW_TEMPERATURE=False, TAIL=False, BLOCK_IDS=1, TOPK=False, K=1, KP=1),
        cfg.num_warps, cfg.num_stages)
    report("fused forward (fp / select / compare)", instructions(fs),
           cfg.block_m * cfg.block_n // (32 * cfg.num_warps), only_fp=True)


if __name__ == "__main__":
    main()
