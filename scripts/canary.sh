#!/usr/bin/env bash
# The canary: is the next release of what users install with us already a break? Builds a fresh environment with the
# newest torch, transformers, PEFT, TRL, accelerate and tokenizers on the package registry (that torch is a CUDA build,
# about 3 GB with its nvidia-* packages; it runs on a CPU) and runs the daily selection of the suite (scripts/test.sh
# --quick: no multi-device tests) with the users' recipes whole. Prints the versions it used beside the newest row of
# the pinned matrix (torch beside the newest torch end of scripts/test.sh) and beside the registry's newest, then what
# broke. Exits non-zero on a break, or when something was installed older than the registry's newest (a pip cap).
# Not part of CI, which stays on the pinned matrix (scripts/test.sh). Run it at the start of every day of work.
#   scripts/canary.sh                 # about the quick run's time, plus the downloads of new releases
#   scripts/canary.sh -k cache_use    # extra pytest arguments
# Record each run in docs/run-history.md (the canary).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export CHATGLM_VENV="${CHATGLM_CANARY_VENV:-$ROOT/.venv-canary}" CHATGLM_TORCH=newest
rm -rf "$CHATGLM_VENV"
echo "canary: a fresh environment in $CHATGLM_VENV with the newest releases on the registry"
# shellcheck source=env.sh
source "$ROOT/scripts/env.sh" newest || { echo "canary: the environment could not be built"; exit 2; }
set +e
HELD_BACK=0
REPORTS="$(mktemp -d)"
trap 'rm -rf "$REPORTS"' EXIT

PINNED_TRANSFORMERS="$(sed -n 's/^MATRIX=(.* \([0-9.]*\))$/\1/p' "$ROOT/scripts/test.sh")"
NEWEST_TORCH_END="$(sed -n 's/^torch==//p' "$ROOT/scripts/requirements-newest-torch.txt")"
companion_pins "$PINNED_TRANSFORMERS"
echo "canary: versions (installed / newest row of the pinned matrix; torch: the newest torch end of scripts/test.sh)"
# The registry is asked too: a local pip cap (a constraint in pip's own config) once installed torch 2.14.1 here for
# a month after 2.15.0 shipped, and the canary reported it as the newest.
"$PY" - "$PINNED_TRANSFORMERS" "$PEFT_PIN" "$TRL_PIN" "$NEWEST_TORCH_END" <<'PY' || HELD_BACK=1
import importlib.metadata as metadata, re, subprocess, sys
from packaging.version import Version
pinned = dict(zip(("transformers", "peft", "trl", "torch"), sys.argv[1:]))
held_back = []
for name in ("transformers", "peft", "trl", "accelerate", "tokenizers", "huggingface-hub", "safetensors", "torch"):
    have, pin = metadata.version(name).split("+")[0], pinned.get(name)
    note = "" if pin is None else ("  (pinned)" if have == pin else
                                   f"  {'NEWER' if Version(have) > Version(pin) else 'OLDER'} than the pinned {pin}")
    index = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name, "--disable-pip-version-check"],
                           capture_output=True, text=True).stdout
    newest = re.match(rf"{re.escape(name)} \(([^)]+)\)", index.strip(), re.IGNORECASE)
    if newest is None:
        note += "  (the registry did not answer)"
    elif newest.group(1) != have:
        note += f"  HELD BACK: the registry has {newest.group(1)}"
        held_back.append(name)
    print(f"  {name:16} {have}{note}")
if held_back:
    print(f"canary: {', '.join(held_back)} not at the registry's newest; a cap in pip's configuration "
          "(`pip config list`, a `constraint` entry) or a dependency's upper bound kept it out")
# What the matrix tracks must be the newest; the others may be held by an upper bound of transformers itself.
sys.exit(1 if set(held_back) & set(pinned) else 0)
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
tests_rc=$?
if [ "$HELD_BACK" = 1 ]; then echo "canary: FAILED to test the newest releases (HELD BACK above)"; exit 1; fi
exit "$tests_rc"
