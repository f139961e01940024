#!/bin/bash
# Peak memory of every pippy process for a large model, against its budget (see
# bench/memory_bench.py). Default: the 1.07 GB model of 16 x Linear(4096, 4096), 4
# stages on 4 local workers, AdamW.
#
#   bench/memory_bench.sh                          # the 1.07 GB model
#   bench/memory_bench.sh --layers 34 --optimizer sgd   # a 2.28 GB model (> 2 GiB)
#   bench/memory_bench.sh --tensor-parallel 2      # each stage sharded across 2 workers (8 workers)
#
# Needs ~8 GB of free memory for the default, ~12 GB for the 2.28 GB model.
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
bazel build "${BAZEL_FLAGS[@]}" //client:pippyctl //coordinator:pippy-coordinator //worker:pippy-worker >&2
exec /usr/bin/python3 "$ROOT/bench/memory_bench.py" --bin "$ROOT/bazel-bin" "$@"
