# Sourced by the device scripts: `record_env` (what ran where), `bench` (one bench run), and one deadline for a whole device
# call (10 minutes a command), so that the tar at the end still runs. T0: the call's start (kept when one script runs another);
# DEADLINE: seconds after T0 by which every step has ended.
T0=${T0:-$(date +%s)}; export T0
left() { echo $(( ${DEADLINE:-540} - ($(date +%s) - T0) )); }
within() {  # within SECONDS CMD...: CMD for at most SECONDS, or what is left before the deadline
  local t=$1 l; shift; l=$(left)
  if [ "$l" -lt 20 ]; then echo "(skipped: the call's deadline)"; return 124; fi
  [ "$t" -gt "$l" ] && t=$l
  timeout "$t" "$@"
}
record_env() {  # record_env: the GPU, torch / Triton, the commit (TANDEM_COMMIT: the device's git is stale), the time
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
    echo "commit ${TANDEM_COMMIT:-unknown}"; date -u; } > "$OUT/env.txt"
}
bench() {  # bench NAME WORKLOAD DRAFT METHODS [extra flags]: one `tandem bench` run (bundled target, bf16, greedy,
  # 128 new tokens, NP prompts cut to 384 tokens, BENCH_ARGS added), its tables printed; BT: its seconds at most
  local name=$1 wl=$2 d=$3 m=$4; shift 4
  echo "== $name: $wl, --draft $d, $m"
  # shellcheck disable=SC2086
  within "${BT:-90}" python3 -m tandem bench --device cuda --dtype bfloat16 --workload "$wl" --data-dir .data \
    --num-prompts "${NP:-10}" --max-new-tokens 128 --methods "$m" --warmup 2 --max-prompt-tokens 384 --draft "$d" \
    --no-plots --allow-mismatch ${BENCH_ARGS:-} "$@" --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  grep -v -e "it/s" -e "req/s" "$OUT/$name.log" | grep -e "^|" -e "^- " -e "^Per" -e "Output check" -e "auto:" -e "rror" \
    | cut -c1-300
}
peer_gptfast() {  # peer_gptfast [SHAPE] [SECONDS]: gpt-fast's compiled AR (.data/peers/gpt-fast) in this call, its
  # JSON lines to $OUT/gptfast.jsonl (SHAPE: tiny15m, the bundled target's, or llama3-8b)
  echo "== peer: gpt-fast compiled AR at the ${1:-tiny15m} shape (ms/token)"
  within "${2:-90}" python3 .data/peers/gpt-fast/ar.py .data/peers/gpt-fast "${1:-tiny15m}" 2>&1 | grep '^{' \
    | tee "$OUT/gptfast.jsonl"
}
