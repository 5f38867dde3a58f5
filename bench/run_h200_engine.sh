#!/usr/bin/env bash
# The batched engine on one H200 (paged Triton attention, CUDA graphs per row bucket), one call:
# the GPU lane for the paged kernel and the engine, then `tandem bench --concurrency` for ar and
# tree beside transformers' generate_batch and padded generate, then the engine's modes
# (batch-parallel, row selection, deterministic, per-request drafting) at a few concurrencies.
#   bash bench/run_h200_engine.sh $OUT      (device tool: carry .data/mbpp)
#   DRAFT=eagle3 METHODS=ar,tree,tree+gate bash bench/run_h200_engine.sh $OUT   (another drafter, the gate)
#   MORE_DRAFTS="eagle3 block" MORE_METHODS=tree,tree+gate ...   (further drafters after the first table)
#   DET_CONC=64 ...   (first: ar and ar+det, batch-invariant mode, at those concurrencies)
#   SINGLE=1 ...   (also the single-request loop, block ar / tree, and gpt-fast: carry .data/peers too)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
NP=${NP:-64}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >> "$OUT/env.txt"
echo "== graphs: capture every bucket of the bundled target, replay vs eager"
timeout 120 python3 bench/gpu_engine_graphs.py > "$OUT/graphs.log" 2>&1
if [ $? != 0 ]; then
  tail -30 "$OUT/graphs.log"; echo "== graphs: retry with a capture stream per bucket"
  TANDEM_GRAPH_STREAM=bucket timeout 120 python3 bench/gpu_engine_graphs.py > "$OUT/graphs_bucket.log" 2>&1
  if [ $? = 0 ]; then export TANDEM_GRAPH_STREAM=bucket; else tail -30 "$OUT/graphs_bucket.log"; export TANDEM_CUDA_GRAPHS=0; fi
fi
tail -4 "$OUT/graphs.log"; echo "TANDEM_GRAPH_STREAM=${TANDEM_GRAPH_STREAM:-} TANDEM_CUDA_GRAPHS=${TANDEM_CUDA_GRAPHS:-1}" | tee -a "$OUT/env.txt"
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane (paged kernel, engine)"
  timeout 200 python3 -m pytest -q -m cuda ${LANE_TESTS:-tests/gpu/test_gpu_kernels.py::test_paged_attention \
    tests/gpu/test_gpu_engine.py tests/gpu/test_gpu_batch_parallel.py} -p no:cacheprovider > "$OUT/gpu_lane.log" 2>&1
  rc=$?; tail -3 "$OUT/gpu_lane.log"
  [ "$rc" != 0 ] && grep -B30 "Error" "$OUT/gpu_lane.log" | head -60
fi
conc() {  # conc NAME CONCURRENCIES METHODS [extra]
  local name=$1 c=$2 m=$3; shift 3
  echo "== $name: --concurrency $c --methods $m $*"
  timeout ${TMO:-240} python3 -m tandem bench --device cuda --dtype bfloat16 --concurrency "$c" --methods "$m" \
    --ignore-eos --max-new-tokens 128 --workload mbpp --data-dir .data --num-prompts "$NP" --max-prompt-tokens 256 \
    --no-plots --allow-mismatch ${DRAFT:+--draft "$DRAFT"} --out "$OUT/$name" "$@" > "$OUT/$name.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "^- " -e "utput" -e "rror" -e "mismatch" | tail -40
}
[ -n "${DET_CONC:-}" ] && conc engine_det "$DET_CONC" ar --deterministic --peers none  # ar and ar+det, same prompts
conc engine_concurrency ${CONC:-1,8,16,32,64} ${METHODS:-ar,tree} --peers ${PEERS:-generate_batch,generate}
for d in ${MORE_DRAFTS:-}; do  # further drafters, speculative methods only (ar does not depend on the drafter)
  DRAFT=$d conc engine_$d ${CONC:-1,8,16,32,64} ${MORE_METHODS:-tree} --peers none
done
if [ "${SINGLE:-0}" = 1 ]; then  # the single-request resident loop and the compiled-AR peer, same call
  echo "== single request: block drafter, ar / tree (10 MBPP prompts)"
  timeout 100 python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts 10 \
    --max-new-tokens 128 --methods ar,tree --warmup 2 --max-prompt-tokens 384 --draft block --no-plots --allow-mismatch \
    --out "$OUT/single_block" 2>&1 | grep -v -e "it/s" -e "req/s" | grep -e "^|" -e "Output check" -e "rror"
  echo "== peer: gpt-fast compiled AR at the bundled target's shape (ms/token)"
  timeout 90 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
fi
[ "${MODES:-1}" = 1 ] && TMO=200 conc engine_modes ${MODES_CONC:-8,32,64} ${MODES_METHODS:-ar,tree,tree+seq} \
  --batch-parallel --row-selection --deterministic --peers none
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
