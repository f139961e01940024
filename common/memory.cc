#include "common/memory.h"

#include <malloc.h>

#include <fstream>
#include <sstream>
#include <string>

namespace pippy {

void KeepFreedMemory() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 0x7fffffff);  // the largest value mallopt takes (2 GiB)
}

void KeepFreedMemoryForStreams(int max_arenas) {
  if (max_arenas > 0) mallopt(M_ARENA_MAX, max_arenas);
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 32 << 20);
}

void ReturnFreedMemory() { malloc_trim(0); }

int64_t TakePeakResidentBytes() {
  int64_t kib = 0;
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) != 0) continue;
    std::istringstream(line.substr(6)) >> kib;
    break;
  }
  // "5" resets the peak resident set size to the current one (Linux 4.0 and later).
  std::ofstream("/proc/self/clear_refs") << "5";
  return kib * 1024;
}

}  // namespace pippy
