#!/usr/bin/env bash
# One device call for the batched engine's draft gate (2026-12-07, ninth session): steady-state
# tables (REQS requests a level, at most C in flight; MBPP, bf16, 128 new tokens, EAGLE-3 head)
# with the gate's cost model alone (the default, TANDEM_GATE_ARMS=0) and with its measured arms
# (TANDEM_GATE_ARMS=1), `ar` in both for the ratio; then PROFILE=1: where an engine `tree` step's device time goes
# (bench/gpu_profile_engine_kernels.py) at one request and at 64; TIMELINE=1: host time by phase of `ar`'s
# steps and of the gated engine's plain steps (bench/gpu_step_timeline.py --host-only).
#   bash bench/run_gpu_gate.sh $OUT   (device tool: carry .data = a copy of ../shared/datasets/mbpp under .data/mbpp)
# GATECHECK=1: bench/gpu_gate_check.py --phases in a steady state (GC_CONC, GC_REQS; GC_PHASES="" drops
#   --phases, GC_FLAGS adds flags such as --stacks --skip-ungated).
# ONLINE=1: the server against the offline engine (--online --engine-process; carry .whl: .whl/site.tar.xz,
#   the server's packages for the device's Python 3.12, uvloop and httptools included; ONLINE_CONC,
#   ONLINE_REQS; CHUNK_RATES="default 0": one online run a server --max-chunk-rate; ONLINE_MAIN=0 skips
#   these tables); ONLINE_PROFILE=1: the engine process's main thread sampled (PROFILE_METHODS, PROFILE_CONC).
# NODES="12 20": `ar` and `tree` with those node budgets at NCONC (default 1,8,32). ARMS: the arms
#   settings to run (default "0 1"; ARMS=" " none); METHODS_1 / METHODS_0: each run's methods.
# (tenth session, 2026-12-07: `bench/results/h100-2026-12-07-serve/README.md` has each call's command)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
DEADLINE=${DEADLINE:-560}; source bench/deadline.sh
record_env; cat "$OUT/env.txt"
for arms in ${ARMS:-0 1}; do
  v=METHODS_$arms; m=${!v:-ar,tree,tree+gate}; [ "$arms" = 1 ] && m=${!v:-ar,tree+gate}
  name=engine_arms$arms
  echo "== $name: TANDEM_GATE_ARMS=$arms --methods $m"
  TANDEM_GATE_ARMS=$arms within "${TMO:-240}" python3 -m tandem bench --device cuda --dtype bfloat16 \
    --concurrency "${CONC:-1,8,32,64}" --methods "$m" --ignore-eos --max-new-tokens 128 --workload mbpp \
    --data-dir .data --num-prompts 64 --max-prompt-tokens 256 --no-plots --allow-mismatch --draft eagle3 \
    --peers none --requests "${REQS:-256}" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "^- " -e "rror" | cut -c1-400 | tail -24
  rm -f "$OUT/$name/results.json"
done
for n in ${NODES:-}; do  # smaller trees (depth N / 4): what a step's drafting costs against what it accepts
  name=engine_nodes$n
  echo "== $name: ar,tree --nodes $n"
  within "${NTMO:-120}" python3 -m tandem bench --device cuda --dtype bfloat16 --concurrency "${NCONC:-1,8,32}" \
    --methods ar,tree --nodes "$n" --ignore-eos --max-new-tokens 128 --workload mbpp --data-dir .data --num-prompts 64 \
    --max-prompt-tokens 256 --no-plots --allow-mismatch --draft eagle3 --peers none --requests "${REQS:-256}" \
    --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "^- " -e "rror" | cut -c1-300 | tail -12
  rm -f "$OUT/$name/results.json"
done
if [ "${TIMELINE:-0}" = 1 ]; then  # the gated engine's plain steps against `ar`'s: each host phase's time
  for m in "ar" "tree --gate-off real"; do
    echo "== host-only timeline: $m"
    within 100 python3 bench/gpu_step_timeline.py --method $m --concurrency 1 64 --host-only --steps 60 \
      --out "$OUT/timeline" 2>/dev/null | grep '^{' | python3 -c "import json,sys
for l in sys.stdin:
    d=json.loads(l); h=d['host_by_phase_us']
    print(d['method'], d['gate_off'], d['concurrency'], 'ms', d['step_ms_unprofiled'], 'wall_us', d['wall_us'],
          {k: v for k, v in list(h.items())[:12]})"
  done
fi
if [ "${PROFILE:-0}" = 1 ]; then
  echo "== engine tree step's timeline: device busy / idle by host phase, at 1 and 8 requests"
  within 120 python3 bench/gpu_step_timeline.py --method tree --concurrency 1 8 --steps 20 --out "$OUT/timeline" \
    2>/dev/null | grep '^{' | cut -c1-1500
  for c in ${PCONC:-1 64}; do
    echo "== engine tree step's kernels at $c request(s)"
    within 90 python3 bench/gpu_profile_engine_kernels.py --draft eagle3 --method tree --concurrency "$c" \
      --top 30 > "$OUT/kernels_tree_$c.txt" 2>&1
    head -45 "$OUT/kernels_tree_$c.txt"
  done
fi
if [ "${GATECHECK:-0}" = 1 ]; then  # host time by phase, ar / tree / tree+gate, prompts arriving (a steady state)
  for c in ${GC_CONC:-64}; do
    echo "== gate check with phases at C=$c, ${GC_REQS:-256} requests"
    within "${GC_TMO:-150}" python3 bench/gpu_gate_check.py --draft eagle3 --concurrency "$c" --requests "${GC_REQS:-256}" \
      ${GC_PHASES---phases} ${GC_FLAGS:-} --data-dir .data > "$OUT/gate_check_$c.txt" 2>&1
    cut -c1-900 "$OUT/gate_check_$c.txt" | grep -v "it/s"
  done
fi
if [ "${ONLINE:-0}" = 1 ]; then  # the server's packages: .whl/site.tar.xz (fastapi, starlette, pydantic, uvicorn, unpacked and xz'd)
  tar -xJf .whl/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD
  python3 -c "import uvicorn, fastapi; print('uvicorn', uvicorn.__version__, 'fastapi', fastapi.__version__)
for m in ('uvloop', 'httptools'):
    try:
        mod = __import__(m); print(m, mod.__version__)
    except Exception as e: print(m, 'missing:', e)"
  if [ "${ONLINE_MAIN:-1}" = 1 ]; then  # (ONLINE_MAIN=0: the profile below only)
  echo "== offline, the same requests (the served table's reference)"
  within "${ONLINE_TMO:-240}" python3 -m tandem bench --device cuda --dtype bfloat16 --draft eagle3 --allow-mismatch \
    --methods ar,tree+gate --concurrency "${ONLINE_CONC:-1,8,16,32,64}" --requests "${ONLINE_REQS:-128}" \
    --max-new-tokens 128 --ignore-eos --workload mbpp --data-dir .data --num-prompts 64 --max-prompt-tokens 256 --no-plots \
    --peers none --out "$OUT/offline" > "$OUT/offline.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/offline.log" | grep -e "^|" -e "rror" | tail -12
  rm -f "$OUT/offline/results.json"
  for rate in ${CHUNK_RATES:-default}; do
    name=online; flag=""; [ "$rate" != default ] && { name=online_rate$rate; flag="--max-chunk-rate $rate"; }
    echo "== $name (--engine-process $flag): eagle3, ar and tree (gated: a GPU's default); the client in its own process"
    within "${ONLINE_TMO:-240}" python3 -m tandem bench --online --engine-process $flag --device cuda --dtype bfloat16 \
      --draft eagle3 --methods ar,tree --concurrency "${ONLINE_CONC:-1,8,16,32,64}" --requests "${ONLINE_REQS:-128}" \
      --max-new-tokens 128 --ignore-eos --workload mbpp --data-dir .data --num-prompts 64 --max-prompt-tokens 256 --no-plots \
      --out "$OUT/$name" > "$OUT/$name.log" 2>&1
    grep -v -e "it/s" "$OUT/$name.log" | grep -e "^|" -e "rror" | tail -16
    rm -f "$OUT/$name/results.json"
  done
  fi
  if [ "${ONLINE_PROFILE:-0}" = 1 ]; then  # the engine process's loop, its stack sampled (where its time goes)
    for m in ${PROFILE_METHODS:-ar}; do
      echo "== online, engine process sampled: $m at ${PROFILE_CONC:-64}"
      TANDEM_ENGINE_PROFILE="$OUT/engine_stacks_$m.txt" within 120 python3 -m tandem bench --online --engine-process \
        --device cuda --dtype bfloat16 --draft eagle3 --methods $m --concurrency "${PROFILE_CONC:-64}" --requests 512 \
        --max-new-tokens 128 --ignore-eos --workload mbpp --data-dir .data --num-prompts 64 --max-prompt-tokens 256 \
        --no-plots --out "$OUT/online_prof_$m" > "$OUT/online_prof_$m.log" 2>&1
      grep -e "^|" "$OUT/online_prof_$m.log" | tail -1
      head -45 "$OUT/engine_stacks_$m.txt"
    done
  fi
fi
