#!/usr/bin/env bash
# One H200 call (thirteenth session): the draft gate that keeps both step kinds current (plain
# refreshes while drafting, steady probe pairs while not) and the host trims of plain steps at
# many requests; the GPU lane over the engine; TIMELINE=1: the host-only timeline of `ar` at 1
# and 64 requests; engine tables (default ar, tree, tree+gate) with the EAGLE-3 head and the draft
# model; GATE=1: the gate's own log (bench/gpu_gate_check.py); SINGLE=1: one request and gpt-fast;
# GATE_ARGS: more flags for it (--phases);
# ONLINE=1: the server (--online --engine-process; carry .whl: the server's wheels for the device's Python).
#   bash bench/run_h200_session13.sh $OUT      (device tool: carry .data/mbpp; .data/peers for SINGLE=1)
# DRAFTS: drafters of the tables (default "eagle3 draft"); METHODS_<drafter>: their methods; REQS: requests
# a level, at most C in flight (default: one wave of C).
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"; date -u >> "$OUT/env.txt"
git log -1 --format=%H >> "$OUT/env.txt" 2>/dev/null
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane: the engine (ar async on the GPU; tree with the draft model's and the head's run_accepts)"
  timeout ${LANE_TMO:-200} python3 -m pytest -q -m cuda tests/gpu/test_gpu_engine.py \
    -p no:cacheprovider > "$OUT/lane.log" 2>&1; tail -1 "$OUT/lane.log"; grep -m2 -A30 "^___" "$OUT/lane.log" | head -60
fi
if [ "${TIMELINE:-0}" = 1 ]; then
  echo "== host-only step timeline: ar, async (default) then synchronous"
  for flag in ""; do
    timeout 100 python3 bench/gpu_step_timeline.py --method ar --concurrency 1 64 --host-only $flag 2>/dev/null \
      | grep '^{' | tee -a "$OUT/host_only_ar$flag.jsonl" | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); print('$flag', d['concurrency'], 'ms', d['step_ms_unprofiled'], 'wall_us', d['wall_us'], '/', d['steps'])"
  done
fi
for rep in ${REPS-a}; do
  for d in ${DRAFTS-eagle3 draft}; do
    name=engine_${d}_$rep; v=METHODS_$d; m=${!v:-ar,tree,tree+gate}
    echo "== $name: $d --methods $m"
    timeout ${TMO:-200} python3 -m tandem bench --device cuda --dtype bfloat16 --concurrency ${CONC:-1,8,32,64} \
      --methods "$m" --ignore-eos --max-new-tokens 128 --workload mbpp --data-dir .data --num-prompts 64 \
      --max-prompt-tokens 256 --no-plots --allow-mismatch --draft $d --peers none ${REQS:+--requests $REQS} \
      --out "$OUT/$name" > "$OUT/$name.log" 2>&1
    grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "rror" | tail -14
    rm -f "$OUT/$name/results.json"
  done
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
if [ "${GATE:-0}" = 1 ]; then
  echo "== the gate's log: eagle3 at ${GATE_CONC:-8 64}"
  timeout ${GATE_TMO:-200} python3 bench/gpu_gate_check.py --draft eagle3 --concurrency ${GATE_CONC:-8 64} \
    --data-dir .data ${GATE_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/gate.log" | tail -40
fi
if [ "${ONLINE:-0}" = 1 ]; then  # the server's packages: .whl/*.whl, or .whl/site.tar.xz (the same, unpacked and xz'd: smaller)
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  else
    tar -xJf .whl/site.tar.xz -C /tmp
  fi
  export PYTHONPATH=/tmp/site:$PWD
  echo "== online (--engine-process): eagle3, ar and tree; the client in its own process"
  timeout ${ONLINE_TMO:-200} python3 -m tandem bench --online --engine-process --device cuda --dtype bfloat16 --draft eagle3 --methods ${ONLINE_METHODS:-ar,tree,tree+gate} \
    --concurrency ${ONLINE_CONC:-1,8,32,64} --requests 64 --max-new-tokens 128 --ignore-eos --workload mbpp --data-dir .data \
    --num-prompts 64 --max-prompt-tokens 256 --no-plots --out "$OUT/online" > "$OUT/online.log" 2>&1
  grep -v -e "it/s" "$OUT/online.log" | grep -e "^|" -e "rror" | tail -12
  rm -f "$OUT/online/results.json"
fi
