#!/usr/bin/env bash
# The resident paths that were tested only on the CPU: EAGLE-3 head chain / tree (bf16, fp32
# output check, a shallower tree) and sampled resident tree with the block drafter, plus the
# GPU lane for the resident loop and the gpt-fast peer in the same call.
#   bash bench/run_h200_resident_more.sh $OUT     (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD TANDEM_RESIDENT=${TANDEM_RESIDENT:-1}
NP=${NP:-10}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
git rev-parse --short HEAD >> "$OUT/env.txt" 2>/dev/null
echo "== GPU lane (resident)"
timeout 200 python3 -m pytest -q -m cuda ${LANE_TESTS:-tests/gpu/test_gpu_resident.py} -p no:cacheprovider > "$OUT/gpu_lane.log" 2>&1
rc=$?; tail -15 "$OUT/gpu_lane.log"
bench() {  # bench NAME DTYPE WORKLOAD DRAFT METHODS [extra]
  local name=$1 dt=$2 wl=$3 d=$4 m=$5; shift 5
  echo "== $name: $wl, $dt, --draft $d, $m $* (TANDEM_RESIDENT=$TANDEM_RESIDENT)"
  timeout 90 python3 -m tandem bench --device cuda --dtype "$dt" --workload "$wl" --data-dir .data --num-prompts "$NP" \
    --max-new-tokens 128 --methods "$m" --warmup 2 --max-prompt-tokens 384 --draft "$d" --no-plots "$@" \
    --out "$OUT/$name" 2>&1 | grep -v -e "it/s" -e "req/s" | grep -e "^|" -e "^- " -e "Output check" -e "^Per" -e "auto:" -e "rror"
}
bench mbpp_eagle3_resident bfloat16 mbpp eagle3 ar,chain,tree --allow-mismatch
bench mbpp_eagle3_d4 bfloat16 mbpp eagle3 tree --depth 4 --allow-mismatch
NP=6 bench fp32_eagle3_resident float32 mbpp eagle3 ar,chain,tree
bench mbpp_block_sampled bfloat16 mbpp block ar,tree --temperature 0.7 --seed 1 --allow-mismatch
${EXTRA:-true}
echo "== peer: gpt-fast compiled AR (ms/token)"
timeout 100 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
