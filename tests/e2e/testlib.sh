# Sourced by the end-to-end shell tests: pass/fail counting, the processes a test
# starts (each appended to `pids`, each stopped by its own pid when the test exits:
# SIGTERM, then SIGKILL half a second later), idle workers and waiting for them, free
# ports, and the summary line whose status is the test's.
passed=0
failed=0
pids=()
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }
stop_started() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  sleep 0.5
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
}
trap stop_started EXIT
# Workers the coordinator lists as IDLE; the test defines ctl (pippyctl with its flags).
idle_workers() { ctl workers --output json 2>/dev/null | /usr/bin/python3 -c \
  "import json,sys; print(sum(1 for w in json.load(sys.stdin).get('workers', []) if w['state']=='IDLE'))"; }
# Waits up to 15 s until exactly N workers are IDLE (a worker started in the background has
# not registered yet when its command returns); returns 1 if they never are.
wait_idle() { for _ in $(seq 150); do [ "$(idle_workers)" = "$1" ] && return 0; sleep 0.1; done; return 1; }
# Starts $COORD on 127.0.0.1:PORT (0: any) with the state in $TMP/state, plus any
# further flags, appending to $TMP/coordinator.log; sets coord_pid, PORT and ADDR.
# Called again with the same PORT, it restarts the coordinator where it was.
start_coordinator() {  # PORT [FLAGS...]
  local port=$1
  shift
  rm -f "$TMP/port"
  "$COORD" --bind 127.0.0.1 --port "$port" --port-file "$TMP/port" --state-dir "$TMP/state" --heartbeat-timeout-s 3 \
    "$@" >> "$TMP/coordinator.log" 2>&1 &
  coord_pid=$!
  pids+=($coord_pid)
  for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
  PORT=$(cat "$TMP/port")
  ADDR="127.0.0.1:$PORT"
}
free_port() { /usr/bin/python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
finish() {
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
}
