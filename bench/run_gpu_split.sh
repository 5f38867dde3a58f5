#!/usr/bin/env bash
# Split-column (flash-decoding) attention on one GPU: its GPU lane (the attention kernel, the head's
# kernels, the resident loop), Tandem's AR at the Llama-3-8B shape beside gpt-fast's compiled AR in
# the same call, and the bundled pair with the EAGLE-3 head on MBPP (bf16, greedy, 128 new tokens).
#   bash bench/run_gpu_split.sh $OUT   (device tool: carry .data as bench/run_gpu_head.sh says)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
DEADLINE=${DEADLINE:-560}; source bench/deadline.sh
record_env; cat "$OUT/env.txt"
echo "== GPU lane"
# (-k applies to every file named: the attention tests run on their own, then the two lane files)
within 150 python3 -m pytest -q -m cuda tests/gpu/test_gpu_kernels.py -k cached_attention -p no:cacheprovider \
  > "$OUT/lane_attention.log" 2>&1
within 120 python3 -m pytest -q -m cuda tests/gpu/test_gpu_head_level.py tests/gpu/test_gpu_resident.py \
  -p no:cacheprovider > "$OUT/lane.log" 2>&1
for f in lane_attention lane; do tail -1 "$OUT/$f.log"; grep -e "^FAILED" -e "^ERROR" "$OUT/$f.log" | head -10; done
echo "== tandem AR at the llama3-8b shape"
within 80 python3 bench/gpu_core.py --preset llama3-8b --out "$OUT" > "$OUT/tandem_8b.txt" 2>&1; tail -1 "$OUT/tandem_8b.txt"
echo "== gpt-fast compiled AR at the llama3-8b shape"
[ "${PEER:-1}" = 1 ] && within 150 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast llama3-8b 2>&1 | grep '^{' | tee "$OUT/gptfast_8b.jsonl"
echo "== mbpp, EAGLE-3 head"
within 75 python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts 10 \
  --max-new-tokens 128 --methods ar,chain,tree --warmup 2 --max-prompt-tokens 384 --draft eagle3 --no-plots \
  --allow-mismatch --out "$OUT/mbpp_eagle3" > "$OUT/mbpp_eagle3.log" 2>&1
grep -v -e "it/s" -e "req/s" "$OUT/mbpp_eagle3.log" | grep -e "^|" -e "Output check" -e "^- " -e "rror" | cut -c1-300
