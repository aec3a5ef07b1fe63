# Sourced by device scripts that run named stages against one call's time (bench/device_x2.sh,
# bench/device_gpu1.sh), after they set `deadline` (seconds into the call) and `LOG`.
#   run NAME EST CMD...   starts CMD only if EST seconds fit before the deadline, cuts it there
#                         at the latest; its last ${TAIL:-30} lines (INFO/DEBUG left out) go to
#                         the log, the whole output to /tmp/NAME.full (8 files come back)
log() { echo "=== $* (t=${SECONDS}s, $(date +%T))" | tee -a "$LOG"; }
want() { ((SECONDS + $2 < deadline)) || { log "skip $1: it may not end by t=${deadline}s"; false; }; }
run() {
  local name=$1 est=$2; shift 2
  want "$name" "$est" || return 0
  log "$name"
  timeout $((deadline - SECONDS)) "$@" > "/tmp/$name.full" 2>&1
  echo "rc=$?" >> "/tmp/$name.full"
  grep -v " INFO \| DEBUG " "/tmp/$name.full" | tail -"${TAIL:-30}" | tee -a "$LOG"
}
