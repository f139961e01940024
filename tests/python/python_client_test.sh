#!/bin/bash
# The Python client (client/python/pippy) against `pippyctl local` (a real coordinator
# and 2 workers): client/python/example.py submits the zoo's MLP, follows it, fetches
# the trained model, and the model loads with torch.jit.load. The committed stubs must
# be what client/python/generate makes from proto/ today.
set -u
PIPPYCTL="$PWD/client/pippyctl"
ZOO="$PWD/examples/models/zoo"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/pyclient"
rm -rf "$TMP" && mkdir -p "$TMP"
passed=0
failed=0
ok() { echo "ok   $1"; passed=$((passed + 1)); }
bad() { echo "FAIL $1"; failed=$((failed + 1)); }

# Stubs up to date.
client/python/generate "$TMP/stubs" > /dev/null
if diff -r -q -x __pycache__ "$TMP/stubs" client/python/pippy/_stubs > "$TMP/stubs.diff"; then
  ok "the committed Python stubs match proto/"
else
  bad "the Python stubs are stale: run client/python/generate ($(cat "$TMP/stubs.diff"))"
fi

PORT=$(/usr/bin/python3 -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
"$PIPPYCTL" local --workers 2 --port "$PORT" --state-dir "$TMP/state" --ucx-tls sm,self > "$TMP/local.log" 2>&1 &
LOCAL=$!
trap 'kill "$LOCAL" 2>/dev/null; wait "$LOCAL" 2>/dev/null' EXIT
for _ in $(seq 150); do
  [ "$("$PIPPYCTL" --coordinator "127.0.0.1:$PORT" workers --output json 2>/dev/null | /usr/bin/python3 -c \
    "import json,sys; print(len(json.load(sys.stdin).get('workers', [])))" 2>/dev/null)" = 2 ] && break
  sleep 0.1
done
if /usr/bin/python3 client/python/example.py "127.0.0.1:$PORT" "$ZOO/mlp.pt" "$ZOO/mlp.data.pt" "$TMP/trained.pt" \
     > "$TMP/example.out" 2>&1 &&
   /usr/bin/python3 -c "import sys, torch; m = torch.jit.load(sys.argv[1]); print(sum(p.numel() for p in m.parameters()), 'parameters')" \
     "$TMP/trained.pt" >> "$TMP/example.out" 2>&1; then
  ok "example.py trained and fetched a model that torch.jit.load opens: $(tail -2 "$TMP/example.out" | tr '\n' ' ')"
else
  bad "example.py: $(cat "$TMP/example.out")"
fi
# Errors come back as PippyError with the gRPC code and the coordinator's message.
if /usr/bin/python3 - "127.0.0.1:$PORT" "$ZOO/mlp.pt" "$ZOO/mlp.data.pt" <<'PY' > "$TMP/errors.out" 2>&1
import sys
sys.path.insert(0, "client/python")
import grpc, pippy
c = pippy.Client(sys.argv[1])
try:
    c.status("job-999")
    raise SystemExit("no error for an unknown job")
except pippy.PippyError as e:
    assert e.code == grpc.StatusCode.NOT_FOUND, e
try:
    c.submit(sys.argv[2], sys.argv[3], stages=2, schedule="1f1b", microbatches=3, batch_size=16, loss="mse",
             optimizer="sgd")
    raise SystemExit("no error for a batch that does not split")
except pippy.PippyError as e:
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT and "batch_size" in str(e), e
    print("refused:", e)
spec = pippy.make_spec(sys.argv[2], sys.argv[3], stages=2, schedule="1f1b", microbatches=2, batch_size=16, dtype="bf16")
assert spec.precision == pippy.job_pb2.PRECISION_BF16, spec
def refused(what, call, message):
    """call() raises PippyError(INVALID_ARGUMENT) containing message (the README
    promises PippyError, not ValueError or TypeError)."""
    try:
        call()
    except pippy.PippyError as e:
        assert e.code == grpc.StatusCode.INVALID_ARGUMENT and message in str(e), (what, e)
        return
    raise SystemExit(f"no error for {what}")
refused("dtype fp16", lambda: pippy.make_spec(sys.argv[2], sys.argv[3], stages=2, schedule="1f1b", microbatches=2,
                                              batch_size=16, dtype="fp16"),
        "dtype: unknown 'fp16'; use fp32, bf16")
refused("a misspelled keyword", lambda: c.submit(sys.argv[2], sys.argv[3], stage=2, schedule="1f1b", microbatches=2,
                                                 batch_size=16, loss="mse", optimizer="sgd"),
        "unknown argument 'stage'; did you mean stages")
refused("an unknown schedule", lambda: c.submit(sys.argv[2], sys.argv[3], stages=2, schedule="zigzag",
                                                microbatches=2, batch_size=16, loss="mse", optimizer="sgd"),
        "schedule: unknown 'zigzag'")
tp = pippy.make_spec(sys.argv[2], sys.argv[3], stages=2, schedule="1f1b", microbatches=2, batch_size=16,
                     tensor_parallel=2, tp_plan="0=colwise, 2=rowwise")
assert tp.tensor_parallel.size == 2 and [(r.pattern, r.style) for r in tp.tensor_parallel.rules] == \
    [("0", pippy.job_pb2.TP_COLWISE), ("2", pippy.job_pb2.TP_ROWWISE)], tp.tensor_parallel
refused("a tensor-parallel plan without a style", lambda: pippy.make_spec(
    sys.argv[2], sys.argv[3], stages=2, schedule="1f1b", microbatches=2, batch_size=16, tensor_parallel=2,
    tp_plan="0=columns"), "tp_plan: '0=columns' is not PATTERN=STYLE")
refused("a misspelled serve keyword", lambda: c.serve(sys.argv[2], sys.argv[3], stages=2, max_batchh=8),
        "unknown argument 'max_batchh'; did you mean max_batch")
for torch_name, kind in (("Schedule1F1B", "SCHEDULE_1F1B"), ("ScheduleZBVZeroBubble", "SCHEDULE_ZBV")):
    spec = pippy.make_spec(sys.argv[2], sys.argv[3], stages=2, schedule=torch_name, microbatches=2, batch_size=16)
    assert spec.schedule.kind == getattr(pippy.job_pb2, kind), (torch_name, spec.schedule.kind)
# watch: each change once; no loss before the first step.
job = c.submit(sys.argv[2], sys.argv[3], stages=2, schedule="1f1b", microbatches=2, batch_size=16, steps=3,
               loss="mse", optimizer="sgd")
events = list(c.watch(job))
keys = [(e["state"], e["step"], e["message"]) for e in events]
assert len(keys) == len(set(keys)), keys
assert all(e["loss"] is None for e in events if e["step"] == 0), events
assert events[-1]["state"] == "SUCCEEDED" and events[-1]["loss"] is not None, events[-1]
print(f"watch: {len(events)} events, each once: {[k[0] for k in keys]}")
PY
then ok "errors: $(tail -1 "$TMP/errors.out")"; else bad "errors: $(cat "$TMP/errors.out")"; fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
