#!/usr/bin/env bash
# The one-row GEMV layer kernels (tandem.kernels.gemv) on one GPU: their GPU lane, the launch-shape sweep at the
# Llama-3-8B layer shapes (bench/gpu_gemv.py, against cuBLAS and the small kernels), then Tandem's AR at the
# Llama-3-8B shape with the sweep's shapes, gpt-fast's compiled AR in the same call, and Tandem's AR with the
# kernels off (TANDEM_GEMV=0: cuBLAS, as before).
# SWEEP=0: the kernels' default shapes (no sweep); SKINNY=1: bench/gpu_skinny.py after the sweep; OFF=0: no run with the kernels off; MBPP=1: the bundled pair with
# the EAGLE-3 head on MBPP at the end; LANE_FILES: the lane's test files.
#   bash bench/run_gpu_gemv.sh $OUT   (device tool: carry .data, with ../shared/peers/gpt-fast under .data/peers)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
DEADLINE=${DEADLINE:-570}; source bench/deadline.sh
record_env; cat "$OUT/env.txt"
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane"
  within 150 python3 -m pytest -q -m cuda ${LANE_FILES:-tests/gpu/test_gpu_gemv.py} -p no:cacheprovider \
    > "$OUT/lane.log" 2>&1
  tail -1 "$OUT/lane.log"; grep -e "^FAILED" -e "^ERROR" -e "Error" "$OUT/lane.log" | head -10 | cut -c1-300
fi
TUNE=()
if [ "${SWEEP:-1}" = 1 ]; then
  echo "== launch-shape sweep"
  (cd bench && within 220 python3 gpu_gemv.py --preset llama3-8b --out "$OUT" > "$OUT/sweep.log" 2>&1)
  sed -n '/^best per op/,$p' "$OUT/sweep.log" | head -8; grep -e "Error" "$OUT/sweep.log" | head -5 | cut -c1-300
  [ -f "$OUT/gemv_launch.json" ] && TUNE=(--gemv-launch "$OUT/gemv_launch.json") && cat "$OUT/gemv_launch.json"; echo
fi
if [ "${SKINNY:-0}" = 1 ]; then  # the fused layer kernels against cuBLAS at a large model's 2-16-row passes
  echo "== few-row passes (bench/gpu_skinny.py)"
  (cd bench && within 200 python3 gpu_skinny.py --preset llama3-8b > "$OUT/skinny.log" 2>&1)
  sed -n '/^best fused variant/,$p' "$OUT/skinny.log"; grep -e "Error" "$OUT/skinny.log" | head -5 | cut -c1-300
fi
run_ar() {  # run_ar TAG: Tandem's AR at the llama3-8b shape (one-row step timing and end to end)
  within 100 python3 bench/gpu_core.py --preset llama3-8b --rows 1 "${TUNE[@]}" --out "$OUT" > "$OUT/tandem_8b$1.txt" 2>&1
  grep -e "step rows" -e "AR end-to-end" -e "Error" "$OUT/tandem_8b$1.txt" | cut -c1-300
}
[ "${SWEEP:-1}" = 1 ] && python3 bench/gpu_linear_kernels.py 2>&1 | grep -v Warn | tee "$OUT/linear_kernels.txt" | cut -c1-400
echo "== tandem AR at the llama3-8b shape, GEMV kernels on"; run_ar ""
echo "== gpt-fast compiled AR at the llama3-8b shape"
[ "${PEER:-1}" = 1 ] && within 160 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast llama3-8b 2>&1 | grep '^{' | tee "$OUT/gptfast_8b.jsonl"
[ "${OFF:-1}" = 1 ] && { echo "== tandem AR at the llama3-8b shape, GEMV kernels off"; TANDEM_GEMV=0 run_ar _gemv0; }
if [ "${MBPP:-0}" = 1 ]; then  # the bundled pair with the EAGLE-3 head on MBPP (bf16, greedy, 128 new tokens)
  echo "== mbpp, EAGLE-3 head"
  within 80 python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts 10 \
    --max-new-tokens 128 --methods ar,chain,tree --warmup 2 --max-prompt-tokens 384 --draft eagle3 --no-plots \
    --allow-mismatch --out "$OUT/mbpp_eagle3" > "$OUT/mbpp_eagle3.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/mbpp_eagle3.log" | grep -e "^|" -e "Output check" -e "^- " -e "rror" | cut -c1-300
fi
