#!/bin/bash
# Compiles (-c) or links a libFuzzer target with Debian's clang: AddressSanitizer,
# UndefinedBehaviorSanitizer (every finding fatal; not vptr/function, which need type
# information across the uninstrumented LibTorch) and
# libFuzzer's coverage instrumentation over pippy's code; the system libraries
# (LibTorch, protobuf, Abseil, spdlog) are linked as they are, uninstrumented.
# Called by the genrules of fuzz/fuzz.bzl: clang_fuzz.sh compile GENDIR SRC OUT
#                                       or clang_fuzz.sh link OUT OBJ...
set -eu
CLANG=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$CLANG" ]; then
  echo "fuzz: clang++ is not installed (scripts/setup installs Debian's clang and libclang-rt-14-dev)" >&2
  exit 1
fi
mode=$1; shift
case "$mode" in
  compile)
    gendir=$1 src=$2 out=$3
    exec "$CLANG" -c -std=c++17 -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined,fuzzer-no-link -fno-sanitize=vptr,function -fno-sanitize-recover=undefined \
      -DSPDLOG_COMPILED_LIB -DSPDLOG_FMT_EXTERNAL -Wno-deprecated-declarations -Wno-unknown-warning-option \
      -I. -I"$gendir" -isystem /usr/include/torch/csrc/api/include "$src" -o "$out"
    ;;
  link)
    out=$1; shift
    exec "$CLANG" -fsanitize=address,undefined,fuzzer -Wl,--as-needed "$@" -o "$out" \
      -ltorch -ltorch_cpu -lc10 -lprotobuf -lspdlog -lfmt \
      -labsl_status -labsl_statusor -labsl_cord -labsl_cord_internal -labsl_cordz_functions \
      -labsl_cordz_handle -labsl_cordz_info -labsl_str_format_internal -labsl_strings \
      -labsl_strings_internal -labsl_synchronization -labsl_time -labsl_time_zone -labsl_int128 \
      -labsl_hash -labsl_city -labsl_low_level_hash -labsl_raw_hash_set -labsl_hashtablez_sampler \
      -labsl_throw_delegate -labsl_base -labsl_spinlock_wait -labsl_raw_logging_internal \
      -labsl_malloc_internal -labsl_stacktrace -labsl_symbolize -labsl_debugging_internal \
      -labsl_demangle_internal -labsl_graphcycles_internal -labsl_exponential_biased \
      -labsl_log_severity -lpthread
    ;;
  *) echo "clang_fuzz.sh: compile|link" >&2; exit 2 ;;
esac
