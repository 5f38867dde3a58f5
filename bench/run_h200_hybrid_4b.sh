#!/usr/bin/env bash
# Issue 17's table on one GPU: a random-weight Qwen3.5 target at the 4B shape (bf16), drafted by a
# random Qwen3.5 draft at the 0.8B shape, `ar` / `chain` / `tree` at N = 16, 32, 64, each pass's
# accept count replayed from the bundled pair's MBPP run in the same call (no trained hybrid pair
# exists yet: *simulated acceptance*, from an attention-only pair). Then `tree@32` again with each
# GDN tree kernel (TANDEM_GDN_TREE: wy, path), for the verify pass's cost per kernel.
#   bash bench/run_h200_hybrid_4b.sh $OUT            (device tool: carry .data, a copy of ../shared/datasets/mbpp)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
NP=${NP:-4}
source bench/deadline.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
M="ar,chain,tree@16,tree@32,tree@64"
echo "== trace: the bundled pair, MBPP, bf16, $M"
within 120 python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts 10 \
  --max-new-tokens 128 --methods "$M" --warmup 1 --max-prompt-tokens 384 --draft draft --no-plots --allow-mismatch \
  --out "$OUT/trace" 2>&1 | grep -e "^|" -e "rror"
replay() {  # replay NAME KERNEL METHODS
  echo "== replay $1: qwen3.5-4b / qwen3.5-0.8b, bf16, TANDEM_GDN_TREE=$2, $3"
  TANDEM_GDN_TREE=$2 within "${RT:-240}" python3 -m tandem bench --preset qwen3.5-4b --replay "$OUT/trace/results.json" \
    --device cuda --dtype bfloat16 --methods "$3" --num-prompts "$NP" --no-plots --out "$OUT/$1" 2>&1 \
    | grep -e "^|" -e "replayed tau" -e "rror"
}
replay wy wy "$M"
RT=120 replay path path "ar,tree@32"
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
