#!/bin/bash
# 2 replicas x 2 stages against 1 x 2 on the same global batch, beside a Python
# torch.distributed (gloo) pipeline with DDP-style all-reduce. See
# bench/data_parallel_bench.py.
#
#   bench/data_parallel_bench.sh [--runs 3] [--steps 30] [--width 512] [--batch 256]
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
bazel build "${BAZEL_FLAGS[@]}" //client:pippyctl //coordinator:pippy-coordinator //worker:pippy-worker >&2
exec /usr/bin/python3 "$ROOT/bench/data_parallel_bench.py" --bin "$ROOT/bazel-bin" "$@"
