#!/bin/bash
# The coordinator as a control plane, with real processes: it never loads a submitted
# model nor runs its code in its own process (a preparing child does, with deadlines
# and a heap cap; hostile models: hostile_test.sh). A normal job trains and is
# fetched; the coordinator's own peak memory stays below a 384 MiB model it trained;
# pippyctl list pages and filters, pippyctl delete removes an ended job's files;
# submit --detach answers after the upload, the job PARTITIONING while it is prepared,
# then FAILED (a hanging model, a refusal) or trained, cancellable meanwhile, and
# prepared again by a restarted coordinator;
# SIGTERM during a hanging preparation stops the coordinator and its child within 2 s;
# a coordinator capped at 900 MiB of heap trains and fetches a 1 GiB model.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/control_plane"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

/usr/bin/python3 "$PWD/tests/e2e/hostile_models.py" "$TMP"  # hang.pt, small.data.pt
cat > "$TMP/make_models.py" <<'PY'
import sys, torch
tmp = sys.argv[1]
# 6 x Linear(4096): 384 MiB of parameters.
torch.manual_seed(0)
big = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(6)])
torch.jit.script(big).save(f"{tmp}/big.pt")
torch.save({"inputs": torch.randn(8, 4096), "targets": torch.randn(8, 4096)}, f"{tmp}/big.data.pt")
# 16 x Linear(4096): 1 GiB, for a coordinator capped below that.
huge = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(16)])
torch.jit.script(huge).save(f"{tmp}/huge.pt")
PY
/usr/bin/python3 "$TMP/make_models.py" "$TMP"
[ -s "$TMP/big.pt" ] || { bad "the test's models were not made"; finish; exit 1; }

# The coordinator's child preparing a submission (waits up to 10 s for it to start).
preparing_child() {
  local c=""
  for _ in $(seq 200); do
    c=$(pgrep -P "$coord_pid" -f -- "--prepare" | head -1)
    [ -n "$c" ] && break
    sleep 0.05
  done
  echo "$c"
}

start_coordinator 0 --probe-timeout-s 3 --prepare-timeout-s 120
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
SPEC=(--stages 2 --schedule 1f1b --microbatches 2 --batch-size 8 --steps 2 --loss mse --optimizer sgd)
for i in 0 1; do
  "$WORKER" --coordinator "$ADDR" --name "w$i" --ucx-tls sm,self --wait-timeout-s 60 > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
done
wait_idle 2 && ok "2 workers registered" || bad "2 workers registered: $(idle_workers) idle"

# 1. A normal job trains and is fetched; then a 384 MiB model, whose preparation and
#    merge run in children: the coordinator's peak stays below it. (Hostile models
#    next to normal traffic: hostile_test.sh.)
if ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" "${SPEC[@]}" --wait > "$TMP/mlp.out" 2> "$TMP/mlp.err"; then
  ok "a normal job trains: $(head -1 "$TMP/mlp.out")"
else
  bad "normal job: $(cat "$TMP/mlp.err")"
fi
id=$(ctl submit "$TMP/big.pt" --data "$TMP/big.data.pt" --stages 2 --schedule gpipe --microbatches 2 --batch-size 8 --steps 1 --loss mse --optimizer sgd --wait > "$TMP/big.out" 2> "$TMP/big.err"; head -1 "$TMP/big.out")
ctl fetch "$id" -o "$TMP/big.trained.pt" > /dev/null 2>> "$TMP/big.err"
model_kb=$(( $(stat -c %s "$TMP/big.pt") / 1024 ))
peak_kb=$(awk '/VmHWM/{print $2}' "/proc/$coord_pid/status")
fetched=$(/usr/bin/python3 -c "import torch; m = torch.jit.load('$TMP/big.trained.pt'); print(sum(p.numel() for p in m.parameters()))" 2>&1)
if [ -n "$id" ] && [ "$fetched" = "$((6 * (4096 * 4096 + 4096)))" ] && [ "${peak_kb:-0}" -gt 0 ] &&
   [ "$peak_kb" -lt $((model_kb * 3 / 4)) ]; then
  ok "a $((model_kb / 1024)) MiB model trained and fetched; the coordinator's peak resident memory $((peak_kb / 1024)) MiB"
else
  bad "large model: job '$id', fetched '$fetched' parameters, coordinator peak ${peak_kb:-?} kB vs model ${model_kb} kB ($(cat "$TMP/big.err"))"
fi
grep -q "prepared a submission in a child process" "$TMP/coordinator.log" &&
  ok "the log names the child's peak: $(grep -o "prepared a submission in a child process.*" "$TMP/coordinator.log" | tail -1)" ||
  bad "no child preparation in the coordinator's log"

# 3b. The list pages and filters; an ended job is deleted with its files.
newest=$(ctl list --limit 1 --newest-first --output json | /usr/bin/python3 -c "import json,sys; print(','.join(j['job_id'] for j in json.load(sys.stdin)['jobs']))")
succeeded=$(ctl list --state succeeded --output json | /usr/bin/python3 -c "import json,sys; print(len(json.load(sys.stdin)['jobs']))")
ctl delete "$id" > "$TMP/delete.out" 2>&1
deleted=$?
if [ "$newest" = "$id" ] && [ "$succeeded" = 2 ] && [ "$deleted" = 0 ] && ! ctl status "$id" > /dev/null 2>&1 &&
   [ ! -e "$TMP/state/models/$id.pt" ] && [ ! -e "$TMP/state/jobs/$id" ]; then
  ok "list --limit 1 --newest-first gave $newest, --state succeeded $succeeded jobs; delete removed $id and its files"
else
  bad "list/delete: newest '$newest', succeeded '$succeeded', delete exit $deleted ($(cat "$TMP/delete.out")), files: $(ls "$TMP/state/models" "$TMP/state/jobs" 2>&1 | tr '\n' ' ')"
fi

# 3c. Detached submissions (--detach): the id comes once the upload is stored. A hanging
#     model is PARTITIONING, then FAILED by the probe deadline (3 s) while a normal
#     detached job queued behind it trains; a refusal found by the preparation is the
#     job's FAILED reason (the message pippyctl prints without --detach); a cancel during
#     the preparation stops its child and removes the job's files.
job_field() {  # ID FIELD: one field of the job's record ("" if absent)
  ctl status "$1" --output json 2>/dev/null | /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin).get('$2', ''))"
}
wait_ended() {  # ID SECONDS: the state it ended in, or the last one seen
  local s=""
  for _ in $(seq $(($2 * 10))); do
    s=$(job_field "$1" state)
    case "$s" in SUCCEEDED|FAILED|CANCELLED) break ;; esac
    sleep 0.1
  done
  echo "$s"
}
t0=$(date +%s%N)
hang_id=$(ctl submit "$TMP/hang.pt" --data "$TMP/small.data.pt" "${SPEC[@]}" --detach 2> "$TMP/detach.err")
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
hang_state=$(job_field "$hang_id" state)
child=$(preparing_child)
mlp_id=$(ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" "${SPEC[@]}" --detach 2>> "$TMP/detach.err")
mlp_state=$(job_field "$mlp_id" state)
hang_end=$(wait_ended "$hang_id" 30)
hang_reason=$(job_field "$hang_id" reason)
mlp_end=$(wait_ended "$mlp_id" 60)
if [ -n "$hang_id" ] && [ "$hang_state" = PARTITIONING ] && [ -n "$child" ] && [ "$mlp_state" = PARTITIONING ] &&
   [ "$hang_end" = FAILED ] && [[ "$hang_reason" == *"did not finish within 3s (--probe-timeout-s)"* ]] &&
   [ "$mlp_end" = SUCCEEDED ] && [ ! -e "$TMP/state/jobs/$hang_id" ]; then
  ok "submit --detach answered $hang_id in $ms ms while it was PARTITIONING; it FAILED by the probe deadline; $mlp_id, detached behind it, SUCCEEDED"
else
  bad "detached: $hang_id '$hang_state' -> '$hang_end' ($hang_reason), child '$child', $mlp_id '$mlp_state' -> '$mlp_end' ($(cat "$TMP/detach.err"))"
fi
SPEC3=(--stages 3 --schedule gpipe --microbatches 2 --batch-size 8 --steps 2 --loss mse --optimizer sgd)
ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" "${SPEC3[@]}" > /dev/null 2> "$TMP/sync_refused.err"
sync_rc=$?
refused_id=$(ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" "${SPEC3[@]}" --detach 2>> "$TMP/detach.err")
refused_end=$(wait_ended "$refused_id" 30)
refused_reason=$(job_field "$refused_id" reason)
if [ "$sync_rc" = 2 ] && grep -q "needs 3 workers" "$TMP/sync_refused.err" && [ "$refused_end" = FAILED ] &&
   [[ "$refused_reason" == *"needs 3 workers"*"only 2 are registered"* ]]; then
  ok "a refusal: exit 2 without --detach, FAILED with it: $refused_reason"
else
  bad "detached refusal: sync exit $sync_rc ($(cat "$TMP/sync_refused.err")), $refused_id '$refused_end' ($refused_reason)"
fi
cancel_id=$(ctl submit "$TMP/hang.pt" --data "$TMP/small.data.pt" "${SPEC[@]}" --detach 2>> "$TMP/detach.err")
child=$(preparing_child)
ctl cancel "$cancel_id" > /dev/null 2>&1
gone_ms=""
for i in $(seq 40); do
  if [ -n "$child" ] && { [ ! -e "/proc/$child" ] || grep -q "^State:.*Z" "/proc/$child/status" 2>/dev/null; }; then
    gone_ms=$((i * 50)); break
  fi
  sleep 0.05
done
cancel_end=$(job_field "$cancel_id" state)
if [ -n "$child" ] && [ -n "$gone_ms" ] && [ "$cancel_end" = CANCELLED ] && [ ! -e "$TMP/state/jobs/$cancel_id" ]; then
  ok "cancel during the preparation: $cancel_id CANCELLED, its child gone within $gone_ms ms, its files removed"
else
  bad "cancel while PARTITIONING: child '$child' gone '$gone_ms', state '$cancel_end', files: $(ls "$TMP/state/jobs/$cancel_id" 2>&1)"
fi

# 4. SIGTERM while a child prepares a hanging model: the coordinator and the child stop
#    within 2 s (a zombie counts as stopped: the test's shell reaps it after). A detached
#    submission waiting behind it stays PARTITIONING in the records, and the restarted
#    coordinator prepares it again from its stored upload.
kill "$coord_pid"; wait "$coord_pid" 2>/dev/null
start_coordinator "$PORT" --probe-timeout-s 120
ctl submit "$TMP/hang.pt" --data "$TMP/small.data.pt" "${SPEC[@]}" > "$TMP/hang2.out" 2>&1 &
submit=$!
child=$(preparing_child)
behind_id=$(ctl submit "$TMP/hang.pt" --data "$TMP/small.data.pt" "${SPEC[@]}" --detach 2>> "$TMP/detach.err")
sleep 1  # into the forward
gone() { [ ! -e "/proc/$1" ] || grep -q "^State:.*Z" "/proc/$1/status" 2>/dev/null; }
kill -TERM "$coord_pid"
stopped=""
for i in $(seq 40); do
  if gone "$coord_pid" && gone "$child"; then stopped=$((i * 50)); break; fi
  sleep 0.05
done
wait "$submit"
rc=$?
if [ -n "$child" ] && [ -n "$stopped" ] && [ "$rc" != 0 ]; then
  ok "SIGTERM during a hanging preparation: coordinator and child stopped within ${stopped} ms; pippyctl: $(cut -c1-100 "$TMP/hang2.out")"
else
  bad "SIGTERM: child '$child', stopped '${stopped}', submit exit $rc ($(cat "$TMP/hang2.out")); $(tail -3 "$TMP/coordinator.log")"
fi
start_coordinator "$PORT" --probe-timeout-s 3
behind_end=$(wait_ended "$behind_id" 30)
behind_reason=$(job_field "$behind_id" reason)
again=$(ctl status "$behind_id" 2>/dev/null | grep -c "preparing it again")
if [ -n "$behind_id" ] && [ "$behind_end" = FAILED ] && [[ "$behind_reason" == *"did not finish within 3s"* ]] &&
   [ "$again" -ge 1 ]; then
  ok "restarted: the detached $behind_id was prepared again from its stored upload (and refused by the new 3 s probe deadline)"
else
  bad "restart while PARTITIONING: $behind_id '$behind_end' ($behind_reason), 'preparing it again' lines: $again"
fi
kill "$coord_pid"; wait "$coord_pid" 2>/dev/null

# 5. A coordinator whose heap (and its children's: RLIMIT_DATA is inherited) is capped
#    at 900 MiB splits, trains and fetches a 1 GiB model: its children read one stage's
#    records at a time (the whole model, loaded, would not fit).
TMP="$TMP/capped"
mkdir -p "$TMP"
cap=$((900 << 20))
model_bytes=$(stat -c %s "$TMP/../huge.pt")
prlimit --data="$cap" "$COORD" --bind 127.0.0.1 --port 0 --port-file "$TMP/port" --state-dir "$TMP/state" \
  >> "$TMP/coordinator.log" 2>&1 &
coord_pid=$!
pids+=($coord_pid)
for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
ADDR="127.0.0.1:$(cat "$TMP/port")"
for i in 0 1 2 3; do
  "$WORKER" --coordinator "$ADDR" --name "c$i" --ucx-tls sm,self --wait-timeout-s 60 > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
done
wait_idle 4 || bad "4 workers registered with the capped coordinator: $(idle_workers) idle"
ctl submit "$TMP/../huge.pt" --synthetic "inputs=float32[32,4096];targets=float32[32,4096];seed=0" --stages 4 \
  --schedule gpipe --microbatches 2 --batch-size 8 --steps 1 --loss mse --optimizer sgd --wait > "$TMP/huge.out" 2> "$TMP/huge.err"
rc=$?
ctl fetch job-1 -o "$TMP/huge.trained.pt" > /dev/null 2>> "$TMP/huge.err"
fetched=$(/usr/bin/python3 -c "import torch; m = torch.jit.load('$TMP/huge.trained.pt'); print(sum(p.numel() for p in m.parameters()))" 2>&1)
limit=$(awk '/Max data size/{print $4}' "/proc/$coord_pid/limits")
peaks=$(grep -o "in a child process.*peak resident memory [0-9]* MiB" "$TMP/coordinator.log" | grep -o "[0-9]* MiB" | tr '\n' ' ')
if [ "$rc" = 0 ] && [ "$fetched" = "$((16 * (4096 * 4096 + 4096)))" ] && [ "$limit" = "$cap" ] && [ "$cap" -lt "$model_bytes" ]; then
  ok "under a $((cap >> 20)) MiB heap cap a $((model_bytes >> 20)) MiB model trained and was fetched (children's peaks: ${peaks})"
else
  bad "capped coordinator: exit $rc, fetched '$fetched' parameters, limit '$limit' ($(tail -3 "$TMP/huge.err"); $(tail -3 "$TMP/coordinator.log"))"
fi
finish
