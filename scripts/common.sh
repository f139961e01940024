# Shared settings for the README's commands (sourced, not run).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DISK_CACHE="${PIPPY_BAZEL_DISK_CACHE:-$HOME/.cache/pippy-bazel-disk}"
mkdir -p "$DISK_CACHE"
BAZEL_FLAGS=(--disk_cache="$DISK_CACHE")
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
cd "$ROOT"
