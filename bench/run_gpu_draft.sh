#!/usr/bin/env bash
# Issue 11 (twelfth session): the block drafter's draft-pass kernels at their launch variants on recorded
# inputs (bench/gpu_draft_kernels.py), run_gpu_block.sh's phases (PHASES, default "bench profile"), gpt-fast's
# compiled AR (PEER=1), then the GPU lane of the kernels changed (head_topk, the selections, the resident loop's
# kernels; LANE_K: pytest's -k).
#   bash bench/run_gpu_draft.sh $OUT   (device tool: carry .data = copies of ../shared/datasets/{mbpp,gsm8k})
# KERNELS=0 skips the variants, LANE=0 the lane.
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
DEADLINE=${DEADLINE:-580}; source bench/deadline.sh
record_env; cat "$OUT/env.txt"
if [ "${KERNELS:-1}" != 0 ]; then
  echo "== the draft pass's kernels at their variants"
  within "${KT:-220}" python3 bench/gpu_draft_kernels.py --data-dir .data --out "$OUT" > "$OUT/draft_kernels.log" 2>&1
  grep -e "^|" -e "rror" "$OUT/draft_kernels.log" | cut -c1-200; tail -2 "$OUT/draft_kernels.log" | cut -c1-300
fi
PHASES=${PHASES:-bench profile} bash bench/run_gpu_block.sh "$OUT"
if [ "${PEER:-0}" = 1 ]; then
  peer_gptfast tiny15m 90
fi
if [ "${LANE:-1}" != 0 ]; then
  echo "== GPU lane: head_topk, the selections, the resident loop's kernels"
  within "${LT:-150}" python3 -m pytest -q -m cuda tests/gpu/test_gpu_head_level.py \
    "tests/gpu/test_gpu_resident.py::test_resident_kernels_equal_their_references" -k "${LANE_K:-}" -p no:cacheprovider > "$OUT/lane.log" 2>&1
  tail -2 "$OUT/lane.log"; grep -e "^FAILED" -e "^ERROR" "$OUT/lane.log" | head -20
fi
