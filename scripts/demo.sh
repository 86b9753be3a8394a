#!/usr/bin/env bash
# Offline demo on a fresh machine: sets up .venv with only what the demo needs (torch 2.13.0 CPU, the newest tested
# transformers, accelerate, safetensors, sentencepiece, tiktoken; scripts/test.sh adds the tests' packages to it) and
# runs examples/demo.py, which builds a tiny random checkpoint from config.json and generates, its prompt and answer
# in text with glm-4-9b-chat's real tokenizer from testdata/. Arguments go to the demo:
#   scripts/demo.sh --model /path/to/glm-4-9b-chat --prompt "你好"      scripts/demo.sh --help
set -euo pipefail
HERE="$(dirname "${BASH_SOURCE[0]}")"
for arg in "$@"; do  # the usage needs no environment
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then exec python3 "$HERE/../examples/demo.py" --help; fi
done
# An explicit empty version: `source` would otherwise hand this script's arguments (--model ...) to env.sh.
CHATGLM_SETUP=demo
source "$HERE/env.sh" ""
exec "$PY" "$ROOT/examples/demo.py" "$@"
