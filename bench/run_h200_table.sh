#!/usr/bin/env bash
# The README's drafters x methods table on one H200, in two device calls (each under 10 minutes):
#   PART=A: the GPU lane for the resident loop and the kernels, the bf16 MBPP table for the block
#           drafter, the EAGLE-3 head and the small draft model, a profile, gpt-fast at the bundled shape
#   PART=B: fp32 output checks (SOURCE=1: the held-out source workload too), the 8B-shape replay
#           of the head's acceptance (random weights, labelled simulated, trace from $TRACE; its
#           ar row is Tandem's ar at that shape) and gpt-fast at the 8B shape
#   PART=S: sampled rows (temperature 0.7): the block drafter and the EAGLE-3 head, `tree`
#   PART=A STRICT=1 bash bench/run_h200_table.sh $OUT      (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
NP=${NP:-10}
PART=${PART:-A}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
bench() {  # bench NAME DTYPE WORKLOAD DRAFT METHODS [extra]
  local name=$1 dt=$2 wl=$3 d=$4 m=$5; shift 5
  echo "== $name: $wl, $dt, --draft $d, $m $*"
  timeout 90 python3 -m tandem bench --device cuda --dtype "$dt" --workload "$wl" --data-dir .data --num-prompts "$NP" \
    --max-new-tokens 128 --methods "$m" --warmup 2 --max-prompt-tokens 384 --draft "$d" --no-plots "$@" \
    --out "$OUT/$name" 2>&1 | grep -v -e "it/s" -e "req/s" | grep -e "^|" -e "^- " -e "Output check" -e "^Per" -e "auto:" -e "rror"
}
if [ "$PART" = A ]; then
  echo "== GPU lane (resident loop, kernels)"
  timeout 200 python3 -m pytest -q -m cuda tests/gpu/test_gpu_resident.py tests/gpu/test_gpu_kernels.py -p no:cacheprovider > "$OUT/gpu_lane.log" 2>&1
  rc=$?; tail -3 "$OUT/gpu_lane.log"
  if [ "$rc" != 0 ] && [ "${STRICT:-0}" = 1 ]; then grep -B25 "Error" "$OUT/gpu_lane.log" | head -80; echo "GPU lane failed (rc $rc): no benchmarks"; exit 1; fi
  bench mbpp_block bfloat16 mbpp block ar,chain,tree,auto --allow-mismatch
  bench mbpp_eagle3 bfloat16 mbpp eagle3 ar,chain,tree --allow-mismatch
  bench mbpp_draft bfloat16 mbpp draft ar,chain,tree --allow-mismatch
  echo "== profile: EAGLE-3 head, resident graphs"
  timeout 60 python3 bench/gpu_profile_resident.py --kind eagle3 > "$OUT/profile_eagle3.txt" 2>&1
  grep -e "replay median" -e "kernels," -e "tok/s" "$OUT/profile_eagle3.txt"
  echo "== peer: gpt-fast compiled AR (ms/token)"
  timeout 90 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
elif [ "$PART" = S ]; then
  bench sampled_block bfloat16 mbpp block ar,tree --temperature 0.7 --seed 1 --allow-mismatch
  NP=6 bench sampled_eagle3 bfloat16 mbpp eagle3 tree --temperature 0.7 --seed 1 --allow-mismatch
else
  NP=4 bench fp32_block float32 mbpp block chain,tree
  NP=4 bench fp32_eagle3 float32 mbpp eagle3 chain,tree
  NP=4 bench fp32_draft float32 mbpp draft chain,tree
  [ "${SOURCE:-0}" = 1 ] && bench source_block bfloat16 source block ar,tree --allow-mismatch
  echo "== replay: llama3-8b target + eagle3-llama3.1-8b head, the head's MBPP acceptance (simulated)"
  timeout 150 python3 -m tandem bench --device cuda --dtype bfloat16 --preset llama3-8b --draft-preset eagle3-llama3.1-8b \
    --replay "${TRACE:-bench/results/h200-2026-12-01-drafters-table/mbpp_eagle3/results.json.gz}" --methods ar,chain,tree \
    --num-prompts "$NP" --no-plots --out "$OUT/replay_8b_eagle3" 2>&1 | grep -v -e "it/s" | grep -e "^|" -e "replayed" -e "rror"
  echo "== peer: gpt-fast compiled AR at the llama3-8b shape"
  timeout 100 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast llama3-8b 2>&1 | grep '^{' | tee "$OUT/gptfast_8b.jsonl"
fi
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
