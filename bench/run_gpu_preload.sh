#!/usr/bin/env bash
# Thirteenth session: every weight-reading kernel of a pass (the fused layers' three projections, the
# block drafter's head_topk, the large model's GEMVs) loads its first weight step before the PDL wait
# (TANDEM_PRELOAD=1, the default) or after it (0), A/B in one call: MBPP with each drafter
# in DRAFTS (ar, chain, tree at the default N), the draft / verify graph replays, gpt-fast's compiled AR (PEER=1),
# the Llama-3-8B shape's AR (EIGHT=1), and the GPU lane of the kernels changed (LANE=1).
#   bash bench/run_gpu_preload.sh $OUT   (device tool: carry .data = copies of ../shared/datasets/{mbpp,gsm8k})
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
DEADLINE=${DEADLINE:-560}; source bench/deadline.sh
record_env; cat "$OUT/env.txt"
if [ "${KERNELS:-1}" = 1 ]; then
  echo "== the fused layer kernels, first weight step before (pre1) / after (pre0) the wait, us a call in a graph"
  within "${KT:-120}" python3 bench/gpu_fused_layer.py --pre --iters 300 > "$OUT/fused_pre.jsonl" 2> "$OUT/fused_pre.err"
  python3 - "$OUT/fused_pre.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
by = {}
for r in rows:
    if r["variant"].endswith(("_pre1", "_pre0")):
        by.setdefault((r["shape"], r["op"], r["rows"], r["variant"][:-5]), {})[r["variant"][-1]] = r
for (sh, op, m, v), d in by.items():
    a, b = d.get("1"), d.get("0")
    if a and b:
        print(f"{sh:6s} {op:10s} rows {m:2d} {v:18s} pre1 {a['us']:6.2f}  pre0 {b['us']:6.2f}  err {a['rel_err']:.1e}")
PY
  tail -3 "$OUT/fused_pre.err"
fi
for pre in ${PRES:-1 0}; do
  for d in ${DRAFTS:-block}; do (export TANDEM_PRELOAD=$pre; bench "mbpp_${d}_pre$pre" mbpp "$d" ar,chain,tree); done
done
if [ "${PROFILE:-1}" = 1 ]; then
  for pre in ${PRES:-1 0}; do
    echo "== graph replays, TANDEM_PRELOAD=$pre"
    within "${PT:-70}" env TANDEM_PRELOAD=$pre python3 bench/gpu_profile_resident.py --kind block --nodes 31 \
      > "$OUT/profile_pre$pre.txt" 2>&1
    grep -e "tok/s" -e "replay median" -e "kernels," "$OUT/profile_pre$pre.txt"
  done
fi
if [ "${EIGHT:-0}" = 1 ]; then  # the Llama-3-8B shape (random weights): its one-row GEMVs, AR end to end
  for pre in ${PRES:-1 0}; do
    echo "== llama3-8b AR, TANDEM_PRELOAD=$pre"
    within "${ET:-110}" env TANDEM_PRELOAD=$pre python3 bench/gpu_core.py --preset llama3-8b --rows 1,32 --new-tokens 128 \
      --out "$OUT/core8b_pre$pre" > "$OUT/core8b_pre$pre.txt" 2>&1
    grep -e "floor" -e "step rows" -e "rror" "$OUT/core8b_pre$pre.txt" | cut -c1-200
  done
fi
if [ "${PEER:-1}" = 1 ]; then
  peer_gptfast tiny15m 90
fi
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane: the resident kernels (the narrow tree), PDL on / off, the fused layers, head_topk, the GEMVs"
  r=tests/gpu/test_gpu_resident.py
  within "${LT:-150}" env TANDEM_PRELOAD=1 python3 -m pytest -q -m cuda "$r::test_resident_kernels_equal_their_references" \
    "$r::test_programmatic_dependent_launch_changes_no_token" tests/gpu/test_gpu_fused_layer.py \
    tests/gpu/test_gpu_head_level.py tests/gpu/test_gpu_gemv.py -k "${LANE_K:-not select}" -p no:cacheprovider \
    > "$OUT/lane.log" 2>&1
  tail -2 "$OUT/lane.log"; grep -e "^FAILED" -e "^ERROR" "$OUT/lane.log" | head -20
fi
