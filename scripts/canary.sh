#!/usr/bin/env bash
# The canary: is the next release of what users install with us already a break? Builds a fresh environment with the
# newest torch, transformers, PEFT, TRL, accelerate and tokenizers on the package registry (that torch is a CUDA build,
# about 3 GB with its nvidia-* packages; it runs on a CPU) and runs the daily selection of the suite (scripts/test.sh
# --quick: no multi-device tests) with the users' recipes whole. Prints the versions it used beside the newest row of
# the pinned matrix (and torch beside the pinned 2.13.0 of the matrix), then what broke.
# Not part of CI, which stays on the pinned matrix (scripts/test.sh). Run it at the start of every day of work.
#   scripts/canary.sh                 # about 5 minutes on 2 cores, plus the downloads of new releases
#   scripts/canary.sh -k cache_use    # extra pytest arguments
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CHATGLM_VENV="${CHATGLM_CANARY_VENV:-$ROOT/.venv-canary}" CHATGLM_TORCH=newest
rm -rf "$CHATGLM_VENV"
echo "canary: a fresh environment in $CHATGLM_VENV with the newest releases on the registry"
# shellcheck source=env.sh
source "$ROOT/scripts/env.sh" newest || { echo "canary: the environment could not be built"; exit 2; }
set +e
REPORTS="$(mktemp -d)"
trap 'rm -rf "$REPORTS"' EXIT

PINNED_TRANSFORMERS="$(sed -n 's/^MATRIX=(.* \([0-9.]*\))$/\1/p' "$ROOT/scripts/test.sh")"
companion_pins "$PINNED_TRANSFORMERS"
echo "canary: versions (newest on the registry / newest row of the pinned matrix)"
"$PY" - "$PINNED_TRANSFORMERS" "$PEFT_PIN" "$TRL_PIN" "$DEFAULT_TORCH" <<'PY'
import importlib.metadata as metadata, sys
pinned = dict(zip(("transformers", "peft", "trl", "torch"), sys.argv[1:]))
for name in ("transformers", "peft", "trl", "accelerate", "tokenizers", "huggingface-hub", "safetensors", "torch"):
    have, pin = metadata.version(name).split("+")[0], pinned.get(name)
    note = "" if pin is None else ("  (pinned)" if have == pin else f"  NEWER than the pinned {pin}")
    print(f"  {name:16} {have}{note}")
PY

cd "$ROOT"
"$PY" -m pytest -q -m "not matrix_ends and not multi_device" --junitxml="$REPORTS/quick.xml" "$@"
"$PY" -m pytest -q -m "matrix_ends" tests/test_recipes.py --junitxml="$REPORTS/recipes.xml" "$@"

"$PY" - "$REPORTS" <<'PY'
import sys, pathlib, xml.etree.ElementTree as ET
passed = skipped = 0
broke = []
for report in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            passed += 1
        elif outcome.tag == "skipped":
            skipped += 1
        else:
            first_line = (outcome.get("message") or "").strip().splitlines()[:1]
            broke.append(f"{case.get('classname')}::{case.get('name')}: {first_line[0] if first_line else outcome.tag}")
print(f"canary: {passed} passed, {len(broke)} broke, {skipped} skipped")
for line in broke:
    print(f"  BROKE {line[:220]}")
sys.exit(1 if broke else 0)
PY
