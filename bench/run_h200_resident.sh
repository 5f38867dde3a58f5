#!/usr/bin/env bash
# The device-resident loop on one H200: the GPU lane, then the block drafter x methods with the
# resident loop (default) and with the host-driven loop (TANDEM_RESIDENT=0), bf16 and fp32,
# and the compiled-AR peer (gpt-fast) in the same call.
#   bash bench/run_h200_resident.sh $OUT     (device tool: carry .data = mbpp.jsonl + peers/gpt-fast)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
NP=${NP:-10}
LANE=${LANE:-1}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
git rev-parse --short HEAD >> "$OUT/env.txt" 2>/dev/null
if [ "$LANE" = 1 ]; then
  echo "== GPU lane"
  timeout 240 python3 -m pytest -q -m cuda ${LANE_TESTS:-tests/gpu} -p no:cacheprovider > "$OUT/gpu_lane.log" 2>&1
  rc=$?; tail -25 "$OUT/gpu_lane.log"
  if [ "$rc" != 0 ] && [ "${STRICT:-0}" = 1 ]; then echo "GPU lane failed (rc $rc): no benchmarks"; exit 1; fi
fi
bench() {  # bench NAME DTYPE WORKLOAD DRAFT METHODS [extra]
  local name=$1 dt=$2 wl=$3 d=$4 m=$5; shift 5
  echo "== $name: $wl, $dt, --draft $d, $m (TANDEM_RESIDENT=${TANDEM_RESIDENT:-1})"
  timeout 90 python3 -m tandem bench --device cuda --dtype "$dt" --workload "$wl" --data-dir .data --num-prompts "$NP" \
    --max-new-tokens 128 --methods "$m" --warmup 2 --max-prompt-tokens 384 --draft "$d" --no-plots "$@" \
    --out "$OUT/$name" 2>&1 | grep -v -e "it/s" -e "req/s" | grep -e "^|" -e "^- " -e "Output check" -e "^Per" -e "auto:" -e "rror"
}
bench mbpp_block_resident bfloat16 mbpp block ar,chain,tree,auto --allow-mismatch
[ "${HOST:-1}" = 1 ] && TANDEM_RESIDENT=0 bench mbpp_block_host bfloat16 mbpp block ar,chain,tree --allow-mismatch
if [ "${OTHERS:-1}" = 1 ]; then
  bench mbpp_eagle3 bfloat16 mbpp eagle3 ar,chain,tree --allow-mismatch
  bench mbpp_draft bfloat16 mbpp draft ar,chain,tree --allow-mismatch
fi
NP=8 bench fp32_block_resident float32 mbpp block ar,chain,tree
bench source_block_resident bfloat16 source block ar,chain,tree --allow-mismatch
echo "== peer: gpt-fast compiled AR (ms/token)"
timeout 100 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
