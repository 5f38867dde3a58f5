#!/usr/bin/env bash
# Hybrid targets' captured tree passes (runtime.hybrid_graphs, the path kernel: the CUDA default) on one GPU:
# their GPU lane, the random hybrid target (hybrid loop and batched engine, fp32, outputs checked against
# ar), and issue 17's 4B replay again (`ar`, `tree`; the default Qwen3.5-0.8B-shaped draft, of the
# target's vocabulary: a Qwen2.5-0.5B one could not embed the target's tokens) from the trace of the
# bundled pair's MBPP run in $TRACE (simulated acceptance).
#   bash bench/run_h200_hybrid_graphs.sh $OUT       (device tool: carry .data, with .data/trace/results.json)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD:$PWD/bench
export DEADLINE=${DEADLINE:-300} TANDEM_HYBRID_GRAPHS=1  # (the default since this lane passed, 2026-12-07)
source bench/deadline.sh
TRACE=${TRACE:-.data/trace/results.json}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
echo "== GPU lane: captured hybrid passes"
within "${LT:-120}" python3 -m pytest -q -m cuda tests/gpu/test_gpu_hybrid_graphs.py -p no:cacheprovider > "$OUT/lane.log" 2>&1
rc=$?; tail -3 "$OUT/lane.log"
if [ "$rc" != 0 ]; then grep -B30 -m2 "Error" "$OUT/lane.log" | head -80; fi
echo "== random hybrid target, fp32, default kernel (path, captured), hybrid loop and engine"
within 90 python3 bench/gpu_hybrid_check.py --device cuda --dtype float32 --hidden 1024 --layers 16 --nodes 16 32 \
  ${ENGINE- --engine 1 8} > "$OUT/hybrid_path.txt" 2>&1; echo "rc $?"
tail -60 "$OUT/hybrid_path.txt" | grep -v '^ *[{}]' | tr -d '\n'; echo
[ "${REPLAY:-1}" = 1 ] && echo "== replay: qwen3.5-4b / qwen3.5-0.8b, bf16, ar,tree" && within 150 python3 -m tandem bench --preset qwen3.5-4b --replay "$TRACE" --device cuda \
  --dtype bfloat16 --methods ar,tree --num-prompts "${NP:-2}" --no-plots --out "$OUT/replay" 2>&1 \
  | grep -e "^|" -e "replayed tau" -e "rror"
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
