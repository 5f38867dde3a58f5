#!/usr/bin/env bash
# Hybrid (Qwen3.5) targets on one H200: the GDN path kernel's GPU lane (a failure skips its later runs),
# GDN verify / commit per kernel (walk, WY, path) at transformers' default Qwen3.5 GDN shape, and
# a random hybrid target decoding greedy `tree` over oracle trees with each tree kernel (fp32: the
# outputs must equal `ar`; the per-pass times are what the hybrid loop costs with that kernel).
# The random target also runs in the batched engine (walk), each request checked against its solo ar.
#   bash bench/run_h200_hybrid.sh $OUT            (device tool; nothing to carry)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD:$PWD/bench
source bench/deadline.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
echo "== GPU lane: the GDN path kernel"
within 180 python3 -m pytest -q -m cuda tests/gpu/test_gpu_gdn_path.py -p no:cacheprovider > "$OUT/lane_gdn.log" 2>&1
rc=$?; tail -3 "$OUT/lane_gdn.log"
if [ "$rc" != 0 ]; then grep -B30 -m3 "Error" "$OUT/lane_gdn.log" | head -120; echo "failed (rc $rc): the path kernel is not run below"; fi
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  echo "== $name"; within "$t" "$@"; echo "rc $?"
}
hybrid() {  # hybrid KERNEL [extra]: the random hybrid target in fp32 with that tree kernel
  local k=$1; shift
  TANDEM_GDN_TREE=$k within "${HT:-150}" python3 bench/gpu_hybrid_check.py --device cuda --dtype float32 --hidden 1024 --layers 16 \
    --nodes 16 32 "$@" > "$OUT/hybrid_$k.txt" 2>&1; local rc=$?; tail -40 "$OUT/hybrid_$k.txt" | grep -v '^ *[{}]' | tr -d '\n'; echo; return $rc
}
echo "== random hybrid target, fp32, walk, and the batched engine at 1 and 8 requests"; hybrid walk --engine 1 8
step "GDN kernels, one layer" "${GT:-200}" python3 bench/gpu_gdn.py --out "$OUT/gdn"
if [ "${KERNELS:-1}" = 1 ] && [ "$rc" = 0 ]; then
  echo "== random hybrid target, fp32, path"; HT=90 hybrid path
  echo "== random hybrid target, fp32, wy"; HT=90 hybrid wy
fi
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
