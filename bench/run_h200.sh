#!/usr/bin/env bash
# The H200 figures of the README, in one go (device tool: carry .data, which holds mbpp.jsonl).
#   TANDEM_COMMIT=<sha> bash bench/run_h200.sh $OUT [quick]
# The bundled pair runs in float32 so the output check against ar is exact (in bf16 a 1-row and a
# many-row pass round differently and near-ties can flip; `tandem audit` judges those).
set -uo pipefail
OUT=${1:-out}; QUICK=${2:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TQDM_MININTERVAL=30
N=20; NEW=128
[ -n "$QUICK" ] && N=3 && NEW=32
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/env.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" >> "$OUT/env.txt"
for wl in mbpp source; do
  python3 -m tandem bench --device cuda --dtype float32 --workload $wl --data-dir .data --num-prompts $N \
    --max-new-tokens $NEW --methods ar,chain,tree,async,hf,hf-assisted --warmup 2 --max-prompt-tokens 384 \
    --out "$OUT/bench_$wl" 2>&1 | grep -v -e "it/s" -e "req/s" | tail -28
done
python3 -m tandem bench --device cuda --dtype float32 --workload mbpp --data-dir .data --num-prompts $N \
  --max-new-tokens $NEW --methods ar,tree --nodes 4,8,16,32,64,96 --warmup 2 --no-plots \
  --out "$OUT/bench_nodes" 2>&1 | grep -v -e "it/s" -e "req/s" | tail -12
python3 -m tandem profile --preset llama3-8b --dtype bfloat16 --context 512 --tau-json "$OUT/bench_nodes/results.json" \
  --out "$OUT/profile_llama3-8b" 2>&1 | tail -45
python3 -m tandem audit --method tree --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts 10 \
  --max-new-tokens $NEW --out "$OUT/audit_tree_bf16" 2>&1 | grep -v -e "it/s" -e "req/s" | tail -12
