#!/bin/bash
# pippyctl as a program: exit codes, stderr messages, --output json, files it writes.
set -u
PIPPYCTL=client/pippyctl
ZOO=examples/models/zoo
TMP="${TEST_TMPDIR:-/tmp}"
passed=0
failed=0

# expect NAME WANT_EXIT WANT_STDERR_SUBSTRING -- ARGS...
expect() {
  local name=$1 want_exit=$2 want_err=$3
  shift 4
  local out err code
  out=$("$PIPPYCTL" "$@" 2>"$TMP/err")
  code=$?
  err=$(cat "$TMP/err")
  if [ "$code" -ne "$want_exit" ] || [[ "$err" != *"$want_err"* ]]; then
    echo "FAIL $name: exit $code (want $want_exit), stderr: $err"
    failed=$((failed + 1))
  else
    echo "ok   $name"
    passed=$((passed + 1))
  fi
}

expect help 0 "" -- split --help
expect no-args 2 "" --
expect unknown-command 2 "unknown command 'splat'" -- splat
expect unknown-flag 2 "not expected: 2 --stagez" -- split "$ZOO/mlp.pt" --stagez 2
expect missing-file 2 "cannot open" -- split "$TMP/nope.pt" --stages 2
printf 'not a model' > "$TMP/text.pt"
expect not-torchscript 2 "not a TorchScript archive" -- split "$TMP/text.pt" --stages 2
head -c 3000 "$ZOO/gpt.pt" > "$TMP/trunc.pt"
expect truncated 2 "truncated or corrupt" -- split "$TMP/trunc.pt" --stages 2
expect checkpoint 2 "torch.save() checkpoint" -- split "$ZOO/mlp.checkpoint.pt" --stages 2
expect unknown-split 2 "nearest names: blocks.3.attn" -- split "$ZOO/gpt.pt" --split-at blocks.3.atn
expect illegal-cut 2 "only tensors can be sent" -- split "$ZOO/gpt.pt" --split-at blocks.3.attn.qkv
expect too-many-stages 2 "cannot make 99 stages" -- split "$ZOO/mlp.pt" --stages 99
expect interface 2 "module interface" -- split "$ZOO/iface.pt" --stages 2
expect bad-balance 2 "--balance: unknown balance 'bytes': use params, flops, time" -- split "$ZOO/mlp.pt" --stages 2 --balance bytes
expect bad-stages 2 "--stages: 'two' is not a number" -- split "$ZOO/mlp.pt" --stages two
expect zero-stages 2 "--stages: must be > 0" -- split "$ZOO/mlp.pt" --stages 0
expect bad-output 2 "--output" -- --output yaml split "$ZOO/mlp.pt" --stages 2
# Tensor parallelism: each refusal exits 2 naming the module and the fix.
LLAMA_PLAN='layers.*.attn.q=colwise,layers.*.attn.k=colwise,layers.*.attn.v=colwise,layers.*.attn.o=rowwise,layers.*.mlp.gate=colwise,layers.*.mlp.up=colwise,layers.*.mlp.down=rowwise'
LX=(--stages 2 --example-input "$ZOO/llama.input.pt")
expect tp-no-match 2 "'layers.*.attn.query' matches no module" -- split "$ZOO/llama.pt" "${LX[@]}" --tensor-parallel 2 --tp-plan 'layers.*.attn.query=colwise'
expect tp-not-linear 2 "layers.0.attn_norm (colwise) is not a Linear or an Embedding" -- split "$ZOO/llama.pt" "${LX[@]}" --tensor-parallel 2 --tp-plan 'layers.*.attn_norm=colwise'
expect tp-indivisible 2 "but 3 does not divide 32: choose a --tensor-parallel that divides it" -- split "$ZOO/llama.pt" "${LX[@]}" --tensor-parallel 3 --tp-plan "$LLAMA_PLAN"
expect tp-fixed-heads 2 "aten::view in layers.0.attn gives the sharded output of colwise layers.0.attn.q a fixed shape" -- split "$ZOO/llama_fixed_heads.pt" --stages 2 --example-input "$ZOO/llama_fixed_heads.input.pt" --tensor-parallel 2 --tp-plan "$LLAMA_PLAN"
expect tp-fused-qkv 2 "blocks.0.attn.qkv looks like a fused projection" -- split "$ZOO/gpt.pt" --stages 2 --example-input "$ZOO/gpt.input.pt" --tensor-parallel 2 --tp-plan 'blocks.*.attn.qkv=colwise,blocks.*.attn.proj=rowwise'
expect tp-needs-example 2 "give --example-input FILE" -- split "$ZOO/llama.pt" --stages 2 --tensor-parallel 2 --tp-plan "$LLAMA_PLAN"
expect tp-needs-plan 2 "needs --tp-plan" -- split "$ZOO/llama.pt" "${LX[@]}" --tensor-parallel 2
expect submit-needs-schedule 2 "--schedule is required" -- submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --microbatches 2 --batch-size 8
expect submit-unknown-loss 2 "--loss: unknown loss 'l1': use mse, cross_entropy, model" -- submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --schedule 1f1b --microbatches 2 --batch-size 8 --loss l1
expect submit-data-and-synthetic 2 "excludes --synthetic" -- submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --synthetic "inputs=float32[8,32]" --schedule 1f1b --microbatches 2 --batch-size 8
expect submit-negative-checkpoint 2 "--checkpoint-every" -- submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --schedule 1f1b --microbatches 2 --batch-size 8 --loss mse --optimizer sgd --checkpoint-every -1
expect submit-zero-recovery-timeout 2 "--recovery-timeout-s: must be > 0" -- submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --schedule 1f1b --microbatches 2 --batch-size 8 --loss mse --optimizer sgd --recovery-timeout-s 0
# Checked before anything is uploaded: the spec's own fields.
expect submit-spec-checked-first 2 "--batch-size: 6 does not split into 4 equal micro-batches; use a --microbatches that divides it: 1, 2, 3, 6" -- submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --schedule 1f1b --stages 2 --microbatches 4 --batch-size 6 --loss mse --optimizer sgd
expect submit-momentum-adam 2 "only sgd takes momentum" -- submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --schedule 1f1b --stages 2 --microbatches 2 --batch-size 8 --loss mse --optimizer adam --momentum 0.9
expect fetch-needs-out 2 "--out is required" -- fetch job-1
expect infer-needs-out 2 "--out is required" -- infer job-1 --input "$ZOO/mlp.input.pt"
# --output json: errors are a JSON object on stderr too (parse errors and refusals).
expect json-error-parse 2 '{"error": {"code": "INVALID_ARGUMENT", "message": "--schedule is required; run pippyctl --help"}}' -- --output json submit "$ZOO/mlp.pt"
expect json-error-refusal 2 '{"error": {"code": "INVALID_ARGUMENT", "message": "--batch-size: 6 does not split into 4' -- submit "$ZOO/mlp.pt" --data "$ZOO/mlp.data.pt" --schedule 1f1b --stages 2 --microbatches 4 --batch-size 6 --loss mse --optimizer sgd --output json
# No coordinator there: exit 3, naming where it looked ($PIPPY_COORDINATOR is the fallback).
PIPPY_COORDINATOR=127.0.0.1:1 expect unreachable 3 "cannot reach the coordinator at 127.0.0.1:1" -- list
expect unreachable-flag-after-command 3 "cannot reach the coordinator at 127.0.0.1:1" -- list --coordinator 127.0.0.1:1

# JSON output parses and has the stages asked for (--output before or after the command).
if "$PIPPYCTL" split "$ZOO/gpt.pt" --stages 4 --output json --example-input "$ZOO/gpt.input.pt" > "$TMP/plan.json" &&
   "$PIPPYCTL" --output json split "$ZOO/gpt.pt" --stages 4 --example-input "$ZOO/gpt.input.pt" | cmp -s - "$TMP/plan.json" &&
   /usr/bin/python3 -c "import json,sys; p=json.load(open(sys.argv[1])); assert len(p['stages'])==4; assert p['tied'][0]['stages']==[0,3], p['tied']" "$TMP/plan.json"; then
  echo "ok   json"; passed=$((passed + 1))
else
  echo "FAIL json"; failed=$((failed + 1))
fi
# --out writes stage files and plan.json.
if "$PIPPYCTL" split "$ZOO/unet.pt" --stages 3 --out "$TMP/u" > /dev/null &&
   [ -f "$TMP/u/stage_0.pt" ] && [ -f "$TMP/u/stage_2.pt" ] && [ -f "$TMP/u/plan.json" ]; then
  echo "ok   out-dir"; passed=$((passed + 1))
else
  echo "FAIL out-dir"; failed=$((failed + 1))
fi

# --list-cuts as a table and as JSON
if "$PIPPYCTL" split "$ZOO/gpt.pt" --list-cuts --output json |
   /usr/bin/python3 -c "import json,sys; d=json.load(sys.stdin); assert len(d['cuts']) > 10 and any(c['name']=='blocks.4' for c in d['cuts'])"; then
  echo "ok   list-cuts-json"; passed=$((passed + 1))
else
  echo "FAIL list-cuts-json"; failed=$((failed + 1))
fi

# pippyctl schedule
expect schedule-help 0 "" -- schedule --help
expect schedule-unknown 2 "unknown schedule 'zigzag'" -- schedule --schedule zigzag --ranks 2 --microbatches 4
# torch.distributed.pipelining's class names work as schedule names.
for torch_name in ScheduleGPipe Schedule1F1B ScheduleInterleaved1F1B ScheduleLoopedBFS ScheduleInterleavedZeroBubble ScheduleZBVZeroBubble; do
  expect "schedule-$torch_name" 0 "" -- schedule --schedule "$torch_name" --ranks 2 --microbatches 4
done
expect schedule-precondition 2 "at least as many micro-batches as ranks" -- schedule --schedule 1f1b --ranks 4 --microbatches 2
expect schedule-bad-costs 2 "expected three positive numbers" -- schedule --schedule gpipe --ranks 2 --microbatches 2 --costs 1,2
printf '0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1B0,1SEND_B0\n' > "$TMP/broken.csv"
expect schedule-broken-csv 2 "no RECV_F (1RECV_F0)" -- schedule --from-csv "$TMP/broken.csv"
if "$PIPPYCTL" schedule --schedule 1f1b --ranks 4 --microbatches 8 --csv "$TMP/s.csv" --svg "$TMP/s.svg" > "$TMP/out.txt" &&
   grep -q "mean bubble 27.3%" "$TMP/out.txt" && grep -q "<svg" "$TMP/s.svg" &&
   "$PIPPYCTL" schedule --from-csv "$TMP/s.csv" | grep -q "mean bubble 27.3%"; then
  echo "ok   schedule-csv-svg"; passed=$((passed + 1))
else
  echo "FAIL schedule-csv-svg"; cat "$TMP/out.txt"; failed=$((failed + 1))
fi
if "$PIPPYCTL" schedule --schedule zbv --ranks 2 --microbatches 4 --output json |
   /usr/bin/python3 -c "import json,sys; d=json.load(sys.stdin); assert d['stages']==4 and len(d['per_rank'])==2"; then
  echo "ok   schedule-json"; passed=$((passed + 1))
else
  echo "FAIL schedule-json"; failed=$((failed + 1))
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
