// Running part of a fuzz input in a fork, as the coordinator runs LibTorch's loaders in a
// child process (coordinator/job_preparation.h): LibTorch crashes on some corrupt archives
// and pickles, and sizes allocations by what a pickle announces. What happens in the
// child is absorbed, as the coordinator absorbs it; the fuzz target then runs pippy's
// own code in-process only on inputs that a child got through.
#ifndef PIPPY_FUZZ_CHILD_H_
#define PIPPY_FUZZ_CHILD_H_

#include <fcntl.h>
#include <sanitizer/allocator_interface.h>
#include <sanitizer/common_interface_defs.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

namespace pippy::fuzz {

// How the child ended: `fn`'s exit code 0 or 2, or anything else (a signal, a
// sanitizer's report of an allocation LibTorch sized from the input, ...).
enum class Child { kOk, kRefused, kFailed };

// In the child: an allocation of more than 1 GiB ends it at once (the coordinator's
// child meets it as std::bad_alloc under its heap cap; here the sanitizer would map and
// fill it first, which takes seconds).
inline void EndOnHugeAllocation(const volatile void*, size_t size) {
  if (size > (size_t{1} << 30)) _exit(3);
}
inline void NoFreeHook(const volatile void*) {}

// Runs `fn` (returning 0 or 2) in a fork. In the child, SIGSEGV/SIGBUS/SIGABRT/
// SIGFPE/SIGILL go to their default action (set through the kernel: the sanitizers'
// signal() and sigaction() keep their own handlers), libFuzzer's crash report and
// stderr are off: what the child meets is not the target's finding.
template <typename Fn>
Child InChild(Fn&& fn) {
  const pid_t pid = fork();
  if (pid == 0) {
    struct {
      void (*handler)(int);
      unsigned long flags;
      void (*restorer)();
      uint64_t mask;
    } dfl{SIG_DFL, 0, nullptr, 0};
    for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) syscall(SYS_rt_sigaction, sig, &dfl, nullptr, 8);
    __sanitizer_set_death_callback(nullptr);
    __sanitizer_install_malloc_and_free_hooks(EndOnHugeAllocation, NoFreeHook);
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, STDERR_FILENO);
    _exit(fn());
  }
  if (pid < 0) std::abort();
  int status = 0;
  while (waitpid(pid, &status, 0) != pid) {
    if (errno != EINTR) std::abort();  // libFuzzer's -timeout ticks with SIGALRM
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return Child::kOk;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 2) return Child::kRefused;
  return Child::kFailed;
}

}  // namespace pippy::fuzz

#endif  // PIPPY_FUZZ_CHILD_H_
