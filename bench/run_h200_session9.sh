#!/usr/bin/env bash
# One H200 call (2026-12-02, ninth session): the GPU lane over trees verified on the device (torch
# references, then the Triton programs), the engine's EAGLE-3 table with device vs host verification
# and the gate, the Triton verification in the engine, the single-request loop and gpt-fast.
#   bash bench/run_h200_session9.sh $OUT     (device tool: carry .data/mbpp and .data/peers)
#   LANE=0 TRITON=0 SINGLE=0 REPS="a" METHODS=ar,tree ...   (one table only)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"; git log -1 --format=%h >> "$OUT/env.txt" 2>/dev/null
table() {  # table NAME METHODS [env...]
  local name=$1 m=$2; shift 2
  echo "== $name: eagle3 --methods $m $*"
  env "$@" timeout ${TMO:-150} python3 -m tandem bench --device cuda --dtype bfloat16 --concurrency ${CONC:-1,8,32,64} \
    --methods "$m" --ignore-eos --max-new-tokens 128 --workload mbpp --data-dir .data --num-prompts 64 \
    --max-prompt-tokens 256 --no-plots --allow-mismatch --draft eagle3 --peers none --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "rror" | tail -14
  rm -f "$OUT/$name/results.json"
}
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane: tree verification (torch refs and Triton), the engine"
  TANDEM_TRITON_VERIFY=0 timeout 150 python3 -m pytest -q -m cuda tests/gpu/test_gpu_tree_verify.py tests/gpu/test_gpu_engine.py \
    -p no:cacheprovider > "$OUT/lane.log" 2>&1; tail -1 "$OUT/lane.log"; grep -m2 -A30 "^___" "$OUT/lane.log" | head -60
  TANDEM_TRITON_VERIFY=1 timeout 120 python3 -m pytest -q -m cuda tests/gpu/test_gpu_tree_verify.py tests/gpu/test_gpu_engine.py \
    -p no:cacheprovider > "$OUT/lane_triton.log" 2>&1; tail -1 "$OUT/lane_triton.log"; grep -m2 -A30 "^___" "$OUT/lane_triton.log" | head -60
fi
for rep in ${REPS-a b}; do table engine_$rep ${METHODS:-ar,tree,tree+host,tree+gate}; done
[ "${TRITON:-1}" = 1 ] && table engine_torchverify ar,tree TANDEM_TRITON_VERIFY=0  # (the torch lines, the default until 7494f44)
if [ "${SINGLE:-1}" = 1 ]; then
  echo "== single request: eagle3, ar / tree (10 MBPP prompts)"
  timeout 100 python3 -m tandem bench --device cuda --dtype bfloat16 --workload mbpp --data-dir .data --num-prompts 10 \
    --max-new-tokens 128 --methods ar,tree --warmup 2 --max-prompt-tokens 384 --draft eagle3 --no-plots --allow-mismatch \
    --peers none --out "$OUT/single" > "$OUT/single.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/single.log" | grep -e "^|" -e "rror" | head -8; rm -f "$OUT/single/results.json"
  echo "== peer: gpt-fast compiled AR at the bundled target's shape (ms/token)"
  timeout 90 python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast tiny15m 2>&1 | grep '^{' | tee "$OUT/gptfast.jsonl"
fi
if [ "${ONLINE:-0}" = 1 ]; then  # the server's packages: .whl/*.whl, or .whl/site.tar.xz (the same, unpacked and xz'd: smaller)
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  else
    tar -xJf .whl/site.tar.xz -C /tmp
  fi
  export PYTHONPATH=/tmp/site:$PWD
  echo "== online (--engine-process): eagle3, ar and tree; the client in its own process"
  timeout 170 python3 -m tandem bench --online --engine-process --device cuda --dtype bfloat16 --draft eagle3 --methods ar,tree \
    --concurrency 1,8,32,64 --requests 64 --max-new-tokens 128 --ignore-eos --workload mbpp --data-dir .data \
    --num-prompts 64 --max-prompt-tokens 256 --no-plots --out "$OUT/online" > "$OUT/online.log" 2>&1
  grep -v -e "it/s" "$OUT/online.log" | grep -e "^|" -e "rror" | tail -12
  rm -f "$OUT/online/results.json"
fi
