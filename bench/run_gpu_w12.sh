#!/usr/bin/env bash
# W12 in the one-row GEMVs (issue 15) on one GPU: the GEMV lane (bf16 and W12 operands), the per-shape W12 GEMV
# against the bf16 GEMV and cuBLAS (bench/gpu_w12_gemv.py), the Llama-3-8B shape's `ar` end to end with bf16 weights
# and with W12 copies (bench/gpu_core.py [--w12]), and gpt-fast's compiled AR at that shape in the same call (PEER=1).
#   TANDEM_COMMIT=<hash> bash bench/run_gpu_w12.sh $OUT      (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD:$PWD/bench
DEADLINE=${DEADLINE:-570}; source bench/deadline.sh
record_env; cat "$OUT/env.txt"
echo "== GPU lane: one-row GEMVs, bf16 and W12 (${LANE_K:-all})"
within "${LT:-100}" python3 -m pytest -q -m cuda tests/gpu/test_gpu_gemv.py -p no:cacheprovider ${LANE_K:+-k "$LANE_K"} \
  > "$OUT/lane.log" 2>&1
rc=$?; tail -3 "$OUT/lane.log"
if [ "$rc" != 0 ]; then grep -B5 -A25 -m3 "Error\|assert" "$OUT/lane.log" | head -80; fi
echo "== W12 GEMV per shape (us a call in a graph)"
within "${WT:-100}" python3 bench/gpu_w12_gemv.py --out "$OUT/w12" --iters 50 ${W12_LAUNCHES:+--launches $W12_LAUNCHES} 2>&1 \
  | grep -v "^ *$" | cut -c1-220
for mode in bf16 w12; do
  echo "== llama3-8b AR, $mode"
  flag=""; [ "$mode" = w12 ] && flag="--w12"
  within "${ET:-170}" python3 bench/gpu_core.py --preset llama3-8b --rows 1 --new-tokens 128 $flag --out "$OUT/core8b" \
    > "$OUT/core8b_$mode.txt" 2>&1
  grep -e "floor" -e "W12 copies" -e "step rows" -e "AR end" -e "rror" "$OUT/core8b_$mode.txt" | cut -c1-220
done
[ "${PEER:-1}" = 1 ] && peer_gptfast llama3-8b "${PT:-130}"
true
