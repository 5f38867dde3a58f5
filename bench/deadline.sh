# Sourced by the device scripts: one deadline for a whole device call (10 minutes a command), so that
# the tar at the end still runs. T0: the call's start (kept when one script runs another);
# DEADLINE: seconds after T0 by which every step has ended.
T0=${T0:-$(date +%s)}; export T0
left() { echo $(( ${DEADLINE:-540} - ($(date +%s) - T0) )); }
within() {  # within SECONDS CMD...: CMD for at most SECONDS, or what is left before the deadline
  local t=$1 l; shift; l=$(left)
  if [ "$l" -lt 20 ]; then echo "(skipped: the call's deadline)"; return 124; fi
  [ "$t" -gt "$l" ] && t=$l
  timeout "$t" "$@"
}
