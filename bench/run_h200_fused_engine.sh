#!/usr/bin/env bash
# The fused kernels' launch shapes (bench/gpu_fused_layer.py), then the batched engine with and
# without the fused layers (TANDEM_FUSED_LAYER=0), paired in one call: EAGLE-3 head, ar / tree.
#   bash bench/run_h200_fused_engine.sh $OUT      (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD:$PWD/bench
echo "== launch shapes"
timeout 200 python3 bench/gpu_fused_layer.py > "$OUT/fused_shapes.jsonl" 2>&1
sed -n '/^best/,$p' "$OUT/fused_shapes.jsonl"; grep -m3 -i error "$OUT/fused_shapes.jsonl"
for f in 1 0; do
  name=engine_fused$f; [ -d "$OUT/$name" ] && name=${name}_b
  echo "== $name: eagle3, ar,tree (TANDEM_FUSED_LAYER=$f)"
  TANDEM_FUSED_LAYER=$f timeout ${TMO:-120} python3 -m tandem bench --device cuda --dtype bfloat16 --concurrency ${CONC:-1,8,32} \
    --methods ar,tree --ignore-eos --max-new-tokens 128 --workload mbpp --data-dir .data --num-prompts 64 \
    --max-prompt-tokens 256 --no-plots --allow-mismatch --draft eagle3 --peers none --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "rror" | tail -8
done
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
