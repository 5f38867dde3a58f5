#!/usr/bin/env bash
# The H200 figures of the README, in one go (device tool: carry .data, which holds mbpp.jsonl).
#   bash bench/run_h200.sh $OUT [quick]
set -uo pipefail
OUT=${1:-out}; QUICK=${2:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
N=40; NEW=128
[ -n "$QUICK" ] && N=4 && NEW=32
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/env.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> "$OUT/env.txt"
for wl in mbpp source; do
  python3 -m tandem bench --device cuda --dtype bfloat16 --workload $wl --data-dir .data --num-prompts $N \
    --max-new-tokens $NEW --methods ar,chain,tree,async,hf,hf-assisted --warmup 2 --max-prompt-tokens 384 \
    --out "$OUT/bench_$wl" 2>&1 | grep -v "it/s" | tail -40
done
python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts $N \
  --max-new-tokens $NEW --methods ar,tree --nodes 4,8,16,32,64,96 --warmup 2 --no-plots \
  --out "$OUT/bench_nodes" 2>&1 | grep -v "it/s" | tail -25
