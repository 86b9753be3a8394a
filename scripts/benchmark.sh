#!/usr/bin/env bash
# Speed and memory against transformers' own GlmForCausalLM: sets up .venv as the other scripts do and runs
# benchmarks/model_benchmark.py with the remaining arguments. `--transformers VERSION` picks the release to measure
# (default: the newest tested one), `--torch VERSION` the torch (default 2.13.0; another one in its own environment,
# .venv-torchMAJOR.MINOR, as scripts/env.sh's CHATGLM_TORCH); e.g.
#   scripts/benchmark.sh                         scripts/benchmark.sh --transformers 4.44.2 --quick
#   scripts/benchmark.sh --threads 1 --clock cpu scripts/benchmark.sh --model /path/to/glm-4-9b-chat --device cuda
set -euo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
version="" args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --transformers) version="${2:?--transformers needs a version, e.g. --transformers 4.44.2}"; shift 2 ;;
    --transformers=*) version="${1#*=}"; shift ;;
    --torch) export CHATGLM_TORCH="${2:?--torch needs a version, e.g. --torch 2.4.1}"; shift 2 ;;
    --torch=*) export CHATGLM_TORCH="${1#*=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
source "$HERE/env.sh" "$version"
exec "$PY" "$ROOT/benchmarks/model_benchmark.py" ${args[@]+"${args[@]}"}
