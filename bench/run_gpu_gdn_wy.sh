#!/usr/bin/env bash
# The Triton GDN WY kernel (tandem.kernels.gdn_wy) on one GPU: its GPU lane (and the captured hybrid passes
# with every capturable kernel), then one GDN layer's verify and commit at transformers' default Qwen3.5
# GDN shape for the walk, torch WY, the path kernel and the WY kernel's launch variants (bench/gpu_gdn.py,
# outputs checked, bf16 ulps of the path kernel), then, with REPLAY=1 and .data/trace/results.json, issue
# 17's 4B replay (`ar`, `tree`) with the path kernel and with the WY kernel in the same call.
#   TANDEM_COMMIT=<hash> bash bench/run_gpu_gdn_wy.sh $OUT        (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD:$PWD/bench
export DEADLINE=${DEADLINE:-420}
source bench/deadline.sh
record_env; cat "$OUT/env.txt"
echo "== GPU lane: WY kernel, captured hybrid passes"
within "${LT:-150}" python3 -m pytest -q -m cuda tests/gpu/test_gpu_gdn_wy.py tests/gpu/test_gpu_hybrid_graphs.py \
  -p no:cacheprovider > "$OUT/lane.log" 2>&1
rc=$?; tail -3 "$OUT/lane.log"
if [ "$rc" != 0 ]; then grep -B30 -m3 "Error" "$OUT/lane.log" | head -120; fi
echo "== one GDN layer: verify / commit per kernel"
within "${GT:-150}" python3 bench/gpu_gdn.py --out "$OUT/gdn" --iters "${ITERS:-100}" ${GDN_ARGS:-} 2>&1 \
  | grep -e "^|" -e "^Prefill" -e "rror"
if [ "${REPLAY:-0}" = 1 ] && [ -f .data/trace/results.json ]; then
  for kernel in path wy_triton; do
    echo "== replay: qwen3.5-4b / qwen3.5-0.8b, bf16, ar,tree, GDN tree kernel $kernel"
    TANDEM_GDN_TREE=$kernel within "${RT:-100}" python3 -m tandem bench --preset qwen3.5-4b --replay .data/trace/results.json \
      --device cuda --dtype bfloat16 --methods ar,tree --num-prompts "${NP:-2}" --no-plots --out "$OUT/replay_$kernel" 2>&1 \
      | grep -e "^|" -e "replayed tau" -e "rror"
  done
fi
