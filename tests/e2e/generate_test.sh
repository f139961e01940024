#!/bin/bash
# Generation end to end: a real pippy-coordinator and 7 real pippy-worker processes on
# 127.0.0.1. The example generation model (examples/models/gen_lm.py: gpt-fast-style
# KV caches [slots, heads, seq, head_dim]) is served with --generate in 2 and in 3
# stages; 16 concurrent clients on each (prompts of 3-40 tokens, 1-64 new tokens) get
# the tokens of the unsplit model's greedy loop and of full recomputation
# (generate_clients.py). Then: seeded sampling, stop tokens, a cancelled request's slot
# reused, the queue's bound, refusals (a prompt past max_seq, a token outside the
# vocabulary, a model without a slot dimension, a cut between a cache's write and its
# reads), /metrics and status, a lost worker (sequences in flight fail UNAVAILABLE, the
# job serves again), and cancel.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
GEN="$PWD/examples/models/gen"
GEN_LM="$PWD/examples/models/gen_lm.py"
CLIENTS="$PWD/tests/e2e/generate_clients.py"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/generate"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"
export OPENBLAS_NUM_THREADS=1

METRICS_PORT=$(free_port)
start_coordinator 0 --metrics-port "$METRICS_PORT"
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
declare -A worker_pid
for i in 0 1 2 3 4 5 6; do
  "$WORKER" --coordinator "$ADDR" --name "w$i" --device cpu --ucx-tls sm,self --threads 1 --wait-timeout-s 20 \
    > "$TMP/w$i.log" 2>&1 &
  pids+=($!)
  worker_pid[w$i]=$!
done
json_get() { ctl status "$1" --output json | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print($2)"; }
wait_idle 7 && ok "7 workers registered" || bad "7 workers registered"
# The reference: the unsplit model's greedy loop (gen_lm.greedy_cached), in this process.
reference() {  # PROMPT(1,2,3) NEW
  /usr/bin/python3 - "$GEN_LM" "$GEN/gen_lm.pt" "$1" "$2" <<'PY'
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("gen_lm", sys.argv[1]); g = importlib.util.module_from_spec(spec)
spec.loader.exec_module(g)
m = torch.jit.load(sys.argv[2]); m.eval()
print(" ".join(str(t) for t in g.greedy_cached(m, [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4]))))
PY
}

# Refused before anything is placed: a cut that would copy a written cache into two
# stages (a cache shared by two layers, as cross-layer KV sharing does: written by the
# first, read by the second); a model whose written buffer has no slot dimension.
cat > "$TMP/shared.py" <<'PY'
import sys, torch
class Writer(torch.nn.Module):
    def __init__(self, cache):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("cache", cache)
    def forward(self, x, input_pos, slots):
        y = self.lin(x)
        self.cache[slots.unsqueeze(1).expand(y.size(0), y.size(1)), input_pos] = y
        return y
class Reader(torch.nn.Module):
    def __init__(self, cache):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("cache", cache)
    def forward(self, x, slots):
        return self.lin(x) + self.cache[slots].sum(1, keepdim=True)
class Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        cache = torch.zeros(4, 16, 8)
        self.emb = torch.nn.Embedding(16, 8)
        self.first = Writer(cache)
        self.second = Reader(cache)
    def forward(self, idx, input_pos, slots):
        return self.second(self.first(self.emb(idx), input_pos, slots), slots)
torch.jit.script(Shared()).save(f"{sys.argv[1]}/shared.pt")
torch.save((torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), torch.tensor([0])), f"{sys.argv[1]}/shared.input.pt")
PY
/usr/bin/python3 "$TMP/shared.py" "$TMP"  # from a file: torch.jit.script reads the classes' source
ctl split "$TMP/shared.pt" --example-input "$TMP/shared.input.pt" --split-at second > /dev/null 2> "$TMP/cut.err"
code=$?
[ "$code" = 2 ] && grep -q "buffer 'first.cache' is modified in place by forward() and read by stages 0 and 1" \
  "$TMP/cut.err" && ok "a cut that would copy a written cache into two stages is refused: $(head -c 200 "$TMP/cut.err")" \
  || bad "cut through a shared cache: exit $code $(cat "$TMP/cut.err")"
ctl split "$TMP/shared.pt" --example-input "$TMP/shared.input.pt" --split-at first > /dev/null 2> "$TMP/cut_ok.err" \
  && ok "the same model cut before the layers that share the cache splits" || bad "cut before: $(cat "$TMP/cut_ok.err")"
cat > "$TMP/noslots.py" <<'PY'
import sys, torch
class NoSlots(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.register_buffer("cache", torch.zeros(32, 8))  # [max_seq, d]: no slot dimension
    def forward(self, idx, input_pos, slots):
        x = self.emb(idx)
        self.cache[input_pos[0]] = x[0]
        return x @ self.emb.weight.t()
torch.jit.script(NoSlots()).save(f"{sys.argv[1]}/noslots.pt")
torch.save((torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), torch.tensor([0])), f"{sys.argv[1]}/noslots.input.pt")
PY
/usr/bin/python3 "$TMP/noslots.py" "$TMP"  # from a file: torch.jit.script reads the class's source
ctl serve "$TMP/noslots.pt" --generate --stages 1 --example "$TMP/noslots.input.pt" --wait > /dev/null 2> "$TMP/noslots.err"
grep -q "'cache' (shape \[32, 8\]) is written by forward() but is not a cache with a slot dimension" "$TMP/noslots.err" \
  && ok "a model whose cache has no slot dimension is refused naming the buffer" \
  || bad "no slot dimension: $(cat "$TMP/noslots.err")"

ctl serve "$GEN/gen_lm.pt" --generate --stages 2 --example "$GEN/gen_lm.input.pt" --name gen2 --wait \
  > "$TMP/serve2.out" 2> "$TMP/serve2.err"
JOB2=$(head -1 "$TMP/serve2.out")
ctl serve "$GEN/gen_lm.pt" --generate --stages 3 --example "$GEN/gen_lm.input.pt" --prefill-chunk 16 --name gen3 \
  --wait > "$TMP/serve3.out" 2> "$TMP/serve3.err"
JOB3=$(head -1 "$TMP/serve3.out")
s2=$(json_get "$JOB2" "j['state']" 2>/dev/null)
s3=$(json_get "$JOB3" "j['state']" 2>/dev/null)
[ "$s2" = SERVING ] && [ "$s3" = SERVING ] && ok "serve --generate in 2 and 3 stages: $JOB2, $JOB3 SERVING" \
  || bad "serve --generate: $s2 $s3 $(cat "$TMP/serve2.err" "$TMP/serve3.err")"
slots=$(ctl status "$JOB2" | grep "generation:")
echo "$slots" | grep -q "8 slots of 128 positions, prefill chunks of 64 tokens" && ok "status:$slots" \
  || bad "status: $slots"

# 16 concurrent clients on each job at once, every sequence checked.
/usr/bin/python3 "$CLIENTS" "$ADDR" gen2 "$GEN/gen_lm.pt" "$GEN_LM" --clients 16 --seed 1 > "$TMP/clients2.out" 2>&1 &
c2=$!
/usr/bin/python3 "$CLIENTS" "$ADDR" gen3 "$GEN/gen_lm.pt" "$GEN_LM" --clients 16 --seed 2 > "$TMP/clients3.out" 2>&1
r3=$?
wait $c2
r2=$?
[ "$r2" = 0 ] && ok "2 stages: $(tail -1 "$TMP/clients2.out")" || bad "2 stages: $(cat "$TMP/clients2.out")"
[ "$r3" = 0 ] && ok "3 stages (prefill chunks of 16): $(tail -1 "$TMP/clients3.out")" \
  || bad "3 stages: $(cat "$TMP/clients3.out")"

# pippyctl generate: greedy tokens as the reference gives them; a stop token ends early.
want=$(reference 1,2,3 8)
got=$(ctl generate gen2 --tokens 1,2,3 --max-new-tokens 8 2> "$TMP/gen.err")
[ -n "$want" ] && [ "$got" = "$want" ] && ok "pippyctl generate: $got ($(cat "$TMP/gen.err"))" \
  || bad "pippyctl generate: '$got' want '$want' $(cat "$TMP/gen.err")"
stop=$(echo "$want" | cut -d' ' -f3)
want_stop=$(echo "$want" | tr ' ' '\n' | awk -v s="$stop" '{print} $1==s {exit}' | tr '\n' ' ' | sed 's/ $//')
got=$(ctl generate gen3 --tokens 1,2,3 --max-new-tokens 8 --stop-token "$stop" 2> "$TMP/stop.err")
[ "$got" = "$want_stop" ] && grep -q "; stop;" "$TMP/stop.err" \
  && ok "--stop-token $stop ends the sequence after it: $got" || bad "stop token: '$got' want '$want_stop' $(cat "$TMP/stop.err")"
# Seeded sampling: the same seed gives the same tokens, run to run and on either split.
a=$(ctl generate gen2 --tokens 5,6,7 --max-new-tokens 24 --temperature 0.8 --top-k 20 --seed 42 2> /dev/null)
b=$(ctl generate gen2 --tokens 5,6,7 --max-new-tokens 24 --temperature 0.8 --top-k 20 --seed 42 2> /dev/null)
c=$(ctl generate gen3 --tokens 5,6,7 --max-new-tokens 24 --temperature 0.8 --top-k 20 --seed 42 2> /dev/null)
d=$(ctl generate gen2 --tokens 5,6,7 --max-new-tokens 24 --temperature 0.8 --top-k 20 --seed 43 2> /dev/null)
greedy=$(reference 5,6,7 24)
[ -n "$a" ] && [ "$a" = "$b" ] && [ "$a" = "$c" ] && [ "$a" != "$d" ] && [ "$a" != "$greedy" ] \
  && ok "--temperature 0.8 --top-k 20 --seed 42: the same 24 tokens twice and on 3 stages; seed 43 and greedy differ" \
  || bad "sampling: a='$a' b='$b' c='$c' d='$d' greedy='$greedy'"

# Refusals, while the jobs go on.
long=$(seq -s, 1 129 | sed 's/[0-9]\+/1/g')
ctl generate gen2 --tokens "$long" > /dev/null 2> "$TMP/long.err"
code=$?  # 2: INVALID_ARGUMENT
[ "$code" = 2 ] && grep -q "129 tokens, more than the job's max_seq (128" "$TMP/long.err" \
  && ok "a prompt longer than max_seq is INVALID_ARGUMENT (exit 2): $(cat "$TMP/long.err")" \
  || bad "long prompt: exit $code $(cat "$TMP/long.err")"
ctl generate gen2 --tokens 1,96 > /dev/null 2> "$TMP/vocab.err"
code=$?
[ "$code" = 2 ] && grep -q "token 1 is 96, outside the vocabulary \[0, 96)" "$TMP/vocab.err" \
  && ok "a token outside the vocabulary is INVALID_ARGUMENT (exit 2) naming it" || bad "vocab: exit $code $(cat "$TMP/vocab.err")"
printf '\x80\x02}q\x00.' > "$TMP/in.pt"
ctl infer gen2 --input "$TMP/in.pt" -o "$TMP/x.pt" > /dev/null 2> "$TMP/infer.err"
grep -q "is a generation job: use pippyctl generate" "$TMP/infer.err" && ok "Infer on a generation job is refused" \
  || bad "infer on generation: $(cat "$TMP/infer.err")"

# One slot and one waiting request at most: a cancelled sequence's slot goes to the next,
# a third request is RESOURCE_EXHAUSTED, a deadline that passes frees the slot too.
ctl serve "$GEN/gen_lm.pt" --generate --stages 1 --example "$GEN/gen_lm.input.pt" --max-slots 1 --max-queued 1 \
  --name gen1 --wait > "$TMP/serve1.out" 2> "$TMP/serve1.err"
JOB1=$(head -1 "$TMP/serve1.out")
want=$(reference 9,8,7 6)
if /usr/bin/python3 - "$ADDR" "$want" "$JOB1" > "$TMP/slots.out" 2>&1 <<'PY'
import os, sys, threading, time, grpc
sys.path.insert(0, os.path.join(os.getcwd(), "client", "python"))
import pippy
addr, want, job = sys.argv[1], [int(t) for t in sys.argv[2].split()], sys.argv[3]
with pippy.Client(addr, timeout_s=60) as c:
    first = c.generate("gen1", [1, 2, 3], max_new_tokens=120, timeout_s=120)
    head = [next(first), next(first)]           # it holds the only slot
    got = {}
    def second():
        got["tokens"] = list(c.generate("gen1", [9, 8, 7], max_new_tokens=6, timeout_s=120))
    t = threading.Thread(target=second)
    t.start()
    waiting = 0
    for _ in range(100):  # until the second waits for the slot
        waiting = c.status(job)["serving"].get("generation", {}).get("waiting", 0)
        if waiting == 1:
            break
        time.sleep(0.05)
    try:
        list(c.generate("gen1", [4, 5], max_new_tokens=2, timeout_s=30))
        print("a third request was taken")
        sys.exit(1)
    except pippy.PippyError as e:
        third = e.code
    busy = waiting == 1 and "tokens" not in got
    first.close()                                # cancelled: its slot goes to the second
    t.join(timeout=60)
    ok = busy and third == grpc.StatusCode.RESOURCE_EXHAUSTED and got.get("tokens") == want
    print(f"the second waited while the first held the slot: {busy}; a third: {third.name}; "
          f"after the first was cancelled the second got {got.get('tokens')}")
    sys.exit(0 if ok else 1)
PY
then ok "slots: $(cat "$TMP/slots.out")"; else bad "slots: $(cat "$TMP/slots.out")"; fi
# 120 tokens take longer than 50 ms (about 1 ms a token here): the deadline passes
# mid-sequence. Under load the request may not reach the coordinator within a short
# deadline, or a long one may outlast the sequence: a few deadlines are tried until one
# passed mid-sequence (the call ends DEADLINE_EXCEEDED and the job counts the sequence
# failed).
passed_mid=""
for deadline in 0.05 0.1 0.03 0.2 0.02; do
  failed_before=$(json_get "$JOB1" "int(j['serving']['generation'].get('failed', 0))")
  ctl generate gen1 --tokens 1,2,3 --max-new-tokens 120 --timeout-s "$deadline" > /dev/null 2> "$TMP/deadline.err"
  sleep 0.2  # the scheduler's next pass frees the slot
  failed_after=$(json_get "$JOB1" "int(j['serving']['generation'].get('failed', 0))")
  if grep -qi "deadline" "$TMP/deadline.err" && [ "$failed_after" = "$((failed_before + 1))" ]; then
    passed_mid="$deadline"
    break
  fi
done
got=$(ctl generate gen1 --tokens 9,8,7 --max-new-tokens 6 --timeout-s 30 2> "$TMP/after.err")
inuse=$(json_get "$JOB1" "j['serving']['generation'].get('slots_in_use', 0)")
[ -n "$passed_mid" ] && [ "$got" = "$want" ] && [ "$inuse" = 0 ] \
  && ok "a request whose deadline ($passed_mid s) passed mid-sequence ends, counted failed, and the next gets its slot: $got" \
  || bad "deadline: $(cat "$TMP/deadline.err") next '$got' $(cat "$TMP/after.err") slots in use $inuse"
ctl cancel "$JOB1" > /dev/null

# /metrics (Prometheus' own parser) and status.
if /usr/bin/python3 - "$METRICS_PORT" "$JOB2" > "$TMP/metrics.out" 2>&1 <<'PY'
import sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
port, job = sys.argv[1:3]
with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
    fams = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
def value(fam, suffix="", **labels):
    return sum(s.value for s in fams[fam].samples if s.name == fam + suffix
               and all(s.labels.get(k) == v for k, v in labels.items()))
seqs = value("pippy_generation_sequences", "_total", job=job, outcome="ok")
ttft = value("pippy_generation_time_to_first_token_seconds", "_count", job=job)
itl = value("pippy_generation_inter_token_seconds", "_count", job=job)
tokens = value("pippy_generation_tokens", "_total", job=job)
assert fams["pippy_generation_time_to_first_token_seconds"].type == "histogram"
assert seqs >= 34 and ttft >= seqs and tokens == ttft + itl, (seqs, ttft, itl, tokens)
assert value("pippy_generation_slots", job=job) == 8
assert "pippy_generation_tokens_per_second" in fams and "pippy_generation_slots_in_use" in fams
print(f"{seqs:.0f} sequences, {tokens:.0f} tokens = {ttft:.0f} first + {itl:.0f} inter-token latencies")
PY
then ok "/metrics: $(cat "$TMP/metrics.out")"; else bad "metrics: $(cat "$TMP/metrics.out")"; fi
st=$(ctl status "$JOB2")
echo "$st" | grep -q "time to first token p50" && echo "$st" | grep -q "micro-batches: [1-9][0-9]* prefill, [1-9]" \
  && ok "status: $(echo "$st" | grep -E "time to first|micro-batches:" | tr -s ' ' | tr '\n' ';')" \
  || bad "status: $st"

# The trace: the last micro-batches, prefill and decode, two in flight at once.
ctl trace "$JOB2" -o "$TMP/trace.json" > /dev/null 2> "$TMP/trace.err"
if /usr/bin/python3 - "$TMP/trace.json" > "$TMP/trace.out" 2>&1 <<'PY'
import json, sys
ev = [e for e in json.load(open(sys.argv[1]))["traceEvents"] if e["ph"] == "X"]
cats = {c: sum(e["cat"] == c for e in ev) for c in ("prefill", "decode")}
lanes = {e["tid"] for e in ev}
assert cats["prefill"] > 0 and cats["decode"] > 0 and len(lanes) >= 2, (cats, lanes)
print(f"{cats['prefill']} prefill and {cats['decode']} decode micro-batches on {len(lanes)} lanes in flight")
PY
then ok "pippyctl trace: $(cat "$TMP/trace.out")"; else bad "trace: $(cat "$TMP/trace.err" "$TMP/trace.out")"; fi

# A worker of the 2-stage job dies while sequences are in flight: they fail UNAVAILABLE,
# the job is placed again (on the spare worker) and generates as before.
victim=$(ctl workers --output json | /usr/bin/python3 -c "
import json,sys
ws=[w for w in json.load(sys.stdin)['workers'] if w.get('job_id')=='$JOB2' and w.get('rank', 0)==1]
print(ws[0]['name'] if ws else '')")
/usr/bin/python3 - "$ADDR" "$TMP" > "$TMP/lost.out" 2>&1 <<'PY' &
import os, sys, threading, grpc
sys.path.insert(0, os.path.join(os.getcwd(), "client", "python"))
import pippy
addr, tmp = sys.argv[1:3]
codes, stop = [], threading.Event()
def run(i):
    # Sequence after sequence until one fails (the worker dies under one of them).
    with pippy.Client(addr, timeout_s=60) as c:
        for k in range(100):
            if stop.is_set():
                return
            try:
                it = c.generate("gen2", [1 + i, 2, 3], max_new_tokens=120, timeout_s=120)
                next(it)
                open(f"{tmp}/lost.ready", "w").close()
                list(it)
            except pippy.PippyError as e:
                codes.append(e.code.name)
                stop.set()
                return
threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(" ".join(sorted(codes)) if codes else "none failed")
PY
lost=$!
for _ in $(seq 300); do [ -e "$TMP/lost.ready" ] && break; sleep 0.05; done
[ -n "$victim" ] && kill -9 "${worker_pid[$victim]}" 2>/dev/null
wait $lost
codes=$(cat "$TMP/lost.out")
echo "$codes" | grep -q "UNAVAILABLE" && [ -z "$(echo "$codes" | tr ' ' '\n' | grep -v "^UNAVAILABLE$")" ] \
  && ok "sequences in flight when $victim died fail UNAVAILABLE: $codes" || bad "lost worker ($victim): $codes"
state=""
for _ in $(seq 300); do
  state=$(json_get "$JOB2" "j['state'] + ' ' + str(j.get('restarts', 0))" 2>/dev/null)
  [ "${state%% *}" = SERVING ] && [ "${state##* }" != 0 ] && break
  sleep 0.1
done
want=$(reference 4,4,4 10)
got=$(ctl generate gen2 --tokens 4,4,4 --max-new-tokens 10 2> /dev/null)
[ "${state%% *}" = SERVING ] && [ "$got" = "$want" ] \
  && ok "the job serves again (restarts: ${state##* }) and generates as the reference: $got" \
  || bad "after the loss: state '$state', '$got' want '$want'"

ctl cancel "$JOB2" > /dev/null
ctl cancel "$JOB3" > /dev/null
ctl generate gen3 --tokens 1,2 > /dev/null 2> "$TMP/ended.err"
grep -q "generation job $JOB3 ended (CANCELLED" "$TMP/ended.err" && ok "after cancel, generate is refused: $(head -c 120 "$TMP/ended.err")" \
  || bad "after cancel: $(cat "$TMP/ended.err")"
finish
