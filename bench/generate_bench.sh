#!/bin/bash
# Generation: a pippy generation job (2 stages on 2 workers) against one LibTorch process
# running the same model with the same KV cache, one request at a time and with
# continuous batching. See bench/generate_bench.py.
#
#   bench/generate_bench.sh [--clients 16] [--seconds 10] [--runs 3] [--width 512] [--layers 8]
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
bazel build "${BAZEL_FLAGS[@]}" //client:pippyctl //coordinator:pippy-coordinator //worker:pippy-worker >&2
exec /usr/bin/python3 "$ROOT/bench/generate_bench.py" --bin "$ROOT/bazel-bin" "$@"
