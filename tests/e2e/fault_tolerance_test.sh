#!/bin/bash
# Fault tolerance end to end: a real pippy-coordinator and real pippy-worker processes
# on 127.0.0.1. A 2-stage training job of a model with dropout (so the random
# generator's state matters), AdamW (so the optimizer's state matters), is run once
# without interruption; then again while things are killed with SIGKILL:
#   - a worker mid-training (a spare takes its stages);
#   - a worker in the middle of sending its checkpoint (--checkpoint-every 1);
#   - the coordinator (restarted with the same --state-dir; the workers reconnect);
#   - a worker with no spare registered: RECOVERING until one registers;
# and every one of them must end SUCCEEDED with parameters bitwise equal to the
# uninterrupted run's. Then the failures: no worker within --recovery-timeout-s, and
# --max-restarts 0.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/ft"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

start_coordinator 0
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
declare -A worker_pid
nworkers=0
start_worker() {  # [WORKER FLAGS] -> name in $last_worker
  local name="w$nworkers"
  nworkers=$((nworkers + 1))
  "$WORKER" --coordinator "$ADDR" --name "$name" --ucx-tls sm,self --wait-timeout-s 20 \
    --reconnect-timeout-s 60 "$@" > "$TMP/$name.log" 2>&1 &
  pids+=($!)
  worker_pid[$name]=$!
  last_worker=$name
}
json_get() {  # JOB EXPR (python on the job record j)
  ctl status "$1" --output json 2>/dev/null | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print($2)"
}
registered_workers() { ctl workers --output json | /usr/bin/python3 -c \
  "import json,sys; print(' '.join(w['name'] for w in json.load(sys.stdin).get('workers', [])))"; }
wait_idle() {  # N: exactly N workers registered, all idle
  for _ in $(seq 300); do
    [ "$(idle_workers)" = "$1" ] && [ "$(registered_workers | wc -w)" = "$1" ] && return 0
    sleep 0.1
  done
  echo "expected $1 idle workers; registered: $(registered_workers), idle: $(idle_workers)"
  return 1
}
keep_workers() {  # N: kills registered workers until N are left (and gone from the list)
  local names
  names=($(registered_workers))
  while [ "${#names[@]}" -gt "$1" ]; do
    kill -9 "${worker_pid[${names[0]}]}"
    local gone=0
    for _ in $(seq 100); do registered_workers | grep -qw "${names[0]}" || { gone=1; break; }; sleep 0.1; done
    [ "$gone" = 1 ] || { echo "worker ${names[0]} still registered 10 s after SIGKILL"; return 1; }
    names=("${names[@]:1}")
  done
}
wait_until() {  # JOB PYTHON-CONDITION [tries of 0.1 s]
  for _ in $(seq "${3:-300}"); do
    [ "$(json_get "$1" "bool($2)")" = True ] && return 0
    sleep 0.1
  done
  return 1
}
worker_of_rank() {  # JOB RANK -> worker name
  local wid
  wid=$(json_get "$1" "j['workers'][$2]")
  ctl workers --output json | /usr/bin/python3 -c \
    "import json,sys; print(next(w['name'] for w in json.load(sys.stdin)['workers'] if w['worker_id']=='$wid'))"
}

/usr/bin/python3 - "$TMP" <<'PY'
import sys, torch
tmp = sys.argv[1]
torch.manual_seed(0)
layers = []
for _ in range(6):
    layers += [torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1)]
torch.jit.script(torch.nn.Sequential(*layers)).save(f"{tmp}/model.pt")
torch.save({"inputs": torch.randn(256, 256), "targets": torch.randn(256, 256)}, f"{tmp}/data.pt")
PY
STEPS=120
JOB=(--data "$TMP/data.pt" --stages 2 --schedule 1f1b --microbatches 4 --batch-size 64 --steps $STEPS --loss mse
     --optimizer adamw --lr 0.001 --seed 7)
submit() { ctl submit "$TMP/model.pt" "${JOB[@]}" "$@"; }
same_as_reference() {  # NAME JOB
  ctl fetch "$2" -o "$TMP/$1.pt" > /dev/null || { echo "fetch $2 failed"; return 1; }
  /usr/bin/python3 - "$TMP/reference.pt" "$TMP/$1.pt" <<'PY'
import sys, torch
a, b = (torch.jit.load(p).state_dict() for p in sys.argv[1:3])
assert a.keys() == b.keys()
worst = max((x - b[k]).abs().max().item() for k, x in a.items())
equal = all(torch.equal(x, b[k]) for k, x in a.items())
print(f"{len(a)} tensors, max abs difference {worst}")
sys.exit(0 if equal else 1)
PY
}
finished_ok() {  # JOB: waits for the end; SUCCEEDED?
  ctl watch "$1" > "$TMP/$1.watch" 2>&1
  [ "$(json_get "$1" "j['state']")" = SUCCEEDED ]
}

for _ in 1 2 3; do start_worker; done
wait_idle 3 && ok "3 workers registered" || bad "3 workers registered"

# The uninterrupted run (checkpoints every 5 steps; they do not change what is computed).
ref=$(submit --checkpoint-every 5)
if finished_ok "$ref" && ctl fetch "$ref" -o "$TMP/reference.pt" > /dev/null; then
  ok "uninterrupted run: $(json_get "$ref" "j['state'], 'checkpoint', j.get('checkpoint_step', 0)")"
else
  bad "uninterrupted run: $(json_get "$ref" "j['state'], j.get('reason')")"
fi
# A run without checkpoints computes the same.
nock=$(submit --checkpoint-every 0)
if finished_ok "$nock" && same_as_reference nockpt "$nock"; then ok "--checkpoint-every 0 trains the same"; else bad "--checkpoint-every 0"; fi

# 1. A worker killed mid-training; the third worker is the spare.
job=$(submit --checkpoint-every 5)
wait_until "$job" "j.get('checkpoint_step', 0) >= 10 and j['state'] == 'RUNNING'" ||
  bad "the job never reached its checkpoint after step 10: $(json_get "$job" "j['state'], j.get('reason')")"
victim=$(worker_of_rank "$job" 1)
kill -9 "${worker_pid[$victim]}"
if finished_ok "$job" && same_as_reference killed "$job"; then
  ok "$(json_get "$job" "j['history'][0]['message']"): SUCCEEDED, bitwise equal; $(json_get "$job" "'restarts', j.get('restarts', 0)")"
else
  bad "killed worker: $(json_get "$job" "j['state'], j.get('reason'), j.get('history')")"; tail -5 "$TMP/$job.watch"
fi
grep -q "restarting from step" "$TMP/$job.watch" && ok "watch shows the restart" || bad "watch shows the restart"
[ "$(json_get "$job" "j.get('restarts', 0)")" = 1 ] && ok "one restart recorded" || bad "restarts: $(json_get "$job" "j.get('restarts')")"

# 2. --checkpoint-every 1 and a worker that dies in the middle of sending its
#    checkpoint after step 6: exactly it and one other are idle when the job is placed;
#    a spare registers once the job runs.
wait_idle 2 || bad "2 idle workers before the in-checkpoint case"
keep_workers 1 || bad "keep 1 worker"
start_worker --test-die-in-checkpoint 6
faulty=$last_worker
wait_idle 2 || bad "the faulty worker and one other are idle"
job=$(submit --checkpoint-every 1)
# (It may be RECOVERING already: the fault strikes at step 6, 6 quick steps in.)
wait_until "$job" "j['state'] in ('RUNNING', 'RECOVERING')" ||
  bad "the in-checkpoint job never ran: $(json_get "$job" "j['state'], j.get('reason')")"
start_worker
wait_until "$job" "j['state'] == 'SUCCEEDED' or j.get('restarts', 0) >= 1" 600 ||
  bad "the in-checkpoint job neither restarted nor succeeded in 60 s: $(json_get "$job" "j['state'], j.get('reason')")"
if finished_ok "$job" && same_as_reference in_checkpoint "$job"; then
  ok "worker killed while sending checkpoint 6: $(json_get "$job" "j['history'][-1]['message']"); bitwise equal"
else
  bad "killed in checkpoint: $(json_get "$job" "j['state'], j.get('reason'), j.get('history')")"
fi
kill -0 "${worker_pid[$faulty]}" 2>/dev/null && bad "the faulty worker is still alive" || ok "the faulty worker died in its checkpoint"
grep -q "test-die-in-checkpoint 6: killing" "$TMP/$faulty.log" || bad "the faulty worker's log does not say why it died"

# 3. The coordinator killed mid-training and restarted with the same state directory:
#    the workers reconnect under their ids and the job resumes from its checkpoint.
wait_idle 2 || bad "2 idle workers before the coordinator is killed"
ids_before=$(ctl workers --output json | /usr/bin/python3 -c \
  "import json,sys; print(sorted((w['name'], w['worker_id']) for w in json.load(sys.stdin)['workers']))")
job=$(submit --checkpoint-every 5)
if wait_until "$job" "j.get('checkpoint_step', 0) >= 10 and j['state'] == 'RUNNING'"; then
  ok "the job is RUNNING past its checkpoint after step 10 when the coordinator is killed"
else
  bad "the job before the coordinator is killed: $(json_get "$job" "j['state'], j.get('checkpoint_step'), j.get('reason')")"
fi
kill -9 "$coord_pid"
wait "$coord_pid" 2>/dev/null
start_coordinator "$PORT"
# The restarted coordinator read the job as RUNNING from its records and put it in
# RECOVERING (its event says so) until the workers were back.
if wait_until "$job" "any('restarted while the job was RUNNING; resuming from step' in e['message'] for e in j['history'])"; then
  ok "after the restart: $(json_get "$job" "[e['message'] for e in j['history'] if 'restarted' in e['message']][0]")"
else
  bad "no RUNNING -> RECOVERING after the restart: $(json_get "$job" "j['state'], j.get('history')")"
fi
if finished_ok "$job" && same_as_reference coordinator "$job"; then
  ok "coordinator killed and restarted: $(json_get "$job" "j['history'][-1]['message']"); bitwise equal"
else
  bad "coordinator restart: $(json_get "$job" "j['state'], j.get('reason'), j.get('history')")"
fi
ids_after=$(ctl workers --output json | /usr/bin/python3 -c \
  "import json,sys; print(sorted((w['name'], w['worker_id']) for w in json.load(sys.stdin)['workers']))")
[ "$ids_before" = "$ids_after" ] && ok "workers kept their ids: $ids_after" || bad "worker ids: $ids_before -> $ids_after"
[ "$(json_get "$ref" "j['state']")" = SUCCEEDED ] && ctl fetch "$ref" -o "$TMP/again.pt" > /dev/null &&
  ok "finished jobs stay fetchable after the restart" || bad "finished job after the restart"

# 4. No spare: exactly 2 workers; one is killed; the job waits RECOVERING until a new
#    worker registers, then resumes.
keep_workers 2 || bad "keep 2 workers"
wait_idle 2 || bad "exactly 2 idle workers before the no-spare case"
job=$(submit --checkpoint-every 5)
wait_until "$job" "j.get('checkpoint_step', 0) >= 10 and j['state'] == 'RUNNING'" ||
  bad "the no-spare job never reached its checkpoint after step 10: $(json_get "$job" "j['state'], j.get('reason')")"
victim=$(worker_of_rank "$job" 0)
kill -9 "${worker_pid[$victim]}"
if wait_until "$job" "j['state'] == 'RECOVERING'" && sleep 1 && [ "$(json_get "$job" "j['state']")" = RECOVERING ]; then
  ok "no spare: the job waits RECOVERING"
else
  bad "no spare: $(json_get "$job" "j['state'], j.get('reason')")"
fi
start_worker
if finished_ok "$job" && same_as_reference no_spare "$job"; then ok "a worker registered: resumed, bitwise equal"; else
  bad "resume after a worker registered: $(json_get "$job" "j['state'], j.get('reason'), j.get('history')")"; fi

# 5. No worker within --recovery-timeout-s: FAILED saying so.
keep_workers 2 || bad "keep 2 workers"
wait_idle 2 || bad "exactly 2 idle workers before the timeout case"
job=$(submit --checkpoint-every 5 --recovery-timeout-s 2)
wait_until "$job" "j.get('step', 0) >= 3 and j['state'] == 'RUNNING'" ||
  bad "the recovery-timeout job never ran 3 steps: $(json_get "$job" "j['state'], j.get('reason')")"
victim=$(worker_of_rank "$job" 1)
kill -9 "${worker_pid[$victim]}"
ctl watch "$job" > /dev/null 2>&1
reason=$(json_get "$job" "j['state'], j.get('reason')")
[[ "$reason" == *FAILED*"--recovery-timeout-s"* ]] && ok "no worker in time: $reason" || bad "recovery timeout: $reason"

# 6. --max-restarts 0: a lost worker fails the job, naming it.
start_worker
wait_idle 2 || bad "2 idle workers before the --max-restarts 0 case"
job=$(submit --max-restarts 0)
wait_until "$job" "j.get('step', 0) >= 3 and j['state'] == 'RUNNING'" ||
  bad "the --max-restarts 0 job never ran 3 steps: $(json_get "$job" "j['state'], j.get('reason')")"
victim=$(worker_of_rank "$job" 0)
kill -9 "${worker_pid[$victim]}"
ctl watch "$job" > /dev/null 2>&1
reason=$(json_get "$job" "j['state'], j.get('reason')")
[[ "$reason" == *FAILED*"--max-restarts"* ]] && ok "--max-restarts 0: $reason" || bad "max restarts: $reason"

finish
