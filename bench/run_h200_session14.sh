#!/usr/bin/env bash
# One H200 call (fourteenth session): the certified INT8 head's kernels and the W12 GEMM variants
# (GPU lane, then their sweeps against cuBLAS), the certified head end to end at the 8B shape, and
# `tlv` against `tree` (tokens per exact pass, tokens/s), the gated engine's plain steps at 64 requests (bench/gpu_gate_check.py --phases).
#   bash bench/run_h200_session14.sh $OUT      (device tool: carry .data/mbpp for GATE=1)
# LANE=0 / HEAD=0 / W12=0 / E2E=0 / TLV=0 / GATE=0 skip a part; *_TMO: their timeouts (s).
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"; date -u >> "$OUT/env.txt"
if [ "${LANE:-1}" = 1 ]; then
  echo "== GPU lane: certified head kernels, --certified-head / tlv runtime, W12 GEMM"
  timeout ${LANE_TMO:-150} python3 -m pytest -q -m cuda tests/gpu/test_gpu_certified_head.py tests/gpu/test_gpu_tlv_certified.py \
    tests/gpu/test_gpu_w12.py -p no:cacheprovider -x > "$OUT/lane.log" 2>&1; tail -1 "$OUT/lane.log"
  grep -m3 -A25 "^___" "$OUT/lane.log" | head -80
fi
if [ "${HEAD:-1}" = 1 ]; then
  echo "== certified head vs bf16 head, 128k x 4096"
  timeout ${HEAD_TMO:-150} python3 bench/gpu_certified_head.py --out "$OUT/head" --sweep > "$OUT/head.log" 2>&1
  tail -14 "$OUT/head.log"
fi
if [ "${W12:-1}" = 1 ]; then
  echo "== W12 GEMM sweep vs cuBLAS, Llama-3-8B shapes"
  timeout ${W12_TMO:-200} python3 bench/gpu_w12.py --out "$OUT/w12" --sweep ${W12_ARGS:-} > "$OUT/w12.log" 2>&1
  grep -v '^{' "$OUT/w12.log" | tail -30
fi
if [ "${E2E:-1}" = 1 ]; then
  echo "== ar with / without --certified-head, Llama-3-8B shape (random weights)"
  timeout ${E2E_TMO:-120} python3 bench/gpu_certified_e2e.py --preset llama3-8b --out "$OUT" 2>&1 | tail -3
fi
if [ "${TLV:-1}" = 1 ]; then
  echo "== tlv vs tree vs ar, bundled pair, bf16, draft model, N = 8"
  timeout ${TLV_TMO:-120} python3 bench/gpu_tlv.py --data-dir .data --num-prompts 10 --out "$OUT" 2>&1 | grep -v Warning | tail -4
fi
if [ "${GATE:-1}" = 1 ]; then
  echo "== the gate's log: eagle3 at 64, per-phase host time"
  timeout ${GATE_TMO:-120} python3 bench/gpu_gate_check.py --draft eagle3 --concurrency 64 --data-dir .data --phases \
    2>&1 | grep -v Warning | tee "$OUT/gate.log" | tail -14
fi
