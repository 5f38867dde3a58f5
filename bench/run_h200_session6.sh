#!/usr/bin/env bash
# One H200 call (2026-12-02): where a drafting engine's plain step goes (host profiles, ar against
# tree with drafting off), the engine table after the gate on measured step costs and the
# per-engine target features, then the online server bench beside it (the engine in the server's
# process and in its own: ONLINE_MODES="thread process").
#   bash bench/run_h200_session6.sh $OUT     (device tool: carry .data/mbpp and .whl)
#   PROFILES=0 DRAFT=eagle3 MORE_DRAFTS= bash bench/run_h200_session6.sh $OUT   (the EAGLE-3 table and the server only)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
[ "${PROFILES:-1}" = 1 ] && for spec in "draft ar" "draft tree --no-drafting" "eagle3 tree --no-drafting"; do
  set -- $spec
  echo "== profile: --draft $1 --method $2 ${3:-} --concurrency 32"
  timeout 100 python3 bench/gpu_profile_engine.py --draft $1 --method $2 ${3:-} --concurrency 32 --top 25 \
    > "$OUT/profile_$1_$2${3:+_off}.log" 2>&1
  head -12 "$OUT/profile_$1_$2${3:+_off}.log"
done
LANE=0 PEERS=none CONC=1,8,32,64 METHODS=ar,tree,tree+gate MORE_DRAFTS="${MORE_DRAFTS-eagle3 block}" \
  MORE_METHODS=ar,tree,tree+gate MODES=0 bash bench/run_h200_engine.sh "$OUT/engine"
if [ "${ONLINE:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD
  for mode in ${ONLINE_MODES:-thread process}; do  # the engine in the server's process, or in its own
    echo "== online ($mode): tandem serve in-process, ${DRAFT:-eagle3}, ar and tree; the client in its own process"
    timeout 200 python3 -m tandem bench --online --device cuda --dtype bfloat16 --draft "${DRAFT:-eagle3}" --methods ar,tree \
      --concurrency 1,8,32,64 --requests 64 --max-new-tokens 128 --ignore-eos --workload mbpp --data-dir .data \
      --num-prompts 64 --max-prompt-tokens 256 --no-plots $([ "$mode" = process ] && echo --engine-process) \
      --out "$OUT/online_$mode" > "$OUT/online_$mode.log" 2>&1
    grep -v -e "it/s" "$OUT/online_$mode.log" | grep -e "^|" -e "rror" | tail -20
  done
fi
