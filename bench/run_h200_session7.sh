#!/usr/bin/env bash
# One H200 call (2026-12-02, seventh session): the engine's EAGLE-3 table twice in one call (the host
# is noisy), the single-request loop and gpt-fast beside it, the engine's host profile at one request,
# then the online server in both modes (engine thread / engine process), each with its client in a
# process of its own.
#   bash bench/run_h200_session7.sh $OUT     (device tool: carry .data/mbpp, .data/peers and .whl)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
conc() {  # conc NAME DRAFT CONCURRENCIES METHODS [extra]
  local name=$1 d=$2 c=$3 m=$4; shift 4
  echo "== $name: --draft $d --concurrency $c --methods $m $*"
  timeout ${TMO:-150} python3 -m tandem bench --device cuda --dtype bfloat16 --concurrency "$c" --methods "$m" \
    --ignore-eos --max-new-tokens 128 --workload mbpp --data-dir .data --num-prompts 64 --max-prompt-tokens 256 \
    --no-plots --allow-mismatch --draft "$d" --peers none --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "rror" | tail -12
  rm -f "$OUT/$name/results.json"
}
for rep in ${REPS:-a b}; do conc engine_eagle3_$rep eagle3 ${CONC:-1,8,32,64} ${METHODS:-ar,tree,tree+gate}; done
if [ "${SINGLE:-1}" = 1 ]; then
  for d in eagle3 block; do
    echo "== single request: --draft $d, ar / tree (10 MBPP prompts)"
    timeout 100 python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts 10 \
      --max-new-tokens 128 --methods ar,tree --warmup 2 --max-prompt-tokens 384 --draft $d --no-plots --allow-mismatch \
      --out "$OUT/single_$d" > "$OUT/single_$d.log" 2>&1
    grep -v -e "it/s" -e "req/s" "$OUT/single_$d.log" | grep -e "^|" -e "Output check" -e "rror" | head -8
    rm -f "$OUT/single_$d/results.json"
  done
  echo "== peer: gpt-fast compiled AR at the bundled target's shape (ms/token)"
  timeout 90 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
fi
if [ "${PROFILE:-1}" = 1 ]; then
  echo "== host profile: engine ar and eagle3 tree at one request"
  for spec in "draft ar" "eagle3 tree"; do set -- $spec
    timeout 60 python3 bench/gpu_profile_engine.py --draft $1 --method $2 --concurrency 1 --top 30 > "$OUT/profile_$1_$2_c1.log" 2>&1
    head -45 "$OUT/profile_$1_$2_c1.log"
  done
fi
if [ "${ONLINE:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
  for mode in ${ONLINE_MODES:-process thread}; do
    echo "== online ($mode): eagle3, ar and tree; the client in its own process"
    timeout 170 python3 -m tandem bench --online --device cuda --dtype bfloat16 --draft eagle3 --methods ar,tree \
      --concurrency 1,8,32,64 --requests 64 --max-new-tokens 128 --ignore-eos --workload mbpp --data-dir .data \
      --num-prompts 64 --max-prompt-tokens 256 --no-plots $([ "$mode" = process ] && echo --engine-process) \
      --out "$OUT/online_$mode" > "$OUT/online_$mode.log" 2>&1
    grep -v -e "it/s" "$OUT/online_$mode.log" | grep -e "^|" -e "rror" | tail -20
    rm -f "$OUT/online_$mode/results.json"
  done
fi
