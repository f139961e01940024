#!/bin/bash
# Health and shutdown that tell the truth, with real processes: a worker running a
# job stops within 2 s of SIGTERM; a coordinator whose loop stops turning while it holds
# its lock (the hidden test fault --test-stall-on-job-name) turns its health NOT_SERVING
# within its 10 s interval, and SIGTERM still stops it within 2 s.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/liveness"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

gone() { [ ! -e "/proc/$1" ] || grep -q "^State:.*Z" "/proc/$1/status" 2>/dev/null; }
# Sends SIGTERM to PID; prints the milliseconds until it is gone, or nothing after 5 s.
stop_ms() {
  local t0
  t0=$(date +%s%N)
  kill -TERM "$1"
  for _ in $(seq 100); do
    gone "$1" && { echo $(( ($(date +%s%N) - t0) / 1000000 )); return; }
    sleep 0.05
  done
}

start_coordinator 0 --test-stall-on-job-name stall
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
for i in 0 1; do
  "$WORKER" --coordinator "$ADDR" --name "w$i" --ucx-tls sm,self --wait-timeout-s 60 > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
  worker[$i]=$!
done
wait_idle 2 && ok "2 workers registered" || bad "2 workers registered: $(idle_workers) idle"

# 1. A worker in the middle of a long job: gone within 2 s of SIGTERM.
job=$(ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --stages 2 --schedule 1f1b --microbatches 4 --batch-size 16 \
        --steps 100000 --loss mse --optimizer sgd 2> "$TMP/long.err")
step=0
for _ in $(seq 300); do
  step=$(ctl status "$job" --output json 2>/dev/null | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print(j.get('step', 0) if j['state'] == 'RUNNING' else 0)")
  [ "${step:-0}" -ge 5 ] && break
  sleep 0.1
done
ms=$( [ "${step:-0}" -ge 5 ] && stop_ms "${worker[0]}")
if [ -n "$ms" ] && [ "$ms" -le 2000 ]; then
  ok "a worker running step ${step}+ of a job stopped ${ms} ms after SIGTERM"
else
  bad "worker SIGTERM: job at step '${step}' ($(cat "$TMP/long.err")), stopped after '${ms:-more than 5000}' ms"
fi
ctl cancel "$job" > /dev/null 2>&1

# 2. The coordinator's loop stalls holding its lock: health NOT_SERVING within the 10 s
#    interval (+ the 0.5 s check), and SIGTERM still stops it within 2 s.
ctl health > "$TMP/health.before" 2>&1 && grep -q SERVING "$TMP/health.before" || bad "health before the stall: $(cat "$TMP/health.before")"
ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --stages 1 --schedule 1f1b --microbatches 4 --batch-size 16 \
  --steps 1 --loss mse --optimizer sgd --name stall > "$TMP/stall.out" 2>&1 || bad "the stalling job was not accepted: $(cat "$TMP/stall.out")"
t0=$(date +%s%N)
for _ in $(seq 20); do grep -q "test-stall-on-job-name stall: the loop stops" "$TMP/coordinator.log" && break; sleep 0.1; done
not_serving=""
for _ in $(seq 150); do
  if ctl health --timeout-s 2 2>&1 | grep -q NOT_SERVING; then not_serving=$(( ($(date +%s%N) - t0) / 1000000 )); break; fi
  sleep 0.1
done
if grep -q "test-stall-on-job-name stall: the loop stops" "$TMP/coordinator.log" && [ -n "$not_serving" ] &&
   [ "$not_serving" -le 12000 ]; then
  ok "the loop stalled: health NOT_SERVING ${not_serving} ms later ($(grep -o "the coordinator's loop has not turned.*" "$TMP/coordinator.log" | head -1))"
else
  bad "stalled loop: NOT_SERVING after '${not_serving:-never within 15 s}' ms; $(tail -3 "$TMP/coordinator.log")"
fi
ms=$(stop_ms "$coord_pid")
if [ -n "$ms" ] && [ "$ms" -le 2000 ]; then
  ok "SIGTERM stopped the stalled coordinator in ${ms} ms: $(tail -1 "$TMP/coordinator.log" | cut -c1-100)"
else
  bad "SIGTERM to the stalled coordinator: gone after '${ms:-more than 5000}' ms"
fi
finish
