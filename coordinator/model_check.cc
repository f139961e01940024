#include "coordinator/model_check.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/log.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/stage/data_source.h"

extern char** environ;

namespace pippy::coordinator {
namespace {

constexpr uintmax_t kMemoryBase = uintmax_t{2} << 30;  // LibTorch itself, with room to spare
constexpr uintmax_t kMemoryFactor = 4;                  // the file, its tensors, the graph
constexpr char kReadingData[] = "[reading data]\n";

}  // namespace

namespace {

// The error as the parent will report it; an allocation the cap refused says so.
void Say(const absl::Status& s) {
  std::string msg(s.message());
  if (absl::StrContains(msg, "bad_alloc")) {
    absl::StrAppend(&msg, " (the file asks for far more memory than its size: it is corrupt or was not written by "
                          "PyTorch)");
  }
  std::fputs(msg.c_str(), stdout);
  std::fflush(stdout);
}

}  // namespace

int RunModelCheck(const std::string& path, const std::string& data_path) {
  log::Init("model-check", log::Level::kOff);
  // A pickle announces a string's length and LibTorch's unpickler makes room for it
  // before reading it: a 5 KB archive can make it allocate and touch 4 GiB. The child's
  // heap is capped at kMemoryFactor times the file plus kMemoryBase, so such an archive
  // fails with bad_alloc (an error) instead of taking the host's memory.
  std::error_code ec;
  uintmax_t file_bytes = std::filesystem::file_size(path, ec);
  if (!ec && !data_path.empty()) file_bytes += std::filesystem::file_size(data_path, ec);
  if (!ec) {
    const rlim_t cap = static_cast<rlim_t>(kMemoryBase + kMemoryFactor * file_bytes);
    rlimit limit{cap, cap};
    setrlimit(RLIMIT_DATA, &limit);
  }
  torch::jit::setGraphExecutorOptimize(false);
  absl::StatusOr<torch::jit::Module> model = torchio::LoadModel(path);
  if (!model.ok()) {
    Say(model.status());
    return 3;
  }
  // The split walks the inlined graph the same way; its errors are reported by the
  // coordinator's own split, this only has to survive it.
  (void)partition::ListLegalCuts(*model);
  if (data_path.empty()) return 0;
  std::fputs(kReadingData, stdout);  // the parent's clue, should the data crash this process
  std::fflush(stdout);
  absl::StatusOr<std::string> bytes = torchio::ReadFile(data_path);
  absl::Status data = bytes.status();
  if (bytes.ok()) data = stage::DataSource::FromExampleBytes(*bytes, torchio::ForwardArgumentNames(*model)).status();
  if (!data.ok()) {
    Say(data);
    return 4;
  }
  return 0;
}

ModelCheckError CheckModelInChild(const std::string& checker, const std::string& path, const std::string& data_path,
                                  absl::Duration timeout) {
  using Field = ModelCheckError::Field;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    return {Field::kModel, absl::UnavailableError(absl::StrCat("model check: pipe: ", std::strerror(errno)))};
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<std::string> args = {checker, kCheckModelFlag, path};
  if (!data_path.empty()) args.push_back(data_path);
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, checker.c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (spawned != 0) {
    close(fds[0]);
    return {Field::kModel, absl::UnavailableError(absl::StrCat("model check: cannot start ", checker, ": ",
                                                               std::strerror(spawned)))};
  }
  // Read what the child says until it closes the pipe (it exits) or the deadline.
  std::string said;
  const absl::Time deadline = absl::Now() + timeout;
  bool timed_out = false;
  for (;;) {
    const int64_t left_ms = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left_ms <= 0) {
      timed_out = true;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int ready = poll(&p, 1, static_cast<int>(std::min<int64_t>(left_ms, 1000)));
    if (ready < 0 && errno == EINTR) continue;
    if (ready <= 0) continue;
    char buf[4096];
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (said.size() < 64 * 1024) said.append(buf, static_cast<size_t>(n));
  }
  close(fds[0]);
  if (timed_out) kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  // Which file the child was on when it crashed or hung: it prints "data" before it
  // reads the data file.
  const Field at = absl::StrContains(said, kReadingData) ? Field::kData : Field::kModel;
  const char* what = at == Field::kData ? "reading the data file" : "loading the model";
  if (timed_out) {
    return {at, absl::InvalidArgumentError(absl::StrCat(what, " did not finish within ", absl::FormatDuration(timeout),
                                                        " (a corrupt file, or one too large for this coordinator; "
                                                        "--model-check-timeout-s)"))};
  }
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    log::Warn("model check of {}: LibTorch crashed with signal {} ({}) {}", path, sig, strsignal(sig), what);
    return {at, absl::InvalidArgumentError(absl::StrCat(
                    "LibTorch crashed (signal ", sig, ", ", strsignal(sig), ") ", what, ": the file is corrupt or was "
                    "not written by ", at == Field::kData ? "torch.save" : "torch.jit.save; save the model with "
                    "torch.jit.script(model).save(path)"))};
  }
  std::string message(absl::StripAsciiWhitespace(said));
  if (auto p = message.find(kReadingData); p != std::string::npos) message.erase(p, std::strlen(kReadingData));
  message = std::string(absl::StripAsciiWhitespace(message));
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return {Field::kModel, absl::OkStatus()};
  if (WIFEXITED(status) && WEXITSTATUS(status) == 3) return {Field::kModel, absl::InvalidArgumentError(message)};
  if (WIFEXITED(status) && WEXITSTATUS(status) == 4) return {Field::kData, absl::InvalidArgumentError(message)};
  return {Field::kModel, absl::UnavailableError(absl::StrCat("model check: ", checker, " exited with status ",
                                                             WIFEXITED(status) ? WEXITSTATUS(status) : -1,
                                                             "; is it a pippy-coordinator binary?"))};
}

}  // namespace pippy::coordinator
