#!/usr/bin/env bash
# Issue 11, the block drafter on one GPU (bundled target, bf16, greedy, 128 new tokens): a retrained
# drafter (TRAIN_ARGS, e.g. the DFlash position decay, torch.compile, a larger corpus) against the
# bundled one on the same machine, each with `ar` in its run; the resident loop's GPU lane; where the
# draft graph's time goes (profile).
#   bash bench/run_gpu_block.sh $OUT   (device tool: carry .data = copies of ../shared/datasets/{mbpp,gsm8k})
# PHASES: which phases, in order (default "train bench lane profile"; the call's deadline cuts the last);
# WORKLOADS="mbpp gsm8k"; NP prompts a workload; DRAFTS: the bundled drafters benched (default block);
# BENCH_ARGS: more bench flags (e.g. --nodes 32,64); LANE_MORE: more GPU-lane test files.
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
DEADLINE=${DEADLINE:-580}; source bench/deadline.sh
NP=${NP:-10}
record_env; cat "$OUT/env.txt"
for phase in ${PHASES:-train bench lane profile}; do
  case $phase in
  train)
    echo "== train: tandem train-drafters --kind block ${TRAIN_ARGS:-}"
    within "${TT:-330}" python3 -m tandem train-drafters --kind block --out /tmp/dr ${TRAIN_ARGS:-} > "$OUT/train.log" 2>&1
    grep -v "it/s" "$OUT/train.log" | tail -4
    mkdir -p "$OUT/block_new" && cp /tmp/dr/block/* /tmp/dr/drafters_metrics.json "$OUT/block_new/" 2>/dev/null ;;
  bench)
    for wl in ${WORKLOADS:-mbpp}; do
      for d in ${DRAFTS:-block}; do bench "${wl}_$d" "$wl" "$d" ar,chain,tree; done
      [ -d /tmp/dr/block ] && bench "${wl}_new" "$wl" /tmp/dr/block ar,chain,tree
    done ;;
  lane)
    echo "== GPU lane: the resident loop and the block drafter's kernels"
    within 200 python3 -m pytest -q -m cuda tests/gpu/test_gpu_resident.py ${LANE_MORE:-} -p no:cacheprovider > "$OUT/lane.log" 2>&1
    tail -2 "$OUT/lane.log"; grep -e "^FAILED" -e "^ERROR" "$OUT/lane.log" | head -20 ;;
  profile)
    echo "== profile: the block drafter's draft and verify graphs"
    within 150 python3 bench/gpu_profile_resident.py --kind block > "$OUT/profile_block.txt" 2>&1
    grep -e "tok/s" -e "replay" "$OUT/profile_block.txt" ;;
  esac
done
