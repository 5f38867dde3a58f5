#!/usr/bin/env bash
# One device call for issue 11: auto and the drafters (bench/run_gpu_auto.sh, no GPU lane), then the
# Llama-3-8B figures (bench/run_gpu_8b.sh) under one deadline, then one tar of $OUT.
#   DEADLINE=530 bash bench/run_gpu_both.sh $OUT   (carry .data as both scripts say)
OUT=${1:-out}; mkdir -p "$OUT"
export DEADLINE=${DEADLINE:-530} T0=$(date +%s)
LANE=${LANE:-0} MBPP=${MBPP-eagle3} TAR=0 bash bench/run_gpu_auto.sh "$OUT"
TAR=0 bash bench/run_gpu_8b.sh "$OUT"
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
