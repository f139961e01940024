#!/bin/bash
# The daemons against a Python torch.distributed (gloo) pipeline on this machine:
# throughput, pipeline efficiency and the ratio to the peer, for a compute-bound
# geometry (8 x Linear 2048, batch 512, m = 8; GPipe and 1F1B) and an overhead-bound one
# (8 x Linear 256, batch 64, m = 16; 1F1B). See bench/daemon_bench.py.
#
#   bench/daemon_bench.sh [--runs 3] [--steps N] [--only compute-bound] [--trace t.json]
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
bazel build "${BAZEL_FLAGS[@]}" //client:pippyctl //coordinator:pippy-coordinator //worker:pippy-worker >&2
exec /usr/bin/python3 "$ROOT/bench/daemon_bench.py" --bin "$ROOT/bazel-bin" "$@"
