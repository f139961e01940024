#include "common/memory.h"

#include <malloc.h>

namespace pippy {

void KeepFreedMemory() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 0x7fffffff);  // the largest value mallopt takes (2 GiB)
}

void ReturnFreedMemory() { malloc_trim(0); }

}  // namespace pippy
