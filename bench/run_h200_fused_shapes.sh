#!/usr/bin/env bash
# The fused kernels' launch shapes (bench/gpu_fused_layer.py) and the GPU lane's engine files.
#   bash bench/run_h200_fused_shapes.sh $OUT
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD:$PWD/bench
echo "== launch shapes"
timeout 260 python3 bench/gpu_fused_layer.py > "$OUT/fused_shapes.jsonl" 2>&1
sed -n '/^best/,$p' "$OUT/fused_shapes.jsonl"; grep -m3 -i error "$OUT/fused_shapes.jsonl"
echo "== GPU lane: fused layers (one-step paths), engine, batch parallel, tree verify, level trees"
timeout 230 python3 -m pytest -q -m cuda tests/gpu/test_gpu_fused_layer.py tests/gpu/test_gpu_engine.py \
  tests/gpu/test_gpu_batch_parallel.py tests/gpu/test_gpu_tree_verify.py tests/gpu/test_gpu_level_tree.py \
  -p no:cacheprovider > "$OUT/gpu_lane2.log" 2>&1
tail -3 "$OUT/gpu_lane2.log"; grep -e "^FAILED" -e "^ERROR" "$OUT/gpu_lane2.log" | head -20
