#!/bin/bash
# The daemons end to end on this 2-core machine: 2 workers with 1 compute thread each
# train a compute-bound MLP (8 Linear layers of 1024, batch 256) with GPipe and 1F1B,
# m = 8. Reports throughput and pipeline efficiency = ideal / measured, where
# ideal = single-process single-thread step time x (m + p - 1) / (m * p), with the
# single-process figure measured in the same run — and, beside them, the same model,
# micro-batches and schedule run by a Python baseline (torch.distributed, gloo,
# send/recv between 2 processes), with pippy's throughput as a ratio to it.
#
# Run: bench/daemon_bench.sh   (after `bazel build //client:pippyctl //coordinator:all //worker:all`)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN="$ROOT/bazel-bin"
TMP="$(mktemp -d)"
trap '[ -n "${LOCAL_PID:-}" ] && kill "$LOCAL_PID" 2>/dev/null; wait 2>/dev/null; rm -rf "$TMP"' EXIT
export OPENBLAS_NUM_THREADS=1
M=8
P=2
BATCH=256
STEPS=6

/usr/bin/python3 - "$TMP" <<'PY'
import sys, torch
out = sys.argv[1]
torch.manual_seed(0)
layers = []
for i in range(8):
    layers.append(torch.nn.Linear(1024, 1024))
    if i < 7:
        layers.append(torch.nn.ReLU())
model = torch.nn.Sequential(*layers)
torch.jit.script(model).save(f"{out}/mlp.pt")
torch.save({"inputs": torch.randn(256, 1024), "targets": torch.randn(256, 1024)}, f"{out}/data.pt")
PY

# Single process, single thread: the full batch, forward + backward + step.
T1=$(/usr/bin/python3 - "$TMP" "$STEPS" <<'PY'
import sys, time, torch, torch.nn.functional as F
torch.set_num_threads(1)
out, steps = sys.argv[1], int(sys.argv[2])
model = torch.jit.load(f"{out}/mlp.pt")
data = torch.load(f"{out}/data.pt")
opt = torch.optim.SGD(model.parameters(), lr=1e-4)
def step():
    F.mse_loss(model(data["inputs"]), data["targets"]).backward(); opt.step(); opt.zero_grad()
step()
t0 = time.perf_counter()
for _ in range(steps): step()
print((time.perf_counter() - t0) / steps)
PY
)

PORT=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$BIN/client/pippyctl" local --workers 2 --threads 1 --port "$PORT" --state-dir "$TMP/state" --ucx-tls sm,self \
  > "$TMP/local.log" 2>&1 &
LOCAL_PID=$!
CTL=("$BIN/client/pippyctl" --coordinator "127.0.0.1:$PORT")
for _ in $(seq 100); do [ "$("${CTL[@]}" workers 2>/dev/null | grep -c idle)" = 2 ] && break; sleep 0.2; done

printf "\nsingle process, 1 thread: %.3f s per step of %d samples (%.0f samples/s)\n" "$T1" "$BATCH" \
  "$(echo "$BATCH / $T1" | /usr/bin/python3 -c 'import sys; print(eval(sys.stdin.read()))')"
printf "%-8s %16s %12s %22s %12s\n" schedule "pippy samples/s" efficiency "gloo baseline samp/s" "pippy/gloo"
for sched in gpipe 1f1b; do
  "${CTL[@]}" submit "$TMP/mlp.pt" --data "$TMP/data.pt" --stages $P --schedule $sched --microbatches $M \
    --batch-size $BATCH --steps $((STEPS + 1)) --loss mse --optimizer sgd --lr 1e-4 --wait > "$TMP/$sched.out"
  job=$(head -1 "$TMP/$sched.out")
  pippy=$("${CTL[@]}" status "$job" --output json | /usr/bin/python3 -c \
          "import json,sys; print(json.load(sys.stdin).get('samples_per_second', 0))")
  GPORT=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  /usr/bin/python3 "$ROOT/bench/daemon_bench_gloo.py" 1 2 "$GPORT" "$TMP/mlp.pt" "$TMP/data.pt" $sched $M $BATCH $STEPS &
  gpid=$!
  gloo=$(/usr/bin/python3 "$ROOT/bench/daemon_bench_gloo.py" 0 2 "$GPORT" "$TMP/mlp.pt" "$TMP/data.pt" $sched $M $BATCH $STEPS)
  wait $gpid
  /usr/bin/python3 - "$sched" "$pippy" "$gloo" "$T1" $M $P $BATCH <<'PY'
import sys
sched, pippy, gloo, t1, m, p, batch = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
ideal = t1 * (m + p - 1) / (m * p)   # seconds per step
measured = batch / pippy if pippy else float("inf")
print(f"{sched:<8} {pippy:16.0f} {ideal / measured:11.0%} {gloo:22.0f} {pippy / gloo:11.2f}x")
PY
done
echo
echo "efficiency = ideal / measured; ideal = single-process step time x (m+p-1)/(m*p) (m=$M, p=$P)"
