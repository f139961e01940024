// A bug planted on purpose, to show that fuzz/child.h reports what AddressSanitizer
// finds in pippy's own code inside the child (fuzz_test runs it and expects the
// failure). Inputs starting "BUG" read past a heap buffer in the child; "SEGV" kills
// the child by a signal, which is absorbed like LibTorch's crashes; anything else is
// fine. Not one of the fuzz targets fuzz_test fuzzes.
#include <csignal>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz/child.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  (void)pippy::fuzz::InChild([&] {
    if (size >= 3 && std::memcmp(data, "BUG", 3) == 0) {
      std::vector<char> v(size);
      volatile char past = v.data()[size + 8];  // the planted heap-buffer-overflow
      (void)past;
    }
    if (size >= 4 && std::memcmp(data, "SEGV", 4) == 0) raise(SIGSEGV);
    return 0;
  });
  return 0;
}
