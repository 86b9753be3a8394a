#!/usr/bin/env bash
# The test suite on the transformers version matrix, in one virtual environment (torch installed once, transformers
# swapped per version). The oldest and newest versions run everything; the versions between them skip the tests
# marked `matrix_ends` (multi-device and tensor-parallel runs, the slowest). Prints one summary line at the end.
#   scripts/test.sh                 # the whole matrix
#   scripts/test.sh 5.24.0 -k parity   # one version, extra pytest arguments
#   scripts/test.sh --quick         # daily work: the newest version, no multi-device / tensor-parallel tests
#   scripts/test.sh --minimal [VERSION]   # only the core suite in the minimal environment
#   scripts/test.sh --torch-ends    # only the torch ends (below)
# The whole matrix also runs the core suite in a minimal environment (.venv-minimal: only torch, transformers,
# accelerate, safetensors, sentencepiece, tiktoken and the test runner) on the oldest and newest versions: tests of
# optional features skip there naming their package, and nothing else may need more than the six dependencies.
# It also runs the core suite (with the attention and torch.compile tests) at the two ends of the torch range, each in
# its own environment (scripts/env.sh, CHATGLM_TORCH): the oldest torch users have (2.4, GLM-4's own floor) with the
# oldest transformers, and the newest torch on the registry with the newest transformers (the matrix itself runs on
# torch 2.13.0).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MATRIX=(4.44.2 4.46.3 4.49.0 4.53.3 4.57.6 5.0.0 5.23.0 5.24.0)
OLDEST=4.44.2; NEWEST=5.24.0
MINIMAL=("$OLDEST" "$NEWEST")
CORE=(tests/test_loading.py tests/test_parity.py tests/test_quantized.py tests/test_generation.py tests/test_cache_use.py tests/test_chat.py
      tests/test_inputs.py tests/test_tokenizer.py tests/test_fast_tokenizer.py tests/test_training.py
      tests/test_recipes.py tests/test_overrides.py tests/test_dependencies.py tests/test_surface.py)
NEWEST_TORCH="$(sed -n 's/^torch==//p' "$ROOT/scripts/requirements-newest-torch.txt")"
TORCH_ENDS=("2.4.1 $OLDEST" "$NEWEST_TORCH $NEWEST")
TORCH_SENSITIVE=(tests/test_attention.py tests/test_compile.py)  # besides the core suite: the kernels, torch.compile
if [ $# -gt 0 ] && [ "$1" = "--torch-ends" ]; then
  shift; MATRIX=(); MINIMAL=()
elif [ $# -gt 0 ] && [ "$1" = "--minimal" ]; then
  shift; MATRIX=(); TORCH_ENDS=()
  if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+\.[0-9]+ ]]; then MINIMAL=("$1"); shift; fi
elif [ $# -gt 0 ]; then
  MINIMAL=(); TORCH_ENDS=()  # a version or --quick: the full environment only
fi
if [ $# -gt 0 ] && [ "$1" = "--quick" ]; then shift; set -- "$NEWEST" -m "not matrix_ends and not multi_device" "$@"; fi
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+\.[0-9]+ ]]; then MATRIX=("$1"); shift; fi
REPORTS="$(mktemp -d)"
status=0
for version in "${MATRIX[@]}"; do
  echo "=== transformers $version ==="
  selection=()
  if [ "$version" != "$OLDEST" ] && [ "$version" != "$NEWEST" ]; then selection=(-m "not matrix_ends"); fi
  (source "$ROOT/scripts/env.sh" "$version" >/dev/null && cd "$ROOT" && \
    "$PY" -m pytest -q "${selection[@]}" --junitxml="$REPORTS/$version.xml" "$@")
  rc=$?
  # Any non-zero exit fails the run: set-up errors, test failures, and pytest's 5 for "no test collected".
  if [ $rc -ne 0 ]; then status=1; echo "transformers $version: exited $rc"; fi
done
for version in "${MINIMAL[@]}"; do
  echo "=== transformers $version, minimal environment ==="
  (export CHATGLM_MINIMAL=1 CHATGLM_TEST_ENV=minimal && source "$ROOT/scripts/env.sh" "$version" >/dev/null && \
    cd "$ROOT" && "$PY" - <<'CHECK' && "$PY" -m pytest -q --junitxml="$REPORTS/$version-minimal.xml" "${CORE[@]}" "$@")
import importlib.util, sys
present = [name for name in ("PIL", "peft", "torchao", "optimum", "trl", "torchvision") if importlib.util.find_spec(name)]
sys.exit(f"the minimal environment holds optional packages: {present}" if present else 0)
CHECK
  rc=$?
  if [ $rc -ne 0 ]; then status=1; echo "transformers $version, minimal environment: exited $rc"; fi
done
for end in "${TORCH_ENDS[@]}"; do
  read -r torch version <<<"$end"
  echo "=== torch $torch, transformers $version ==="
  (export CHATGLM_TORCH="$torch" && source "$ROOT/scripts/env.sh" "$version" >/dev/null && cd "$ROOT" && \
    "$PY" -m pytest -q --junitxml="$REPORTS/$version-torch$torch.xml" "${CORE[@]}" "${TORCH_SENSITIVE[@]}" "$@")
  rc=$?
  if [ $rc -ne 0 ]; then status=1; echo "torch $torch, transformers $version: exited $rc"; fi
done
python3 - "$REPORTS" <<'PY'
import sys, pathlib, xml.etree.ElementTree as ET
passed = failed = skipped = 0
for report in sorted(pathlib.Path(sys.argv[1]).glob("*.xml")):
    for suite in ET.parse(report).getroot().iter("testsuite"):
        tests, fail = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
        skip = int(suite.get("skipped"))
        print(f"  transformers {report.stem}: {tests - fail - skip} passed, {fail} failed, {skip} skipped")
        passed += tests - fail - skip; failed += fail; skipped += skip
print(f"matrix: {passed} passed, {failed} failed, {skipped} skipped")
PY
rm -rf "$REPORTS"
exit $status
