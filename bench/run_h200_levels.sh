#!/usr/bin/env bash
# Level drafters (EAGLE-3 head, small draft model) in the device-resident loop on one H200, then the
# 8B-shape replay of the head's recorded acceptance (random weights, labelled simulated), and the
# compiled-AR peer (gpt-fast) at both shapes in the same call.
#   bash bench/run_h200_levels.sh $OUT     (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD TANDEM_RESIDENT=${TANDEM_RESIDENT:-1}
NP=${NP:-10}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
git rev-parse --short HEAD >> "$OUT/env.txt" 2>/dev/null
echo "== GPU lane (resident)"
timeout 150 python3 -m pytest -q -m cuda tests/gpu/test_gpu_resident.py -p no:cacheprovider > "$OUT/gpu_lane.log" 2>&1
tail -4 "$OUT/gpu_lane.log"
bench() {  # bench NAME DTYPE WORKLOAD DRAFT METHODS [extra]
  local name=$1 dt=$2 wl=$3 d=$4 m=$5; shift 5
  echo "== $name: $wl, $dt, --draft $d, $m $* (TANDEM_RESIDENT=$TANDEM_RESIDENT)"
  timeout 90 python3 -m tandem bench --device cuda --dtype "$dt" --workload "$wl" --data-dir .data --num-prompts "$NP" \
    --max-new-tokens 128 --methods "$m" --warmup 2 --max-prompt-tokens 384 --draft "$d" --no-plots "$@" \
    --out "$OUT/$name" 2>&1 | grep -v -e "it/s" -e "req/s" | grep -e "^|" -e "^- " -e "Output check" -e "^Per" -e "auto:" -e "rror"
}
bench mbpp_eagle3 bfloat16 mbpp eagle3 ar,chain,tree --allow-mismatch
bench mbpp_eagle3_d5 bfloat16 mbpp eagle3 tree --depth 5 --allow-mismatch
bench mbpp_draft bfloat16 mbpp draft ar,chain,tree --allow-mismatch
NP=6 bench fp32_draft float32 mbpp draft ar,chain,tree
echo "== replay: llama3-8b target + eagle3-llama3.1-8b head, the head's MBPP acceptance (simulated)"
timeout 200 python3 -m tandem bench --device cuda --dtype bfloat16 --preset llama3-8b --draft-preset eagle3-llama3.1-8b \
  --replay "$OUT/mbpp_eagle3/results.json" --methods ar,chain,tree --num-prompts "$NP" --no-plots \
  --out "$OUT/replay_8b_eagle3" 2>&1 | grep -v -e "it/s" | grep -e "^|" -e "replayed" -e "rror"
echo "== peer: gpt-fast compiled AR (ms/token)"
timeout 120 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m llama3-8b 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
