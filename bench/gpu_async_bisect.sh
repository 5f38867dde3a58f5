#!/usr/bin/env bash
# Bisect async's CUDA divergence from ar (seen on the H200, 2026-11-29): run ar vs async on a few
# MBPP prompts under switches that each remove one suspect; a variant with 0 mismatches names it.
#   bash bench/gpu_async_bisect.sh $OUT        (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TANDEM_ASYNC_CUDA=1
run() {  # name, transport, env...
  local name=$1 transport=$2; shift 2
  echo "== $name"
  env "$@" timeout 100 python3 -m tandem bench --device cuda --dtype float32 --workload mbpp --data-dir .data \
    --num-prompts 5 --max-new-tokens 96 --methods ar,async --async-transport "$transport" --warmup 1 --no-plots \
    --allow-mismatch --out "$OUT/$name" 2>&1 | grep -e "Output check" -e "First div"
}
run inline inline X=1
run inline-no-graphs inline TANDEM_CUDA_GRAPHS=0
run inline-no-triton inline TANDEM_TRITON=0
run inline-blocking inline CUDA_LAUNCH_BLOCKING=1
run streams streams X=1
run streams-no-graphs streams TANDEM_CUDA_GRAPHS=0
