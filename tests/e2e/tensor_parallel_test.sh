#!/bin/bash
# Tensor parallelism x pipeline parallelism (x data parallelism) end to end: a real
# pippy-coordinator and real pippy-worker processes on 127.0.0.1. The zoo's Llama
# (separate q/k/v/o projections, a SwiGLU MLP, an Embedding) with every Linear of its
# blocks sharded colwise/rowwise and the embedding by vocabulary:
#   P = 2 x T = 2 (4 workers), 1F1B and ZB1P, AdamW, 20 steps;
#   the same with --replicas 2 (8 workers);
#   an inference job and a serving job.
# Each fetched model (the shards gathered back into the original module structure) is
# checked with /usr/bin/python3 against the unsplit model trained by torch.optim on the
# same micro-batches (max relative difference <= 1e-5); also after a worker holding a
# shard is killed mid-job and the job resumes from its checkpoint. The refusals a submission
# meets: a fused qkv, a plan matching nothing, too few workers.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
CHECK="$PWD/tests/python/check_training.py"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/tp"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"

start_coordinator 0
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
nworkers=0
start_worker() {
  local name="w$nworkers"
  nworkers=$((nworkers + 1))
  "$WORKER" --coordinator "$ADDR" --name "$name" --ucx-tls sm,self --replica-host 127.0.0.1 --wait-timeout-s 30 \
    --threads 1 > "$TMP/$name.log" 2>&1 &
  pids+=($!)
}
json_get() { ctl status "$1" --output json | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print($2)"; }
for _ in 0 1 2 3; do start_worker; done
wait_idle 4 && ok "4 workers registered" || bad "4 workers registered"

PLAN='layers.*.attn.q=colwise,layers.*.attn.k=colwise,layers.*.attn.v=colwise,layers.*.attn.o=rowwise,layers.*.mlp.gate=colwise,layers.*.mlp.up=colwise,layers.*.mlp.down=rowwise,tok_emb=vocab'
OPT=(--optimizer adamw --lr 0.002 --weight-decay 0.01)
train() {  # NAME REFERENCE_MICROBATCHES ARGS...
  local name=$1 ref_m=$2
  shift 2
  if ! ctl submit "$ZOO/llama.pt" --data "$ZOO/llama.data.pt" --batch-size 8 --loss model "${OPT[@]}" --steps 20 \
       --stages 2 --tensor-parallel 2 --tp-plan "$PLAN" "$@" --wait > "$TMP/$name.out" 2>&1; then
    bad "$name: job did not succeed: $(tail -3 "$TMP/$name.out" | tr '\n' ' ')"; return
  fi
  last_job=$(head -1 "$TMP/$name.out")
  if ctl fetch "$last_job" -o "$TMP/$name.pt" > /dev/null &&
     /usr/bin/python3 "$CHECK" "$ZOO/llama.pt" "$ZOO/llama.data.pt" "$TMP/$name.pt" --steps 20 --batch-size 8 \
       --microbatches "$ref_m" --loss model "${OPT[@]}" --tolerance 1e-5 > "$TMP/$name.check" 2>&1; then
    ok "$name: the fetched model equals the unsplit model trained in PyTorch ($(tail -1 "$TMP/$name.check"))"
  else
    bad "$name: $(tail -3 "$TMP/$name.check" | tr '\n' ' ')"
  fi
}
train tp_1f1b 4 --schedule 1f1b --microbatches 4
# The groups in status: shard x stage, each rank's shard in the breakdown.
ctl status "$last_job" > "$TMP/status.txt"
if grep -q "tensor parallel: 2 ranks per stage" "$TMP/status.txt" && grep -q "shard 1: stage 0:" "$TMP/status.txt" &&
   grep -q "(shard 1)" "$TMP/status.txt"; then
  ok "status shows the tensor-parallel groups"
else
  bad "status: $(cat "$TMP/status.txt")"
fi
# Its checkpoint (the state after the last step, each shard's stages linked in) merges to
# the same model.
if ctl fetch "$last_job" --checkpoint -o "$TMP/ckpt.pt" > /dev/null 2> "$TMP/ckpt.err" &&
   /usr/bin/python3 -c "
import sys, torch
a = dict(torch.jit.load('$TMP/tp_1f1b.pt').named_parameters()); b = dict(torch.jit.load('$TMP/ckpt.pt').named_parameters())
sys.exit(0 if a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) else 1)"; then
  ok "fetch --checkpoint gathers the shards into the same model bitwise"
else
  bad "fetch --checkpoint: $(cat "$TMP/ckpt.err")"
fi
ctl trace "$last_job" -o "$TMP/trace.json" > /dev/null 2>&1
slices=$(/usr/bin/python3 -c "import json; print(sum(1 for e in json.load(open('$TMP/trace.json'))['traceEvents'] if e.get('name', '').startswith('tp all-reduce')))" 2>/dev/null)
if grep -q "tensor-parallel all-reduce" "$TMP/status.txt" && [ "${slices:-0}" -gt 0 ]; then
  ok "the group's all-reduces: in each rank's breakdown, $slices slices in the trace"
else
  bad "tp all-reduce: status $(grep -c "tensor-parallel all-reduce" "$TMP/status.txt"), trace slices '${slices}'"
fi
grid=$(ctl workers --output json | /usr/bin/python3 -c \
  "import json,sys; print(sorted((w.get('tp_rank', 0), w.get('rank', 0)) for w in json.load(sys.stdin)['workers']))")
[ "$grid" = "[(0, 0), (0, 1), (1, 0), (1, 1)]" ] && ok "workers: shard x rank $grid" || bad "workers grid: $grid"
train tp_zb1p 4 --schedule zb1p --microbatches 4

# The inference job: its outputs equal the unsplit forward.
if ctl submit "$ZOO/llama.pt" --data "$ZOO/llama.data.pt" --stages 2 --schedule inference --microbatches 2 \
     --batch-size 8 --steps 1 --tensor-parallel 2 --tp-plan "$PLAN" --wait > "$TMP/inference.out" 2>&1 &&
   ctl fetch "$(head -1 "$TMP/inference.out")" -o "$TMP/outputs.pt" > /dev/null &&
   /usr/bin/python3 - "$ZOO/llama.pt" "$ZOO/llama.data.pt" "$TMP/outputs.pt" > "$TMP/inference.check" 2>&1 <<'PY'
import sys, torch
model = torch.jit.load(sys.argv[1])
data = torch.load(sys.argv[2])
got = torch.load(sys.argv[3])
with torch.no_grad():
    want = model(data["inputs"])
d = (got - want).abs().max().item() / want.abs().max().item()
print(f"max relative difference {d:.3g}")
sys.exit(0 if got.shape == want.shape and d <= 1e-5 else 1)
PY
then ok "inference job equals the unsplit forward ($(cat "$TMP/inference.check"))"
else bad "inference job: $(tail -3 "$TMP/inference.out" "$TMP/inference.check" 2>/dev/null | tr '\n' ' ')"; fi

# Refused at submission, exit 2 with the module and the fix.
refused() {  # NAME WANT ARGS...
  local name=$1 want=$2
  shift 2
  ctl submit "$@" > /dev/null 2> "$TMP/$name.err"
  local code=$?
  if [ "$code" = 2 ] && grep -qF -- "$want" "$TMP/$name.err"; then ok "refused: $name"; else
    bad "$name: exit $code, $(cat "$TMP/$name.err")"; fi
}
refused fused-qkv "blocks.0.attn.qkv looks like a fused projection" "$ZOO/gpt.pt" --data "$ZOO/gpt.data.pt" \
  --batch-size 8 --loss model --optimizer sgd --stages 2 --schedule 1f1b --microbatches 2 --steps 1 --tensor-parallel 2 \
  --tp-plan 'blocks.*.attn.qkv=colwise,blocks.*.attn.proj=rowwise'
refused no-match "'layers.*.attn.query' matches no module" "$ZOO/llama.pt" --data "$ZOO/llama.data.pt" \
  --batch-size 8 --loss model --optimizer sgd --stages 2 --schedule 1f1b --microbatches 2 --steps 1 --tensor-parallel 2 \
  --tp-plan 'layers.*.attn.query=colwise'
refused too-few-workers "needs 8 workers" "$ZOO/llama.pt" --data "$ZOO/llama.data.pt" --batch-size 8 --loss model \
  --optimizer sgd --stages 4 --schedule 1f1b --microbatches 4 --steps 1 --tensor-parallel 2 --tp-plan "$PLAN"

# A serving job, P = 2 x T = 2: pippyctl infer answers as the unsplit model.
ctl serve "$ZOO/llama.pt" --stages 2 --example "$ZOO/llama.input.pt" --tensor-parallel 2 --tp-plan "$PLAN" \
  --max-batch 8 --name llama-tp --wait > "$TMP/serve.out" 2> "$TMP/serve.err"
SERVE_JOB=$(head -1 "$TMP/serve.out")
[ "$(json_get "$SERVE_JOB" "j['state']" 2>/dev/null)" = SERVING ] && ok "serve --tensor-parallel 2: SERVING" ||
  bad "serve: $(cat "$TMP/serve.err")"
/usr/bin/python3 -c "import torch; torch.manual_seed(1); torch.save(torch.randint(0, 64, (3, 16)), '$TMP/one.pt')"
if ctl infer llama-tp --input "$TMP/one.pt" -o "$TMP/one.out.pt" > "$TMP/infer.out" 2>&1 &&
   /usr/bin/python3 - "$ZOO/llama.pt" "$TMP" > "$TMP/infer.check" 2>&1 <<'PY'
import sys, torch
m = torch.jit.load(sys.argv[1]); tmp = sys.argv[2]
x = torch.load(f"{tmp}/one.pt"); y = torch.load(f"{tmp}/one.out.pt")
with torch.no_grad():
    want = m(x)
d = ((y - want).abs().max() / want.abs().max()).item()
print(f"max relative difference {d:.3g}")
sys.exit(0 if y.shape == want.shape and d <= 1e-5 else 1)
PY
then ok "pippyctl infer on the tensor-parallel serving job equals the unsplit model ($(cat "$TMP/infer.check"))"
else bad "infer: $(cat "$TMP/infer.out" "$TMP/infer.check" 2>/dev/null | tr '\n' ' ')"; fi
ctl cancel "$SERVE_JOB" > /dev/null
wait_idle 4 || bad "the serving job's workers are idle again"

# x data parallelism: 2 replicas x 2 stages x 2 shards on 8 workers; each replica
# trains on half of every batch, its 2 micro-batches: the reference accumulates 4.
for _ in 4 5 6 7; do start_worker; done
wait_idle 8 && ok "8 workers registered" || bad "8 workers registered"
train tp_dp_1f1b 4 --schedule 1f1b --microbatches 2 --replicas 2

# A lost rank of a tensor-parallel group: a worker holding shard 1 is killed after a
# checkpoint; the job restarts every rank from it (each shard's stages and state) on the
# idle workers and still equals the reference.
declare -A pid_of
for i in $(seq 0 $((nworkers - 1))); do pid_of[w$i]=$(pgrep -f -- "--name w$i " | head -1); done
wait_idle 8
SGD=(--optimizer sgd --momentum 0.9 --lr 0.05)
job=$(ctl submit "$ZOO/llama.pt" --data "$ZOO/llama.data.pt" --batch-size 8 --loss model "${SGD[@]}" --steps 1000 \
  --stages 2 --schedule 1f1b --microbatches 4 --tensor-parallel 2 --tp-plan "$PLAN" --checkpoint-every 20)
for _ in $(seq 300); do [ "$(json_get "$job" "j.get('checkpoint_step', 0) >= 20")" = True ] && break; sleep 0.1; done
victim=$(ctl workers --output json | /usr/bin/python3 -c \
  "import json,sys; print(next(w['name'] for w in json.load(sys.stdin)['workers'] if w.get('tp_rank', 0) == 1 and w.get('job_id') == '$job'))")
at_kill=$(json_get "$job" "j['state'], j.get('step', 0)")
kill -9 "${pid_of[$victim]}"
ctl watch "$job" > "$TMP/recover.out" 2>&1
state=$(json_get "$job" "j['state'], j.get('restarts', 0)")
if [[ "$state" == "SUCCEEDED 1" ]] && ctl fetch "$job" -o "$TMP/recovered.pt" > /dev/null 2>&1 &&
   /usr/bin/python3 "$CHECK" "$ZOO/llama.pt" "$ZOO/llama.data.pt" "$TMP/recovered.pt" --steps 1000 --batch-size 8 \
     --microbatches 4 --loss model "${SGD[@]}" --tolerance 1e-5 > "$TMP/recovered.check" 2>&1; then
  ok "shard-1 worker $victim killed: the job resumed from its checkpoint ($state) and equals the reference ($(tail -1 "$TMP/recovered.check"))"
else
  bad "resume: $state (worker '$victim' killed at $at_kill) $(json_get "$job" "j.get('reason'), j.get('history')") $(tail -2 "$TMP/recovered.check" 2>/dev/null)"
fi
finish
