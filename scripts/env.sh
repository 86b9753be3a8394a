#!/usr/bin/env bash
# Set-up shared by scripts/demo.sh and scripts/test.sh: one virtual environment in .venv with torch 2.13.0
# (the CPU wheel) installed once and pinned, so that no later install can pull another torch.
# Usage: source scripts/env.sh [TRANSFORMERS_VERSION]   (empty or absent: the newest tested release; `newest`: the
#        newest release on the registry of transformers, PEFT, TRL, accelerate and tokenizers, for scripts/canary.sh)
# CHATGLM_TORCH=VERSION: another torch release, in its own environment .venv-torchMAJOR.MINOR (the torch ends of
#        scripts/test.sh); `newest`: the newest torch on the registry (scripts/canary.sh, in its own environment).
# CHATGLM_SETUP=demo (scripts/demo.sh): only the six dependencies (torch, transformers, accelerate, safetensors,
#        sentencepiece, tiktoken); smoke (scripts/test.sh --smoke): those and the test runner; otherwise also what
#        the tests of optional features and the recipes need (scripts/test.sh, on the same .venv).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_TORCH="2.13.0"
TORCH="${CHATGLM_TORCH:-$DEFAULT_TORCH}"
# CHATGLM_MINIMAL=1: the minimal environment (only the six dependencies and the test runner), in its own venv.
if [ "${CHATGLM_MINIMAL:-0}" = 1 ]; then VENV="${CHATGLM_MINIMAL_VENV:-$ROOT/.venv-minimal}"
elif [ "$TORCH" != "$DEFAULT_TORCH" ]; then VENV="${CHATGLM_VENV:-$ROOT/.venv-torch${TORCH%.*}}"
else VENV="${CHATGLM_VENV:-$ROOT/.venv}"; fi
PY="$VENV/bin/python"
# Newest release the repository is tested against; the demo runs on it.
DEFAULT_TRANSFORMERS="5.24.0"

# Each step that installs something says so on stderr, one line ending with its time; with everything installed the
# set-up prints one line (stdout). pip itself stays quiet: its lines would bury the steps.
setup_step() { printf 'set-up: %s ...' "$1" >&2; STEP_START=$SECONDS; }
setup_step_done() { printf ' done (%d s)\n' "$((SECONDS - STEP_START))" >&2; }
if [ ! -x "$PY" ]; then
  setup_step "creating the virtual environment $VENV"
  python3 -m venv "$VENV"
  setup_step_done
fi
# Every install runs with a constraints file that pins the environment's torch, so that no later install can pull
# another one: scripts/constraints.txt for the default torch, else one written into the environment.
CONSTRAINTS="$ROOT/scripts/constraints.txt"
if [ "$TORCH" != "$DEFAULT_TORCH" ]; then
  CONSTRAINTS="$VENV/torch-constraint.txt"
  [ "$TORCH" = newest ] && : >"$CONSTRAINTS" || echo "torch==$TORCH" >"$CONSTRAINTS"
fi
pip_install() { "$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "$@" 2> >(grep -v "is ignored: it is neither" >&2); }
# Versions are read from the installed metadata: importing torch only to read its version cost seconds per check.
installed_version() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]).split("+")[0])' "$1" 2>/dev/null || true; }
torch_version() { installed_version torch; }
case "$TORCH" in
  "$DEFAULT_TORCH") TORCH_DOWNLOAD="the CPU wheel, about 200 MB to download on a first run" ;;
  newest) TORCH_DOWNLOAD="the newest on the registry: a CUDA build, about 3 GB with its nvidia-* packages" ;;
  *) TORCH_DOWNLOAD="the registry's CUDA build (it runs on a CPU), about 2.5 GB with its nvidia-* packages" ;;
esac
if [ "$TORCH" = newest ] || [ "$(torch_version)" != "$TORCH" ]; then
  setup_step "installing torch $TORCH ($TORCH_DOWNLOAD)"
  if [ "$TORCH" = newest ]; then pip_install --upgrade torch; else pip_install "torch==$TORCH"; fi
  setup_step_done
  if [ "$TORCH" = newest ]; then echo "torch==$(torch_version)" >"$CONSTRAINTS"; fi
fi
# The six dependencies (torch above, transformers below) and, unless this is the demo's set-up, the test runner;
# then, unless CHATGLM_MINIMAL=1 or the demo's set-up, what the tests exercise as users do: Pillow (GLM-4V images),
# torchao and optimum-quanto (model.quantize()); PEFT and TRL come with each transformers release below, pinned to
# that release.
PACKAGES=(accelerate safetensors sentencepiece tiktoken)
OPTIONAL=1
if [ "${CHATGLM_SETUP:-}" = demo ]; then OPTIONAL=0; else PACKAGES+=(pytest hypothesis); fi
if [ "${CHATGLM_SETUP:-}" = smoke ]; then OPTIONAL=0; fi  # the smoke tests use no optional feature
if [ "${CHATGLM_MINIMAL:-0}" = 1 ]; then OPTIONAL=0; fi
read -ra MISSING <<<"$("$PY" -c 'import importlib.util as u, sys
print(" ".join(name for name in sys.argv[1:] if u.find_spec(name) is None))' "${PACKAGES[@]}")"
if [ ${#MISSING[@]} -gt 0 ]; then
  setup_step "installing $(IFS=,; echo "${MISSING[*]}" | sed 's/,/, /g')"
  pip_install "${MISSING[@]}"
  setup_step_done
fi
# torch 2.4 gets torchao 0.6.1, of its months: later releases read dtypes that torch 2.5 added (torch.int1).
TORCHAO=torchao; case "$(torch_version)" in 2.4.*) TORCHAO=torchao==0.6.1 ;; esac
if [ "$OPTIONAL" = 1 ] && ! "$PY" -c 'import PIL, torchao.quantization, optimum.quanto' 2>/dev/null; then
  setup_step "installing pillow, $TORCHAO, optimum-quanto (for the tests of optional features)"
  pip_install pillow "$TORCHAO" optimum-quanto
  setup_step_done
fi

# companion_pins VERSION: sets TRL_PIN and PEFT_PIN, the TRL and PEFT that users of that transformers release have
# (the LoRA and SFTTrainer recipes in tests/test_recipes.py): the releases of the same months, which name that
# transformers among those they support. PEFT 0.14 to 0.18 cannot apply LoRA beside the torchao that torch 2.13 needs
# (they import its removed LinearActivationQuantizedTensor): the releases of their months get 0.19.1, the oldest PEFT
# that can.
companion_pins() {
  case "$1" in
    4.44.*|4.45.*) TRL_PIN=0.11.4 PEFT_PIN=0.12.0 ;; 4.46.*|4.47.*) TRL_PIN=0.12.2 PEFT_PIN=0.13.2 ;;
    4.48.*|4.49.*|4.50.*) TRL_PIN=0.15.2 PEFT_PIN=0.19.1 ;;
    4.51.*|4.52.*|4.53.*|4.54.*|4.55.*) TRL_PIN=0.19.1 PEFT_PIN=0.19.1 ;;
    4.*|5.0.*|5.1.*|5.2.*) TRL_PIN=1.16.0 PEFT_PIN=0.19.1 ;; *) TRL_PIN=1.16.0 PEFT_PIN=0.21.2 ;;
  esac
}

# use_transformers VERSION: swap the transformers release in the venv (its own tokenizers/huggingface-hub follow).
use_transformers() {
  local want="$1" have
  have="$(installed_version transformers)"
  if [ "$have" != "$want" ]; then
    setup_step "installing transformers $want${have:+ (replacing $have)}"
    pip_install "transformers==$want"
    setup_step_done
  fi
  if [ "$OPTIONAL" = 1 ]; then
    companion_pins "$want"
    if [ "$("$PY" -c 'import trl; print(trl.__version__)' 2>/dev/null || true)" != "$TRL_PIN" ] || \
       [ "$("$PY" -c 'import peft; print(peft.__version__)' 2>/dev/null || true)" != "$PEFT_PIN" ]; then
      # rich: TRL 0.11 imports it without declaring it (a newer huggingface-hub's typer used to bring it).
      setup_step "installing trl $TRL_PIN, peft $PEFT_PIN (for the tests' fine-tuning recipes)"
      pip_install "trl==$TRL_PIN" "peft==$PEFT_PIN" rich "transformers==$want"
      setup_step_done
    fi
  fi
}

# The canary's environment (scripts/canary.sh): the newest release on the registry of everything but torch.
use_newest() {
  setup_step "installing the newest transformers, peft, trl, accelerate, tokenizers on the registry"
  pip_install --upgrade transformers peft trl accelerate tokenizers huggingface-hub safetensors sentencepiece \
    tiktoken rich
  setup_step_done
}

if [ "${1:-}" = newest ]; then use_newest; else use_transformers "${1:-$DEFAULT_TRANSFORMERS}"; fi
echo "environment: $VENV ready"

# Tests and the demo never reach a hub, and never reuse remote code cached by an earlier run. They read the reference
# data in testdata/ (CHATGLM_SHARED_DIR, when the caller set it, points them at another copy).
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
