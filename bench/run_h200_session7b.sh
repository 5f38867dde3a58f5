#!/usr/bin/env bash
# One H200 call (2026-12-02, seventh session, after the fused level glue, the engine's host work and
# the server's streaming): the GPU lane for what changed, the engine's EAGLE-3 table (ar, tree,
# tree+gate), the plain step's cost by concurrency, and the online server with the engine in its own
# process.
#   bash bench/run_h200_session7b.sh $OUT     (device tool: carry .data/mbpp and .whl)
#   REPS="a b" LPT="0 64" bash bench/run_h200_session7b.sh $OUT   (the table twice; the server with and without
#                                                                  a 64-token prefill chunk cap)
#   PEERS=generate METHODS=ar,ar+det,tree,tree+gate ...   (transformers' padded generate beside the first table;
#                                                          deterministic mode)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane: level tree, kernels (paged attention, embed norms), engine"
  timeout 150 python3 -m pytest -q -m cuda tests/gpu/test_gpu_level_tree.py tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_engine.py \
    -k "level or embed_norms or paged or engine" -p no:cacheprovider > "$OUT/lane.log" 2>&1
  tail -2 "$OUT/lane.log"; grep -m2 -A25 "^___" "$OUT/lane.log" | head -50
fi
for rep in ${REPS-a}; do
  echo "== engine table ($rep): eagle3, ar / tree / tree+gate"
  timeout ${TMO:-170} python3 -m tandem bench --device cuda --dtype bfloat16 --concurrency 1,8,32,64 \
    --methods ${METHODS:-ar,tree,tree+gate} --ignore-eos --max-new-tokens 128 --workload mbpp --data-dir .data \
    --num-prompts 64 --max-prompt-tokens 256 --no-plots --allow-mismatch --draft eagle3 \
    --peers $([ "$rep" = a ] && echo "${PEERS:-none}" || echo none) --out "$OUT/engine_$rep" > "$OUT/engine_$rep.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/engine_$rep.log" | grep -e "^|" -e "^- " -e "rror" | tail -24
  rm -f "$OUT/engine_$rep/results.json"
done
[ "${ONLINE:-1}" = 1 ] || exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD
for lpt in ${LPT:-0}; do  # LPT="0 64": also with the prefill chunk capped (the inter-token tail)
  echo "== online (--engine-process, --long-prefill-token-threshold $lpt): eagle3, ar and tree; the client in its own process"
  timeout 170 python3 -m tandem bench --online --engine-process --device cuda --dtype bfloat16 --draft eagle3 --methods ar,tree \
    --concurrency 1,8,32,64 --requests 64 --max-new-tokens 128 --ignore-eos --workload mbpp --data-dir .data \
    --num-prompts 64 --max-prompt-tokens 256 --no-plots --long-prefill-token-threshold $lpt \
    --out "$OUT/online_lpt$lpt" > "$OUT/online_lpt$lpt.log" 2>&1
  grep -v -e "it/s" "$OUT/online_lpt$lpt.log" | grep -e "^|" -e "rror" | tail -12
  rm -f "$OUT/online_lpt$lpt/results.json"
done
