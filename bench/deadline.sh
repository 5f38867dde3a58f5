# Sourced by the device scripts: `record_env` (what ran where), and one deadline for a whole device
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
