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
# runs). Then `pytest -m verl_matrix` runs there. CI does not run this script: it cannot reach a
# verl snapshot (integrations/verl/README.md's release table records the last run).
set -euo pipefail
[[ $# -ge 1 && $# -le 2 ]] || { echo "usage: $0 VERL_SOURCE [VENV]" >&2; exit 2; }
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
