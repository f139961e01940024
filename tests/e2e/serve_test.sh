#!/bin/bash
# Serving end to end: a real pippy-coordinator and 4 real pippy-worker processes on
# 127.0.0.1. The zoo's GPT is served in 3 stages (`pippyctl serve`), answered through
# `pippyctl infer` and the Python client by 32 concurrent clients with mixed batch
# sizes and sequence lengths, unary and streaming, with malformed requests mixed in;
# every answer is checked against the unsplit model's forward (serve_clients.py). Then
# a worker of the pipeline is killed while requests are in flight: they fail with
# UNAVAILABLE, the job reports the loss and serves again on the spare worker. Cancel
# stops serving, frees the workers, and later requests are refused.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
CLIENTS="$PWD/tests/e2e/serve_clients.py"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/serve"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"
export OPENBLAS_NUM_THREADS=1

METRICS_PORT=$(free_port)
start_coordinator 0 --metrics-port "$METRICS_PORT"
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
declare -A worker_pid
for i in 0 1 2 3; do
  device=cpu
  [ "$i" = 3 ] && device=auto  # no GPU in this LibTorch: auto is the CPU
  "$WORKER" --coordinator "$ADDR" --name "w$i" --device "$device" --ucx-tls sm,self --threads 1 --wait-timeout-s 20 \
    > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
  worker_pid[w$i]=$!
done
json_get() { ctl status "$1" --output json | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print($2)"; }
wait_idle 4 && ok "4 workers registered" || bad "4 workers registered"
devices=$(ctl workers --output json | /usr/bin/python3 -c "import json,sys; print(sorted(w['device'] for w in json.load(sys.stdin)['workers']))")
[ "$devices" = "['cpu', 'cpu', 'cpu', 'cpu']" ] && ok "--device auto without a GPU registers as cpu" || bad "devices: $devices"
"$WORKER" --coordinator "$ADDR" --device cuda:0 > /dev/null 2> "$TMP/cuda.err"
code=$?
[ "$code" = 2 ] && grep -q "this build's LibTorch has no CUDA" "$TMP/cuda.err" \
  && ok "--device cuda:0 on a CPU-only LibTorch exits 2: $(head -c 110 "$TMP/cuda.err")" \
  || bad "--device cuda:0: exit $code $(cat "$TMP/cuda.err")"

# Refused before anything is placed: no example input; a training schedule.
ctl serve "$ZOO/gpt.pt" --stages 3 > /dev/null 2> "$TMP/noexample.err"
grep -q "example input" "$TMP/noexample.err" && ok "serve without an example input is refused naming it" \
  || bad "serve without example: $(cat "$TMP/noexample.err")"

ctl serve "$ZOO/gpt.pt" --stages 3 --example "$ZOO/gpt.input.pt" --max-batch 8 --max-delay-ms 5 --name gpt-serve \
  --wait > "$TMP/serve.out" 2> "$TMP/serve.err"
JOB=$(head -1 "$TMP/serve.out")
state=$(json_get "$JOB" "j['state']" 2>/dev/null)
[ "$state" = "SERVING" ] && ok "serve --wait: $JOB is SERVING" || bad "serve: state '$state' $(cat "$TMP/serve.err")"
busy=$(ctl workers --output json | /usr/bin/python3 -c \
  "import json,sys; print(sum(1 for w in json.load(sys.stdin)['workers'] if w['state']=='BUSY'))")
[ "$busy" = "3" ] && ok "3 workers hold the stages" || bad "busy workers: $busy"
edges=$(ctl status "$JOB" | grep "stage edges")
echo "$edges" | grep -q "0->1 ucx (rank 0->1), 1->2 ucx (rank 1->2)" && ok "status:$edges" || bad "edges: $edges"

# One request through pippyctl infer (by name), checked in Python.
/usr/bin/python3 - "$TMP" <<'PY'
import sys, torch
torch.manual_seed(1)
torch.save(torch.randint(0, 64, (3, 16)), f"{sys.argv[1]}/one.pt")
PY
if ctl infer gpt-serve --input "$TMP/one.pt" -o "$TMP/one.out.pt" > "$TMP/infer.out" 2>&1 &&
   /usr/bin/python3 - "$ZOO/gpt.pt" "$TMP" <<'PY'
import sys, torch
m = torch.jit.load(sys.argv[1]); tmp = sys.argv[2]
x = torch.load(f"{tmp}/one.pt"); y = torch.load(f"{tmp}/one.out.pt")
with torch.no_grad():
    want = m(x)
d = ((y - want).abs().max() / want.abs().max()).item()
print("max relative difference", d)
sys.exit(0 if y.shape == want.shape and d <= 1e-6 else 1)
PY
then
  ok "pippyctl infer: $(cat "$TMP/infer.out" | head -1)"
else
  bad "pippyctl infer: $(cat "$TMP/infer.out")"
fi

# 32 concurrent clients, unary and streaming, malformed requests mixed in.
if /usr/bin/python3 "$CLIENTS" "$ADDR" "$JOB" "$ZOO/gpt.pt" --clients 32 --requests 6 --stream > "$TMP/clients.out" 2>&1; then
  ok "$(tail -1 "$TMP/clients.out")"
else
  bad "concurrent clients: $(tail -12 "$TMP/clients.out")"
fi
ctl status "$JOB" > "$TMP/status.txt"
grep -q "requests 1[0-9][0-9] " "$TMP/status.txt" && grep -q "latency p50" "$TMP/status.txt" \
  && ok "status shows the serving counters: $(grep -m1 requests "$TMP/status.txt" | sed 's/^ *//')" \
  || bad "status: $(cat "$TMP/status.txt")"
batched=$(json_get "$JOB" "j['serving']['mean_batch_rows'] > 3")
[ "$batched" = "True" ] && ok "requests share micro-batches (mean rows $(json_get "$JOB" "round(j['serving']['mean_batch_rows'], 1)"))" \
  || bad "micro-batches were not shared: $(json_get "$JOB" "j['serving']")"

# The serving counters on /metrics, read with Prometheus' own parser.
if /usr/bin/python3 - "$METRICS_PORT" "$JOB" > "$TMP/metrics.out" 2>&1 <<'PY'
import sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
port, job = sys.argv[1:3]
with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
    fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
def value(fam, **labels):
    return sum(s.value for s in fams[fam].samples if s.name in (fam, fam + "_total", fam + "_count")
               and all(s.labels.get(k) == v for k, v in labels.items()))
ok, err = value("pippy_serving_requests", job=job, outcome="ok"), value("pippy_serving_requests", job=job, outcome="error")
assert ok >= 177 and err >= 4, (ok, err)
assert fams["pippy_serving_request_seconds"].type == "histogram"
assert value("pippy_serving_request_seconds", job=job) == ok + err
assert value("pippy_serving_microbatches", job=job) > 0 and value("pippy_serving_rows", job=job) > ok
print(f"{ok:.0f} ok, {err:.0f} failed, {value('pippy_serving_microbatches', job=job):.0f} micro-batches")
PY
then ok "/metrics: $(cat "$TMP/metrics.out")"; else bad "metrics: $(cat "$TMP/metrics.out")"; fi

# A client that gives up while its request waits: the request is dropped, not computed.
ctl serve "$ZOO/gpt.pt" --stages 1 --example "$ZOO/gpt.input.pt" --max-batch 64 --max-delay-ms 3000 \
  --name gpt-slow --wait > "$TMP/serve3.out" 2>&1
JOB3=$(head -1 "$TMP/serve3.out")
ctl infer "$JOB3" --input "$TMP/one.pt" -o "$TMP/late.out.pt" --timeout-s 0.5 > /dev/null 2> "$TMP/deadline.err"
sleep 3
dropped=$(json_get "$JOB3" "(int(j['serving'].get('microbatches', 0)), int(j['serving'].get('failed', 0)))")
grep -q "DEADLINE_EXCEEDED\|Deadline" "$TMP/deadline.err" && [ "$dropped" = "(0, 1)" ] \
  && ok "a request whose client's deadline passed while it waited is dropped (micro-batches, failed: $dropped)" \
  || bad "deadline: $(cat "$TMP/deadline.err") $dropped"
ctl cancel "$JOB3" > /dev/null

# Mixed precision: a bf16 serving job answers what PyTorch's autocast gives (op by op,
# as the workers run TorchScript), in bf16.
wait_idle 1 > /dev/null
ctl serve "$ZOO/gpt.pt" --stages 1 --example "$ZOO/gpt.input.pt" --dtype bf16 --name gpt-bf16 --wait \
  > "$TMP/serve_bf16.out" 2>&1
JOB_BF16=$(head -1 "$TMP/serve_bf16.out")
if ctl infer gpt-bf16 --input "$TMP/one.pt" -o "$TMP/one.bf16.pt" > /dev/null 2> "$TMP/bf16.err" &&
   /usr/bin/python3 - "$ZOO/gpt.pt" "$TMP" > "$TMP/bf16.out" 2>&1 <<'PY'
import sys, torch
torch._C._set_graph_executor_optimize(False)
m = torch.jit.load(sys.argv[1]); tmp = sys.argv[2]
x = torch.load(f"{tmp}/one.pt"); y = torch.load(f"{tmp}/one.bf16.pt")
with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
    want = m(x)
d = ((y.float() - want.float()).abs().max() / want.float().abs().max()).item()
print(f"{y.dtype}, max relative difference {d} against torch.autocast")
sys.exit(0 if y.dtype == want.dtype == torch.bfloat16 and d == 0 else 1)
PY
then ok "bf16 serving: $(cat "$TMP/bf16.out")"; else bad "bf16 serving: $(cat "$TMP/bf16.err" "$TMP/bf16.out")"; fi
ctl cancel "$JOB_BF16" > /dev/null

# A malformed request does not reach the pipeline (or disturb it): the next one is answered.
printf 'garbage' > "$TMP/garbage.pt"
ctl infer "$JOB" --input "$TMP/garbage.pt" -o "$TMP/garbage.out.pt" > /dev/null 2> "$TMP/garbage.err"
code=$?
grep -q "INVALID_ARGUMENT\|input" "$TMP/garbage.err" && [ $code -ne 0 ] && ctl infer "$JOB" --input "$TMP/one.pt" -o "$TMP/next.out.pt" > "$TMP/next.out" \
  && ok "a malformed request is refused ($(head -c 120 "$TMP/garbage.err")) and the next is answered" \
  || bad "malformed: $(cat "$TMP/garbage.err")"
# infer needs -o (the answer does not vanish silently).
ctl infer "$JOB" --input "$TMP/one.pt" > /dev/null 2> "$TMP/noout.err"
code=$?
[ "$code" = 2 ] && grep -q -- "--out is required" "$TMP/noout.err" && [ -s "$TMP/next.out.pt" ] &&
  ok "infer without -o is refused before sending ($(head -c 80 "$TMP/noout.err")); with -o the answer is written" ||
  bad "infer without -o: exit $code, $(cat "$TMP/noout.err")"
ctl infer no-such-job --input "$TMP/one.pt" -o "$TMP/nojob.out.pt" > /dev/null 2> "$TMP/nojob.err"
grep -q "no serving job 'no-such-job'" "$TMP/nojob.err" && ok "an unknown job is NOT_FOUND naming it" \
  || bad "unknown job: $(cat "$TMP/nojob.err")"

# A worker of the pipeline dies while requests are in flight: once the clients are
# answered, the victim is frozen (SIGSTOP) so that the micro-batches reaching it stay
# in the pipeline, and killed once the job counts some in flight.
victim=$(ctl workers --output json | /usr/bin/python3 -c "
import json,sys
ws=[w for w in json.load(sys.stdin)['workers'] if w['state']=='BUSY' and w.get('rank', 0)==1]
print(ws[0]['name'] if ws else '')")
/usr/bin/python3 - "$ADDR" "$JOB" "$TMP" > "$TMP/inflight.out" 2>&1 <<'PY' &
import os, sys, threading, time, torch, grpc
sys.path.insert(0, os.path.join(os.getcwd(), "client", "python"))
import pippy
addr, job, tmp = sys.argv[1:4]
codes = []
def run():
    with pippy.Client(addr, timeout_s=60) as c:
        for _ in range(400):
            try:
                c.infer(job, torch.randint(0, 64, (4, 16)))
                codes.append("OK")
                if not os.path.exists(f"{tmp}/load.ready"):
                    open(f"{tmp}/load.ready", "w").close()
            except pippy.PippyError as e:
                codes.append(e.code.name)
                if e.code != grpc.StatusCode.UNAVAILABLE:
                    print("unexpected", e)
                return
threads = [threading.Thread(target=run) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(" ".join(sorted(set(codes))))
PY
load=$!
for _ in $(seq 300); do [ -e "$TMP/load.ready" ] && break; sleep 0.1; done
kill -STOP "${worker_pid[$victim]}" 2>/dev/null
for _ in $(seq 50); do [ "$(json_get "$JOB" "j['serving'].get('inflight', 0)")" != "0" ] && break; sleep 0.1; done
kill -9 "${worker_pid[$victim]}" 2>/dev/null
wait "$load"
grep -q "UNAVAILABLE" "$TMP/inflight.out" && ! grep -q unexpected "$TMP/inflight.out" \
  && ok "killing $victim mid-traffic: in-flight requests failed UNAVAILABLE ($(tail -1 "$TMP/inflight.out"))" \
  || bad "in flight: $(cat "$TMP/inflight.out")"
for _ in $(seq 300); do
  [ "$(json_get "$JOB" "j['state']")" = "SERVING" ] && [ "$(json_get "$JOB" "j.get('restarts', 0)")" = "1" ] && break
  sleep 0.1
done
history=$(json_get "$JOB" "' | '.join(e['message'] for e in j.get('history', []))")
if [ "$(json_get "$JOB" "j['state']")" = "SERVING" ] && echo "$history" | grep -q "$victim"; then
  ok "the job reports the lost worker and serves again on the spare: $(echo "$history" | head -c 160)"
else
  bad "after the kill: $(json_get "$JOB" "j['state'], j.get('reason'), j.get('history')")"
fi
ctl infer "$JOB" --input "$TMP/one.pt" -o "$TMP/one.again.pt" > /dev/null 2>&1 && cmp -s "$TMP/one.out.pt" "$TMP/one.again.pt" \
  || /usr/bin/python3 -c "import torch,sys; a=torch.load('$TMP/one.out.pt'); b=torch.load('$TMP/one.again.pt'); sys.exit(0 if torch.equal(a,b) else 1)" \
  && ok "after the restart the same request gives the same output" || bad "after restart: infer failed or differs"

# The coordinator killed and restarted with the same state directory: the serving job
# is placed again once the workers reconnect, and answers as before.
kill -9 "$coord_pid"
wait "$coord_pid" 2>/dev/null
start_coordinator "$PORT" --metrics-port "$METRICS_PORT"
for _ in $(seq 300); do [ "$(json_get "$JOB" "j['state']" 2>/dev/null)" = "SERVING" ] && break; sleep 0.1; done
if [ "$(json_get "$JOB" "j['state']")" = "SERVING" ] && ctl infer gpt-serve --input "$TMP/one.pt" -o "$TMP/one.third.pt" > /dev/null &&
   /usr/bin/python3 -c "import torch,sys; a=torch.load('$TMP/one.out.pt'); b=torch.load('$TMP/one.third.pt'); sys.exit(0 if torch.equal(a,b) else 1)"; then
  ok "coordinator restarted: the job serves again by its name, same output ($(json_get "$JOB" "j['history'][-1]['message'][:90]"))"
else
  bad "after the coordinator restart: $(json_get "$JOB" "j['state'], j.get('reason'), j.get('history')")"
fi

# Cancel: serving stops, the workers are free, requests are refused; what cancel
# answers of the requests is what status says afterwards.
ctl cancel "$JOB" --output json > "$TMP/cancel.json"
wait_idle 3 && ok "cancel frees the 3 workers" || bad "idle after cancel: $(idle_workers)"
ctl status "$JOB" --output json > "$TMP/cancelled.json"
counts() { /usr/bin/python3 -c "import json,sys; s=json.load(open(sys.argv[1]))['serving']; print(s['requests'], s['failed'], s['rows'])" "$1"; }
[ "$(counts "$TMP/cancel.json")" = "$(counts "$TMP/cancelled.json")" ] && [ "$(counts "$TMP/cancel.json" | cut -d' ' -f1)" -gt 0 ] &&
  ok "cancel's request counts are status's afterwards: $(counts "$TMP/cancel.json") (requests, failed, rows)" ||
  bad "cancel said $(counts "$TMP/cancel.json"), status later $(counts "$TMP/cancelled.json")"
ctl infer "$JOB" --input "$TMP/one.pt" -o "$TMP/after.out.pt" > /dev/null 2> "$TMP/after.err"
grep -q "ended (CANCELLED" "$TMP/after.err" && ok "a request after cancel is refused: $(head -c 100 "$TMP/after.err")" \
  || bad "after cancel: $(cat "$TMP/after.err")"

# Isolation, deterministically: a job that waits 1.5 s to fill a micro-batch, so that
# 3 good requests and 1 whose token is out of the vocabulary (the same shape) share
# one. The bad one fails with the model's error; the others are sent again alone and
# answered with the unsplit model's output.
ctl serve "$ZOO/gpt.pt" --stages 2 --example "$ZOO/gpt.input.pt" --max-batch 64 --max-delay-ms 1500 \
  --name gpt-wait --wait > "$TMP/serve2.out" 2>&1
JOB2=$(head -1 "$TMP/serve2.out")
if /usr/bin/python3 - "$ADDR" "$JOB2" "$ZOO/gpt.pt" > "$TMP/isolation.out" 2>&1 <<'PY'
import os, sys, torch, grpc
sys.path.insert(0, os.path.join(os.getcwd(), "client", "python"))
import pippy
addr, job, model = sys.argv[1:4]
m = torch.jit.load(model)
torch.manual_seed(2)
xs = [torch.randint(0, 64, (r, 16)) for r in (2, 3, 1, 2)]
xs[2][0, 5] = 99
with pippy.Client(addr) as c:
    got = dict(c.infer_stream(job, xs, timeout_s=60))
fails = []
for i, x in enumerate(xs):
    y = got.get(i)
    if i == 2:
        if not (isinstance(y, pippy.InferError) and y.code == grpc.StatusCode.INVALID_ARGUMENT and "index out of range" in str(y)):
            fails.append(f"bad request: {y!r}")
        else:
            print("bad request:", str(y)[:140])
    else:
        with torch.no_grad():
            want = m(x)
        if isinstance(y, Exception) or not torch.allclose(y, want, rtol=0, atol=1e-6 * want.abs().max().item()):
            fails.append(f"request {i}: {y!r}")
print("\n".join(fails))
sys.exit(1 if fails else 0)
PY
then
  if grep -q "micro-batch 0 of 4 requests failed in the model" "$TMP/coordinator.log"; then
    ok "a request that fails in the model fails alone; the 3 sharing its micro-batch are answered ($(grep -m1 'bad request' "$TMP/isolation.out" | head -c 100))"
  else
    bad "isolation: the 4 requests did not share a micro-batch: $(grep -i 'alone\|micro-batch' "$TMP/coordinator.log" | tail -3)"
  fi
else
  bad "isolation: $(cat "$TMP/isolation.out")"
fi
ctl cancel "$JOB2" > /dev/null
finish
