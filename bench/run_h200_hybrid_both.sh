#!/usr/bin/env bash
# Both hybrid device scripts in one call (when machines are scarce), under one deadline:
# the GDN lane, the random target in the hybrid loop and the batched engine, the one-layer GDN bench
# (run_h200_hybrid.sh without the per-kernel loops), then issue 17's 4B table (run_h200_hybrid_4b.sh).
#   bash bench/run_h200_hybrid_both.sh $OUT          (device tool: carry .data)
set -uo pipefail
OUT=${1:-out}; export DEADLINE=${DEADLINE:-545}
source bench/deadline.sh
KERNELS=0 GT=120 bash bench/run_h200_hybrid.sh "$OUT/hybrid"
NP=${NP:-3} bash bench/run_h200_hybrid_4b.sh "$OUT/4b"
