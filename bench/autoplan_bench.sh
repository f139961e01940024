#!/bin/bash
# `auto` plans against a grid of 12 hand-picked plans per model (an MLP, a model whose
# parameter balance misleads, the zoo's GPT), medians of 3. See bench/autoplan_bench.py.
#
#   bench/autoplan_bench.sh [--runs 3] [--only mlp|misleading|gpt]
set -euo pipefail
source "$(dirname "$0")/../scripts/common.sh"
bazel build "${BAZEL_FLAGS[@]}" //client:pippyctl //coordinator:pippy-coordinator //worker:pippy-worker \
  //examples/models:zoo >&2
exec /usr/bin/python3 "$ROOT/bench/autoplan_bench.py" --bin "$ROOT/bazel-bin" "$@"
