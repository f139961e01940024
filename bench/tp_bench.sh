#!/bin/bash
# Tensor parallelism (P = 1 x T = 2, P = 2 x T = 2) on real daemons against the same
# sharding written by hand over torch.distributed gloo (bench/tp_bench.py says how).
#
#   bench/tp_bench.sh [--runs 3] [--steps 6] [--width 2048] [--layers 8] [--batch 256]
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
bazel build "${BAZEL_FLAGS[@]}" //client:pippyctl //coordinator:pippy-coordinator //worker:pippy-worker >&2
exec /usr/bin/python3 "$ROOT/bench/tp_bench.py" --bin "$ROOT/bazel-bin" "$@"
