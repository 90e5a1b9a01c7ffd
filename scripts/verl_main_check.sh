#!/usr/bin/env bash
# rl-kernels' verl integration tests on a verl built from source (verl's main branch, or any
# checkout): scripts/verl_main_check.sh VERL_SOURCE [VENV]
#
#   VERL_SOURCE  a verl source tree (a clone or an unpacked snapshot of verl-project/verl)
#   VENV         the venv to build (default: .venv-verl-src beside the README's .venv)
#
# Run from the repository root after the README's test set-up (its .venv). Like the verl matrix in
# .ci/run, the new venv sees the README venv's packages (torch, Ray, transformers, rl-kernels
# itself, ...) through a .pth line placed after its own site-packages, and holds only verl, built
# from VERL_SOURCE with `pip install --no-deps` (no other package is resolved, so the same torch
# runs). Then `pytest -m verl_matrix` runs there. Then verl's own CPU unit tests of the functions and
# engine methods the integration replaces (VERL_TESTS below, from VERL_SOURCE's tests/) run twice
# on that verl: as verl ships, and with the integration imported first (the pytest plugin
# tests/support/verl_patched.py); both counts are printed, and the script fails when the patched
# run fails a test that the unpatched run passes. CI does not run this script: it cannot reach a
# verl snapshot (integrations/verl/README.md's release table records the last run).
set -euo pipefail
usage="usage: $0 VERL_SOURCE [VENV]"
if [[ ${1:-} == -h || ${1:-} == --help ]]; then echo "$usage"; sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0"; exit 0; fi
[[ $# -ge 1 && $# -le 2 ]] || { echo "$usage" >&2; exit 2; }
src=$(realpath "$1")
[[ -f "$src/setup.py" || -f "$src/pyproject.toml" ]] && [[ -d "$src/verl" ]] || {
    echo "$0: $1 is not a verl source tree (no setup.py / pyproject.toml and verl/ there)" >&2; exit 2; }
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || { echo "$0: no .venv here: run the README's test set-up first" >&2; exit 2; }
venv=${2:-.venv-verl-src}
base_site=$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
python3 -m venv "$venv"
echo "import site; site.addsitedir('$base_site')" > "$(ls -d "$venv"/lib/python3*/site-packages)/zz_rl_kernels_base.pth"
"$venv/bin/pip" install -q --no-deps "$src"
"$venv/bin/python" - "$src" <<'EOF'
import importlib.metadata, os, sys
import verl
where = os.path.dirname(verl.__file__)
assert not where.startswith(os.path.realpath(sys.argv[1]) + os.sep), f"verl imported from the source tree {where}"
print(f"verl {importlib.metadata.version('verl')} from {where}")
EOF
commit=$(git -C "$src" rev-parse HEAD 2>/dev/null || echo "(not a git checkout)")
echo "verl source: $src, commit $commit"
"$venv/bin/python" -m pytest -m verl_matrix -p no:cacheprovider

# verl's own tests of what the integration replaces (rl_kernels/integrations/verl/): the from-logits
# functions, FusedLinearForPPO under verl's fused forwards, the distillation loss, the engines'
# logits processors and forward_step, the Megatron fused forward. Deselected in both runs:
# test_distributed_* (NCCL on 2 and 4 GPUs) and, on the Megatron fused forward, a GPTModel subclass
# that overrides forward, which rl-kernels refuses by design (integrations/verl/README.md, "Which
# models the fused path serves": verl's fused forward skips the override).
VERL_TESTS=(tests/utils/test_torch_functional.py tests/models/test_fused_kernels_ulysses_sp_on_cpu.py
            tests/workers/test_distillation_topk_symmetry_on_cpu.py
            tests/workers/test_megatron_distillation_only_on_cpu.py
            tests/workers/test_engine_forward_step_detach_on_cpu.py tests/models/test_model_forward_fused.py)
DESELECT="not test_distributed_ and not test_legacy_fallback_patch_and_unpatch_are_idempotent"
root=$PWD venv_python=$(realpath "$venv")/bin/python
out=$(mktemp -d)
status=0
for run in unpatched patched; do
    plugin=(); [[ $run == patched ]] && plugin=(-p verl_patched)
    # run from $out: verl from the venv, rl-kernels from this checkout, nothing from a source tree
    (cd "$out" && PYTHONPATH="$root:$root/tests/support" "$venv_python" -m pytest "${plugin[@]}" \
        -c /dev/null --rootdir "$src" -p no:cacheprovider -p no:warnings -q --tb=short -rfE -k "$DESELECT" \
        "${VERL_TESTS[@]/#/$src/}") > "$out/$run.log" 2>&1 || true
    grep -E '^(FAILED|ERROR) ' "$out/$run.log" | sed 's/ - .*//' | sort > "$out/$run.failed" || true
    echo "verl's own tests, $run: $(grep -E '[0-9]+ (passed|failed|errors?)' "$out/$run.log" | tail -1)"
done
grep '^rl_kernels calls served' "$out/patched.log" || true
new=$(comm -13 "$out/unpatched.failed" "$out/patched.failed")
if [[ -n $new ]]; then
    echo "FAILED with the integration imported only:"; echo "$new"; status=1
fi
echo "logs: $out/unpatched.log, $out/patched.log"
exit $status
