#!/bin/bash
# End to end: a real pippy-coordinator and 4 real pippy-worker processes on 127.0.0.1
# (ports chosen by the OS); jobs submitted with pippyctl; trained models fetched and
# checked with /usr/bin/python3 against a plain PyTorch training loop. The coordinator
# takes gRPC messages of at most 2 MiB here, so a 10 MB model must travel in chunks.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
CHECK="$PWD/tests/python/check_training.py"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/e2e"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

METRICS_PORT=$(free_port)
WORKER_METRICS_PORT=$(free_port)
"$COORD" --bind 127.0.0.1 --port 0 --port-file "$TMP/port" --state-dir "$TMP/state" --heartbeat-timeout-s 3 \
  --max-message-mib 2 --metrics-port "$METRICS_PORT" > "$TMP/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
ADDR="127.0.0.1:$(cat "$TMP/port")"
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
declare -A worker_pid
HEALTH_PORT=$(free_port)
for i in 0 1 2 3; do
  health=()
  [ "$i" = 0 ] && health=(--health-port "$HEALTH_PORT" --metrics-port "$WORKER_METRICS_PORT")
  "$WORKER" --coordinator "$ADDR" --name "w$i" --ucx-tls sm,self --wait-timeout-s 30 "${health[@]}" > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
  worker_pid[w$i]=$!
done
wait_idle 4 && ok "4 workers registered" || bad "4 workers registered"
# grpc.health.v1: the coordinator, and worker w0 on its --health-port.
if ctl health > "$TMP/health.out" && "$PIPPYCTL" health "127.0.0.1:$HEALTH_PORT" --service pippy.Worker >> "$TMP/health.out"; then
  ok "health: $(tr '\n' ' ' < "$TMP/health.out")"
else
  bad "health: $(cat "$TMP/health.out")"
fi

/usr/bin/python3 - "$ZOO" "$TMP" <<'PY'
import sys, torch
zoo, tmp = sys.argv[1:3]
torch.save({"inputs": torch.load(f"{zoo}/gpt.input.pt"), "targets": torch.load(f"{zoo}/gpt.target.pt")}, f"{tmp}/gpt.data.pt")
torch.save({"inputs": torch.randn(8, 5), "targets": torch.randn(8, 5)}, f"{tmp}/wrong.data.pt")
# A 10 MB model: bigger than the 1 MiB chunks and the coordinator's 2 MiB message limit.
torch.manual_seed(0)
wide = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(800, 800), torch.nn.ReLU())])
torch.jit.script(wide).save(f"{tmp}/wide.pt")
torch.save({"inputs": torch.randn(32, 800), "targets": torch.randn(32, 800)}, f"{tmp}/wide.data.pt")
PY

COMMON=(--data "$TMP/gpt.data.pt" --microbatches 8 --batch-size 8 --steps 5 --loss model --optimizer adamw
        --lr 0.001 --weight-decay 0.01)
# The unsplit GPT trained by PyTorch as a COMMON job trains it, against TRAINED.pt
# (check_training.py; more of its flags after).
check_common() {  # TRAINED.pt [FLAGS...]
  /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" "$TMP/gpt.data.pt" "$1" --steps 5 --batch-size 8 --microbatches 8 \
    --loss model --optimizer adamw --lr 0.001 --weight-decay 0.01 --tolerance 1e-4 "${@:2}"
}
# Runs `submit ... --wait` (output to $TMP/NAME.out, errors to $TMP/NAME.err), then
# prints the job id; fails unless the job SUCCEEDED. (Never `--wait | head -1`: head
# would close the pipe and end pippyctl before the job does.)
submit_wait() {  # NAME ARGS...
  local name=$1
  shift
  ctl submit "$@" --wait > "$TMP/$name.out" 2> "$TMP/$name.err" || return 1
  head -1 "$TMP/$name.out"
}
train_and_check() {  # NAME ARGS...
  local name=$1
  shift
  if ! ctl submit "$ZOO/gpt.pt" "${COMMON[@]}" "$@" --wait > "$TMP/$name.out" 2>&1; then
    bad "$name: job did not succeed"; cat "$TMP/$name.out"; return
  fi
  local job
  job=$(head -1 "$TMP/$name.out")
  ctl fetch "$job" -o "$TMP/$name.pt" > /dev/null || { bad "$name: fetch"; return; }
  if check_common "$TMP/$name.pt"; then
    ok "$name"
  else
    bad "$name"
  fi
}
train_and_check gpt_1f1b_4stages --stages 4 --schedule 1f1b
train_and_check gpt_gpipe_4stages --stages 4 --schedule gpipe
train_and_check gpt_interleaved_8stages_2perworker --stages 8 --schedule interleaved-1f1b --stages-per-worker 2

# Mixed precision (--dtype bf16): each stage's forward under autocast to bfloat16, fp32
# weights and optimizer state. Against PyTorch's autocast run of the unsplit model: the
# loss curve within 1%, and the trained parameters (which the same op-by-op autocast makes
# nearly equal). The fp32 run above shows the two precisions differ.
if job=$(submit_wait gpt_bf16 "$ZOO/gpt.pt" "${COMMON[@]}" --stages 2 --schedule 1f1b --dtype bf16) &&
   ctl fetch "$job" -o "$TMP/bf16.pt" > /dev/null && ctl status "$job" --output json > "$TMP/bf16.json" &&
   /usr/bin/python3 -c "import json,sys; assert json.load(open(sys.argv[1]))['spec']['precision'] == 'PRECISION_BF16'" "$TMP/bf16.json" &&
   check_common "$TMP/bf16.pt" --dtype bf16 --losses "$TMP/bf16.json" --loss-tolerance 0.01; then
  ok "gpt_bf16_1f1b_2stages (loss curve and parameters vs PyTorch autocast)"
else
  bad "gpt_bf16_1f1b_2stages"
fi
if [ ! -s "$TMP/bf16.pt" ]; then
  bad "bf16 vs fp32: no trained bf16 model to compare (the bf16 job failed above)"
elif check_common "$TMP/bf16.pt" > "$TMP/bf16_vs_fp32.out" || ! grep -q "max relative difference" "$TMP/bf16_vs_fp32.out"; then
  bad "a bf16 job trained the same parameters as fp32 (autocast did not act), or the comparison did not run"
  cat "$TMP/bf16_vs_fp32.out"
else
  ok "bf16 differs from fp32 ($(tail -1 "$TMP/bf16_vs_fp32.out" | grep -o 'max relative difference [^ ]*'))"
fi

# Each worker of a 3-stage job receives its stage file and its share of the data, not
# the model: what it reports receiving is within 10% of that, and the parameters it
# loaded are its stage's (the plan's param_bytes), never the whole model's.
if job=$(submit_wait three "$ZOO/gpt.pt" "${COMMON[@]}" --stages 3 --schedule 1f1b) &&
   ctl status "$job" --output json > "$TMP/three.json" && ctl workers --output json > "$TMP/three.workers.json" &&
   /usr/bin/python3 - "$TMP/three.json" "$TMP/three.workers.json" "$ZOO/gpt.pt" "$TMP/gpt.data.pt" <<'PY'
import json, os, sys
job = json.load(open(sys.argv[1]))
workers = {w["worker_id"]: w for w in json.load(open(sys.argv[2]))["workers"]}
model_bytes, data_bytes = os.path.getsize(sys.argv[3]), os.path.getsize(sys.argv[4])
stage_files = [int(b) for b in job["stage_file_bytes"]]
params = [int(s.get("param_bytes", 0)) for s in job["plan"]["stages"]]
total = 0
for rank, wid in enumerate(job["workers"]):
    w = workers[wid]
    got, loaded = int(w.get("bytes_received", 0)), int(w.get("loaded_param_bytes", 0))
    stages = [int(s) for s in w.get("stages", [])]
    want_files = sum(stage_files[s] for s in stages)
    print(f"rank {rank}: stages {stages}, received {got} bytes (stage files {want_files} + data share), "
          f"loaded {loaded} parameter bytes (plan: {sum(params[s] for s in stages)}); model {model_bytes}")
    assert stages == [rank], stages
    assert want_files <= got <= 1.1 * (want_files + data_bytes), (got, want_files, data_bytes)
    assert loaded == sum(params[s] for s in stages), (loaded, params)
    assert loaded < 0.6 * sum(params)
    # The rank's memory peak in its last step: the worker process holds at least the
    # parameters it loaded; the job's most is at least the last step's.
    peak = int(job["breakdown"][rank].get("peak_memory_bytes", 0))
    most = int(job["peak_memory_bytes"][rank])
    print(f"rank {rank}: peak memory {peak >> 20} MiB in the last step, {most >> 20} MiB at most")
    assert loaded < peak <= most < 8 << 30, (loaded, peak, most)
    total += got
assert total < 1.3 * (model_bytes + data_bytes), (total, model_bytes)
PY
then ok "3-stage job: each worker received only its stage and data share, and reports its memory peak"; else bad "3-stage job: bytes per worker"; cat "$TMP/three.err"; fi

# Prometheus metrics of the coordinator and of worker w0, scraped over HTTP and read with
# Prometheus' own parser: the families exist with their types, and the numbers agree
# with what ran: the steps and samples the jobs' own records (ListJobs) count.
ctl list --limit 1000 --output json > "$TMP/jobs.json"
if /usr/bin/python3 - "$METRICS_PORT" "$WORKER_METRICS_PORT" "$TMP/jobs.json" <<'PY'
import json, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers["Content-Type"]
        fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    return fams
c = scrape(sys.argv[1])
# Counters' families drop "_total" in prometheus_client; their samples keep it.
value = lambda fams, fam, **labels: sum(s.value for s in fams[fam].samples if s.name in (fam, fam + "_total")
                                        and all(s.labels.get(k) == v for k, v in labels.items()))
assert c["pippy_jobs"].type == "gauge" and value(c, "pippy_jobs", state="SUCCEEDED") >= 4, c["pippy_jobs"]
assert value(c, "pippy_workers", state="IDLE") + value(c, "pippy_workers", state="BUSY") == 4
# What the job records say ran, independently of the metrics' counters.
jobs = json.load(open(sys.argv[3])).get("jobs", [])
steps = sum(int(j.get("step", 0)) for j in jobs)
samples = sum(int(j.get("step", 0)) * int(j["spec"].get("batch_size", 0)) for j in jobs)
assert steps >= 20, jobs
assert c["pippy_steps"].type == "counter" and value(c, "pippy_steps") == steps, (value(c, "pippy_steps"), steps)
assert value(c, "pippy_samples") == samples, (value(c, "pippy_samples"), samples)
hist = c["pippy_step_seconds"]
assert hist.type == "histogram"
count = [s.value for s in hist.samples if s.name == "pippy_step_seconds_count"][0]
inf = [s.value for s in hist.samples if s.name == "pippy_step_seconds_bucket" and s.labels["le"] == "+Inf"][0]
total = [s.value for s in hist.samples if s.name == "pippy_step_seconds_sum"][0]
assert count == inf == steps, (count, inf, steps)
assert total > 0
assert value(c, "pippy_transport_bytes", direction="sent") > 0
assert value(c, "pippy_transport_bytes", direction="sent") == value(c, "pippy_transport_bytes", direction="received")
assert len(c["pippy_worker_heartbeat_age_seconds"].samples) == 4
assert c["pippy_rank_peak_memory_bytes"].type == "gauge"  # samples only while a job runs
w = scrape(sys.argv[2])
assert value(w, "pippy_worker_registered") == 1
assert value(w, "pippy_worker_steps") >= 5, w["pippy_worker_steps"]
assert value(w, "pippy_worker_transport_bytes", direction="sent") > 0
print(f"coordinator: {len(c)} families, {value(c, 'pippy_steps'):.0f} steps; worker w0: "
      f"{value(w, 'pippy_worker_steps'):.0f} steps, {value(w, 'pippy_worker_transport_bytes', direction='sent'):.0f} bytes sent")
PY
then ok "/metrics of the coordinator and a worker parse with prometheus_client and agree with the jobs"; else bad "metrics"; fi

# The trace of that job's last step: a Chrome trace-event file (what Perfetto and
# chrome://tracing read) with every rank's actions, and the breakdown in `status`.
if ctl trace "$job" -o "$TMP/trace.json" > "$TMP/trace.out" &&
   ctl status "$job" > "$TMP/three.status" && grep -q "waiting for peers" "$TMP/three.status" &&
   grep -q "peak memory .*(job's most" "$TMP/three.status" &&
   /usr/bin/python3 - "$TMP/trace.json" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))
events = t["traceEvents"]
slices = [e for e in events if e["ph"] == "X"]
meta = [e for e in events if e["ph"] == "M"]
for e in slices:
    assert isinstance(e["name"], str) and e["name"], e
    for k in ("ts", "dur", "pid", "tid"):
        assert isinstance(e[k], int) and e[k] >= 0, (k, e)
    assert e["dur"] >= 1
assert {m["pid"] for m in meta if m["name"] == "process_name"} == {0, 1, 2}
names = {(e["pid"], e["name"]) for e in slices}
for r in range(3):  # 1F1B, stage r on rank r, 8 micro-batches: every F and B
    for mb in range(8):
        assert (r, f"{r}F{mb}") in names and (r, f"{r}B{mb}") in names, (r, mb)
    assert (r, "optimizer step") in names
assert any(e["name"].startswith("0SEND_F") and e["args"]["bytes"] > 0 for e in slices)
counters = [e for e in events if e["ph"] == "C" and e["name"] == "peak memory"]
assert {e["pid"] for e in counters} == {0, 1, 2} and all(e["args"]["MiB"] > 0 for e in counters), counters
print(f"trace: {len(slices)} slices over 3 ranks, {len(meta)} track names")
PY
then ok "pippyctl trace writes a Chrome trace of every rank with its memory peak; status shows the breakdown"; else bad "trace"; cat "$TMP/trace.out"; fi

# AdamW without --weight-decay uses torch's default (0.01), as torch.optim.AdamW does.
if ctl submit "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --microbatches 4 --batch-size 8 --steps 3 --loss model \
     --optimizer adamw --lr 0.001 --stages 2 --schedule 1f1b --wait > "$TMP/adamw.out" 2>&1 &&
   ctl fetch "$(head -1 "$TMP/adamw.out")" -o "$TMP/adamw.pt" > /dev/null &&
   /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" "$TMP/gpt.data.pt" "$TMP/adamw.pt" --steps 3 --batch-size 8 \
     --microbatches 4 --loss model --optimizer adamw --lr 0.001 --tolerance 1e-4; then
  ok "adamw defaults equal torch.optim.AdamW's"
else
  bad "adamw defaults"; cat "$TMP/adamw.out"
fi

# Learning-rate schedules (--lr-schedule, --warmup-steps, --min-lr) against torch's
# schedulers stepped after each optimizer step in a plain PyTorch loop: the learning
# rate of every step equal (reported by the ranks), the losses and parameters within 1e-5.
LRS=(--lr-schedule cosine --warmup-steps 5 --min-lr 3e-4)
if job=$(submit_wait cosine "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --microbatches 4 --batch-size 8 --steps 30 \
           --loss model --optimizer adamw --lr 0.003 "${LRS[@]}" --stages 2 --schedule 1f1b) &&
   ctl fetch "$job" -o "$TMP/cosine.pt" > /dev/null && ctl status "$job" --output json > "$TMP/cosine.json" &&
   grep -q "SUCCEEDED step 30/30 .*  lr 0.000311" "$TMP/cosine.out" &&
   /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" "$TMP/gpt.data.pt" "$TMP/cosine.pt" --steps 30 --batch-size 8 \
     --microbatches 4 --loss model --optimizer adamw --lr 0.003 "${LRS[@]}" --tolerance 1e-5 \
     --losses "$TMP/cosine.json" --loss-tolerance 1e-5 > "$TMP/cosine.check" 2>&1; then
  ok "cosine schedule with warm-up (1f1b, 2 stages, adamw, 30 steps) equals torch's SequentialLR: $(tr '\n' ' ' < "$TMP/cosine.check" | cut -c1-400)"
else
  bad "cosine schedule"; cat "$TMP/cosine.out" "$TMP/cosine.check" 2> /dev/null
fi
LRS=(--lr-schedule linear --min-lr 1e-4)
if job=$(submit_wait linear "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --microbatches 4 --batch-size 8 --steps 10 \
           --loss model --optimizer sgd --momentum 0.9 --lr 0.01 "${LRS[@]}" --stages 4 --schedule zb1p) &&
   ctl fetch "$job" -o "$TMP/linear.pt" > /dev/null && ctl status "$job" --output json > "$TMP/linear.json" &&
   /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" "$TMP/gpt.data.pt" "$TMP/linear.pt" --steps 10 --batch-size 8 \
     --microbatches 4 --loss model --optimizer sgd --momentum 0.9 --lr 0.01 "${LRS[@]}" --tolerance 1e-5 \
     --losses "$TMP/linear.json" --loss-tolerance 1e-5 > "$TMP/linear.check" 2>&1; then
  ok "linear schedule (zb1p, 4 stages, sgd with momentum) equals torch's LinearLR: $(tr '\n' ' ' < "$TMP/linear.check" | cut -c1-300)"
else
  bad "linear schedule"; cat "$TMP/linear.out" "$TMP/linear.check" 2> /dev/null
fi
# Schedules that cannot be run are refused before anything is uploaded, naming the flag.
if ! ctl submit "$ZOO/gpt.pt" "${COMMON[@]}" --stages 2 --schedule 1f1b --lr-schedule cosine --warmup-steps 5 \
       > /dev/null 2> "$TMP/warmup.err" && grep -q -- "--warmup-steps: 5 leaves none of the 5 steps to decay over" "$TMP/warmup.err" &&
   ! ctl submit "$ZOO/gpt.pt" "${COMMON[@]}" --stages 2 --schedule 1f1b --lr-schedule exponential \
       > /dev/null 2> "$TMP/sched.err" && grep -q "constant" "$TMP/sched.err" && grep -q "cosine" "$TMP/sched.err"; then
  ok "impossible schedules refused: $(head -1 "$TMP/warmup.err"); $(head -1 "$TMP/sched.err")"
else
  bad "schedule refusals"; cat "$TMP/warmup.err" "$TMP/sched.err"
fi

# A model larger than a chunk and than the coordinator's message limit submits, trains
# and fetches, and `fetch` writes exactly what the coordinator assembled.
if job=$(submit_wait wide "$TMP/wide.pt" --data "$TMP/wide.data.pt" --stages 2 --schedule 1f1b --microbatches 4 \
           --batch-size 16 --steps 2 --loss mse --optimizer sgd --lr 0.01) &&
   ctl fetch "$job" -o "$TMP/wide.trained.pt" > /dev/null &&
   /usr/bin/python3 "$CHECK" "$TMP/wide.pt" "$TMP/wide.data.pt" "$TMP/wide.trained.pt" --steps 2 --batch-size 16 \
     --microbatches 4 --loss mse --optimizer sgd --lr 0.01 --tolerance 1e-5; then
  ok "10 MB model through a 2 MiB message limit: $(stat -c %s "$TMP/wide.pt") bytes in, $(stat -c %s "$TMP/wide.trained.pt") out"
else
  bad "10 MB model"; cat "$TMP/wide.err"
fi

# Inference: the outputs equal the unsplit forward.
if job=$(submit_wait inference "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --stages 4 --schedule inference \
           --microbatches 4 --batch-size 8 --steps 1) &&
   ctl fetch "$job" -o "$TMP/outputs.pt" > /dev/null &&
   /usr/bin/python3 - "$ZOO/gpt.pt" "$TMP/gpt.data.pt" "$TMP/outputs.pt" <<'PY'
import sys, torch
model = torch.jit.load(sys.argv[1])
data = torch.load(sys.argv[2])
got = torch.load(sys.argv[3])
with torch.no_grad():
    want = model(data["inputs"])
d = (got - want).abs().max().item() / want.abs().max().item()
print(f"inference outputs vs unsplit forward: max relative difference {d:.3g}")
sys.exit(0 if got.shape == want.shape and d <= 1e-5 else 1)
PY
then ok "inference job equals the unsplit forward"; else bad "inference job"; cat "$TMP/inference.err"; fi

# Bad input is refused with INVALID_ARGUMENT (exit 2) naming the field; the coordinator keeps serving.
expect_refused() {  # NAME WANT_SUBSTRING ARGS...
  local name=$1 want=$2
  shift 2
  local err code
  err=$(ctl submit "$@" 2>&1 >/dev/null)
  code=$?
  if [ "$code" = 2 ] && [[ "$err" == *"$want"* ]]; then ok "refused: $name"; else bad "refused: $name (exit $code: $err)"; fi
}
: > "$TMP/empty.pt"
echo "not a model" > "$TMP/corrupt.pt"
expect_refused "empty model" "model: empty" "$TMP/empty.pt" "${COMMON[@]}" --stages 2 --schedule 1f1b
expect_refused "corrupt model" "model: 'corrupt.pt' is not a TorchScript archive" "$TMP/corrupt.pt" "${COMMON[@]}" --stages 2 --schedule 1f1b
expect_refused "unknown schedule" "--schedule: unknown schedule 'zigzag': use gpipe, 1f1b," "$ZOO/gpt.pt" "${COMMON[@]}" --stages 2 --schedule zigzag
expect_refused "too many stages" "--stages/--split-at: cannot make 500 stages" "$ZOO/gpt.pt" "${COMMON[@]}" --stages 500 --schedule gpipe
expect_refused "data that does not fit" "data" "$ZOO/gpt.pt" --data "$TMP/wrong.data.pt" --microbatches 2 --batch-size 8 \
  --steps 1 --loss model --optimizer sgd --lr 0.1 --stages 2 --schedule 1f1b
expect_refused "missing loss" "--loss: missing" "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --microbatches 2 --batch-size 8 \
  --steps 1 --optimizer sgd --lr 0.1 --stages 2 --schedule 1f1b
expect_refused "more stages than workers" "--stages/--split-at: the job needs 8 workers (8 stages, 1 per worker) but only 4 are registered; use fewer stages, more stages per worker (an interleaved schedule) or start more workers" \
  "$ZOO/gpt.pt" "${COMMON[@]}" --stages 8 --schedule gpipe
expect_refused "bad synthetic spec" "--synthetic" "$ZOO/mlp.pt" --synthetic "inputs=float33[16,32]" --microbatches 2 \
  --batch-size 16 --steps 1 --loss mse --optimizer sgd --lr 0.1 --stages 2 --schedule 1f1b
if ctl submit "$ZOO/mlp.pt" --synthetic "inputs=float32[64,32];targets=float32[64,32];seed=3" --stages 2 \
     --schedule 1f1b --microbatches 4 --batch-size 16 --steps 3 --loss mse --optimizer sgd --lr 0.01 --wait > /dev/null 2>&1; then
  ok "synthetic data source trains"
else
  bad "synthetic data source trains"
fi
ctl list > /dev/null && ok "coordinator still serving after bad input" || bad "coordinator still serving after bad input"

# Long jobs for the failure checks: submit, then wait until step N has been reported.
long_job() {  # STAGES -> job id (no restarts: a lost worker fails it; tests/e2e/fault_tolerance_test.sh restarts)
  ctl submit "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --microbatches 8 --batch-size 8 --steps 100000 --loss model \
    --optimizer sgd --lr 0.001 --stages "$1" --schedule 1f1b --max-restarts 0
}
wait_for_step() {  # N (for $job)
  for _ in $(seq 200); do
    step=$(ctl status "$job" --output json | /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin).get('step', 0))")
    [ "${step:-0}" -ge "$1" ] && break
    sleep 0.1
  done
}

# Cancel mid-step: the job ends CANCELLED at once; its ranks stop (the wait in
# progress is cancelled) and report, so all 4 workers are idle again well within
# their 30 s wait timeout.
job=$(long_job 4)
wait_for_step 2
start=$(date +%s%N)
ctl cancel "$job" > "$TMP/cancel.out" 2>&1
state=$(ctl status "$job" --output json | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print(j['state'], j.get('reason',''))")
for _ in $(seq 150); do [ "$(idle_workers)" = 4 ] && break; sleep 0.1; done
elapsed=$(( ($(date +%s%N) - start) / 1000000 ))
if [[ "$state" == CANCELLED* ]] && [ "$(idle_workers)" = 4 ]; then
  ok "cancelled job: $state; all 4 workers idle again after ${elapsed}ms"
else
  bad "cancel: state '$state', $(idle_workers) workers idle after ${elapsed}ms"; cat "$TMP/cancel.out"
fi

# A worker killed mid-job: the job FAILS naming it, the others return to idle, the next job runs.
job=$(long_job 4)
wait_for_step 2
start=$(date +%s%N)
kill -9 "${worker_pid[w2]}"
ctl watch "$job" > "$TMP/killed.out" 2>&1
elapsed=$(( ($(date +%s%N) - start) / 1000000 ))ms
reason=$(ctl status "$job" --output json | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print(j['state'], j.get('reason',''))")
if [[ "$reason" == FAILED*"worker w2"* ]]; then ok "killed worker fails the job within ${elapsed}: $reason"; else bad "killed worker: $reason"; fi
for _ in $(seq 300); do [ "$(idle_workers)" = 3 ] && break; sleep 0.1; done
[ "$(idle_workers)" = 3 ] && ok "the other 3 workers are idle again" || bad "the other workers are idle again ($(idle_workers) idle)"
train_and_check next_job_after_failure --stages 2 --schedule 1f1b

# A worker that stops sending heartbeats (frozen with SIGSTOP; its stream stays open)
# fails its job once the heartbeat timeout (3 s) passes.
job=$(long_job 2)
wait_for_step 2
busy=$(ctl workers --output json | /usr/bin/python3 -c \
  "import json,sys; print(next(w['name'] for w in json.load(sys.stdin)['workers'] if w.get('job_id')=='$job'))")
kill -STOP "${worker_pid[$busy]}"
start=$(date +%s%N)
ctl watch "$job" > /dev/null 2>&1
elapsed=$(( ($(date +%s%N) - start) / 1000000 ))
reason=$(ctl status "$job" --output json | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print(j['state'], j.get('reason',''))")
kill -CONT "${worker_pid[$busy]}"
if [[ "$reason" == FAILED*"worker $busy"*"stopped sending heartbeats"* ]]; then
  ok "silent worker fails the job after ${elapsed}ms: $reason"
else
  bad "silent worker: $reason"
fi

# Job records survive a coordinator restart (the workers keep dialling the old address
# until they are stopped; the restart tests are in tests/e2e/fault_tolerance_test.sh).
kill "${pids[0]}"
for _ in $(seq 100); do kill -0 "${pids[0]}" 2>/dev/null || break; sleep 0.1; done
kill -0 "${pids[0]}" 2>/dev/null && bad "coordinator did not stop within 10 s of SIGTERM" || ok "coordinator stopped on SIGTERM"
# Without its coordinator a worker is NOT_SERVING (exit 1), and says so.
sleep 1
"$PIPPYCTL" health "127.0.0.1:$HEALTH_PORT" > "$TMP/health2.out" 2>&1
rc=$?
[ "$rc" = 1 ] && grep -q NOT_SERVING "$TMP/health2.out" && ok "worker without a coordinator: NOT_SERVING" ||
  bad "worker health after the coordinator stopped: rc $rc, $(cat "$TMP/health2.out")"
"$COORD" --bind 127.0.0.1 --port 0 --port-file "$TMP/port2" --state-dir "$TMP/state" > "$TMP/coordinator2.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$TMP/port2" ] && break; sleep 0.1; done
ADDR="127.0.0.1:$(cat "$TMP/port2")"
count=$(ctl list --output json | /usr/bin/python3 -c "import json,sys; print(len(json.load(sys.stdin).get('jobs', [])))")
[ "$count" -ge 6 ] && ok "ListJobs after a restart shows the $count earlier jobs" || bad "jobs after restart: $count"

finish
