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

// For the processes that stream files through gRPC (the coordinator and its children,
// workers receiving their stages, pippyctl): allocations up to 32 MiB come from the
// heap, and the heap is trimmed only once 32 MiB of its top is free. By default glibc
// gave the buffers of each message back to the kernel as they were freed, so every
// 1 MiB chunk of an upload landed in freshly faulted pages: a 2 GiB submission took
// 5.8-9.6 s, 40% of the coordinator's time in page faults under the socket copy; with
// these settings 1.4-2.5 s (`cp` of the file and sync: 1.6-2.0 s). Thresholds of 8 and
// 16 MiB did not help; 64 and 256 MiB did not help more. What a process may keep
// beyond its need is 32 MiB per malloc arena, so `max_arenas` > 0 caps their number
// (glibc's default is 8 per core, one per thread that allocates until then): the
// coordinator's gRPC threads each filled an arena, and its peak while receiving a
// 384 MiB model rose from 211 MiB with 2 arenas to 324 MiB with the default, its
// upload no slower (2 GiB: 2.8-6.5 s with 2, 3.1-7.0 s with 16, on a disk that
// copies it in 3.7-4.3 s). 0 leaves glibc's default: the workers' compute threads
// allocate concurrently. KeepFreedMemory later overrides the thresholds.
void KeepFreedMemoryForStreams(int max_arenas = 0);

// Makes glibc's malloc back its large blocks with transparent huge pages (2 MiB pages,
// the tunable glibc.malloc.hugetlb=1, glibc 2.35 and later), where the kernel offers them
// on request (/sys/kernel/mm/transparent_hugepage/enabled "madvise" or "always"). A
// stage arrives in, and loads into, buffers of hundreds of MiB whose every 4 KiB page
// was a page fault: on the 2-core VM of bench/memory_bench.sh a 256 MiB stage took
// 0.96-1.23 s to receive and 0.9-1.1 s more to load and connect; with huge pages
// 0.66-0.89 s and 0.6-0.7 s. glibc reads its tunables only when a program starts, so
// this sets GLIBC_TUNABLES and executes the program again (same pid, same arguments);
// call it first in main. It does nothing where the tunable is already set (by a user,
// or by the first run) or PIPPY_HUGE_PAGES=0; children inherit the setting.
void UseTransparentHugePages(char** argv);

// Gives the heap's free memory back to the kernel (malloc_trim): call when a job ends,
// so that an idle worker does not hold its last job's peak.
void ReturnFreedMemory();

// The most resident memory (bytes) this process has held since it started or since the
// last call, and the peak starts again from what is resident now (Linux: VmHWM, reset
// through /proc/self/clear_refs). 0 where the kernel does not tell.
int64_t TakePeakResidentBytes();

}  // namespace pippy

#endif  // PIPPY_COMMON_MEMORY_H_
