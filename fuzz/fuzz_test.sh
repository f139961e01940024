#!/bin/bash
# Runs every fuzz target (arguments: their paths) for PIPPY_FUZZ_SECONDS (default 8)
# from its seed corpus in fuzz/corpus/<target>/, then prints how many inputs each tried
# and whether it crashed. New corpus entries go to a scratch folder; a crashing input is
# kept in the test's outputs (bazel-testlogs/fuzz/fuzz_test/test.outputs/). Longer
# runs: scripts/fuzz TARGET SECONDS.
set -u
SECONDS_EACH="${PIPPY_FUZZ_SECONDS:-8}"
OUT="${TEST_UNDECLARED_OUTPUTS_DIR:-${TEST_TMPDIR:-/tmp}}"
WORK="${TEST_TMPDIR:-/tmp}/fuzz"
rm -rf "$WORK" && mkdir -p "$WORK"
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=0}"
export PIPPY_FUZZ_MODEL="${PIPPY_FUZZ_MODEL:-examples/models/zoo/gpt.pt}"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
failed=0
rows=()
for bin in "$@"; do
  t=$(basename "$bin")
  seeds="fuzz/corpus/$t"
  mkdir -p "$WORK/$t"
  log="$WORK/$t.log"
  # -rss_limit_mb and -timeout make an input that eats memory or hangs a failure too.
  # LibTorch's unpickler makes room for the length a pickle's string announces (up to
  # 4 GiB and more) before it reads it. The coordinator meets that in its model check's
  # child under a heap cap; the LibTorch targets meet it in a fork (fuzz/child.h) and
  # allow such single allocations there (RSS stays limited in this process). They also
  # run about 10 inputs a second (a LibTorch load or split each; model and data in a fork
  # too), so they get twice the time.
  extra=()
  seconds=$SECONDS_EACH
  case "$t" in model_fuzz|split_fuzz|data_fuzz) extra=(-malloc_limit_mb=65536); seconds=$((SECONDS_EACH * 2)) ;; esac
  # A fixed seed (PIPPY_FUZZ_SEED, default 1): the same mutations every run, so that a
  # failure here reproduces; scripts/fuzz explores with fresh seeds.
  "$bin" -seed="${PIPPY_FUZZ_SEED:-1}" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 "${extra[@]}" \
    -artifact_prefix="$OUT/$t-" "$WORK/$t" "$seeds" > "$log" 2>&1
  rc=$?
  runs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || true)
  seeds_n=$(find -L "$seeds" -type f | wc -l)
  if [ "$rc" -eq 0 ]; then
    rows+=("$(printf '%-18s %6s seeds %10s inputs  0 crashes' "$t" "$seeds_n" "${runs:-?}")")
  else
    failed=$((failed + 1))
    rows+=("$(printf '%-18s %6s seeds %10s inputs  CRASH (exit %s)' "$t" "$seeds_n" "${runs:-?}" "$rc")")
    echo "=== $t crashed; its log:"
    grep -v '^#[0-9]' "$log" | tail -60
  fi
done
echo
echo "fuzzing, ${SECONDS_EACH} s per target (model, split, data: $((SECONDS_EACH * 2)) s) (ASan + UBSan + libFuzzer, clang $(clang++-14 --version 2>/dev/null | head -1 | grep -o '[0-9][0-9.]*' | head -1)):"
printf '  %s\n' "${rows[@]}"
echo "$(( $# - failed )) of $# fuzz targets ran clean"
[ "$failed" -eq 0 ]
