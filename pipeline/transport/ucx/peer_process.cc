#include "pipeline/transport/ucx/peer_process.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace pippy::transport::ucx {

Options LocalOptions(const std::string& tls) {
  Options o;
  o.ucx_config = {{"TLS", tls}};
  if (tls.find("tcp") != std::string::npos) o.ucx_config.push_back({"NET_DEVICES", "lo"});
  return o;
}

PeerProcess::PeerProcess(const std::vector<std::string>& argv) {
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0) return;
  if (pipe(from_child) != 0) {
    close(to_child[0]);
    close(to_child[1]);
    return;
  }
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
  posix_spawn_file_actions_adddup2(&fa, from_child[1], 1);
  posix_spawn_file_actions_addclose(&fa, to_child[1]);
  posix_spawn_file_actions_addclose(&fa, from_child[0]);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  if (posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ) != 0) pid_ = -1;
  posix_spawn_file_actions_destroy(&fa);
  close(to_child[0]);
  close(from_child[1]);
  to_ = fdopen(to_child[1], "w");
  from_ = fdopen(from_child[0], "r");
}

PeerProcess::~PeerProcess() {
  Kill();
  if (to_) fclose(to_);
  if (from_) fclose(from_);
}

void PeerProcess::Kill() {
  if (pid_ <= 0) return;
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

int PeerProcess::WaitExit(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (pid_ > 0) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    if (absl::Now() >= deadline) return -1;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return -1;
}

absl::StatusOr<std::unique_ptr<UcxTransport>> PeerProcess::Connect(const Options& options) {
  if (pid_ <= 0) return absl::FailedPreconditionError("the peer process did not start");
  auto t = UcxTransport::Create(0, 2, options);
  if (!t.ok()) return t.status();
  std::string child;
  char buf[8192];
  while (child.empty() && fgets(buf, sizeof(buf), from_)) {
    std::string line(buf);
    if (line.rfind("ADDRESS ", 0) == 0) {
      child = absl::HexStringToBytes(std::string(absl::StripTrailingAsciiWhitespace(line.substr(8))));
    }
  }
  if (child.empty()) return absl::UnavailableError("the peer process ended without printing its ADDRESS line");
  fprintf(to_, "%s\n", absl::BytesToHexString((*t)->address()).c_str());
  fflush(to_);
  absl::Status s = (*t)->Connect({(*t)->address(), child});
  if (!s.ok()) return s;
  return t;
}

}  // namespace pippy::transport::ucx
