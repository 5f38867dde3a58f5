#!/usr/bin/env bash
# Issue 11 on one GPU (bundled pair, bf16, greedy, 128 new tokens): the resident loop's GPU lane
# (with the shallow shapes `auto` may choose), the drafters x methods table with `auto` on MBPP
# and on GSM8K (English word problems: a low-acceptance workload for this code-trained pair), and
# gpt-fast's compiled AR at the bundled target's shape in the same call.
#   bash bench/run_gpu_auto.sh $OUT   (device tool: carry .data = copies of ../shared/datasets/{mbpp,gsm8k}
#                                      and ../shared/peers/gpt-fast under .data/peers)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
DEADLINE=${DEADLINE:-540}; source bench/deadline.sh
NP=${NP:-10}
record_env; cat "$OUT/env.txt"
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane: the resident loop"
  within 150 python3 -m pytest -q -m cuda tests/gpu/test_gpu_resident.py -p no:cacheprovider > "$OUT/lane.log" 2>&1
  tail -2 "$OUT/lane.log"; grep -e "^FAILED" -e "^ERROR" "$OUT/lane.log" | head -20
fi
echo "== peer: gpt-fast compiled AR at the bundled target's shape (ms/token)"
[ "${PEER:-1}" = 1 ] && within 90 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
DRAFTS=${DRAFTS:-eagle3 block draft}
for d in ${MBPP-$DRAFTS}; do bench "mbpp_$d" mbpp "$d" ar,chain,tree,auto; done
for d in ${GSM8K-$DRAFTS}; do bench "gsm8k_$d" gsm8k "$d" ar,tree,auto; done
[ "${TAR:-1}" = 1 ] && tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
