#!/usr/bin/env bash
# One H200 call (tenth session): the engine's EAGLE-3 table with the next step's trees drafted
# ahead (the default) against drafting at the step's start (+sync), the step timeline (device
# busy / idle per step) with and without, and a fresh process's first steps (the warm-up request).
#   bash bench/run_h200_session10.sh $OUT     (device tool: carry .data/mbpp; .data/peers for SINGLE=1)
#   REPS="a" METHODS=ar,tree TIMELINE=0 FIRST=0 ...   (one table only)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"; date -u >> "$OUT/env.txt"
table() {  # table NAME METHODS [env...]
  local name=$1 m=$2; shift 2
  echo "== $name: eagle3 --methods $m $*"
  env "$@" timeout ${TMO:-170} python3 -m tandem bench --device cuda --dtype bfloat16 --concurrency ${CONC:-1,8,32,64} \
    --methods "$m" --ignore-eos --max-new-tokens 128 --workload mbpp --data-dir .data --num-prompts 64 \
    --max-prompt-tokens 256 --no-plots --allow-mismatch --draft eagle3 --peers none --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "rror" | tail -14
  rm -f "$OUT/$name/results.json"
}
if [ "${LANE:-0}" = 1 ]; then
  echo "== GPU lane: tree verification, the engine"
  timeout 150 python3 -m pytest -q -m cuda tests/gpu/test_gpu_tree_verify.py tests/gpu/test_gpu_engine.py \
    -p no:cacheprovider > "$OUT/lane.log" 2>&1; tail -1 "$OUT/lane.log"; grep -m2 -A30 "^___" "$OUT/lane.log" | head -60
fi
if [ "${SYNC:-1}" = 1 ]; then
  echo "== synchronizing calls of steady tree steps, by call site (drafted ahead, then not)"
  timeout 100 python3 bench/gpu_sync_points.py --method tree --concurrency 1 8 > "$OUT/sync_points.log" 2>&1
  timeout 100 python3 bench/gpu_sync_points.py --method tree --concurrency 8 --no-draft-ahead > "$OUT/sync_points_noahead.log" 2>&1
  grep -v Warning "$OUT/sync_points.log" | head -40; grep waits_per_step "$OUT/sync_points_noahead.log"
fi
if [ "${REPLAY:-0}" = 1 ]; then
  echo "== a graph replay's host time, by owner (steps as they run; then the device drained before each)"
  timeout 100 python3 bench/gpu_replay_cost.py --method tree --concurrency 1 64 2>&1 | grep -e '^{' -e rror | tee "$OUT/replay_cost.jsonl"
fi
for rep in ${REPS-a b}; do table engine_$rep ${METHODS:-ar,tree,tree+sync,tree+gate}; done
if [ "${TIMELINE:-1}" = 1 ]; then
  echo "== step timeline: tree, drafted ahead and not (device busy / idle per step, us)"
  for flag in "" --no-draft-ahead; do
    timeout 100 python3 bench/gpu_step_timeline.py --method tree --concurrency 1 64 $flag --out "$OUT/timeline$flag" \
      2>/dev/null | grep '^{' | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print('$flag', d['concurrency'], 'wall', d['wall_us'], 'busy', d['busy_us'], 'idle', d['idle_us'], 'unprofiled ms', d.get('step_ms_unprofiled'))" | tee -a "$OUT/timeline.txt"
  done
fi
if [ "${FIRST:-1}" = 1 ]; then
  echo "== a fresh process's first steps (the warm-up request on)"
  timeout 120 python3 bench/gpu_first_steps.py --method tree --concurrency 1 8 32 > "$OUT/first_steps.log" 2>&1; tail -8 "$OUT/first_steps.log"
fi
if [ "${SINGLE:-0}" = 1 ]; then
  echo "== single request: eagle3, ar / tree (10 MBPP prompts)"
  timeout 100 python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts 10 \
    --max-new-tokens 128 --methods ar,tree --warmup 2 --max-prompt-tokens 384 --draft eagle3 --no-plots --allow-mismatch \
    --peers none --out "$OUT/single" > "$OUT/single.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/single.log" | grep -e "^|" -e "rror" | head -8; rm -f "$OUT/single/results.json"
  echo "== peer: gpt-fast compiled AR at the bundled target's shape (ms/token)"
  timeout 90 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
fi
