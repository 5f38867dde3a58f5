#!/usr/bin/env bash
# Issue 11, first GPU call: train the bundled target's block drafter (full preset, ~4 min on
# one H200), then a short paired benchmark of ar / chain / tree with it and with the bundled
# draft model, so the cost structure of one-pass drafting is measured early.
#   bash bench/run_h200_drafters.sh $OUT        (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
git rev-parse --short HEAD >> "$OUT/env.txt" 2>/dev/null
KIND=${KIND:-block}
timeout ${TRAIN_TIMEOUT:-330} python3 -m tandem train-drafters --kind "$KIND" --out /tmp/drafters ${TRAIN_ARGS:-} 2>&1 \
  | grep -v "it/s" | tee "$OUT/train_$KIND.log" | tail -8
for wl in mbpp source; do
  for d in /tmp/drafters/$KIND; do
    echo "== $wl, drafter $d"
    timeout 120 python3 -m tandem bench --device cuda --dtype bfloat16 --workload $wl --data-dir .data \
      --num-prompts ${NP:-10} --max-new-tokens 128 --methods ar,chain,tree --warmup 2 --max-prompt-tokens 384 \
      --draft "$d" --no-plots --out "$OUT/bench_${wl}_$KIND" 2>&1 | grep -v -e "it/s" -e "req/s" | tail -8
  done
done
(cd /tmp/drafters && tar -czf "$OUT/drafters_$KIND.tar.gz" .)
