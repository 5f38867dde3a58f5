#!/usr/bin/env bash
# The fused decoder-layer kernels (tandem.kernels.fused_layer) on one H200, bundled pair, bf16:
# the GPU lane (LANE=1), the resident graphs' kernel counts and replay times with and without them,
# the drafters x methods table with them, the same EAGLE-3 rows without them (TANDEM_FUSED_LAYER=0:
# the before, in the same call), and gpt-fast's compiled AR at the bundled target's shape.
#   bash bench/run_h200_fused.sh $OUT            (device tool: carry .data, a copy of ../shared/datasets/mbpp
#                                                 and ../shared/peers)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
NP=${NP:-10}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
git log -1 --format=%H >> "$OUT/env.txt" 2>/dev/null
DEADLINE=${DEADLINE:-500}  # seconds: later steps are skipped (the tar at the end must run inside the call)
bench() {  # bench NAME DRAFT METHODS [extra]
  local name=$1 d=$2 m=$3; shift 3
  if [ "$SECONDS" -gt "$DEADLINE" ]; then echo "== $name: skipped (deadline)"; return; fi
  echo "== $name: --draft $d, $m $* (TANDEM_FUSED_LAYER=${TANDEM_FUSED_LAYER:-1})"
  timeout "${BT:-100}" python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data \
    --num-prompts "$NP" --max-new-tokens 128 --methods "$m" --warmup 2 --max-prompt-tokens 384 --draft "$d" \
    --no-plots --allow-mismatch "$@" --out "$OUT/$name" 2>&1 | grep -v -e "it/s" -e "req/s" \
    | grep -e "^|" -e "Output check" -e "^Per" -e "auto:" -e "rror"
}
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane: the fused layers (a failure stops the run)"
  timeout 120 python3 -m pytest -q -m cuda tests/gpu/test_gpu_fused_layer.py -p no:cacheprovider > "$OUT/lane_fused.log" 2>&1
  rc=$?; tail -3 "$OUT/lane_fused.log"
  if [ "$rc" != 0 ]; then grep -B30 -m3 "Error" "$OUT/lane_fused.log" | head -120; echo "failed (rc $rc)"; exit 1; fi
  echo "== GPU lane: the rest"
  timeout 120 python3 -m pytest -q -m cuda tests/gpu/test_gpu_resident.py tests/gpu/test_gpu_kernels.py \
    tests/gpu/test_gpu_graphs.py tests/gpu/test_gpu_methods.py tests/gpu/test_gpu_engine.py -p no:cacheprovider > "$OUT/gpu_lane.log" 2>&1
  tail -4 "$OUT/gpu_lane.log"; grep -e "^FAILED" -e "^ERROR" "$OUT/gpu_lane.log" | head -20
fi
for f in 1 0; do
  [ "$SECONDS" -gt "$DEADLINE" ] && break
  echo "== profile: EAGLE-3 head, resident graphs, TANDEM_FUSED_LAYER=$f"
  TANDEM_FUSED_LAYER=$f timeout 60 python3 bench/gpu_profile_resident.py --kind eagle3 > "$OUT/profile_eagle3_fused$f.txt" 2>&1
  grep -e "replay median" -e "kernels," -e "tok/s" "$OUT/profile_eagle3_fused$f.txt"
done
echo "== peer: gpt-fast compiled AR (ms/token)"
timeout 90 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
bench eagle3 eagle3 ar,chain,tree
TANDEM_FUSED_LAYER=0 bench eagle3_unfused eagle3 ar,tree
bench block block ar,chain,tree
bench draft draft ar,chain,tree
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
