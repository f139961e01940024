#!/bin/bash
# What reading a dataset costs (docs/data.md), each figure beside a reference measured
# in the same run:
#   1. tokens/s one rank reads from a token dataset (stage::Dataset: pread per run of
#      windows, ids checked, int64 inputs and/or targets, the next steps' rows asked
#      of the kernel ahead; bench/data_read_bench.cc), in order and shuffled, vs `cat`
#      of the same files to /dev/null, from disk (pages dropped before each reader)
#      and from the page cache (the files read once first);
#   2. the step time of a small LM (the zoo's GPT, 2 stages, 1F1B, 2 local workers)
#      training on the dataset vs on --synthetic data of the same shapes (median of
#      the steps after the first 5);
#   3. each worker's peak RSS (VmHWM) after a job on a 1 GB and a 2 GB dataset, on
#      fresh workers: it does not grow with the dataset.
#
#   bench/data_bench.sh [GB_SMALL=1] [GB_LARGE=2] [STEPS=200]
# Needs GB_SMALL + GB_LARGE of disk under ${TMPDIR:-/tmp}.
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
GB_SMALL=${1:-1}
GB_LARGE=${2:-2}
STEPS=${3:-200}
bazel build "${BAZEL_FLAGS[@]}" //client:pippyctl //coordinator:pippy-coordinator //worker:pippy-worker \
  //bench:data_read_bench //examples/models:zoo >&2
BIN="$ROOT/bazel-bin"
PIPPYCTL="$BIN/client/pippyctl"
COORD="$BIN/coordinator/pippy-coordinator"
WORKER="$BIN/worker/pippy-worker"
GPT="$BIN/examples/models/zoo/gpt.pt"
TMP=$(mktemp -d "${TMPDIR:-/tmp}/pippy-data-bench.XXXXXX")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  sleep 0.5
  for p in "${pids[@]}"; do { kill -9 "$p"; wait "$p"; } 2>/dev/null || true; done
  rm -rf "$TMP"
}
trap cleanup EXIT
export OPENBLAS_NUM_THREADS=1

make_tokens() {  # DIR GB: uint16 ids in [0, 64), 128 MiB shards
  /usr/bin/python3 - "$1" "$2" <<'PY'
import os, sys
import numpy as np
out, gb = sys.argv[1], float(sys.argv[2])
os.makedirs(out)
rng = np.random.default_rng(0)
per_shard = 64 << 20  # tokens (128 MiB)
left = int(gb * (1 << 30)) // 2
i = 0
while left > 0:
    n = min(per_shard, left)
    rng.integers(0, 64, n, dtype=np.uint16).tofile(f"{out}/part_{i:04d}.bin")
    left -= n
    i += 1
PY
}
echo "making ${GB_SMALL} GB and ${GB_LARGE} GB token datasets in $TMP ..." >&2
make_tokens "$TMP/small" "$GB_SMALL"
make_tokens "$TMP/large" "$GB_LARGE"

# 1. Read throughput: from disk (each file's pages dropped from the page cache first,
#    posix_fadvise DONTNEED) and from the page cache (read once before).
evict() { /usr/bin/python3 -c "
import glob, os, sys
for f in glob.glob(sys.argv[1] + '/*.bin'):
    fd = os.open(f, os.O_RDONLY); os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED); os.close(fd)" "$1"; }
time_cat() { /usr/bin/python3 -c "
import subprocess, sys, time, glob
t = time.perf_counter()
subprocess.run(['cat'] + sorted(glob.glob(sys.argv[1] + '/*.bin')), stdout=subprocess.DEVNULL, check=True)
print(time.perf_counter() - t)" "$1"; }
# nanoGPT's get_batch on the same files: np.memmap, windows of L + 1, int64 tensors.
numpy_reader() { /usr/bin/python3 - "$1" "$2" "$3" "$4" <<'PY'
import glob, json, sys, time
import numpy as np, torch
files, L, B, order = sorted(glob.glob(sys.argv[1] + "/*.bin")), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
tokens = 0
t = time.perf_counter()
rng = np.random.default_rng(0)
for f in files:
    data = np.memmap(f, dtype=np.uint16, mode="r")
    n = (len(data) - 1) // L
    starts = np.arange(n) * L if order == "off" else rng.permutation(n) * L
    for b in range(0, n - B + 1, B):
        ix = starts[b:b + B]
        x = torch.stack([torch.from_numpy(data[i:i + L].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + L].astype(np.int64)) for i in ix])
        tokens += B * L
s = time.perf_counter() - t
print(json.dumps({"tokens": tokens, "seconds": s, "tokens_per_second": tokens / s, "bytes": tokens * 2}))
PY
}
bytes=$(du -cb "$TMP"/small/*.bin | tail -1 | cut -f1)
R="$BIN/bench/data_read_bench"
# Each reader three times, cat between them (figures on this VM swing from run to run):
# the medians are printed. COLD=1: each one's pages dropped first.
declare -A runs
measure() {  # COLD
  for _ in 1 2 3; do
    for name in cat inputs both shuffled shuffled_both; do
      [ "$1" = 1 ] && evict "$TMP/small"
      case $name in
        cat) r=$(time_cat "$TMP/small") ;;
        inputs) r=$("$R" "$TMP/small" 1024 64 off 120 inputs) ;;
        both) r=$("$R" "$TMP/small" 1024 64 off 120 both) ;;
        shuffled) r=$("$R" "$TMP/small" 1024 64 on 60 inputs) ;;
        shuffled_both) r=$("$R" "$TMP/small" 1024 64 on 60 both) ;;
      esac
      runs[$1,$name]+="$r;"
    done
  done
}
measure 1
cat "$TMP"/small/*.bin > /dev/null
measure 0
numpy_inorder=$(numpy_reader "$TMP/small" 1024 64 off)
numpy_shuffled=$(numpy_reader "$TMP/small" 1024 64 on)

# 2 and 3: real daemons; fresh workers for each dataset size.
"$COORD" --bind 127.0.0.1 --port 0 --port-file "$TMP/port" --state-dir "$TMP/state" --dataset-root "$TMP" \
  > "$TMP/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -s "$TMP/port" ] && break; sleep 0.1; done
ADDR="127.0.0.1:$(cat "$TMP/port")"
ctl() { "$PIPPYCTL" --coordinator "$ADDR" "$@"; }
worker_pids=()
start_workers() {
  for p in "${worker_pids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  worker_pids=()
  for w in 0 1; do
    "$WORKER" --coordinator "$ADDR" --name "w$w-$1" --ucx-tls sm,self --dataset-root "$TMP" > "$TMP/w$w-$1.log" 2>&1 &
    pids+=($!)
    worker_pids+=($!)
  done
  for _ in $(seq 150); do
    n=$(ctl workers --output json 2>/dev/null | /usr/bin/python3 -c \
      "import json,sys; print(sum(1 for w in json.load(sys.stdin).get('workers', []) if w['state']=='IDLE'))")
    [ "$n" = 2 ] && return 0
    sleep 0.1
  done
  echo "workers did not register" >&2
  return 1
}
COMMON=(--microbatches 4 --batch-size 8 --steps "$STEPS" --loss model --optimizer adamw --lr 0.001 --stages 2
        --schedule 1f1b --checkpoint-every 0)
run_job() {  # NAME ARGS...: the job's JSON record
  local name=$1
  shift
  ctl submit "$GPT" "${COMMON[@]}" "$@" --wait > "$TMP/$name.out" 2>&1 || { cat "$TMP/$name.out" >&2; return 1; }
  ctl status "$(head -1 "$TMP/$name.out")" --output json > "$TMP/$name.json"
}
peaks() { for p in "${worker_pids[@]}"; do grep VmHWM "/proc/$p/status" | awk '{print $2 * 1024}'; done | paste -sd,; }
start_workers synthetic
run_job synthetic --synthetic "inputs=int64[64,16]@64;targets=int64[64,16]@64"
peak_synthetic=$(peaks)
start_workers small
run_job small --dataset "$TMP/small" --seq-len 16 --shuffle on
peak_small=$(peaks)
start_workers large
run_job large --dataset "$TMP/large" --seq-len 16 --shuffle on
peak_large=$(peaks)

/usr/bin/python3 - "$TMP" "$bytes" "${runs[1,cat]}" "${runs[0,cat]}" "${runs[1,inputs]}" "${runs[1,both]}" \
  "${runs[1,shuffled]}" "${runs[0,inputs]}" "${runs[0,both]}" "${runs[0,shuffled]}" "${runs[0,shuffled_both]}" \
  "$numpy_inorder" "$numpy_shuffled" "$peak_synthetic" "$peak_small" "$peak_large" "$GB_SMALL" "$GB_LARGE" <<'PY'
import json, statistics, sys
tmp, nbytes = sys.argv[1], int(sys.argv[2])
tokens = nbytes / 2
def cat_rate(arg):  # tokens/s of each cat, from its seconds
    return [tokens / float(x) for x in arg.strip(";").split(";")]
def rates(arg):
    return [json.loads(x)["tokens_per_second"] for x in arg.strip(";").split(";")]
cat_cold, cat_warm = cat_rate(sys.argv[3]), cat_rate(sys.argv[4])
inputs_cold, both_cold, shuffled_cold, inputs, both, shuffled, shuffled_both = (rates(a) for a in sys.argv[5:12])
np_warm, np_shuffled = ([json.loads(a)["tokens_per_second"]] for a in sys.argv[12:14])
peaks = [[int(x) for x in a.split(",")] for a in sys.argv[14:17]]
gb_small, gb_large = sys.argv[17], sys.argv[18]
print(f"1. one rank reading {nbytes / 2**30:.2f} GiB of uint16 tokens into int64 tensors, seq_len 1024, batch 64 "
      "(one core; 'inputs': the first stage's rank, 'both': a rank with the first and the last stage); "
      "medians of 3 [range]")
print(f"   {'reader':<48} {'tokens/s':>10} {'file MiB/s':>11} {'vs cat':>7}  {'range':>11}")
for label, cat, rows in (("from disk (page cache dropped before each)", cat_cold,
                          [("pippy Dataset, in order, inputs", inputs_cold),
                           ("pippy Dataset, in order, inputs + targets", both_cold),
                           ("pippy Dataset, shuffled, inputs", shuffled_cold)]),
                         ("from the page cache", cat_warm,
                          [("pippy Dataset, in order, inputs", inputs),
                           ("pippy Dataset, in order, inputs + targets", both),
                           ("pippy Dataset, shuffled, inputs", shuffled),
                           ("pippy Dataset, shuffled, inputs + targets", shuffled_both),
                           ("nanoGPT get_batch (np.memmap), in order, both", np_warm),
                           ("nanoGPT get_batch (np.memmap), shuffled, both", np_shuffled)])):
    c = statistics.median(cat)
    print(f"   {label}:")
    print(f"   {'  cat > /dev/null':<48} {c:10.3g} {c * 2 / 2**20:11.0f} {1.0:7.2f}  "
          f"[{min(cat) / c:.2f}-{max(cat) / c:.2f}]")
    for name, r in rows:
        m = statistics.median(r)
        print(f"   {'  ' + name:<48} {m:10.3g} {m * 2 / 2**20:11.0f} {m / c:7.2f}  "
              f"[{min(r) / c:.2f}-{max(r) / c:.2f}]")
def med(name):
    j = json.load(open(f"{tmp}/{name}.json"))
    s = j["step_seconds"][5:]
    return statistics.median(s), len(s) + 5
(syn, n), (small, _), (large, _) = med("synthetic"), med("small"), med("large")
print(f"2. the zoo's GPT, 2 stages, 1F1B, batch 8 x 16 tokens, {n} steps: median step time (steps 5+)")
print(f"   {'data':<34} {'ms/step':>9} {'vs synthetic':>13}")
for name, v in (("--synthetic", syn), (f"--dataset {gb_small} GB, shuffled", small), (f"--dataset {gb_large} GB, shuffled", large)):
    print(f"   {name:<34} {v * 1e3:9.3f} {v / syn:13.3f}")
print("3. peak RSS (VmHWM) of each worker (rank 0, rank 1), fresh workers per job")
for name, p in (("--synthetic", peaks[0]), (f"--dataset {gb_small} GB", peaks[1]), (f"--dataset {gb_large} GB", peaks[2])):
    print(f"   {name:<34} " + ", ".join(f"{x / 2**20:.0f} MiB" for x in p))
print(f"   {gb_large} GB vs {gb_small} GB: " + ", ".join(f"{b / a:.3f}x" for a, b in zip(peaks[1], peaks[2])))
PY
