// Running part of a fuzz input in a fork, as the coordinator runs LibTorch's loaders in a
// child process (coordinator/job_preparation.h): LibTorch crashes on some corrupt archives
// and pickles, and sizes allocations by what a pickle announces. What happens in the
// child is absorbed, as the coordinator absorbs it, unless a sanitizer reports it in
// pippy's own code; the fuzz target then runs pippy's own code in-process only on
// inputs that a child got through.
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
#include <cstdio>
#include <cstdlib>
#include <string>

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

// The first frame of a sanitizer report that is not the sanitizer's own (its
// interceptors and runtime), or "" when the report has no stack (UBSan prints none:
// its report's first line names the source file, always pippy's, as only pippy's code
// is instrumented).
inline std::string FirstOwnFrame(const std::string& report) {
  size_t at = 0;
  while (at < report.size()) {
    size_t end = report.find('\n', at);
    if (end == std::string::npos) end = report.size();
    const std::string line = report.substr(at, end - at);
    at = end + 1;
    const size_t hash = line.find_first_not_of(' ');
    if (hash == std::string::npos || line[hash] != '#' || line.find(" 0x") == std::string::npos) continue;
    if (line.find(" in __asan") != std::string::npos || line.find(" in __interceptor") != std::string::npos ||
        line.find(" in __sanitizer") != std::string::npos || line.find(" in __ubsan") != std::string::npos ||
        line.find("compiler-rt") != std::string::npos) {
      continue;
    }
    return line;
  }
  return "";
}

// Whether a child's sanitizer report is LibTorch's (its first own frame is in
// LibTorch's libraries, which are not instrumented: an interceptor caught them) and
// so absorbed like LibTorch's crashes, or pippy's: a finding.
inline bool IsLibTorchReport(const std::string& report) {
  const std::string frame = FirstOwnFrame(report);
  return frame.find("libtorch") != std::string::npos || frame.find("libc10") != std::string::npos;
}

// Runs `fn` (returning 0 or 2) in a fork. In the child, SIGSEGV/SIGBUS/SIGABRT/
// SIGFPE/SIGILL go to their default action (set through the kernel: the sanitizers'
// signal() and sigaction() keep their own handlers) and libFuzzer's crash report is
// off: a crash there is LibTorch's to fix and is absorbed, as the coordinator's child
// absorbs it. The child's stderr comes back to this process: a sanitizer report
// (AddressSanitizer, UndefinedBehaviorSanitizer) whose first frame is pippy's code is
// pippy's finding: it is printed and this process aborts, so libFuzzer keeps the input.
template <typename Fn>
Child InChild(Fn&& fn) {
  int err[2];
  if (pipe(err) != 0) std::abort();
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
    close(err[0]);
    dup2(err[1], STDERR_FILENO);
    close(err[1]);
    _exit(fn());
  }
  if (pid < 0) std::abort();
  close(err[1]);
  // Read while the child runs (a report can exceed the pipe's buffer); keep 256 KiB.
  std::string said;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(err[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;  // libFuzzer's -timeout ticks with SIGALRM
    if (n <= 0) break;
    if (said.size() < (size_t{256} << 10)) said.append(buf, static_cast<size_t>(n));
  }
  close(err[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) != pid) {
    if (errno != EINTR) std::abort();
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return Child::kOk;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 2) return Child::kRefused;
  const bool report = said.find("ERROR: AddressSanitizer") != std::string::npos ||
                      said.find("runtime error:") != std::string::npos;
  if (report && !IsLibTorchReport(said)) {
    std::fprintf(stderr, "fuzz/child.h: a sanitizer report from pippy's own code in the child:\n%s\n", said.c_str());
    std::abort();
  }
  return Child::kFailed;
}

}  // namespace pippy::fuzz

#endif  // PIPPY_FUZZ_CHILD_H_
