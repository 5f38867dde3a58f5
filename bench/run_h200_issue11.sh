#!/usr/bin/env bash
# Issue 11's H200 figures: the drafters x methods table (bf16), the fp32 output check, auto, and
# the compiled-AR peer (gpt-fast) at the bundled target's shape and the Llama-3-8B shape.
#   bash bench/run_h200_issue11.sh $OUT     (device tool: carry .data = mbpp.jsonl + peers/gpt-fast)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
NP=${NP:-10}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
bench() {  # bench NAME DTYPE WORKLOAD DRAFT METHODS [extra]
  local name=$1 dt=$2 wl=$3 d=$4 m=$5; shift 5
  echo "== $name: $wl, $dt, --draft $d, $m"
  timeout 75 python3 -m tandem bench --device cuda --dtype "$dt" --workload "$wl" --data-dir .data --num-prompts "$NP" \
    --max-new-tokens 128 --methods "$m" --warmup 2 --max-prompt-tokens 384 --draft "$d" --no-plots "$@" \
    --out "$OUT/$name" 2>&1 | grep -v -e "it/s" -e "req/s" | grep -e "^|" -e "^- " -e "Output check" -e "^Per" -e "auto:"
}
bench mbpp_block bfloat16 mbpp block ar,chain,tree,tree@64,auto --allow-mismatch
bench mbpp_eagle3 bfloat16 mbpp eagle3 ar,chain,tree --allow-mismatch
bench mbpp_draft bfloat16 mbpp draft ar,chain,tree --allow-mismatch
bench source_block bfloat16 source block ar,chain,tree,auto --allow-mismatch
bench source_eagle3 bfloat16 source eagle3 ar,chain,tree --allow-mismatch
for d in block eagle3; do NP=8 bench "fp32_$d" float32 mbpp $d ar,chain,tree; done
echo "== peer: gpt-fast compiled AR (ms/token)"
timeout 130 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m llama3-8b 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
echo "== tandem ar at the llama3-8b shape (random weights)"
timeout 80 python3 bench/gpu_core.py --preset llama3-8b 2>&1 | tail -12 | tee "$OUT/tandem_8b.txt"
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
