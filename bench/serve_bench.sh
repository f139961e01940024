#!/bin/bash
# Serving: a pippy serving job (2 stages on 2 workers) against a single-process LibTorch
# forward of the unsplit model, batch 1 and batched, and against sequential pipelining
# (one request at a time through the stages). See bench/serve_bench.py.
#
#   bench/serve_bench.sh [--clients 16] [--seconds 5] [--width 1024] [--max-batch 16]
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
bazel build "${BAZEL_FLAGS[@]}" //client:pippyctl //coordinator:pippy-coordinator //worker:pippy-worker >&2
exec /usr/bin/python3 "$ROOT/bench/serve_bench.py" --bin "$ROOT/bazel-bin" "$@"
