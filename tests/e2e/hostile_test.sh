#!/bin/bash
# Hostile input next to normal traffic, with real processes: while a serving job answers
# one-row requests in a loop and health is polled, a model whose forward never returns
# and one whose forward allocates without bound are refused within their deadlines, an
# upload that goes quiet is cancelled after --stream-idle-timeout-s (freeing its stream
# slot), and a serving
# request whose output outgrows the coordinator's --max-message-mib fails alone with
# RESOURCE_EXHAUSTED (its worker's connection and the job go on); a normal training job
# submitted after them trains. Every normal request in the loop is answered and health
# says SERVING throughout.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/hostile"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

/usr/bin/python3 "$PWD/tests/e2e/hostile_models.py" "$TMP"
[ -s "$TMP/wide.pt" ] || { bad "the test's models were not made"; finish; exit 1; }
/usr/bin/python3 -c "import torch; torch.manual_seed(1); torch.save(torch.randn(3, 4), '$TMP/wide3.pt')"

start_coordinator 0 --probe-timeout-s 8 --prepare-timeout-s 60 --max-message-mib 2 --stream-idle-timeout-s 2 \
  --max-concurrent-streams 1
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
for i in 0 1 2; do
  "$WORKER" --coordinator "$ADDR" --name "w$i" --ucx-tls sm,self --wait-timeout-s 60 > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
done
wait_idle 3 && ok "3 workers registered" || bad "3 workers registered: $(idle_workers) idle"
SERVE=$(ctl serve "$TMP/wide.pt" --stages 1 --example "$TMP/wide.input.pt" --max-batch 8 --max-delay-ms 5 --name wide \
          --wait 2> "$TMP/serve.err" | head -1)
[ "$(ctl status "$SERVE" --output json 2>/dev/null | /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin)['state'])")" = SERVING ] &&
  ok "serving job $SERVE is SERVING" || bad "serving job: $(cat "$TMP/serve.err")"

# The normal traffic: one-row requests (1.2 MB of output each) and health, until told to stop.
(
  n=0 okn=0 healthy=0
  while [ ! -f "$TMP/stop" ] && [ "$n" -lt 2000 ]; do
    n=$((n + 1))
    ctl infer "$SERVE" --input "$TMP/wide.input.pt" -o "$TMP/loop.out.pt" > /dev/null 2>> "$TMP/loop.err" && okn=$((okn + 1))
    ctl health > /dev/null 2>&1 && healthy=$((healthy + 1))
    echo "$n $okn $healthy" > "$TMP/loop.count"
    sleep 0.2
  done
) &
pids+=($!)
loop=$!
for _ in $(seq 100); do [ -s "$TMP/loop.count" ] && break; sleep 0.1; done

# 1. A forward that never returns: refused by --probe-timeout-s 8.
t0=$(date +%s.%N)
ctl submit "$TMP/hang.pt" --data "$TMP/small.data.pt" --stages 2 --schedule 1f1b --microbatches 2 --batch-size 8 \
  --steps 2 --loss mse --optimizer sgd > "$TMP/hang.out" 2>&1
rc=$?
secs=$(echo "$(date +%s.%N) - $t0" | bc)
if [ "$rc" = 2 ] && grep -q "did not finish within 8s (--probe-timeout-s)" "$TMP/hang.out"; then
  ok "a forward that never returns is refused after ${secs%.*} s: $(cut -c1-120 "$TMP/hang.out")"
else
  bad "hanging forward: exit $rc ($(cat "$TMP/hang.out"))"
fi
# 2. A forward that allocates without bound: refused by the child's heap cap (or, on a
#    slow machine, by the probe deadline first): either way within its deadlines.
ctl submit "$TMP/hog.pt" --data "$TMP/small.data.pt" --stages 2 --schedule 1f1b --microbatches 2 --batch-size 8 \
  --steps 2 --loss mse --optimizer sgd > "$TMP/hog.out" 2>&1
rc=$?
if [ "$rc" = 2 ] && grep -q "ran out of memory on one micro-batch\|did not finish within 8s (--probe-timeout-s)" "$TMP/hog.out"; then
  ok "a forward that allocates without bound is refused: $(head -1 "$TMP/hog.out" | cut -c1-120)"
else
  bad "allocating forward: exit $rc ($(head -3 "$TMP/hog.out"))"
fi
# 3. An upload that goes quiet (its spec and 4 KiB, then nothing): cancelled after 2 s,
#    freeing the one stream slot (--max-concurrent-streams 1) for the job in 5.
/usr/bin/python3 - "$ADDR" "$ZOO/mlp.pt" <<'PY' > "$TMP/quiet.out" 2>&1
import os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "client", "python", "pippy", "_stubs"))
import grpc
from proto import coordinator_pb2, coordinator_pb2_grpc, job_pb2
addr, model = sys.argv[1:]
def requests():
    spec = job_pb2.JobSpec()
    spec.schedule.kind = job_pb2.SCHEDULE_1F1B
    yield coordinator_pb2.SubmitJobRequest(spec=spec)
    with open(model, "rb") as f:
        yield coordinator_pb2.SubmitJobRequest(model_chunk=f.read(4096))
    time.sleep(60)  # and then nothing
start = time.monotonic()
try:
    coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(addr)).SubmitJob(requests(), timeout=30)
    print("quiet upload: accepted?!")
except grpc.RpcError as e:
    print(f"quiet upload ended after {time.monotonic() - start:.1f} s: {e.code().name}")
PY
secs=$(grep -o "ended after [0-9.]*" "$TMP/quiet.out" | grep -o "[0-9.]*$")
if [ -n "$secs" ] && /usr/bin/python3 -c "import sys; sys.exit(0 if 1.5 <= float(sys.argv[1]) <= 15 else 1)" "$secs" &&
   grep -q "SubmitJob from .*nothing moved for 2s; cancelled (--stream-idle-timeout-s)" "$TMP/coordinator.log"; then
  ok "an upload quiet for 2 s is cancelled: $(cat "$TMP/quiet.out")"
else
  bad "quiet upload: $(cat "$TMP/quiet.out"); log: $(grep -i "nothing moved" "$TMP/coordinator.log")"
fi
# 4. A serving request whose output (3 rows x 1.2 MB) outgrows a 2 MiB message: it
#    fails alone with RESOURCE_EXHAUSTED; the worker keeps its connection.
ctl infer "$SERVE" --input "$TMP/wide3.pt" -o "$TMP/wide3.out.pt" > "$TMP/big.out" 2>&1
rc=$?
code=$(/usr/bin/python3 - "$ADDR" "$SERVE" "$TMP/wide3.pt" <<'PY' 2>&1
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "client", "python", "pippy", "_stubs"))
import grpc
from proto import coordinator_pb2, coordinator_pb2_grpc
addr, job, path = sys.argv[1:]
try:
    coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(addr)).Infer(
        coordinator_pb2.InferRequest(job=job, input=open(path, "rb").read()), timeout=60)
    print("OK")
except grpc.RpcError as e:
    print(e.code().name)
PY
)
if [ "$rc" != 0 ] && [ "$code" = RESOURCE_EXHAUSTED ] && grep -q "more than one message to the coordinator may carry" "$TMP/big.out" &&
   ! grep -q "removed" "$TMP/coordinator.log"; then
  ok "a request whose output outgrows --max-message-mib 2 fails alone ($code): $(tail -1 "$TMP/big.out" | cut -c1-150)"
else
  bad "oversized output: exit $rc, code $code ($(cat "$TMP/big.out")); $(grep removed "$TMP/coordinator.log")"
fi
# 5. A normal training job after all that.
if ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --stages 2 --schedule 1f1b --microbatches 4 --batch-size 16 \
     --steps 3 --loss mse --optimizer sgd --wait > "$TMP/mlp.out" 2> "$TMP/mlp.err"; then
  ok "a normal job then trains: $(head -1 "$TMP/mlp.out")"
else
  bad "normal job after the hostile ones: $(cat "$TMP/mlp.err")"
fi

touch "$TMP/stop"
wait "$loop" 2>/dev/null
read -r n okn healthy < "$TMP/loop.count"
state=$(ctl status "$SERVE" --output json 2>/dev/null | /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin)['state'])")
if [ "$n" -ge 10 ] && [ "$okn" = "$n" ] && [ "$healthy" = "$n" ] && [ "$state" = SERVING ]; then
  ok "throughout: $okn of $n one-row requests answered, health SERVING $healthy times; the serving job is still $state"
else
  bad "normal traffic: $okn of $n requests answered, $healthy healthy, job $state; $(tail -3 "$TMP/loop.err")"
fi
finish
