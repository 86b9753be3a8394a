#!/usr/bin/env bash
# Decode speed against llama.cpp on the CPU, on demand (not run by CI or scripts/test.sh): runs
# benchmarks/llamacpp_benchmark.py (see its --help) with the remaining arguments, in the llama.cpp environment that
# scripts/engines.sh builds (.venv-engines/llama: transformers + llama-cpp-python built from its sdist, whose vendored
# llama.cpp gives convert_hf_to_gguf.py). Run `bash scripts/engines.sh` once first: it builds that environment (its
# time: docs/run-history.md). CHATGLM_ENGINES_DIR points at another .venv-engines. E.g.
#   scripts/llamacpp_benchmark.sh                      scripts/llamacpp_benchmark.sh --threads 1 --classes int4
#   scripts/llamacpp_benchmark.sh --workdir /tmp/l44   (keeps the checkpoint and GGUFs for the next run)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENVS="${CHATGLM_ENGINES_DIR:-$ROOT/.venv-engines}"
LLAMA_PY="$ENVS/llama/bin/python"
if ! "$LLAMA_PY" -c "import llama_cpp" 2>/dev/null; then
  echo "llamacpp_benchmark: no llama.cpp environment at $ENVS/llama: run 'bash scripts/engines.sh'" \
       "once (it builds it), or set CHATGLM_ENGINES_DIR to a .venv-engines holding one." >&2
  exit 1
fi
CONVERT="$(ls "$ENVS"/src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py 2>/dev/null | tail -1)"
exec "$LLAMA_PY" "$ROOT/benchmarks/llamacpp_benchmark.py" ${CONVERT:+--convert "$CONVERT"} "$@"
