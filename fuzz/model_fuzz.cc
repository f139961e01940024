// Fuzz target: the model loader and the partitioner on mutated TorchScript archives
// (what SubmitJob and pippyctl split receive as model.pt). As the coordinator does
// (coordinator/model_check.h), each input is first loaded in a child process: LibTorch's
// deserializer and TorchScript compiler crash on some corrupt archives (a stack overflow
// in the parser on deep nesting, a bad pointer in the type parser), which is LibTorch's
// to fix and the child's to absorb. What a child survives is loaded here, where any bytes
// must be refused with an error or load to a module that the partitioner lists cuts for
// and splits in two (or refuses to, with an error).
#include <fcntl.h>
#include <sanitizer/common_interface_defs.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "common/log.h"
#include "pipeline/partition/model_io.h"
#include "pipeline/partition/partition.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  pippy::log::Init("model_fuzz", pippy::log::Level::kOff);
  return 0;
}

namespace {

// What the coordinator's --check-model child does, in a fork of this process. Exit 0:
// loaded; 2: refused with an error. Anything else is LibTorch failing on the archive,
// absorbed as the coordinator absorbs it: a crash (SIGSEGV/SIGBUS/SIGABRT go to their
// default action in the child, not to the sanitizer's handler), or an allocation
// LibTorch sizes from the archive, which the product sees as std::bad_alloc and the
// sanitizer reports as out-of-memory. The child's stderr and libFuzzer's crash report
// are off: what the child meets is not this target's finding.
enum class Child { kLoaded, kRefused, kFailed };
Child LoadInChild(absl::string_view bytes) {
  const pid_t pid = fork();
  if (pid == 0) {
    // Straight to the kernel: the sanitizer's signal() and sigaction() keep its own
    // handlers in place.
    struct {
      void (*handler)(int);
      unsigned long flags;
      void (*restorer)();
      uint64_t mask;
    } dfl{SIG_DFL, 0, nullptr, 0};
    for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) syscall(SYS_rt_sigaction, sig, &dfl, nullptr, 8);
    __sanitizer_set_death_callback(nullptr);
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, STDERR_FILENO);
    auto model = pippy::partition::LoadModelFromBytes(bytes, "fuzz.pt");
    if (!model.ok()) _exit(2);
    (void)pippy::partition::ListLegalCuts(*model);
    _exit(0);
  }
  int status = 0;
  if (pid < 0) std::abort();
  while (waitpid(pid, &status, 0) != pid) {
    if (errno != EINTR) std::abort();  // libFuzzer's -timeout ticks with SIGALRM
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return Child::kLoaded;
  if (WIFEXITED(status) && WEXITSTATUS(status) == 2) return Child::kRefused;
  return Child::kFailed;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pippy::partition;
  if (LoadInChild(absl::string_view(reinterpret_cast<const char*>(data), size)) != Child::kLoaded) return 0;
  auto model = LoadModelFromBytes(absl::string_view(reinterpret_cast<const char*>(data), size), "fuzz.pt");
  if (!model.ok()) return 0;
  (void)ListLegalCuts(*model);
  SplitOptions options;
  options.num_stages = 2;
  options.share_tensors = true;
  (void)SplitModel(*model, options);
  return 0;
}
