// Process-wide memory settings for the processes that run pipeline ranks, and what
// they read of their own memory.
#ifndef PIPPY_COMMON_MEMORY_H_
#define PIPPY_COMMON_MEMORY_H_

#include <cstdint>

namespace pippy {

// Tells glibc's malloc to keep memory the process frees instead of returning it to the
// kernel: allocations up to 1 GiB come from the heap (not one mmap each) and the heap
// is not trimmed. A training step allocates and frees the same activation and gradient
// buffers every micro-batch; handing them back to the kernel made every reuse a run of
// page faults (37k/s per worker measured with perf, 30% of a worker's time in the
// kernel). Call it when the steps begin — after a rank has loaded its stages and freed
// what it received, whose large one-off buffers are better returned (kept, they would
// raise the rank's peak by their size). Safe to call again.
void KeepFreedMemory();

// Gives the heap's free memory back to the kernel (malloc_trim): call when a job ends,
// so that an idle worker does not hold its last job's peak.
void ReturnFreedMemory();

// The most resident memory (bytes) this process has held since it started or since the
// last call, and the peak starts again from what is resident now (Linux: VmHWM, reset
// through /proc/self/clear_refs). 0 where the kernel does not tell.
int64_t TakePeakResidentBytes();

}  // namespace pippy

#endif  // PIPPY_COMMON_MEMORY_H_
