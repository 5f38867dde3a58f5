#!/usr/bin/env bash
# The README's bundled-pair table (H200): both workloads, every method, output checked against ar.
#   TANDEM_COMMIT=<sha> bash bench/run_h200_bench.sh $OUT
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
for wl in mbpp source; do
  python3 -m tandem bench --device cuda --dtype float32 --workload $wl --data-dir .data --num-prompts 20 \
    --max-new-tokens 128 --methods ar,chain,tree,async,hf,hf-assisted --warmup 2 --max-prompt-tokens 384 \
    --out "$OUT/bench_$wl" 2>&1 | grep -v -e "it/s" -e "req/s" -e "^tandem async: trial" | tail -24
done
