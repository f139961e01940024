#include "common/memory.h"

#include <malloc.h>
#include <unistd.h>

#include <cstdlib>

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

void UseTransparentHugePages(char** argv) {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  std::string t = tunables == nullptr ? "" : tunables;
  if (t.find("glibc.malloc.hugetlb") != std::string::npos) return;
  const char* wanted = std::getenv("PIPPY_HUGE_PAGES");
  if (wanted != nullptr && std::string(wanted) == "0") return;
  std::string mode;
  std::getline(std::ifstream("/sys/kernel/mm/transparent_hugepage/enabled"), mode);
  if (mode.find("[madvise]") == std::string::npos && mode.find("[always]") == std::string::npos) return;
  const std::string set = t.empty() ? "glibc.malloc.hugetlb=1" : t + ":glibc.malloc.hugetlb=1";
  if (setenv("GLIBC_TUNABLES", set.c_str(), 1) != 0) return;
  // The program's own path, not /proc/self/exe: the kernel names a process after the
  // file it executed (comm), and tools and refusals ("port in use by pid N
  // (pippy-coordinator)") show that name.
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    execv(self, argv);
  }
  // Not executed again (no /proc?): go on with 4 KiB pages.
  if (tunables == nullptr) {
    unsetenv("GLIBC_TUNABLES");
  } else {
    setenv("GLIBC_TUNABLES", tunables, 1);
  }
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
