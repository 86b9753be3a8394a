#!/usr/bin/env bash
# The GPU checks, in one command for a lent GPU machine (its own python3 with torch and transformers; nothing is
# installed). Parts, in this order (PARTS picks some):
#   int4_check   tools/int4_check.py: chatglm2-6b's int4 layers packed for the GPU's kernel hold one copy of the codes
#                and read them back bit for bit (seconds)
#   int4         the benchmark's int4 rows at chatglm2-6b's shape (docs/speed-and-memory.md: Pre-quantized int4)
#   decode       the benchmark on a glm-4-9b-shaped model, fork against transformers' GlmForCausalLM: decode, the
#                kernels per layer, copy bandwidth and the compiled / CUDA-graph decode (issue 38's GPU rows)
#   full         the same model, every other section (docs/speed-and-memory.md: Speed on a GPU)
#   boundaries   tools/gpu_check.py: models split over cpu and cuda:0 against one device, fp32 and bf16
# Logs and JSON go to $OUT (the device tool's folder) or out/gpu.
#   bash scripts/gpu_checks.sh                            # everything (times per part: docs/run-history.md)
#   PARTS="int4_check int4 decode" bash scripts/gpu_checks.sh   # issue 38's rows
#   BENCHMARK_ARGS="--rounds 5" bash scripts/gpu_checks.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RESULTS="${OUT:-$ROOT/out/gpu}"
mkdir -p "$RESULTS"
PY="${PYTHON:-python3}"
PARTS="${PARTS:-int4_check int4 decode full boundaries}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
cd "$ROOT"
status=0
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c 'import torch, transformers, accelerate; print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}")'
  date -u +%Y-%m-%dT%H:%MZ; } 2>&1 | tee "$RESULTS/machine.txt"

wanted() { [[ " $PARTS " == *" $1 "* ]]; }
NINE_B=(--preset glm-4-9b --device cuda --in-memory --rounds 3)

if wanted int4_check; then
  echo "=== tools/int4_check.py"
  timeout "${INT4_CHECK_SECONDS:-90}" "$PY" tools/int4_check.py --device cuda --json "$RESULTS/int4_check.json" 2>&1 \
    | tee "$RESULTS/int4_check.log" || status=1
fi
if wanted int4; then
  echo "=== benchmarks/model_benchmark.py, chatglm2-6b-int4 shape, in memory: the int4 rows"
  timeout "${INT4_SECONDS:-250}" "$PY" benchmarks/model_benchmark.py --preset chatglm2-6b-int4 --device cuda --in-memory \
    --sections int4,compiled --contexts 128 --prefill-timed 2048 --rounds 3 --json "$RESULTS/int4.json" 2>&1 \
    | tee "$RESULTS/int4.log" || status=1
fi
if wanted decode; then
  echo "=== benchmarks/model_benchmark.py, glm-4-9b shape, in memory: decode, kernels per layer, compiled"
  # shellcheck disable=SC2086
  timeout "${DECODE_SECONDS:-360}" "$PY" benchmarks/model_benchmark.py "${NINE_B[@]}" \
    --sections decode,profile,bandwidth,compiled --contexts 128 --batch 8 --batch-context 512 \
    --json "$RESULTS/decode.json" ${BENCHMARK_ARGS:-} 2>&1 | tee "$RESULTS/decode.log" || status=1
fi
if wanted full; then
  echo "=== benchmarks/model_benchmark.py, glm-4-9b shape, in memory: the other sections"
  # shellcheck disable=SC2086
  timeout "${BENCHMARK_SECONDS:-420}" "$PY" benchmarks/model_benchmark.py "${NINE_B[@]}" \
    --sections kv,prefill,decode,generate,weights --contexts 128,4096 --prefill 32768 --prefill-timed 4096 \
    --batch 8,32 --batch-context 512 --gen-prompt 32 --gen-new 64 --json "$RESULTS/benchmark.json" \
    ${BENCHMARK_ARGS:-} 2>&1 | tee "$RESULTS/benchmark.log" || status=1
fi
if wanted boundaries; then
  echo "=== tools/gpu_check.py"
  timeout "${GPU_CHECK_SECONDS:-180}" "$PY" tools/gpu_check.py --json "$RESULTS/gpu_check.json" 2>&1 \
    | tee "$RESULTS/gpu_check.log" || status=1
fi
exit $status
