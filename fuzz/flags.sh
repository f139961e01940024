# Sourced by fuzz/fuzz_test.sh and scripts/fuzz: libFuzzer's flags for a target.
# -rss_limit_mb and -timeout make an input that eats memory or hangs a failure too.
# LibTorch's unpickler makes room for the length a pickle's string announces (up to
# 4 GiB and more) before it reads it. The coordinator meets that in its model check's
# child under a heap cap; the LibTorch targets meet it in a fork (fuzz/child.h) and
# allow such single allocations there (RSS stays limited in this process).
fuzz_flags() {  # TARGET
  echo -timeout=20 -rss_limit_mb=4096 -print_final_stats=1
  if fuzz_uses_libtorch "$1"; then echo -malloc_limit_mb=65536; fi
  # Serving requests are read in the coordinator's own process: no allocation may
  # follow what a pickle announces (the largest legitimate one is the input's size).
  if [ "$1" = request_fuzz ]; then echo -malloc_limit_mb=512; fi
}
# The targets that load or split with LibTorch: about 10 inputs a second.
fuzz_uses_libtorch() { case "$1" in model_fuzz|split_fuzz|data_fuzz) return 0 ;; *) return 1 ;; esac; }
