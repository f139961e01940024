#!/bin/bash
# Auto plans end to end: a real pippy-coordinator and 2 real pippy-worker processes on
# 127.0.0.1. The zoo's GPT submitted with --schedule/--microbatches/--stages auto: the
# coordinator measures it, chooses, and the job trains; the fetched model is checked with
# /usr/bin/python3 against the unsplit model trained with the micro-batches auto chose.
# Then --microbatches auto alone (the rest kept as given, the choice calibrated by what
# the first job's steps took on the workers); a BatchNorm1d model that cannot
# run one-sample micro-batches (that size is left out, saying why); --explain and status;
# the refusals; `pippyctl plan` offline and `pippyctl split --profile`.
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
CHECK="$PWD/tests/python/check_training.py"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/autoplan"
rm -rf "$TMP" && mkdir -p "$TMP"
source "$PWD/tests/e2e/testlib.sh"
export OPENBLAS_NUM_THREADS=1

start_coordinator 0
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
for name in w0 w1; do
  "$WORKER" --coordinator "$ADDR" --name "$name" --ucx-tls sm,self --threads 1 > "$TMP/$name.log" 2>&1 &
  pids+=($!)
done
wait_idle 2 && ok "2 workers registered" || bad "2 workers registered: $(ctl workers 2>&1 | tail -3)"
# pyget FILE EXPR: EXPR over the JSON in FILE as j.
pyget() { /usr/bin/python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print($2)" "$1"; }

/usr/bin/python3 - "$ZOO" "$TMP" <<'PY'
import sys, torch
zoo, tmp = sys.argv[1:3]
torch.save({"inputs": torch.load(f"{zoo}/gpt.input.pt"), "targets": torch.load(f"{zoo}/gpt.target.pt")}, f"{tmp}/gpt.data.pt")
torch.manual_seed(0)
bn = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
torch.jit.script(bn).save(f"{tmp}/bn.pt")
torch.save({"inputs": torch.randn(8, 16), "targets": torch.randn(8, 4)}, f"{tmp}/bn.data.pt")
PY
TRAIN=(--batch-size 8 --loss model --optimizer sgd --momentum 0.9 --lr 0.05 --steps 4)

# equal NAME JOB MODEL DATA LOSS: the fetched model against the unsplit one trained with
# the micro-batches the job's spec holds (chosen or given).
equal() {
  local name=$1 job=$2 model=$3 data=$4 loss=$5
  ctl status "$job" --output json > "$TMP/$name.json"
  local m
  m=$(pyget "$TMP/$name.json" "j['spec']['schedule']['microbatches']")
  ctl fetch "$job" -o "$TMP/$name.trained.pt" > /dev/null &&
    /usr/bin/python3 "$CHECK" "$model" "$data" "$TMP/$name.trained.pt" --steps 4 --batch-size 8 --microbatches "$m" \
      --loss "$loss" --optimizer sgd --momentum 0.9 --lr 0.05 --tolerance 1e-6 > "$TMP/$name.check" 2>&1
}

# 1. Everything auto, with --explain.
ctl submit "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" "${TRAIN[@]}" --schedule auto --microbatches auto --stages auto \
  --explain --wait > "$TMP/all.out" 2> "$TMP/all.err"
rc=$?
job=$(head -1 "$TMP/all.out")
[ "$rc" = 0 ] && ok "all auto: the job succeeded" || bad "all auto: rc $rc: $(tail -3 "$TMP/all.err")"
rows=$(grep -cE '^[0-9]+ +(gpipe|1f1b|interleaved-1f1b|zb1p|zbv) ' "$TMP/all.err")
if grep -q "^#  *schedule  *micro-batches  *stages  *workers  *samples/s  *bubble  *peak/rank" "$TMP/all.err" &&
   [ "$rows" -ge 10 ] && grep -qE '^1 .* chosen$' "$TMP/all.err" && grep -q "^why: " "$TMP/all.err" &&
   grep -q "best other schedule" "$TMP/all.err" && grep -q "best other micro-batch count" "$TMP/all.err"; then
  ok "--explain: $rows candidates ranked, the first chosen, and why"
else
  bad "--explain: $(cat "$TMP/all.err")"
fi
if equal all "$job" "$ZOO/gpt.pt" "$TMP/gpt.data.pt" model; then
  ok "all auto: equals the unsplit model with the chosen micro-batches"
else
  bad "all auto: not equal: $(tail -3 "$TMP/all.check")"
fi
# The chosen values are the spec's; the chosen candidate is within 2% of the fastest
# (a simpler plan may win a tie), every candidate predicted a positive rate, and the
# profile covers sizes 1 to 8.
verdict=$(pyget "$TMP/all.json" "(lambda c, s: 'ok' if (
    c['chosen'] == ['schedule', 'microbatches', 'stages'] and
    c['candidates'][0]['schedule'] == s['schedule']['kind'] and
    c['candidates'][0]['microbatches'] == s['schedule']['microbatches'] and
    c['candidates'][0]['stages'] == len(j['plan']['stages']) and
    c['candidates'][0]['samples_per_second'] >= 0.98 * max(x['samples_per_second'] for x in c['candidates'] if not x.get('refused')) and
    all(x['samples_per_second'] > 0 for x in c['candidates']) and
    c['profile']['microbatch_sizes'] == [1, 2, 4, 8] and j['plan']['split_method'] == 'auto-plan')
    else (c['chosen'], c['candidates'][0], s['schedule'], len(j['plan']['stages'])))(j['plan']['choice'], j['spec'])")
[ "$verdict" = ok ] && ok "the spec holds the chosen plan; it is the fastest predicted (within 2%)" || bad "chosen: $verdict"
ctl status "$job" > "$TMP/all.status"
if grep -qE "auto plan \(schedule, microbatches, stages\): [a-z0-9-]+, [0-9]+ micro-batches, [0-9]+ stages on [0-9] workers; predicted [0-9.]+ samples/s, measured [0-9.]+ \([0-9.]+x\)" "$TMP/all.status"; then
  ok "status: $(grep -o 'auto plan.*' "$TMP/all.status" | cut -c1-150)"
else
  bad "status: $(cat "$TMP/all.status")"
fi
events() { pyget "$1" "'\\n'.join(e['message'] for e in j.get('history', []))"; }
events "$TMP/all.json" | grep -q "plan chosen (auto schedule, microbatches, stages)" &&
  ok "the choice is a job event" || bad "events: $(events "$TMP/all.json")"

# 2. Only the micro-batches auto: the schedule and stages stay as given.
ctl submit "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" "${TRAIN[@]}" --schedule 1f1b --stages 2 --microbatches auto \
  --wait > "$TMP/m.out" 2> "$TMP/m.err"
rc=$?
job=$(head -1 "$TMP/m.out")
if [ "$rc" = 0 ] && equal m "$job" "$ZOO/gpt.pt" "$TMP/gpt.data.pt" model; then
  ok "--microbatches auto: succeeded and equals the unsplit model"
else
  bad "--microbatches auto: rc $rc $(tail -2 "$TMP/m.err") $(tail -2 "$TMP/m.check" 2>/dev/null)"
fi
verdict=$(pyget "$TMP/m.json" "'ok' if (j['plan']['choice']['chosen'] == ['microbatches'] and
    j['spec']['schedule']['kind'] == 'SCHEDULE_1F1B' and len(j['plan']['stages']) == 2 and
    all(c['schedule'] == 'SCHEDULE_1F1B' and c['stages'] == 2 for c in j['plan']['choice']['candidates']) and
    sorted(c['microbatches'] for c in j['plan']['choice']['candidates']) == [2, 4, 8])
    else (j['plan']['choice']['chosen'], j['spec']['schedule'], [(c['schedule'], c['microbatches'], c['stages']) for c in j['plan']['choice']['candidates']])")
# 1F1B needs at least as many micro-batches as stages: m = 1 is no candidate.
[ "$verdict" = ok ] && ok "--microbatches auto: only m varies (2, 4, 8), 1f1b on 2 stages kept" || bad "m only: $verdict"

# The first job's steps 1-3 taught the coordinator what its workers' actions cost against
# the prediction: the second job's choice was scaled by that, and says so.
verdict=$(pyget "$TMP/m.json" "'ok' if (len(j['spec']['auto_plan'].get('calibration', [])) >= 1 and
    all(f.get('jobs', 0) >= 1 and f.get('forward', 0) > 0 for f in j['spec']['auto_plan']['calibration']) and
    'earlier job(s): F x' in j['plan']['choice']['why'])
    else (j['spec']['auto_plan'].get('calibration'), j['plan']['choice']['why'])")
[ "$verdict" = ok ] && ok "the second auto job is calibrated by what the first measured on the workers" ||
  bad "calibration: $verdict"
grep -q "auto plan calibration, [0-9] rank(s) on a host: measured / predicted F x" "$TMP/coordinator.log" &&
  ok "the coordinator logs what it learned" || bad "no calibration in the coordinator's log"

# 3. A model that cannot run one-sample micro-batches in training (BatchNorm1d): that
# size is no candidate, the job says why, and it still trains equal to PyTorch.
ctl submit "$TMP/bn.pt" --data "$TMP/bn.data.pt" --batch-size 8 --loss mse --optimizer sgd --momentum 0.9 --lr 0.05 \
  --steps 4 --schedule gpipe --stages 2 --microbatches auto --wait > "$TMP/bn.out" 2> "$TMP/bn.err"
rc=$?
job=$(head -1 "$TMP/bn.out")
if [ "$rc" = 0 ] && equal bn "$job" "$TMP/bn.pt" "$TMP/bn.data.pt" mse; then
  ok "BatchNorm1d model, --microbatches auto: succeeded and equals the unsplit model"
else
  bad "BatchNorm1d: rc $rc $(tail -2 "$TMP/bn.err") m $(pyget "$TMP/bn.json" "j['spec']['schedule']") $(tail -1 "$TMP/bn.check" 2>/dev/null)"
fi
verdict=$(pyget "$TMP/bn.json" "'ok' if (j['plan']['choice']['profile']['microbatch_sizes'] == [2, 4, 8] and
    '1 sample(s) per micro-batch' in j['plan']['choice']['profile']['unmeasured'][0] and
    j['spec']['schedule']['microbatches'] in (1, 2, 4) and
    any('not a candidate: measuring the model at 1 sample' in e['message'] for e in j.get('history', [])))
    else (j['plan']['choice']['profile'].get('microbatch_sizes'), j['spec']['schedule'], [e['message'][:100] for e in j.get('history', [])])")
[ "$verdict" = ok ] && ok "BatchNorm1d: one-sample micro-batches left out, with why, in the events" || bad "BatchNorm1d: $verdict"

# 4. Refusals (exit 2, before anything runs).
refused() {  # WHAT PATTERN ARGS...
  local what=$1 pattern=$2
  shift 2
  "$@" > /dev/null 2> "$TMP/refused.err"
  local rc=$?
  if [ "$rc" = 2 ] && grep -q "$pattern" "$TMP/refused.err"; then ok "refused, exit 2: $what"; else
    bad "$what: rc $rc: $(cat "$TMP/refused.err")"; fi
}
refused "--stages auto with --split-at" "auto chooses the cuts too" \
  ctl submit "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" "${TRAIN[@]}" --schedule 1f1b --microbatches 2 --stages auto --split-at blocks.3
refused "auto with --tensor-parallel" "not supported yet" \
  ctl submit "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" "${TRAIN[@]}" --schedule 1f1b --stages 2 --microbatches auto --tensor-parallel 2 \
    --tp-plan "blocks.*.fc=colwise,blocks.*.out=rowwise"
refused "auto with --resume-from" "keeps its source job's plan" \
  ctl submit "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" "${TRAIN[@]}" --schedule auto --microbatches 2 --stages 2 --resume-from "$job"
refused "--microbatches 0" "auto" \
  ctl submit "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" "${TRAIN[@]}" --schedule 1f1b --stages 2 --microbatches 0
jobs_listed=$(ctl list --output json | /usr/bin/python3 -c "import json,sys; print(len(json.load(sys.stdin).get('jobs', [])))")
[ "$jobs_listed" = 3 ] && ok "nothing refused was queued (3 jobs)" || bad "jobs listed: $jobs_listed"

# 5. Offline: pippyctl plan for 4 workers on one 2-core host and on 4 hosts.
"$PIPPYCTL" plan "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --batch-size 8 --workers 4 --hosts 1 --host-cpus 2 \
  > "$TMP/plan.txt" 2>&1
rc=$?
if [ "$rc" = 0 ] && grep -q "4 workers of 1 thread(s) on 1 host(s) of 2 cores" "$TMP/plan.txt" &&
   grep -qE '^1 .* chosen$' "$TMP/plan.txt" && grep -q "^why: " "$TMP/plan.txt"; then
  ok "pippyctl plan: $(grep -E '^1 ' "$TMP/plan.txt" | tr -s ' ')"
else
  bad "pippyctl plan: rc $rc $(cat "$TMP/plan.txt")"
fi
"$PIPPYCTL" --output json plan "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --batch-size 8 --workers 4 --hosts 4 \
  --host-cpus 2 --schedule 1f1b --microbatches 8 --stages auto > "$TMP/plan.json" 2> "$TMP/plan.err"
verdict=$(pyget "$TMP/plan.json" "'ok' if sorted(c['workers'] for c in j['candidates']) == [1, 2, 3, 4] and j['chosen'] == ['stages'] else j")
[ "$verdict" = ok ] && ok "pippyctl plan --stages auto: 1 to 4 workers simulated" || bad "plan json: $verdict $(cat "$TMP/plan.err")"
"$PIPPYCTL" plan "$ZOO/gpt.pt" --data "$TMP/gpt.data.pt" --batch-size 8 --workers 2 --memory 1000 > "$TMP/plan.mem" 2>&1
rc=$?
[ "$rc" = 2 ] && grep -q "no plan fits the workers' memory" "$TMP/plan.mem" &&
  ok "pippyctl plan: 1000 bytes of memory: every candidate refused, exit 2" || bad "plan --memory: rc $rc $(cat "$TMP/plan.mem")"

# 6. pippyctl split --profile: the measured spans.
"$PIPPYCTL" split "$ZOO/gpt.pt" --example-input "$ZOO/gpt.input.pt" --profile > "$TMP/profile.txt" 2>&1
rc=$?
spans=$(grep -cE '^[0-9]+ ' "$TMP/profile.txt")
if [ "$rc" = 0 ] && grep -q "^measured on .* with [0-9]* thread(s)" "$TMP/profile.txt" && [ "$spans" -ge 5 ]; then
  ok "split --profile: $spans spans measured"
else
  bad "split --profile: rc $rc $(cat "$TMP/profile.txt")"
fi

finish
