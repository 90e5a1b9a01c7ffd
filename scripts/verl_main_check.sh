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
# runs). Then `pytest -m verl_matrix` runs there. Then verl's own CPU test files that reach a symbol the integration replaces or wraps
# (found by grep over VERL_SOURCE's tests/ for the symbols the patch sets, below) run twice on that
# verl: as verl ships, and with the integration imported first (the pytest plugin
# tests/support/verl_patched.py); both counts are printed, and the script fails when the patched
# run fails a test that the unpatched run passes and integrations/verl/README.md does not list as
# a by-design difference. CI does not run this script: it cannot reach a
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

# verl's own CPU tests that reach what the integration replaces or wraps: the symbols are read from
# the patch itself (every attribute it set: a module-level function by its name, a class's method
# by the class's name), and every test file under VERL_SOURCE/tests naming one (grep -w) runs,
# except verl's GPU / NPU / multi-node ones (*_on_gpu*, *_on_npu*, special_*). test_distributed_*
# (NCCL on 2 and 4 GPUs) is deselected in both runs. A test that fails only patched fails the
# script unless integrations/verl/README.md lists it ("verl's own tests that differ by design":
# a line "- `tests/<file>::<test>`: <reason>").
root=$PWD venv_python=$(realpath "$venv")/bin/python
out=$(mktemp -d)
PYTHONPATH="$root" "$venv_python" - > "$out/symbols" 2>/dev/null <<'EOF2'
import logging, warnings
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
import rl_kernels.integrations.verl as rkv
from rl_kernels.integrations.verl_impl import patch_state
names = set()
for owner, name, _ in patch_state._undo:  # every set_attr of the patch
    names.add(owner.__name__ if isinstance(owner, type) else name)
print("\n".join(sorted(n for n in names if not n.startswith("__"))))
EOF2
[[ -s $out/symbols ]] || { echo "$0: the integration patched nothing on this verl" >&2; exit 1; }
pattern=$(paste -sd'|' "$out/symbols")
mapfile -t VERL_TESTS < <(cd "$src" && grep -rlwE --include='test_*.py' "$pattern" tests \
    | grep -vE '_on_(gpu|npu)|(^|/)special_|/test_special_' | sort)
echo "symbols replaced or wrapped ($(wc -l < "$out/symbols")): $(paste -sd' ' "$out/symbols")"
echo "verl's test files reaching them (${#VERL_TESTS[@]}): ${VERL_TESTS[*]}"
DESELECT="not test_distributed_"
status=0
for run in unpatched patched; do
    plugin=(); [[ $run == patched ]] && plugin=(-p verl_patched)
    # run from $out: verl from the venv, rl-kernels from this checkout, nothing from a source tree
    (cd "$out" && PYTHONPATH="$root:$root/tests/support" "$venv_python" -m pytest "${plugin[@]}" \
        -c /dev/null --rootdir "$src" -p no:cacheprovider -p no:warnings -q --tb=short -rfE -k "$DESELECT" \
        "${VERL_TESTS[@]/#/$src/}") > "$out/$run.log" 2>&1 || true
    # test ids as the README lists them: tests/<file>::<test>, parameters dropped (pytest prints the
    # paths relative to $out, e.g. ../../work/verl/tests/...)
    grep -E '^(FAILED|ERROR) ' "$out/$run.log" | sed -E 's/ - .*//; s/^[A-Z]+ //; s/\[.*//; s#^.*/tests/#tests/#' \
        | sort -u > "$out/$run.failed" || true
    counts=$(grep -E '[0-9]+ (passed|failed|errors?|skipped)' "$out/$run.log" | tail -1)
    echo "verl's own tests, $run: ${counts:-(no pytest summary: the run did not finish)}"
    [[ -n $counts ]] || status=1
done
grep '^rl_kernels calls served' "$out/patched.log" || true
grep -oE '^- `tests/[^`]+::[^`]+`' "$root/integrations/verl/README.md" | sed 's/^- `//; s/`$//' | sort -u > "$out/by_design"
comm -13 "$out/unpatched.failed" "$out/patched.failed" > "$out/patched_only"
listed=$(comm -12 "$out/patched_only" "$out/by_design")
[[ -n $listed ]] && { echo "failed patched only, by design (integrations/verl/README.md):"; echo "$listed"; }
new=$(comm -23 "$out/patched_only" "$out/by_design")
if [[ -n $new ]]; then
    echo "FAILED with the integration imported only, not listed as by design:"; echo "$new"; status=1
fi
stale=$(comm -13 "$out/patched_only" "$out/by_design")
[[ -n $stale ]] && { echo "listed as by design but not failing patched only here (stale entry, or skipped):"; echo "$stale"; }
echo "logs: $out/unpatched.log, $out/patched.log"
exit $status
