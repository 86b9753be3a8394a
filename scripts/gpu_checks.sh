#!/usr/bin/env bash
# The GPU checks, in one command for a lent GPU machine (its own python3 with torch and transformers; nothing is
# installed): tools/gpu_check.py (models split over cpu and cuda:0 against one device, fp32 and bf16) and the
# benchmark on a glm-4-9b-shaped model built in GPU memory, fork against transformers' GlmForCausalLM, every section;
# then the int4 rows at chatglm2-6b's shape. These are the README's "Speed on a GPU" numbers. Logs and JSON go to
# $OUT (the device tool's folder) or out/gpu.
#   bash scripts/gpu_checks.sh                 # about 8 minutes on one H200
#   BENCHMARK_ARGS="--rounds 5" bash scripts/gpu_checks.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${OUT:-$ROOT/out/gpu}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"
status=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch, transformers, accelerate; print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}")'
  date -u +%Y-%m-%dT%H:%MZ; } 2>&1 | tee "$RESULTS/machine.txt"

echo "=== tools/gpu_check.py"
timeout "${GPU_CHECK_SECONDS:-180}" "$PY" tools/gpu_check.py --json "$RESULTS/gpu_check.json" 2>&1 \
  | tee "$RESULTS/gpu_check.log" || status=1

echo "=== benchmarks/model_benchmark.py, glm-4-9b shape, in memory"
# shellcheck disable=SC2086
timeout "${BENCHMARK_SECONDS:-420}" "$PY" benchmarks/model_benchmark.py --preset glm-4-9b --device cuda --in-memory \
  --contexts 128,4096 --prefill 32768 --prefill-timed 4096 --batch 8,32 --batch-context 512 --rounds 3 \
  --gen-prompt 32 --gen-new 64 --json "$RESULTS/benchmark.json" ${BENCHMARK_ARGS:-} 2>&1 \
  | tee "$RESULTS/benchmark.log" || status=1

echo "=== benchmarks/model_benchmark.py, chatglm2-6b-int4 shape, in memory: the int4 rows (README: Pre-quantized int4)"
timeout "${INT4_SECONDS:-300}" "$PY" benchmarks/model_benchmark.py --preset chatglm2-6b-int4 --device cuda --in-memory \
  --sections int4,compiled --contexts 128 --prefill-timed 2048 --rounds 3 --json "$RESULTS/int4.json" 2>&1 \
  | tee "$RESULTS/int4.log" || status=1
exit $status
