#!/bin/bash
# What a new user meets, with real daemons: a second coordinator on a port in use, and a
# worker whose health port is taken, exit 2 naming the port and the process holding it;
# a job that fails with a multi-line traceback keeps `pippyctl list` one line per job
# (its whole reason in `status`); jobs are found by name as well as id (status, fetch,
# cancel); --output json parses, keeps zero fields and gives 64-bit integers as numbers,
# `list` summaries without plans or loss arrays, errors as JSON on stderr; `infer`
# without -o says the output was not kept.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/new_user"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

start_coordinator 0
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
HEALTH=$(free_port)
for i in 0 1; do
  h=()
  [ "$i" = 0 ] && h=(--health-port "$HEALTH")
  "$WORKER" --coordinator "$ADDR" --name "w$i" --ucx-tls sm,self --wait-timeout-s 30 "${h[@]}" > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
done
wait_idle 2 && ok "2 workers registered" || bad "2 workers registered: $(idle_workers) idle"

# 1. Ports in use: refused, named, with their holder.
"$COORD" --port "$PORT" --state-dir "$TMP/state2" > "$TMP/second.out" 2>&1
rc=$?
if [ "$rc" = 2 ] && grep -q -- "--port $PORT: cannot listen on 127.0.0.1:$PORT: in use by pid $coord_pid (pippy-coordinat)" "$TMP/second.out"; then
  ok "a second coordinator on port $PORT exits 2: $(grep -o "pippy-coordinator: --port.*" "$TMP/second.out" | cut -c1-140)"
else
  bad "second coordinator: exit $rc, $(tail -2 "$TMP/second.out")"
fi
timeout 20 "$WORKER" --coordinator "$ADDR" --name dup --health-port "$HEALTH" > "$TMP/dup.out" 2>&1
rc=$?
if [ "$rc" = 2 ] && grep -q -- "--health-port $HEALTH: the port is in use by pid [0-9]* (pippy-worker)" "$TMP/dup.out"; then
  ok "a worker on a health port in use exits 2: $(grep -o "pippy-worker: --health-port.*" "$TMP/dup.out" | cut -c1-120)"
else
  bad "worker on a used health port: exit $rc, $(tail -2 "$TMP/dup.out")"
fi

# 2. A job that fails on the workers with a TorchScript traceback (its data's last
#    rows make its forward raise; the preparation's probe saw only the first rows).
cat > "$TMP/make.py" <<'PY'
import sys, torch
tmp = sys.argv[1]
class Picky(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    def forward(self, x):
        if bool(x.abs().max() > 100.0):
            raise RuntimeError("picky: an input above 100")
        return self.b(torch.relu(self.a(x)))
torch.jit.script(Picky()).save(f"{tmp}/picky.pt")
x = torch.randn(64, 8)
x[40:] = 1000.0
torch.save({"inputs": x, "targets": torch.randn(64, 8)}, f"{tmp}/picky.data.pt")
PY
/usr/bin/python3 "$TMP/make.py" "$TMP"
SPEC=(--stages 2 --schedule 1f1b --microbatches 2 --batch-size 16 --steps 4 --loss mse --optimizer sgd)
ctl submit "$TMP/picky.pt" --data "$TMP/picky.data.pt" "${SPEC[@]}" --name picky --wait > /dev/null 2>&1
ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" "${SPEC[@]}" --name mlp-run --wait > /dev/null 2> "$TMP/mlp.err" ||
  bad "the normal job: $(cat "$TMP/mlp.err")"
ctl list > "$TMP/list.out"
lines=$(wc -l < "$TMP/list.out")
widest=$(awk '{ if (length($0) > w) w = length($0) } END { print w }' "$TMP/list.out")
reason_lines=$(ctl status picky | sed -n '/reason, whole:/,$p' | wc -l)
if [ "$(ctl status picky --output json | /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin)['state'])")" = FAILED ] &&
   [ "$lines" = 4 ] && [ "$widest" -le 200 ] && [ "$reason_lines" -ge 3 ]; then
  ok "a failed job's traceback: list stays 1 line per job ($lines lines, the widest $widest characters); status shows it whole ($reason_lines lines)"
else
  bad "list with a traceback: $lines lines, widest $widest, status reason lines $reason_lines"; cat "$TMP/list.out"
fi

# 3. Names where ids go: status, fetch, cancel.
if ctl status mlp-run | head -1 | grep -q "^job job-[0-9]* (mlp-run): SUCCEEDED" && ctl fetch mlp-run -o "$TMP/mlp.trained.pt" > /dev/null &&
   [ -s "$TMP/mlp.trained.pt" ]; then
  ok "status and fetch take the job's name: $(ctl status mlp-run | head -1)"
else
  bad "names: $(ctl status mlp-run 2>&1 | head -1)"
fi
ctl fetch picky -o "$TMP/picky.trained.pt" > /dev/null 2> "$TMP/fetchfailed.err"
rc=$?
[ "$rc" = 2 ] && grep -q "ended FAILED: only a job that SUCCEEDED has a trained model to fetch" "$TMP/fetchfailed.err" &&
  ok "fetch of a failed job says why: $(cut -c1-120 "$TMP/fetchfailed.err")" || bad "fetch of a failed job: exit $rc, $(cat "$TMP/fetchfailed.err")"
ctl status no-such-name > /dev/null 2> "$TMP/noname.err"
rc=$?
[ "$rc" = 2 ] && grep -q "no job 'no-such-name': neither a job's id nor its name" "$TMP/noname.err" &&
  ok "an unknown name: $(cat "$TMP/noname.err")" || bad "unknown name: exit $rc, $(cat "$TMP/noname.err")"

# 4. --output json for programs.
ctl status mlp-run --output json > "$TMP/status.json"
ctl list --output json > "$TMP/list.json"
ctl status no-such-name --output json 2> "$TMP/err.json" > /dev/null
if /usr/bin/python3 - "$TMP/status.json" "$TMP/list.json" "$TMP/err.json" <<'PY'
import json, sys
status, listed, err = (json.load(open(p)) for p in sys.argv[1:4])
# Zero fields are there, 64-bit integers are numbers.
assert status["restarts"] == 0 and status["attempt"] == 0, status
assert isinstance(status["model_bytes"], int) and status["model_bytes"] > 0, status["model_bytes"]
assert isinstance(status["created_unix_ms"], int)
stages = status["plan"]["stages"]
assert stages[0]["index"] == 0 and stages[1]["index"] == 1, [s.get("index") for s in stages]
assert len(status["losses"]) == 4
# list: summaries (no plan, no loss arrays), every job.
jobs = listed["jobs"]
assert len(jobs) == 2 and all("plan" not in j and j["losses"] == [] for j in jobs), jobs[0].keys()
assert all(isinstance(j["step"], int) for j in jobs)
# Errors: one JSON object on stderr.
assert err["error"]["code"] == "NOT_FOUND" and "no-such-name" in err["error"]["message"], err
print(f"status {len(json.dumps(status))} bytes, list {len(json.dumps(listed))} bytes for 2 jobs")
PY
then
  ok "--output json: zero fields kept, integers as numbers, list as summaries, errors as JSON"
else
  bad "--output json: $(head -c 300 "$TMP/list.json")"
fi
# 5. Every command's JSON against docs/cli.md's table (its keys and their types).
JOB_ID=$(ctl status mlp-run --output json | /usr/bin/python3 -c "import json,sys; print(json.load(sys.stdin)['job_id'])")
{
  echo "submit"; ctl --output json submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" "${SPEC[@]}" --name json-run
  echo "watch"; ctl --output json watch json-run | tail -1
  echo "status"; ctl --output json status "$JOB_ID"
  echo "list"; ctl --output json list
  echo "workers"; ctl --output json workers
  echo "fetch"; ctl --output json fetch "$JOB_ID" -o "$TMP/fetched.pt"
  echo "trace"; ctl --output json trace "$JOB_ID" -o "$TMP/trace.json"
  echo "health"; ctl --output json health
  echo "schedule"; ctl --output json schedule --schedule 1f1b --ranks 2 --microbatches 4
  echo "split"; ctl --output json split "$ZOO/mlp.pt" --stages 2 | tr -d '\n'; echo
  echo "split --list-cuts"; ctl --output json split "$ZOO/mlp.pt" --list-cuts
  echo "delete"; ctl --output json delete json-run
} > "$TMP/outputs.txt" 2> "$TMP/outputs.err"
if /usr/bin/python3 - "$PWD/docs/cli.md" "$TMP/outputs.txt" <<'PY'
import json, re, sys
doc, outputs = sys.argv[1:3]
types = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}
table = {}
for line in open(doc):
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 3 or not cells[0].startswith("`"):
        continue
    keys = dict(re.findall(r"(\w+) \((\w+)\)", cells[2]))
    for command in re.findall(r"`([^`]+)`", cells[0]):
        table[command] = keys
lines = open(outputs).read().splitlines()
checked = 0
for name, out in zip(lines[0::2], lines[1::2]):
    keys = table[name]
    obj = json.loads(out)
    for k, t in keys.items():
        assert k in obj, f"{name}: no key {k!r} in {sorted(obj)}"
        v = obj[k]
        ok = isinstance(v, types[t]) and not (t in ("integer", "number") and isinstance(v, bool))
        assert ok, f"{name}: {k} is {type(v).__name__} {v!r}, docs/cli.md says {t}"
    checked += 1
assert checked == 12, checked
print(f"{checked} commands match docs/cli.md ({len(table)} documented)")
PY
then
  ok "every command's JSON has docs/cli.md's keys with their types"
else
  bad "JSON against docs/cli.md: $(tail -3 "$TMP/outputs.err")"
fi
# 6. Accepted, but probably not meant: said at submission (and in the job's history).
ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --stages 2 --schedule zbv --microbatches 2 --batch-size 16 --steps 2 \
  --loss mse --optimizer sgd --wait > /dev/null 2> "$TMP/zbv.err"
rc_zbv=$?
ctl submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --stages 2 --schedule 1f1b --microbatches 2 --batch-size 32 --steps 1 \
  --loss mse --optimizer sgd > /dev/null 2> "$TMP/big.err"
if [ "$rc_zbv" = 0 ] && grep -q "note: schedule zbv runs 2 stages per worker: the 2 stages use 1 of the 2 registered workers; --stages 4 would use 2" "$TMP/zbv.err" &&
   grep -q "note: --batch-size 32 is more than the data's 16 samples" "$TMP/big.err"; then
  ok "notices: $(grep -o 'note: .*' "$TMP/zbv.err" | cut -c1-100); $(grep -o 'note: .*' "$TMP/big.err" | cut -c1-80)"
else
  bad "notices: zbv exit $rc_zbv ($(cat "$TMP/zbv.err")); big batch: $(cat "$TMP/big.err")"
fi
finish
