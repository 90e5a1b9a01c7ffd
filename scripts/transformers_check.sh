#!/usr/bin/env bash
# rl-kernels' lm-head audit and verl tests on a newer transformers than the README venv's:
# scripts/transformers_check.sh [VENV] [TRANSFORMERS_VERSION]
#
#   VENV                  the venv to build (default: .venv-transformers beside the README's .venv)
#   TRANSFORMERS_VERSION  e.g. 5.24.0 (default: the newest on the package index)
#
# Run from the repository root after the README's test set-up (its .venv). Like the verl matrix in
# .ci/run, the new venv sees the README venv's packages (torch, verl, rl-kernels itself, ...)
# through a .pth line placed after its own site-packages, and holds only transformers
# (`pip install --no-deps`) and those of its requirements that the README venv does not satisfy
# (tokenizers, huggingface-hub, ...; never torch), so its transformers wins and the same torch
# runs. It prints the causal-LM model types of that transformers which the audit table
# (rl_kernels/integrations/lm_heads.py) does not list: they are refused on the fused path until
# each one's forward is read and classified there. Then `pytest -m verl_matrix
# tests/integrations/test_lm_heads.py` runs there. CI does not run this script (integrations/verl/README.md,
# "## transformers audit", records the last run).
set -euo pipefail
usage="usage: $0 [VENV] [TRANSFORMERS_VERSION]"
if [[ ${1:-} == -h || ${1:-} == --help ]]; then echo "$usage"; sed -n '2,/^set -euo/s/^# \{0,1\}//p' "$0"; exit 0; fi
[[ $# -le 2 ]] || { echo "$usage" >&2; exit 2; }
cd "$(dirname "$0")/.."
[[ -x .venv/bin/python ]] || { echo "$0: no .venv here: run the README's test set-up first" >&2; exit 2; }
venv=${1:-.venv-transformers}
spec=transformers${2:+==$2}
base_site=$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')
python3 -m venv "$venv"
echo "import site; site.addsitedir('$base_site')" > "$(ls -d "$venv"/lib/python3*/site-packages)/zz_rl_kernels_base.pth"
"$venv/bin/pip" install -q --no-deps --ignore-installed "$spec"  # into the venv, even where the README venv has it
# transformers' own requirements that the layered environment does not meet (a few rounds: a
# newly installed one may need a newer one in turn); torch is never installed here
for _ in 1 2 3; do
    missing=$("$venv/bin/python" - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement
out, todo, seen = [], ["transformers"], set()
while todo:
    dist = todo.pop()
    for line in md.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = req.name.lower()
        if name in seen or name == "torch":
            continue
        seen.add(name)
        try:
            ok = req.specifier.contains(md.version(req.name), prereleases=True)
        except md.PackageNotFoundError:
            ok = False
        if not ok:
            out.append(str(req).replace(" ", ""))
        elif name in ("tokenizers", "huggingface-hub"):
            todo.append(req.name)
print(" ".join(out))
EOF
)
    [[ -z "$missing" ]] && break
    echo "installing transformers' requirements not met by the README venv: $missing"
    # shellcheck disable=SC2086
    "$venv/bin/pip" install -q --no-deps --ignore-installed $missing
done
"$venv/bin/python" - "$venv" <<'EOF'
import os, sys
import torch, transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from rl_kernels.integrations.lm_heads import LM_HEADS
where = os.path.realpath(transformers.__file__)
assert where.startswith(os.path.realpath(sys.argv[1]) + os.sep), f"transformers imported from {where}, not the new venv"
print(f"transformers {transformers.__version__} from {os.path.dirname(where)}; torch {torch.__version__}")
new = sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) - set(LM_HEADS))
print(f"{len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} causal-LM model types; not in the audit table ({len(new)}, refused "
      f"until audited): {', '.join(f'{t} ({MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t]})' for t in new) or 'none'}")
EOF
"$venv/bin/python" -m pytest -m verl_matrix -p no:cacheprovider tests/integrations/test_lm_heads.py
