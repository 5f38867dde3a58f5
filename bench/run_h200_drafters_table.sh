#!/usr/bin/env bash
# The drafters x methods table on one H200 (bundled pair, MBPP, 128 new tokens, device-resident
# loop for every drafter): the GPU lane for the resident loop first (STRICT=1: no benchmarks if it
# fails), a profile of the EAGLE-3 head's draft graph, bf16 tables, fp32 output checks, sampling,
# and the compiled-AR peer (gpt-fast) in the same call.
#   STRICT=1 bash bench/run_h200_drafters_table.sh $OUT     (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD TANDEM_RESIDENT=${TANDEM_RESIDENT:-1}
NP=${NP:-10}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
git rev-parse --short HEAD >> "$OUT/env.txt" 2>/dev/null
echo "== GPU lane (resident)"
timeout 200 python3 -m pytest -q -m cuda tests/gpu/test_gpu_resident.py -p no:cacheprovider > "$OUT/gpu_lane.log" 2>&1
rc=$?; tail -4 "$OUT/gpu_lane.log"
if [ "$rc" != 0 ] && [ "${STRICT:-0}" = 1 ]; then grep -B20 "Error" "$OUT/gpu_lane.log" | head -60; echo "GPU lane failed (rc $rc): no benchmarks"; exit 1; fi
if [ "${PROFILE:-1}" = 1 ]; then
  echo "== profile: EAGLE-3 head, resident graphs"
  timeout 120 python3 bench/gpu_profile_resident.py --kind eagle3 > "$OUT/profile_eagle3.txt" 2>&1
  grep -e "replay median" -e "kernels," "$OUT/profile_eagle3.txt"
fi
bench() {  # bench NAME DTYPE WORKLOAD DRAFT METHODS [extra]
  local name=$1 dt=$2 wl=$3 d=$4 m=$5; shift 5
  echo "== $name: $wl, $dt, --draft $d, $m $* (TANDEM_RESIDENT=$TANDEM_RESIDENT)"
  timeout 90 python3 -m tandem bench --device cuda --dtype "$dt" --workload "$wl" --data-dir .data --num-prompts "$NP" \
    --max-new-tokens 128 --methods "$m" --warmup 2 --max-prompt-tokens 384 --draft "$d" --no-plots "$@" \
    --out "$OUT/$name" 2>&1 | grep -v -e "it/s" -e "req/s" | grep -e "^|" -e "^- " -e "Output check" -e "^Per" -e "auto:" -e "rror"
}
bench mbpp_block bfloat16 mbpp block ar,chain,tree --allow-mismatch
bench mbpp_eagle3 bfloat16 mbpp eagle3 ar,chain,tree --allow-mismatch
bench mbpp_eagle3_d5 bfloat16 mbpp eagle3 tree --depth 5 --allow-mismatch
bench mbpp_draft bfloat16 mbpp draft ar,chain,tree --allow-mismatch
NP=5 bench fp32_eagle3 float32 mbpp eagle3 chain,tree
NP=5 bench fp32_draft float32 mbpp draft tree
NP=6 bench mbpp_eagle3_sampled bfloat16 mbpp eagle3 tree --temperature 0.7 --seed 1 --allow-mismatch
echo "== peer: gpt-fast compiled AR (ms/token)"
timeout 90 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
