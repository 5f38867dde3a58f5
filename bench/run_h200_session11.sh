#!/usr/bin/env bash
# One H200 call (eleventh session): the EAGLE-3 head's context pass (and the next trees) queued
# on the device behind the verify pass, before the accepts are read (EngineConfig.device_context),
# against feeding the head after the read (`+feed`): the GPU lane, the host-only step timeline
# with and without, and the engine table.
#   bash bench/run_h200_session11.sh $OUT      (device tool: carry .data/mbpp; .data/peers for SINGLE=1)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"; date -u >> "$OUT/env.txt"
git log -1 --format=%H >> "$OUT/env.txt" 2>/dev/null
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane: tree verification, the engine"
  timeout ${LANE_TMO:-200} python3 -m pytest -q -m cuda tests/gpu/test_gpu_tree_verify.py tests/gpu/test_gpu_engine.py \
    -p no:cacheprovider > "$OUT/lane.log" 2>&1; tail -1 "$OUT/lane.log"; grep -m2 -A30 "^___" "$OUT/lane.log" | head -60
fi
if [ "${SYNC:-1}" = 1 ]; then
  echo "== synchronizing calls of steady tree steps, by call site"
  timeout 100 python3 bench/gpu_sync_points.py --method tree --concurrency 1 8 > "$OUT/sync_points.log" 2>&1
  grep -v Warning "$OUT/sync_points.log" | head -30
fi
if [ "${TIMELINE:-1}" = 1 ]; then
  echo "== host-only step timeline: tree, the head run before the read (default), then fed after it"
  for flag in "" --no-device-context; do
    timeout 100 python3 bench/gpu_step_timeline.py --method tree --concurrency 1 64 --host-only $flag 2>/dev/null \
      | grep '^{' | tee -a "$OUT/host_only$flag.jsonl" | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print('$flag', d['concurrency'], 'ms', d['step_ms_unprofiled'], 'wall_us', d['wall_us'], 'run', d['accepts_on_device'], 'trees', d['trees_before_read'], 'ahead', d['drafted_ahead'], '/', d['steps'])"
  done
fi
for rep in ${REPS-a}; do
  name=engine_$rep; m=${METHODS:-ar,tree,tree+feed}
  echo "== $name: eagle3 --methods $m"
  timeout ${TMO:-200} python3 -m tandem bench --device cuda --dtype bfloat16 --concurrency ${CONC:-1,8,32,64} \
    --methods "$m" --ignore-eos --max-new-tokens 128 --workload mbpp --data-dir .data --num-prompts 64 \
    --max-prompt-tokens 256 --no-plots --allow-mismatch --draft eagle3 --peers none --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "rror" | tail -14
  rm -f "$OUT/$name/results.json"
done
if [ "${SINGLE:-0}" = 1 ]; then
  echo "== single request: eagle3, ar / tree (10 MBPP prompts)"
  timeout 100 python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts 10 \
    --max-new-tokens 128 --methods ar,tree --warmup 2 --max-prompt-tokens 384 --draft eagle3 --no-plots --allow-mismatch \
    --peers none --out "$OUT/single" > "$OUT/single.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/single.log" | grep -e "^|" -e "rror" | head -8; rm -f "$OUT/single/results.json"
  echo "== peer: gpt-fast compiled AR at the bundled target's shape (ms/token)"
  timeout 90 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
fi
