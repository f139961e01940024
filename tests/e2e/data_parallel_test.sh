#!/bin/bash
# Data parallelism x pipeline parallelism end to end: a real pippy-coordinator and 4
# real pippy-worker processes on 127.0.0.1; `--replicas 2` jobs of the zoo's GPT (tied
# embedding and head on different stages) as 2 replicas x 2 workers, with 1F1B and with
# interleaved 1F1B (4 stages, 2 per worker). Each fetched model is checked with
# /usr/bin/python3 against the unsplit model trained on the whole batch (every replica
# takes half of it; gradients averaged over gloo). Then a worker of replica 1 is killed
# with no spare: the job waits RECOVERING, resumes on a new worker, and still matches.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
CHECK="$PWD/tests/python/check_training.py"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/dp"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

"$COORD" --bind 127.0.0.1 --port 0 --port-file "$TMP/port" --state-dir "$TMP/state" --heartbeat-timeout-s 3 \
  > "$TMP/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
ADDR="127.0.0.1:$(cat "$TMP/port")"
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
declare -A worker_pid
nworkers=0
start_worker() {
  local name="w$nworkers"
  nworkers=$((nworkers + 1))
  "$WORKER" --coordinator "$ADDR" --name "$name" --ucx-tls sm,self --replica-host 127.0.0.1 --wait-timeout-s 20 \
    > "$TMP/$name.log" 2>&1 &
  pids+=($!)
  worker_pid[$name]=$!
}
json_get() { ctl status "$1" --output json | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print($2)"; }
for _ in 0 1 2 3; do start_worker; done
wait_idle 4 && ok "4 workers registered" || bad "4 workers registered"

/usr/bin/python3 - "$ZOO" "$TMP" <<'PY'
import sys, torch
zoo, tmp = sys.argv[1:3]
torch.save({"inputs": torch.load(f"{zoo}/gpt.input.pt"), "targets": torch.load(f"{zoo}/gpt.target.pt")}, f"{tmp}/gpt.data.pt")
PY
# 2 replicas x 4 micro-batches of 2 rows: the reference accumulates 8 micro-batches of
# the whole 16-row batch.
BASE=(--data "$TMP/gpt.data.pt" --microbatches 4 --batch-size 16 --loss model --optimizer sgd --momentum 0.9 --lr 0.05)
COMMON=("${BASE[@]}" --replicas 2 --steps 6)
check() {  # NAME JOB
  ctl fetch "$2" -o "$TMP/$1.pt" > /dev/null || { echo "fetch failed"; return 1; }
  /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" "$TMP/gpt.data.pt" "$TMP/$1.pt" --steps 6 --batch-size 16 \
    --microbatches 8 --loss model --optimizer sgd --momentum 0.9 --lr 0.05 --tolerance 1e-6
}
train() {  # NAME ARGS...
  local name=$1
  shift
  if ! ctl submit "$ZOO/gpt.pt" "${COMMON[@]}" "$@" --wait > "$TMP/$name.out" 2>&1; then
    bad "$name: job did not succeed: $(tail -2 "$TMP/$name.out")"; return
  fi
  local job
  job=$(head -1 "$TMP/$name.out")
  if check "$name" "$job"; then ok "$name: equals the unsplit model on the whole batch"; else bad "$name"; fi
  last_job=$job
}
train dp_1f1b --stages 2 --schedule 1f1b
# The replica x stage grid and the all-reduce in the breakdown.
ctl status "$last_job" > "$TMP/status.txt"
if grep -q "replica 1: stage 0:" "$TMP/status.txt" && grep -q "replica all-reduce" "$TMP/status.txt"; then
  ok "status shows the replica x stage grid and the all-reduce"
else
  bad "status: $(cat "$TMP/status.txt")"
fi
grids=$(ctl workers --output json | /usr/bin/python3 -c \
  "import json,sys; print(sorted((w.get('replica', 0), w.get('rank', 0)) for w in json.load(sys.stdin)['workers']))")
[ "$grids" = "[(0, 0), (0, 1), (1, 0), (1, 1)]" ] && ok "workers: replica x rank $grids" || bad "workers grid: $grids"
train dp_interleaved --stages 4 --schedule interleaved-1f1b --stages-per-worker 2

# Refused: a batch that does not split into replicas x micro-batches; more workers than registered.
ctl submit "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --replicas 3 --microbatches 4 --batch-size 16 --loss model \
  --optimizer sgd --stages 2 --schedule 1f1b > /dev/null 2> "$TMP/refused.err"
grep -q "16 does not split into 3 replicas x 4" "$TMP/refused.err" && ok "batch not divisible by replicas x micro-batches: refused" ||
  bad "refused: $(cat "$TMP/refused.err")"
ctl submit "$ZOO/gpt.pt" "${BASE[@]}" --replicas 4 --stages 2 --schedule 1f1b > /dev/null 2> "$TMP/refused2.err"
grep -q "needs 8 workers.*4 replicas" "$TMP/refused2.err" && ok "too few workers for 4 replicas: refused" ||
  bad "refused: $(cat "$TMP/refused2.err")"

# A worker of replica 1 killed, no spare: RECOVERING until a worker registers; the
# resumed job still equals the reference.
wait_idle 4
job=$(ctl submit "$ZOO/gpt.pt" "${BASE[@]}" --replicas 2 --stages 2 --schedule 1f1b --steps 400 --checkpoint-every 20)
for _ in $(seq 300); do [ "$(json_get "$job" "j.get('checkpoint_step', 0) >= 20")" = True ] && break; sleep 0.1; done
victim=$(ctl workers --output json | /usr/bin/python3 -c \
  "import json,sys; print(next(w['name'] for w in json.load(sys.stdin)['workers'] if w.get('replica', 0) == 1 and w.get('job_id') == '$job'))")
kill -9 "${worker_pid[$victim]}"
for _ in $(seq 100); do [ "$(json_get "$job" "j['state']")" = RECOVERING ] && break; sleep 0.1; done
[ "$(json_get "$job" "j['state']")" = RECOVERING ] && ok "replica worker $victim killed: RECOVERING" || bad "after the kill: $(json_get "$job" "j['state'], j.get('reason')")"
start_worker
ctl watch "$job" > "$TMP/recover.out" 2>&1
state=$(json_get "$job" "j['state'], j.get('restarts', 0)")
ctl fetch "$job" -o "$TMP/recovered.pt" > /dev/null 2>&1
if [[ "$state" == "SUCCEEDED 1" ]] && /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" "$TMP/gpt.data.pt" "$TMP/recovered.pt" \
     --steps 400 --batch-size 16 --microbatches 8 --loss model --optimizer sgd --momentum 0.9 --lr 0.05 --tolerance 1e-5; then
  ok "resumed on a new worker: $state, equals the reference"
else
  spare="w$((nworkers - 1))"
  alive=$(kill -0 "${worker_pid[$spare]}" 2>/dev/null && echo running || echo "not running")
  bad "resume: $state $(json_get "$job" "j.get('reason'), j.get('history')"); the new worker $spare is $alive, its log: $(tail -5 "$TMP/$spare.log" | tr '\n' ' ')"
fi

finish
