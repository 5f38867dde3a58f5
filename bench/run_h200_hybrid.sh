#!/usr/bin/env bash
# Hybrid (Qwen3.5) targets on one H200: the GDN path kernel's GPU lane (a failure stops the run),
# GDN verify / commit per kernel (walk, WY, path) at transformers' default Qwen3.5 GDN shape, and
# a random hybrid target decoding greedy `tree` over oracle trees with each tree kernel (fp32: the
# outputs must equal `ar`; the per-pass times are what the hybrid loop costs with that kernel).
#   bash bench/run_h200_hybrid.sh $OUT            (device tool; nothing to carry)
set -uo pipefail
OUT=${1:-out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH=$PWD:$PWD/bench
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" >> "$OUT/env.txt"
echo "== GPU lane: the GDN path kernel"
timeout 180 python3 -m pytest -q -m cuda tests/gpu/test_gpu_gdn_path.py -p no:cacheprovider > "$OUT/lane_gdn.log" 2>&1
rc=$?; tail -3 "$OUT/lane_gdn.log"
if [ "$rc" != 0 ]; then grep -B30 -m3 "Error" "$OUT/lane_gdn.log" | head -120; echo "failed (rc $rc)"; exit 1; fi
echo "== GDN kernels, one layer"
timeout 200 python3 bench/gpu_gdn.py --out "$OUT/gdn" 2>&1 | grep -v '^{'
for k in walk path wy; do
  echo "== random hybrid target, fp32, TANDEM_GDN_TREE=$k"
  TANDEM_GDN_TREE=$k timeout 120 python3 bench/gpu_hybrid_check.py --device cuda --dtype float32 --hidden 1024 \
    --layers 16 --nodes 16 32 > "$OUT/hybrid_$k.txt" 2>&1; echo "rc $?"; tail -6 "$OUT/hybrid_$k.txt"
done
tar -czf /tmp/results.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/"
