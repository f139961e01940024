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
source fuzz/flags.sh
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0:allocator_may_return_null=0}"
export PIPPY_FUZZ_MODEL="${PIPPY_FUZZ_MODEL:-examples/models/zoo/gpt.pt}"
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
failed=0
rows=()
# First the check of the check: a bug planted in a copy (fuzz/planted_fuzz.cc) must
# fail its target with AddressSanitizer's report from the child; a child killed by a
# signal (as LibTorch kills some) is absorbed; a clean input passes.
if [ "${1:-}" = --planted ]; then
  planted=$2
  shift 2
  printf 'BUG planted' > "$WORK/bug.in"
  printf 'SEGV' > "$WORK/segv.in"
  printf 'fine' > "$WORK/fine.in"
  "$planted" -runs=1 "$WORK/bug.in" > "$WORK/planted.log" 2>&1
  rc_bug=$?
  "$planted" -runs=1 "$WORK/segv.in" "$WORK/fine.in" > "$WORK/planted-ok.log" 2>&1
  rc_ok=$?
  if [ "$rc_bug" != 0 ] && grep -q "a sanitizer report from pippy's own code in the child" "$WORK/planted.log" &&
     grep -q "heap-buffer-overflow" "$WORK/planted.log" && [ "$rc_ok" = 0 ]; then
    rows+=("$(printf '%-18s a bug planted in the child is reported (exit %s): %s' planted_fuzz "$rc_bug" \
              "$(grep -o 'AddressSanitizer: heap-buffer-overflow' "$WORK/planted.log" | head -1)")")
  else
    failed=$((failed + 1))
    rows+=("$(printf '%-18s FAILED: planted bug exit %s, signal/clean inputs exit %s' planted_fuzz "$rc_bug" "$rc_ok")")
    echo "=== planted_fuzz: its logs"
    tail -30 "$WORK/planted.log" "$WORK/planted-ok.log"
  fi
fi
for bin in "$@"; do
  t=$(basename "$bin")
  seeds="fuzz/corpus/$t"
  mkdir -p "$WORK/$t"
  log="$WORK/$t.log"
  # The LibTorch targets run about 10 inputs a second (a LibTorch load or split each;
  # model and data in a fork too), so they get twice the time. A fixed seed
  # (PIPPY_FUZZ_SEED, default 1): the same mutations every run, so that a failure here
  # reproduces; scripts/fuzz explores with fresh seeds.
  seconds=$SECONDS_EACH
  if fuzz_uses_libtorch "$t"; then seconds=$((SECONDS_EACH * 2)); fi
  # shellcheck disable=SC2046
  "$bin" -seed="${PIPPY_FUZZ_SEED:-1}" -max_total_time="$seconds" $(fuzz_flags "$t") \
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
echo "$(( $# - (failed > 0 ? failed : 0) )) of $# fuzz targets ran clean (and the planted bug: see its line)"
[ "$failed" -eq 0 ]
