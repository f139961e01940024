#include "coordinator/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/memory.h"

extern char** environ;

namespace pippy::coordinator {
namespace {

constexpr char kPhase[] = "[pippy-phase ";
constexpr char kError[] = "[pippy-error ";
constexpr char kPeak[] = "[pippy-peak ";
constexpr size_t kMaxSaid = 64 * 1024;

// What the child printed, line by line: phases, its error, its peak; the rest kept.
class Transcript {
 public:
  // Takes more output; returns whether a new phase began.
  bool Add(absl::string_view bytes) {
    pending_.append(bytes.data(), bytes.size());
    bool new_phase = false;
    size_t nl;
    while ((nl = pending_.find('\n')) != std::string::npos) {
      new_phase |= Line(pending_.substr(0, nl));
      pending_.erase(0, nl + 1);
    }
    return new_phase;
  }
  void Finish(ChildResult* r) {
    if (!pending_.empty()) Line(pending_);
    if (in_error_) r->error = absl::Status(code_, absl::StripAsciiWhitespace(error_));
    r->has_error = in_error_;
    r->phase = phase_;
    r->peak_rss_bytes = peak_;
    r->said = std::string(absl::StripAsciiWhitespace(said_));
  }
  const std::string& phase() const { return phase_; }

 private:
  bool Line(const std::string& line) {
    absl::string_view rest = line;
    if (absl::ConsumePrefix(&rest, kPhase) && absl::ConsumeSuffix(&rest, "]")) {
      phase_ = std::string(rest);
      return true;
    }
    int code = 0;
    if (absl::ConsumePrefix(&rest, kError) && absl::ConsumeSuffix(&rest, "]") && absl::SimpleAtoi(rest, &code) &&
        code > 0 && code <= 16) {
      in_error_ = true;
      code_ = static_cast<absl::StatusCode>(code);
      return false;
    }
    if (absl::ConsumePrefix(&rest, kPeak) && absl::ConsumeSuffix(&rest, "]") && absl::SimpleAtoi(rest, &peak_)) {
      return false;
    }
    std::string& to = in_error_ ? error_ : said_;
    if (to.size() < kMaxSaid) absl::StrAppend(&to, line, "\n");
    return false;
  }

  std::string pending_, said_, error_, phase_;
  bool in_error_ = false;
  absl::StatusCode code_ = absl::StatusCode::kUnknown;
  int64_t peak_ = 0;
};

}  // namespace

ChildResult RunChild(const ChildSpec& spec) {
  using Ending = ChildResult::Ending;
  ChildResult result;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    result.start_error = absl::StrCat("pipe: ", std::strerror(errno));
    return result;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  std::vector<std::string> args = spec.argv;
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (spawned != 0) {
    close(fds[0]);
    result.start_error = absl::StrCat("cannot start ", spec.argv[0], ": ", std::strerror(spawned));
    return result;
  }
  // Read what the child says until it closes the pipe (it exits) or a limit runs out.
  Transcript transcript;
  const absl::Time started = absl::Now();
  absl::Time phase_started = started;
  for (;;) {
    const absl::Time now = absl::Now();
    if (now - started >= spec.timeout) {
      result.ending = Ending::kTimedOut;
      result.limit = spec.timeout;
      break;
    }
    auto bound = spec.phase_timeouts.find(transcript.phase());
    if (bound != spec.phase_timeouts.end() && now - phase_started >= bound->second) {
      result.ending = Ending::kPhaseTimedOut;
      result.limit = bound->second;
      break;
    }
    if (spec.cancelled && spec.cancelled()) {
      result.ending = Ending::kCancelled;
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    const int ready = poll(&p, 1, 100);
    if (ready <= 0) continue;  // EINTR or the 100 ms tick: the limits are checked again
    char buf[4096];
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    if (transcript.Add(absl::string_view(buf, static_cast<size_t>(n)))) phase_started = absl::Now();
  }
  close(fds[0]);
  const bool killed = result.ending != Ending::kNotStarted;
  if (killed) kill(pid, SIGKILL);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  transcript.Finish(&result);
  if (killed) return result;
  if (WIFSIGNALED(status)) {
    result.ending = Ending::kSignalled;
    result.signal = WTERMSIG(status);
  } else {
    result.ending = Ending::kExited;
    result.exit_code = WEXITSTATUS(status);
  }
  return result;
}

std::optional<absl::Status> PlainEnding(const ChildResult& r, absl::string_view doing) {
  using Ending = ChildResult::Ending;
  switch (r.ending) {
    case Ending::kNotStarted:
      return absl::UnavailableError(absl::StrCat(doing, ": ", r.start_error));
    case Ending::kCancelled:
      return absl::UnavailableError(absl::StrCat("the coordinator stopped while ", doing, "; try again once it is back"));
    case Ending::kExited:
      if (r.exit_code == 0) return absl::OkStatus();
      if (r.has_error) return r.error;
      return absl::UnavailableError(absl::StrCat(doing, ": the child process exited with status ", r.exit_code,
                                                 " without saying why; is it a pippy-coordinator binary?",
                                                 r.said.empty() ? "" : absl::StrCat(" It printed: ", r.said)));
    default:
      return std::nullopt;
  }
}

void EnterChild(uint64_t heap_bytes) {
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() == 1) _exit(1);  // the parent died before the line above
  if (heap_bytes > 0) {
    rlimit limit{};
    getrlimit(RLIMIT_DATA, &limit);
    // Never above a cap the coordinator itself was started under.
    const rlim_t cap = limit.rlim_max == RLIM_INFINITY ? heap_bytes : std::min<rlim_t>(heap_bytes, limit.rlim_max);
    limit.rlim_cur = cap;
    limit.rlim_max = cap;
    setrlimit(RLIMIT_DATA, &limit);
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
}

void AnnouncePhase(absl::string_view phase) {
  std::printf("%s%.*s]\n", kPhase, static_cast<int>(phase.size()), phase.data());
  std::fflush(stdout);
}

void ReportError(const absl::Status& status) {
  std::printf("\n%s%d]\n%.*s\n", kError, static_cast<int>(status.code()), static_cast<int>(status.message().size()),
              status.message().data());
  std::fflush(stdout);
}

void ReportPeak() {
  std::printf("%s%lld]\n", kPeak, static_cast<long long>(TakePeakResidentBytes()));
  std::fflush(stdout);
}

}  // namespace pippy::coordinator
