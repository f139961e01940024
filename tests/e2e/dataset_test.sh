#!/bin/bash
# Datasets end to end (docs/data.md): a real pippy-coordinator and 5 real pippy-worker
# processes on 127.0.0.1, all with --dataset-root on the test's data folder. The
# coordinator indexes each dataset; the workers read their rows themselves (no data
# travels through the coordinator). Each trained model is fetched and checked with
# /usr/bin/python3 against a plain PyTorch loop that reads the same windows from the
# shards with numpy, in the order docs/data.md defines (tests/python/check_training.py).
#   - the zoo's GPT on ~200 MB of uint16 token shards, 30 steps, cosine with warm-up 5,
#     2 stages, 1F1B, AdamW, --shuffle off: parameters, losses and learning rates;
#   - --shuffle on --replicas 2 (2 x 2 workers) over an epoch boundary (--epochs 2);
#   - a shuffled job whose worker is killed mid-epoch resumes from its checkpoint and
#     ends bitwise equal to the uninterrupted job;
#   - tensor shards (torch.save files) for the zoo's MLP;
#   - --resume-from and fetch --checkpoint; evaluation on a validation set;
#   - --dataset-upload of a dataset outside every --dataset-root;
#   - refusals naming the file: outside --dataset-root, a shard of odd length, an
#     empty folder, shards whose columns differ, and a token id outside the embedding
#     (found when a rank reads it: the job fails naming shard and offset).
set -u
PIPPYCTL="$PWD/client/pippyctl"
COORD="$PWD/coordinator/pippy-coordinator"
WORKER="$PWD/worker/pippy-worker"
ZOO="$PWD/examples/models/zoo"
CHECK="$PWD/tests/python/check_training.py"
TMP="${TEST_TMPDIR:-$(mktemp -d)}/dataset"
rm -rf "$TMP" && mkdir -p "$TMP/data"
source "$PWD/tests/e2e/testlib.sh"
DATA="$TMP/data"

start_coordinator 0 --dataset-root "$DATA"
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
declare -A worker_pid
nworkers=0
start_worker() {
  local name="w$nworkers"
  nworkers=$((nworkers + 1))
  "$WORKER" --coordinator "$ADDR" --name "$name" --ucx-tls sm,self --replica-host 127.0.0.1 --wait-timeout-s 20 \
    --dataset-root "$DATA" > "$TMP/$name.log" 2>&1 &
  pids+=($!)
  worker_pid[$name]=$!
}
json_get() { ctl status "$1" --output json 2>/dev/null | /usr/bin/python3 -c "import json,sys; j=json.load(sys.stdin); print($2)"; }
worker_of_rank() {  # JOB RANK -> worker name
  local wid
  wid=$(json_get "$1" "j['workers'][$2]")
  ctl workers --output json | /usr/bin/python3 -c \
    "import json,sys; print(next(w['name'] for w in json.load(sys.stdin)['workers'] if w['worker_id']=='$wid'))"
}
for _ in 0 1 2 3 4; do start_worker; done
wait_idle 5 && ok "5 workers registered" || bad "5 workers registered"

/usr/bin/python3 - "$DATA" <<'PY'
import os, sys
import numpy as np
import torch
data = sys.argv[1]
rng = np.random.default_rng(0)
# ~200 MB of token ids for the zoo's GPT (vocabulary 64), in 4 shards of unequal length.
os.makedirs(f"{data}/big")
for i, n in enumerate([26_000_003, 24_999_999, 25_000_000, 24_000_001]):
    rng.integers(0, 64, n, dtype=np.uint16).tofile(f"{data}/big/part_{i:02d}.bin")
# A small one: 64 samples of 16 tokens (1025 tokens), 8 steps an epoch at batch 8.
os.makedirs(f"{data}/small")
for i, n in enumerate([400, 625]):
    rng.integers(0, 64, n, dtype=np.uint16).tofile(f"{data}/small/part_{i}.bin")
# A manifest naming the small one's shards.
with open(f"{data}/small.txt", "w") as f:
    f.write("# the small dataset\nsmall/part_0.bin\nsmall/part_1.bin\n")
# A validation set: 40 samples of 16 tokens (5 batches of 8).
os.makedirs(f"{data}/val")
rng.integers(0, 64, 641, dtype=np.uint16).tofile(f"{data}/val/part_0.bin")
# Bad ones.
os.makedirs(f"{data}/odd"); rng.integers(0, 64, 100, dtype=np.uint16).tofile(f"{data}/odd/a.bin")
with open(f"{data}/odd/b.bin", "wb") as f: f.write(b"\x01\x00\x02")
os.makedirs(f"{data}/empty")
os.makedirs(f"{data}/vocab")
ids = rng.integers(0, 64, 2000, dtype=np.uint16); ids[1500] = 64
ids.tofile(f"{data}/vocab/a.bin")
# Tensor shards for the zoo's MLP: inputs float32[rows, 32], targets float32[rows, 32].
os.makedirs(f"{data}/mlp"); os.makedirs(f"{data}/mixed")
g = torch.Generator().manual_seed(1)
for i, n in enumerate([24, 16, 24]):
    torch.save({"inputs": torch.randn(n, 32, generator=g), "targets": torch.randn(n, 32, generator=g)},
               f"{data}/mlp/shard_{i}.pt")
torch.save({"inputs": torch.randn(8, 32), "targets": torch.randn(8, 32)}, f"{data}/mixed/a.pt")
torch.save({"inputs": torch.randn(8, 32, dtype=torch.float64), "targets": torch.randn(8, 32)}, f"{data}/mixed/b.pt")
# A dataset only pippyctl's side can read (outside every --dataset-root): uploaded.
os.makedirs(f"{data}/../private")
for i, n in enumerate([700, 581]):
    rng.integers(0, 64, n, dtype=np.uint16).tofile(f"{data}/../private/shard {i}.bin")
os.makedirs(f"{sys.argv[1]}/../outside")
rng.integers(0, 64, 1000, dtype=np.uint16).tofile(f"{data}/../outside/a.bin")
PY
du -sh "$DATA/big" | cut -f1 > "$TMP/big.size"

submit_wait() {  # NAME MODEL ARGS...: the job id, and SUCCEEDED
  local name=$1
  shift
  if ! ctl submit "$@" --wait > "$TMP/$name.out" 2>&1; then
    echo "job did not succeed: $(tail -3 "$TMP/$name.out")" >&2
    return 1
  fi
  local job
  job=$(head -1 "$TMP/$name.out")
  ctl status "$job" --output json > "$TMP/$name.json"
  ctl fetch "$job" -o "$TMP/$name.pt" > /dev/null || { echo "fetch failed" >&2; return 1; }
  echo "$job"
}

# 1. GPT on the token shards, cosine with warm-up, in order.
GPT=(--dataset "$DATA/big" --seq-len 16 --microbatches 4 --batch-size 8 --steps 30 --loss model --optimizer adamw
     --lr 0.003 --lr-schedule cosine --warmup-steps 5 --min-lr 0.0003 --shuffle off --stages 2 --schedule 1f1b)
if job=$(submit_wait cosine "$ZOO/gpt.pt" "${GPT[@]}") &&
   /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" - "$TMP/cosine.pt" --dataset "$DATA/big" --seq-len 16 --steps 30 \
     --batch-size 8 --microbatches 4 --loss model --optimizer adamw --lr 0.003 --lr-schedule cosine \
     --warmup-steps 5 --min-lr 0.0003 --tolerance 1e-5 --losses "$TMP/cosine.json" --loss-tolerance 1e-5 \
     > "$TMP/cosine.check" 2>&1; then
  ok "GPT on $(cat "$TMP/big.size") of token shards, cosine + warm-up, 1F1B: $(tail -1 "$TMP/cosine.check")"
else
  bad "GPT on token shards: $(cat "$TMP/cosine.check" 2>/dev/null)"
fi
# No data went through the coordinator: the shares are empty; the ranks said they read it.
if grep -q "reading the dataset $DATA/big (4 shards" "$TMP"/w*.log; then
  ok "the ranks read the dataset themselves"
else
  bad "no worker log says it read the dataset"
fi
summary=$(ctl status "$job" 2>&1 | grep -i "dataset" | head -1)
[ -n "$summary" ] && ok "status: $summary" || bad "status does not show the dataset: $(ctl status "$job" 2>&1 | head -5)"

# 2. Shuffled, 2 replicas x 2 stages, 2 epochs of the small dataset through its manifest
#    (8 steps an epoch: the second epoch reads another permutation).
DP=(--dataset "$DATA/small.txt" --seq-len 16 --microbatches 2 --batch-size 8 --epochs 2 --loss model
    --optimizer sgd --momentum 0.9 --lr 0.05 --shuffle on --seed 5 --replicas 2 --stages 2 --schedule 1f1b)
if job=$(submit_wait dp "$ZOO/gpt.pt" "${DP[@]}") &&
   [ "$(/usr/bin/python3 -c "import json; print(json.load(open('$TMP/dp.json'))['spec']['steps'])")" = 16 ] &&
   /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" - "$TMP/dp.pt" --dataset "$DATA/small" --seq-len 16 --steps 16 \
     --batch-size 8 --microbatches 4 --loss model --optimizer sgd --momentum 0.9 --lr 0.05 --shuffle on --seed 5 \
     --tolerance 1e-5 > "$TMP/dp.check" 2>&1; then
  ok "--shuffle on --replicas 2 --epochs 2 (16 steps): $(tail -1 "$TMP/dp.check")"
else
  bad "shuffled replicas over 2 epochs: $(cat "$TMP/dp.check" 2>/dev/null) $(tail -2 "$TMP/dp.out")"
fi

# 3. Killed mid-epoch and resumed from its checkpoint: bitwise what the uninterrupted job trained.
FT=(--dataset "$DATA/small" --seq-len 16 --microbatches 2 --batch-size 8 --steps 300 --loss model --optimizer adamw
    --lr 0.003 --shuffle on --seed 3 --stages 2 --schedule 1f1b --checkpoint-every 5)
ref=$(submit_wait ft_ref "$ZOO/gpt.pt" "${FT[@]}")
job=$(ctl submit "$ZOO/gpt.pt" "${FT[@]}" 2> "$TMP/ft.err")
reached=0
for _ in $(seq 300); do
  [ "$(json_get "$job" "j.get('checkpoint_step', 0) >= 10 and j['state'] == 'RUNNING'")" = True ] && { reached=1; break; }
  sleep 0.1
done
if [ "$reached" = 1 ]; then
  victim=$(worker_of_rank "$job" 0)
  kill -9 "${worker_pid[$victim]}"
  ctl watch "$job" > "$TMP/ft.watch" 2>&1
  if [ "$(json_get "$job" "j['state'], j.get('restarts', 0)")" = "SUCCEEDED 1" ] &&
     ctl fetch "$job" -o "$TMP/ft.pt" > /dev/null &&
     /usr/bin/python3 - "$TMP/ft_ref.pt" "$TMP/ft.pt" > "$TMP/ft.check" <<'PY'
import sys, torch
a, b = (torch.jit.load(p).state_dict() for p in sys.argv[1:3])
equal = a.keys() == b.keys() and all(torch.equal(x, b[k]) for k, x in a.items())
print(f"{len(a)} tensors {'bitwise equal' if equal else 'differ'}")
sys.exit(0 if equal else 1)
PY
  then
    ok "killed mid-epoch (worker $victim, rank 0, after checkpoint step 10) and resumed: $(cat "$TMP/ft.check") to the uninterrupted job"
  else
    bad "resumed job: $(json_get "$job" "j['state'], j.get('restarts'), j.get('reason')") $(cat "$TMP/ft.check" 2>/dev/null)"
  fi
else
  bad "the job never reached its checkpoint at step 10: $(json_get "$job" "j['state'], j.get('reason')")"
fi
wait_idle 4 || true

# 4. Tensor shards (torch.save files) for the MLP.
MLP=(--dataset "$DATA/mlp" --microbatches 2 --batch-size 8 --steps 12 --loss mse --optimizer sgd --lr 0.05
     --stages 2 --schedule gpipe)
if job=$(submit_wait mlp "$ZOO/mlp.pt" "${MLP[@]}") &&
   /usr/bin/python3 - "$ZOO/mlp.pt" "$DATA/mlp" "$TMP/mlp.pt" > "$TMP/mlp.check" 2>&1 <<'PY'
import glob, sys, torch
import torch.nn.functional as F
model = torch.jit.load(sys.argv[1])
shards = [torch.load(f) for f in sorted(glob.glob(sys.argv[2] + "/*.pt"))]
x = torch.cat([s["inputs"] for s in shards]); y = torch.cat([s["targets"] for s in shards])
opt = torch.optim.SGD(model.parameters(), lr=0.05)
per_epoch = len(x) // 8
for step in range(12):
    first = (step % per_epoch) * 8
    for k in range(2):
        rows = slice(first + 4 * k, first + 4 * k + 4)
        (F.mse_loss(model(x[rows]), y[rows]) / 2).backward()
    opt.step(); opt.zero_grad()
got = torch.jit.load(sys.argv[3]).state_dict()
worst = max(((got[k] - w).abs().max() / w.abs().max()).item() for k, w in model.state_dict().items())
print(f"max relative difference {worst:.3g} over {len(got)} tensors")
sys.exit(0 if worst <= 1e-5 else 1)
PY
then
  ok "MLP on tensor shards (3 files, 64 rows, 8 steps an epoch, 12 steps): $(cat "$TMP/mlp.check")"
else
  bad "MLP on tensor shards: $(cat "$TMP/mlp.check" 2>/dev/null)"
fi

# 5. Continue and fine-tune: a 20-step job, then a job resumed from its last checkpoint
#    (the state after its step 20) to step 30, equals one 30-step job bitwise and a
#    PyTorch loop of 30 steps; the checkpoint of a succeeded job is its result; a
#    cancelled job's last checkpoint, fetched as one model, equals PyTorch after its steps.
RS=(--dataset "$DATA/small" --seq-len 16 --microbatches 2 --batch-size 8 --loss model --optimizer adamw --lr 0.003
    --warmup-steps 5 --shuffle on --seed 7 --stages 2 --schedule 1f1b)
same_tensors() {  # A.pt B.pt: bitwise equal state dicts
  /usr/bin/python3 - "$1" "$2" <<'PY'
import sys, torch
a, b = (torch.jit.load(p).state_dict() for p in sys.argv[1:3])
equal = a.keys() == b.keys() and all(torch.equal(x, b[k]) for k, x in a.items())
print(f"{len(a)} tensors {'bitwise equal' if equal else 'differ'}")
sys.exit(0 if equal else 1)
PY
}
if first=$(submit_wait rs20 "$ZOO/gpt.pt" "${RS[@]}" --steps 20) &&
   [ "$(json_get "$first" "j.get('checkpoint_step', 0)")" = 20 ]; then
  ok "a 20-step job keeps the state after its last step as its checkpoint: $(ctl status "$first" | grep -o 'checkpoint after step.*')"
  if ctl fetch "$first" --checkpoint -o "$TMP/rs20.ckpt.pt" > "$TMP/rs20.fetch" 2>&1 &&
     same_tensors "$TMP/rs20.pt" "$TMP/rs20.ckpt.pt" > "$TMP/rs20.same"; then
    ok "fetch --checkpoint of the succeeded job: its result, $(cat "$TMP/rs20.same")"
  else
    bad "fetch --checkpoint of a succeeded job: $(cat "$TMP/rs20.fetch" "$TMP/rs20.same" 2>/dev/null)"
  fi
  if resumed=$(submit_wait rs30 "$ZOO/gpt.pt" "${RS[@]}" --steps 30 --resume-from "$first") &&
     whole=$(submit_wait rsref "$ZOO/gpt.pt" "${RS[@]}" --steps 30) &&
     same_tensors "$TMP/rsref.pt" "$TMP/rs30.pt" > "$TMP/rs30.same" &&
     /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" - "$TMP/rs30.pt" --dataset "$DATA/small" --seq-len 16 --steps 30 \
       --batch-size 8 --microbatches 2 --loss model --optimizer adamw --lr 0.003 --warmup-steps 5 --shuffle on \
       --seed 7 --tolerance 1e-5 --losses "$TMP/rs30.json" --loss-tolerance 1e-5 > "$TMP/rs30.check" 2>&1; then
    ok "--resume-from $first (20 steps) to 30 steps: $(cat "$TMP/rs30.same") to one 30-step job; vs PyTorch: $(tail -1 "$TMP/rs30.check")"
    ctl status "$resumed" | grep -q "resumed from $first after step 20" &&
      ok "status: $(ctl status "$resumed" | grep -o "resumed from.*")" ||
      bad "status does not say it resumed: $(ctl status "$resumed")"
  else
    bad "--resume-from: $(tail -2 "$TMP/rs30.out" 2>/dev/null) $(cat "$TMP/rs30.same" "$TMP/rs30.check" 2>/dev/null)"
  fi
else
  bad "a 20-step job's final checkpoint: $(tail -2 "$TMP/rs20.out") $(json_get "$first" "j.get('checkpoint_step')")"
fi
job=$(ctl submit "$ZOO/gpt.pt" "${RS[@]}" --steps 300 --checkpoint-every 5 2> "$TMP/rsc.err")
reached=0
for _ in $(seq 300); do
  [ "$(json_get "$job" "j.get('checkpoint_step', 0) >= 5")" = True ] && { reached=1; break; }
  sleep 0.1
done
ctl cancel "$job" > /dev/null 2>&1
k=$(json_get "$job" "j.get('checkpoint_step', 0)")
if [ "$reached" = 1 ] && [ "$(json_get "$job" "j['state']")" = CANCELLED ] &&
   ctl fetch "$job" --checkpoint -o "$TMP/rsc.pt" > "$TMP/rsc.fetch" 2>&1 &&
   /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" - "$TMP/rsc.pt" --dataset "$DATA/small" --seq-len 16 --steps "$k" \
     --batch-size 8 --microbatches 2 --loss model --optimizer adamw --lr 0.003 --warmup-steps 5 --shuffle on \
     --seed 7 --tolerance 1e-5 > "$TMP/rsc.check" 2>&1; then
  ok "a cancelled job's checkpoint after step $k, fetched as one model: vs PyTorch after $k steps: $(tail -1 "$TMP/rsc.check")"
else
  bad "fetch --checkpoint of a cancelled job ($k): $(cat "$TMP/rsc.fetch" "$TMP/rsc.check" 2>/dev/null)"
fi
resume_refused() {  # NAME EXPECTED-TEXT ARGS...
  local name=$1 want=$2
  shift 2
  ctl submit "$ZOO/gpt.pt" --dataset "$DATA/small" --seq-len 16 --microbatches 4 --batch-size 8 --loss model \
    --schedule 1f1b "$@" > /dev/null 2> "$TMP/resume.err"
  if grep -qF -- "$want" "$TMP/resume.err"; then
    ok "refused, $name: $(head -c 240 "$TMP/resume.err")"
  else
    bad "$name: expected '$want', got: $(cat "$TMP/resume.err")"
  fi
}
resume_refused "--resume-from with no more steps" "give more than 20" --optimizer adamw --stages 2 --steps 20 \
  --resume-from "$first"
resume_refused "--resume-from another split" "it has 2 stages, this job 3" --optimizer adamw --stages 3 --steps 30 \
  --resume-from "$first"
resume_refused "--resume-from another optimizer" "its optimizer is adamw, this job's sgd" --optimizer sgd --stages 2 \
  --steps 30 --resume-from "$first"
resume_refused "--resume-from an unknown job" "--resume-from: no job 'job-999'" --optimizer adamw --stages 2 \
  --steps 30 --resume-from job-999
wait_idle 4 || true

# 5b. Evaluation: every 5 steps and after the last, 3 batches of the validation set
#     through the pipeline forward only (ZB1P trains: the evaluation runs its own
#     forward-only order); the losses equal the unsplit model's in eval mode, and the
#     training is what it is without evaluation (bitwise).
EV=(--dataset "$DATA/small" --seq-len 16 --microbatches 2 --batch-size 8 --steps 12 --loss model --optimizer adamw
    --lr 0.003 --stages 2 --schedule zb1p)
if job=$(submit_wait eval "$ZOO/gpt.pt" "${EV[@]}" --eval-dataset "$DATA/val" --eval-every 5 --eval-batches 3) &&
   /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" - "$TMP/eval.pt" --dataset "$DATA/small" --seq-len 16 --steps 12 \
     --batch-size 8 --microbatches 2 --loss model --optimizer adamw --lr 0.003 --tolerance 1e-5 \
     --losses "$TMP/eval.json" --loss-tolerance 1e-5 --eval-dataset "$DATA/val" --eval-every 5 --eval-batches 3 \
     > "$TMP/eval.check" 2>&1; then
  ok "evaluation (--eval-every 5 --eval-batches 3, ZB1P): $(grep 'evaluation losses' "$TMP/eval.check" | cut -c1-260)"
  ctl status "$job" | grep -q "eval loss  " && ok "status: $(ctl status "$job" | grep 'eval loss' | head -1)" ||
    bad "status does not show the evaluation: $(ctl status "$job")"
  if plain=$(submit_wait plain "$ZOO/gpt.pt" "${EV[@]}") && same_tensors "$TMP/plain.pt" "$TMP/eval.pt" > "$TMP/eval.same"; then
    ok "training with evaluation equals training without: $(cat "$TMP/eval.same")"
  else
    bad "evaluation changed the training: $(cat "$TMP/eval.same" 2>/dev/null)"
  fi
else
  bad "evaluation: $(tail -3 "$TMP/eval.out") $(cat "$TMP/eval.check" 2>/dev/null)"
fi
resume_refused "--eval-batches beyond the validation set" "--eval-batches: 9 batches of 8 samples, but the validation dataset" \
  --optimizer adamw --stages 2 --steps 3 --eval-dataset "$DATA/val" --eval-batches 9

# 5c. --dataset-upload: a dataset no daemon may read from its path (outside every
#     --dataset-root) goes with the submission; the coordinator keeps it for the job and
#     streams each reading rank its copy, which is gone from the worker when the job ends.
UP=(--dataset "$TMP/private" --dataset-upload --seq-len 16 --microbatches 2 --batch-size 8 --steps 10 --loss model
    --optimizer sgd --momentum 0.9 --lr 0.05 --shuffle on --seed 9 --stages 2 --schedule 1f1b)
if job=$(submit_wait upload "$ZOO/gpt.pt" "${UP[@]}") &&
   /usr/bin/python3 "$CHECK" "$ZOO/gpt.pt" - "$TMP/upload.pt" --dataset "$TMP/private" --seq-len 16 --steps 10 \
     --batch-size 8 --microbatches 2 --loss model --optimizer sgd --momentum 0.9 --lr 0.05 --shuffle on --seed 9 \
     --tolerance 1e-5 > "$TMP/upload.check" 2>&1; then
  ok "--dataset-upload (2 shards, 1281 tokens, outside every --dataset-root): $(tail -1 "$TMP/upload.check")"
  if grep -q "from its uploaded copy in" "$TMP"/w*.log; then ok "the ranks read their uploaded copies"; else bad "no rank read an uploaded copy"; fi
  copies=$(grep -ho "from its uploaded copy in [^ ]*" "$TMP"/w*.log | awk '{print $NF}' | sort -u)
  left=0
  for d in $copies "$TMP"/state/datasets/*; do [ -e "$d" ] && left=$((left + 1)); done
  if [ -n "$copies" ] && [ "$left" = 0 ]; then
    ok "the uploaded dataset is gone from the coordinator and from the workers' copies ($(echo $copies | wc -w)) once the job ended"
  else
    bad "the uploaded dataset stayed: $copies $(ls -d "$TMP"/state/datasets/* 2>/dev/null)"
  fi
  ctl status "$job" | grep -q "dataset $TMP/private (uploaded)" && ok "status: $(ctl status "$job" | grep -o 'dataset .*(uploaded)')" ||
    bad "status does not say the dataset was uploaded: $(ctl status "$job")"
else
  bad "--dataset-upload: $(tail -3 "$TMP/upload.out") $(cat "$TMP/upload.check" 2>/dev/null)"
fi

# 6. Refusals, each naming the file.
expect_refused() {  # NAME EXPECTED-TEXT ARGS...
  local name=$1 want=$2
  shift 2
  if ctl submit "$ZOO/gpt.pt" --seq-len 16 --microbatches 2 --batch-size 8 --steps 2 --loss model --optimizer sgd \
       --stages 2 --schedule 1f1b "$@" > /dev/null 2> "$TMP/refused.err" && false; then :; fi
  if grep -qF -- "$want" "$TMP/refused.err"; then
    ok "refused, $name: $(head -c 240 "$TMP/refused.err")"
  else
    bad "$name: expected '$want', got: $(cat "$TMP/refused.err")"
  fi
}
expect_refused "outside --dataset-root" "is not under a dataset root of this daemon ($DATA)" --dataset "$TMP/outside"
expect_refused "a shard of odd length" "b.bin' is 3 bytes, not a multiple of the 2-byte token width" --dataset "$DATA/odd"
expect_refused "an empty folder" "empty' holds no shards" --dataset "$DATA/empty"
expect_refused "columns that differ" "b.pt' has input 'idx' as float64[rows, 32] but" --dataset "$DATA/mixed"
expect_refused "--seq-len without --dataset" "--seq-len, --token-dtype and --shuffle are for --dataset" \
  --data "$ZOO/gpt.data.pt"
expect_refused "--epochs with --steps" "--epochs excludes --steps" --dataset "$DATA/small" --epochs 2

# A token id outside the embedding, at token 1500: the preparation reads the first batch
# (tokens 0-128) fine; the rank that reads it fails the job naming shard and offset.
if ctl submit "$ZOO/gpt.pt" --dataset "$DATA/vocab" --seq-len 16 --microbatches 2 --batch-size 8 --steps 20 \
     --loss model --optimizer sgd --stages 2 --schedule 1f1b --max-restarts 0 --wait > "$TMP/vocab.out" 2>&1; then
  bad "a token id outside the embedding: the job succeeded"
else
  job=$(head -1 "$TMP/vocab.out")
  reason=$(json_get "$job" "j['state'], j.get('reason', '')")
  if echo "$reason" | grep -q "^FAILED" && echo "$reason" | grep -qF "a.bin' holds token id 64 at token 1500 (byte 3000), outside the model's embedding of 64 rows"; then
    ok "token id outside the embedding: $reason"
  else
    bad "token id outside the embedding: $reason"
  fi
fi

finish
