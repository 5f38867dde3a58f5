#!/usr/bin/env bash
# Issue 11 at the Llama-3-8B shape on one GPU (random weights, bf16): Tandem's AR (gpu_core.py:
# kernels checked, bandwidth floor, row sweep, end-to-end ms/token), gpt-fast's compiled AR in
# the same call (its compile needs minutes at this shape), and the EAGLE-3 head of the published
# Llama-3.1-8B shape with the bundled head's MBPP acceptance replayed (simulated), resident loop.
#   bash bench/run_gpu_8b.sh $OUT   (device tool: carry .data with ../shared/peers/gpt-fast under .data/peers)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
DEADLINE=${DEADLINE:-540}; source bench/deadline.sh
[ -f "$OUT/env.txt" ] || record_env; cat "$OUT/env.txt"
echo "== replay: llama3-8b target + eagle3-llama3.1-8b head, the bundled head's MBPP acceptance (simulated)"
within 170 python3 -m tandem bench --device cuda --dtype bfloat16 --preset llama3-8b --draft-preset eagle3-llama3.1-8b \
  --replay "${TRACE:-bench/results/h200-2026-12-01-drafters-table/mbpp_eagle3/results.json.gz}" --methods ar,chain,tree \
  --num-prompts "${NP:-6}" --no-plots --out "$OUT/replay_8b_eagle3" > "$OUT/replay_8b_eagle3.log" 2>&1
grep -v -e "it/s" "$OUT/replay_8b_eagle3.log" | grep -e "^|" -e "replayed" -e "^- " -e "rror" | cut -c1-300
echo "== peer: gpt-fast compiled AR at the llama3-8b shape (ms/token)"
[ "${PEER_S:-300}" -gt 0 ] && within ${PEER_S:-300} python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast llama3-8b 2>&1 | grep '^{' | tee "$OUT/gptfast_8b.jsonl"
echo "== tandem ar at the llama3-8b shape (random weights)"
within 100 python3 bench/gpu_core.py --preset llama3-8b > "$OUT/tandem_8b.txt" 2>&1; tail -12 "$OUT/tandem_8b.txt"
[ "${TAR:-1}" = 1 ] && tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
