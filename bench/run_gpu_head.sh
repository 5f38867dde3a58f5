#!/usr/bin/env bash
# The EAGLE-3 head's fused level kernels (tandem.kernels.head_level) on one GPU, with the fused
# kernels on and off in the same call (TANDEM_HEAD_FUSED=0: the layer, a cuBLAS LM head, the top-k
# kernel and a torch selection, as before): their GPU lane, the resident loop's lane, the draft
# graph's kernels and replay time, and the bundled pair on MBPP (bf16, greedy, 128 new tokens).
# AB=TANDEM_FUSED_LINEAR runs the same A/B on another switch (the fused layers' o_proj / down_proj kernel), LANE_FILES
# names the lane's test files, PROFILE=0 skips the draft graph's profile, SMALL=1 times the level kernels' launch shapes last (bench/gpu_small_kernels.py).
#   bash bench/run_gpu_head.sh $OUT   (device tool: carry .data = copies of ../shared/datasets/{mbpp,gsm8k}
#                                      and ../shared/peers/gpt-fast under .data/peers)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
DEADLINE=${DEADLINE:-560}; source bench/deadline.sh
NP=${NP:-10}; AB=${AB:-TANDEM_HEAD_FUSED}
LANE_FILES=${LANE_FILES:-tests/gpu/test_gpu_head_level.py tests/gpu/test_gpu_resident.py}
ab() { (export "$AB=$1"; shift; within "$@"); }  # ab VALUE SECONDS CMD...: CMD with $AB=VALUE
record_env; cat "$OUT/env.txt"
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane: the head's kernels and the resident loop"
  within 200 python3 -m pytest -q -m cuda $LANE_FILES -p no:cacheprovider > "$OUT/lane.log" 2>&1
  tail -2 "$OUT/lane.log"; grep -e "^FAILED" -e "^ERROR" "$OUT/lane.log" | head -20
fi
for f in ${FUSED:-1 0}; do
  [ "${PROFILE:-1}" = 1 ] || break
  echo "== profile, $AB=$f"
  ab "$f" 60 python3 bench/gpu_profile_resident.py --kind eagle3 > "$OUT/profile_fused$f.txt" 2>&1
  grep -e "tok/s" -e "replay median" -e "kernels," "$OUT/profile_fused$f.txt" | grep -v "('ar'"
done
for f in ${FUSED:-1 0}; do
  echo "== mbpp, EAGLE-3 head, $AB=$f"
  ab "$f" "${BT:-80}" python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp \
    --data-dir .data --num-prompts "$NP" --max-new-tokens 128 --methods ar,chain,tree --warmup 2 \
    --max-prompt-tokens 384 --draft eagle3 --no-plots --allow-mismatch --out "$OUT/mbpp_eagle3_fused$f" \
    > "$OUT/mbpp_eagle3_fused$f.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/mbpp_eagle3_fused$f.log" | grep -e "^|" -e "Output check" -e "^- " -e "rror" | cut -c1-300
done
if [ "${PEER:-1}" = 1 ]; then
  peer_gptfast tiny15m 90
fi
if [ "${SMALL:-0}" = 1 ]; then
  echo "== launch shapes of the head's level kernels (bench/gpu_small_kernels.py --ops ${SMALL_OPS:-head_topk,level})"
  within 200 python3 bench/gpu_small_kernels.py --ops "${SMALL_OPS:-head_topk,level}" > "$OUT/small.log" 2>&1
  sed -n '/^best per/,$p' "$OUT/small.log"
fi
[ "${TAR:-1}" = 1 ] && tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
