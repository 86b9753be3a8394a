#!/usr/bin/env bash
# Checks of the tools that patch, replay or trace the original's modules, on demand (not run by CI or
# scripts/test.sh): OpenVINO export (optimum-intel), 4-bit quantization with GPTQModel, AutoRound and llm-compressor
# against our code, on GLM-4, ChatGLM3 and ChatGLM2 random checkpoints with head size 128, two query groups and the
# real vocabulary. See scripts/tools_check.py.
#   bash scripts/tools_check.sh                                 # everything; one table, exits non-zero on a failure
#   bash scripts/tools_check.sh --families glm4 --tools gptq autoround
#   bash scripts/tools_check.sh --code /path/to/other/checkout  # another copy of our files (a branch's worktree)
#   bash scripts/tools_check.sh --original-code glm4=DIR        # also the original files of DIR (never committed
#                                                               # here): the quantized weights compared with ours
#   TOOLS_BUILD_ONLY=1 bash scripts/tools_check.sh              # only build (or check) the environments
# Builds three environments under .venv-tools/ (gitignored), reused when they are already there:
#   openvino/  transformers 4.55.4 (optimum-intel's ChatGLM export accepts 4.51.0 to 4.55.4), openvino, nncf,
#              optimum-intel installed without its torchvision requirement (the registry's torchvision pulls CUDA
#              libraries; the text export does not use it)
#   gptq/      transformers 5.24.0, GPTQModel (7.6.0: the newest release that accepts torch 2.13) and AutoRound
#              (0.16.1; transformers loads its GPTQ-format output through GPTQModel)
#   llmcompressor/  llm-compressor 0.14.0.1 (it pins transformers 5.15.0 to 5.17.0, auto-round <= 0.15.1 and
#              compressed-tensors 0.19.0) with transformers 5.17.0
# The first run downloads and installs the tools; times in docs/run-history.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENVS="$ROOT/.venv-tools"
CONSTRAINTS="$ROOT/scripts/constraints.txt"
OPTIMUM_INTEL_VERSION="${OPTIMUM_INTEL_VERSION:-2.2.0}"
OPENVINO_VERSION="${OPENVINO_VERSION:-2026.4.1}"
NNCF_VERSION="${NNCF_VERSION:-3.4.0}"
OPENVINO_TRANSFORMERS_VERSION="${OPENVINO_TRANSFORMERS_VERSION:-4.55.4}"
GPTQMODEL_VERSION="${GPTQMODEL_VERSION:-7.6.0}"
GPTQ_TRANSFORMERS_VERSION="${GPTQ_TRANSFORMERS_VERSION:-5.24.0}"
AUTOROUND_VERSION="${AUTOROUND_VERSION:-0.16.1}"
LLMCOMPRESSOR_VERSION="${LLMCOMPRESSOR_VERSION:-0.14.0.1}"
LLMCOMPRESSOR_TRANSFORMERS_VERSION="${LLMCOMPRESSOR_TRANSFORMERS_VERSION:-5.17.0}"
mkdir -p "$ENVS"

# Every install with the constraints file, torch first: a package that asks for another torch would pull
# gigabytes of CUDA wheels.
pip_in() { local py="$1"; shift; nice "$py" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "$@"; }
new_venv() { [ -x "$1/bin/python" ] || python3 -m venv "$1"; pip_in "$1/bin/python" torch==2.13.0; }
# The common dependencies of our files (pillow: transformers' import check of remote code lists
# tokenization_chatglm.py's lazy GLM-4V `from PIL import`).
OUR_DEPENDENCIES=(accelerate safetensors sentencepiece tiktoken pillow)

OV_PY="$ENVS/openvino/bin/python"
if ! "$OV_PY" -c "
import sys, importlib.metadata as m
want = {'optimum-intel': '$OPTIMUM_INTEL_VERSION', 'openvino': '$OPENVINO_VERSION', 'nncf': '$NNCF_VERSION',
        'transformers': '$OPENVINO_TRANSFORMERS_VERSION'}
sys.exit(any(m.version(name) != version for name, version in want.items()))" 2>/dev/null; then
  echo "tools: building $ENVS/openvino (optimum-intel $OPTIMUM_INTEL_VERSION, openvino $OPENVINO_VERSION," \
       "transformers $OPENVINO_TRANSFORMERS_VERSION)"
  new_venv "$ENVS/openvino"
  # optimum-intel's requirements but torchvision, then optimum-intel itself without them.
  pip_in "$OV_PY" "transformers==$OPENVINO_TRANSFORMERS_VERSION" "openvino==$OPENVINO_VERSION" \
    "openvino-tokenizers~=${OPENVINO_VERSION%.*}.0" "nncf==$NNCF_VERSION" "optimum~=2.3.0" \
    "huggingface-hub>=0.23.2,<1.22" "requests>=2.33,<3" setuptools "${OUR_DEPENDENCIES[@]}"
  pip_in "$OV_PY" --no-deps "optimum-intel==$OPTIMUM_INTEL_VERSION"
fi

GPTQ_PY="$ENVS/gptq/bin/python"
if ! "$GPTQ_PY" -c "
import sys, importlib.metadata as m
want = {'gptqmodel': '$GPTQMODEL_VERSION', 'transformers': '$GPTQ_TRANSFORMERS_VERSION',
        'auto-round': '$AUTOROUND_VERSION'}
sys.exit(any(m.version(name) != version for name, version in want.items()))" 2>/dev/null; then
  echo "tools: building $ENVS/gptq (GPTQModel $GPTQMODEL_VERSION, AutoRound $AUTOROUND_VERSION," \
       "transformers $GPTQ_TRANSFORMERS_VERSION)"
  new_venv "$ENVS/gptq"
  pip_in "$GPTQ_PY" "transformers==$GPTQ_TRANSFORMERS_VERSION" "gptqmodel==$GPTQMODEL_VERSION" \
    "auto-round==$AUTOROUND_VERSION" "${OUR_DEPENDENCIES[@]}"
fi

LC_PY="$ENVS/llmcompressor/bin/python"
if ! "$LC_PY" -c "
import sys, importlib.metadata as m
want = {'llmcompressor': '$LLMCOMPRESSOR_VERSION', 'transformers': '$LLMCOMPRESSOR_TRANSFORMERS_VERSION'}
sys.exit(any(m.version(name) != version for name, version in want.items()))" 2>/dev/null; then
  echo "tools: building $ENVS/llmcompressor (llm-compressor $LLMCOMPRESSOR_VERSION," \
       "transformers $LLMCOMPRESSOR_TRANSFORMERS_VERSION)"
  new_venv "$ENVS/llmcompressor"
  pip_in "$LC_PY" "transformers==$LLMCOMPRESSOR_TRANSFORMERS_VERSION" "llmcompressor==$LLMCOMPRESSOR_VERSION" \
    "${OUR_DEPENDENCIES[@]}"
fi

[ "${TOOLS_BUILD_ONLY:-}" = 1 ] && exit 0

exec nice "$OV_PY" "$ROOT/scripts/tools_check.py" run --gptq-python "$GPTQ_PY" --llmcompressor-python "$LC_PY" "$@"
