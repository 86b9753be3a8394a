#!/usr/bin/env bash
# The test suite on the transformers version matrix, in one virtual environment (torch installed once, transformers
# swapped per version). The newest version runs everything, the oldest all but the benchmark scripts' runs
# (`newest_end`); the versions between them also skip the tests marked `matrix_ends` (the heavy tests: docs/testing.md)
# and `release_independent` (what no transformers release can change: pytest.ini). Prints each phase's counts and
# times, then one summary line.
#   scripts/test.sh                 # the whole matrix (what CI runs); its summary gives each phase's times
#   scripts/test.sh 5.24.0 -k parity   # one version, extra pytest arguments
#   scripts/test.sh --quick         # daily work: the newest version, no multi-device / tensor-parallel tests
#   scripts/test.sh --smoke         # the edit-run loop: the newest version, the tests marked `smoke` (listed in
#                                   # tests/conftest.py: load, forward, generate, chat, tokenizers, a golden case per
#                                   # family; its times: docs/run-history.md)
#   scripts/test.sh --minimal [VERSION]   # only the core suite in the minimal environment
#   scripts/test.sh --torch-ends    # only the torch ends (below)
# The whole matrix also runs the core suite in a minimal environment (.venv-minimal: only torch, transformers,
# accelerate, safetensors, sentencepiece, tiktoken and the test runner) on the newest version: tests of optional
# features skip there naming their package, and nothing else may need more than the six dependencies. On every version
# tests/test_dependencies.py loads, runs and tokenizes with the optional packages hidden (`--minimal 4.44.2` runs the
# oldest in the real environment).
# It also runs the core suite (with the attention and torch.compile tests) at the two ends of the torch range, each in
# its own environment (scripts/env.sh, CHATGLM_TORCH): the oldest torch users have (2.4, GLM-4's own floor) with the
# oldest transformers, and the newest torch on the registry with the newest transformers (the matrix itself runs on
# torch 2.13.0).
# The whole matrix runs in two lanes side by side (the tests' tiny models keep a process on about one core; CI has two):
# both lanes take phases from one queue, the longest first (the matrix's ends, the torch ends, the minimal
# environment, then the versions between the ends), so that neither lane is left with a long phase at the end. A
# matrix version runs in the lane's own environment: .venv in lane 1, .venv-matrix2 (the same packages) in lane 2.
# Each phase's output is printed whole when it ends; each lane's torch uses one thread (OMP_NUM_THREADS=1, unless set).
# The minimal environment skips the tests marked `matrix_ends` (the heavy variants of tests it runs: they need no
# more packages), and the torch ends skip the tokenizer modules (no torch in them).
# CHATGLM_TEST_LANES=1 runs every phase in one lane, printing as it goes.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MATRIX=(4.44.2 4.46.3 4.49.0 4.53.3 4.57.6 5.0.0 5.23.0 5.24.0)
OLDEST=4.44.2; NEWEST=5.24.0
MINIMAL=("$NEWEST")
CORE=(tests/test_loading.py tests/test_parity.py tests/test_quantized.py tests/test_generation.py tests/test_cache_use.py tests/test_chat.py
      tests/test_inputs.py tests/test_tokenizer.py tests/test_fast_tokenizer.py tests/test_training.py
      tests/test_recipes.py tests/test_overrides.py tests/test_dependencies.py tests/test_surface.py)
NEWEST_TORCH="$(sed -n 's/^torch==//p' "$ROOT/scripts/requirements-newest-torch.txt")"
TORCH_ENDS=("2.4.1 $OLDEST" "$NEWEST_TORCH $NEWEST")
TORCH_SENSITIVE=(tests/test_attention.py tests/test_compile.py)  # besides the core suite: the kernels, torch.compile
TORCH_FREE=(tests/test_tokenizer.py tests/test_fast_tokenizer.py)  # of the core suite: not run at the torch ends
LANES="${CHATGLM_TEST_LANES:-2}"
if [ $# -gt 0 ] && [ "$1" = "--torch-ends" ]; then
  shift; MATRIX=(); MINIMAL=(); LANES=1
elif [ $# -gt 0 ] && [ "$1" = "--minimal" ]; then
  shift; MATRIX=(); TORCH_ENDS=(); LANES=1
  if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+\.[0-9]+ ]]; then MINIMAL=("$1"); shift; fi
elif [ $# -gt 0 ]; then
  MINIMAL=(); TORCH_ENDS=(); LANES=1  # a version or --quick: the full environment only
fi
if [ $# -gt 0 ] && [ "$1" = "--quick" ]; then shift; set -- "$NEWEST" -m "not matrix_ends and not multi_device" "$@"; fi
if [ $# -gt 0 ] && [ "$1" = "--smoke" ]; then
  shift; set -- "$NEWEST" -m smoke "$@"
  export CHATGLM_SETUP=smoke  # scripts/env.sh: no optional packages to check or install
fi
if [ $# -gt 0 ] && [[ "$1" =~ ^[0-9]+\.[0-9]+ ]]; then MATRIX=("$1"); shift; fi
REPORTS="$(mktemp -d)"
START=$SECONDS

# phase KIND VERSION [TORCH [VENV]]: sets up the phase's environment and runs its tests. KIND: matrix (VENV: .venv
# unless given), minimal, torch. Leaves in $REPORTS: NAME.xml (junit), NAME.times ("exit set-up tests lane"), and
# prints the output as it comes (one lane) or whole when the phase ends (two lanes).
phase() {
  local kind="$1" version="$2" torch="${3:-}" name title log begin setup
  case "$kind" in
    matrix) name="$version"; title="transformers $version" ;;
    minimal) name="$version-minimal"; title="transformers $version, minimal environment" ;;
    torch) name="$version-torch$torch"; title="torch $torch, transformers $version" ;;
  esac
  log="$REPORTS/$name.log"; begin=$SECONDS
  if [ "$LANES" = 1 ]; then echo "=== $title ==="; phase_run "$@" 2>&1 | tee "$log"
  else echo "--- lane $LANE: $title (started at $((SECONDS - START)) s)" | flock "$REPORTS/.print" cat
    phase_run "$@" >"$log" 2>&1; fi
  local rc="${PIPESTATUS[0]}"
  setup=$((SECONDS - begin))  # a set-up that failed: all of it
  if [ -f "$REPORTS/$name.setup" ]; then read -r setup <"$REPORTS/$name.setup"; fi
  echo "$rc $setup $((SECONDS - begin - setup)) $LANE" >"$REPORTS/$name.times"
  # Any non-zero exit fails the run: set-up errors, test failures, and pytest's 5 for "no test collected".
  if [ "$LANES" != 1 ]; then
    { echo "=== $title (lane $LANE) ==="; cat "$log"; } | flock "$REPORTS/.print" cat
  fi
  if [ "$rc" -ne 0 ]; then echo "$title: exited $rc"; fi
}

# phase_run: the phase in a subshell (the environment's variables stay there); NAME.setup: the set-up's seconds.
phase_run() (
  local kind="$1" version="$2" torch="${3:-}" venv="${4:-}" begin=$SECONDS selection=()
  case "$kind" in
    matrix) [ -n "$venv" ] && export CHATGLM_VENV="$venv"
            # The versions between the ends skip what is checked on the ends only, the oldest what is checked on the
            # newest only (pytest.ini).
            if [ "$version" = "$OLDEST" ]; then selection=(-m "not newest_end")
            elif [ "$version" != "$NEWEST" ]; then
              selection=(-m "not matrix_ends and not release_independent and not newest_end"); fi ;;
    minimal) export CHATGLM_MINIMAL=1 CHATGLM_TEST_ENV=minimal; selection=(-m "not matrix_ends" "${CORE[@]}") ;;
    torch) export CHATGLM_TORCH="$torch"
           for file in "${CORE[@]}" "${TORCH_SENSITIVE[@]}"; do
             [[ " ${TORCH_FREE[*]} " == *" $file "* ]] || selection+=("$file"); done ;;
  esac
  source "$ROOT/scripts/env.sh" "$version" >/dev/null || exit $?
  # Two lanes on two cores: one torch thread each. Two threads per lane left four threads spinning for two cores (the
  # same tests took 2.8 times the CPU); a lane on its own keeps torch's default.
  if [ "$LANES" != 1 ]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi
  # optimum-quanto compiles its kernels on first use: into the environment, so that environments built side by side
  # never share (or rebuild) one folder.
  export TORCH_EXTENSIONS_DIR="$VENV/torch-extensions"
  cd "$ROOT" || exit 1
  if [ "$kind" = minimal ]; then "$PY" - <<'CHECK' || exit $?
import importlib.util, sys
present = [name for name in ("PIL", "peft", "torchao", "optimum", "trl", "torchvision") if importlib.util.find_spec(name)]
sys.exit(f"the minimal environment holds optional packages: {present}" if present else 0)
CHECK
  fi
  echo $((SECONDS - begin)) >"$REPORTS/$name.setup"
  "$PY" -m pytest -q "${selection[@]}" --junitxml="$REPORTS/$name.xml" "${PYTEST_ARGS[@]}"
)

# next_item: the queue's first item no lane has started ("" when none is left).
next_item() {
  flock "$REPORTS/.queue" bash -c 'head -n 1 "$0"; sed -i 1d "$0"' "$REPORTS/queue"
}

# run_item ITEM: "matrix VERSION", "minimal" (every version of MINIMAL, one after another) or "torch TORCH VERSION".
run_item() {
  local kind="$1" venv=""
  case "$kind" in
    matrix) [ "$LANE" = 2 ] && venv="$ROOT/.venv-matrix2"; phase matrix "$2" "" "$venv" ;;
    minimal) for version in "${MINIMAL[@]}"; do phase minimal "$version"; done ;;
    torch) phase torch "$3" "$2" ;;
  esac
}

PYTEST_ARGS=("$@")
if [ "$LANES" = 1 ]; then
  LANE=1
  for version in "${MATRIX[@]}"; do phase matrix "$version"; done
  for version in "${MINIMAL[@]}"; do phase minimal "$version"; done
  for end in "${TORCH_ENDS[@]}"; do read -r torch version <<<"$end"; phase torch "$version" "$torch"; done
else
  # Longest first (docs/run-history.md has each phase's time): the matrix's ends run every test, then the torch ends,
  # the minimal environment, and the versions between the ends.
  {
    echo "matrix $NEWEST"; echo "matrix $OLDEST"
    for end in "${TORCH_ENDS[@]}"; do echo "torch $end"; done
    echo "minimal"
    for version in "${MATRIX[@]}"; do echo "matrix $version"; done
  } | awk '!seen[$0]++' >"$REPORTS/queue"
  for lane in 1 2; do
    (LANE=$lane; while item="$(next_item)" && [ -n "$item" ]; do run_item $item; done) &
  done
  wait
fi
python3 - "$REPORTS" "$((SECONDS - START))" <<'PY'
import sys, pathlib, xml.etree.ElementTree as ET
reports, wall = pathlib.Path(sys.argv[1]), int(sys.argv[2])
passed = failed = skipped = 0
for times in sorted(reports.glob("*.times")):
    rc, setup, tests, lane = times.read_text().split()
    counts = "no report"
    report = times.with_suffix(".xml")
    if report.exists():
        for suite in ET.parse(report).getroot().iter("testsuite"):
            total, fail = int(suite.get("tests")), int(suite.get("failures")) + int(suite.get("errors"))
            skip = int(suite.get("skipped"))
            counts = f"{total - fail - skip} passed, {fail} failed, {skip} skipped"
            passed += total - fail - skip; failed += fail; skipped += skip
    print(f"  transformers {times.stem}: {counts}; set-up {setup} s, tests {tests} s (lane {lane}, exit {rc})")
print(f"wall time: {wall} s")
print(f"matrix: {passed} passed, {failed} failed, {skipped} skipped")
PY
status=0
for times in "$REPORTS"/*.times; do read -r rc _ <"$times"; [ "$rc" = 0 ] || status=1; done
ls "$REPORTS"/*.times >/dev/null 2>&1 || status=1
rm -rf "$REPORTS"
exit $status
