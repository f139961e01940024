// `pippyctl local`: a coordinator and N workers on this machine, in the foreground,
// each started as its own process and stopped by its pid.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <iostream>
#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/commands.h"
#include "common/cli.h"

extern char** environ;

namespace pippy::cli {
namespace {

volatile sig_atomic_t g_stop = 0;

pid_t Spawn(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (posix_spawn(&pid, argv[0], nullptr, nullptr, argv.data(), environ) != 0) return -1;
  return pid;
}

struct LocalFlags {
  int workers = 1;
  int port = 7070;
  std::string state_dir = "pippy-state";
  int threads = 1;
  std::string ucx_tls;
};

int RunLocal(const LocalFlags& f) {
  const std::string coord = FindSiblingBinary("pippy-coordinator", "coordinator");
  const std::string worker = FindSiblingBinary("pippy-worker", "worker");
  std::vector<pid_t> pids;
  pids.push_back(Spawn({coord, "--bind", "127.0.0.1", "--port", std::to_string(f.port), "--state-dir", f.state_dir}));
  if (pids.back() < 0) return Fail(kProgram, absl::NotFoundError(absl::StrCat("cannot start ", coord)));
  const std::string where = absl::StrCat("127.0.0.1:", f.port);
  for (int i = 0; i < f.workers; ++i) {
    std::vector<std::string> a = {worker, "--coordinator", where, "--name", absl::StrCat("local-", i), "--threads",
                                  std::to_string(f.threads)};
    if (!f.ucx_tls.empty()) {
      a.push_back("--ucx-tls");
      a.push_back(f.ucx_tls);
    }
    pids.push_back(Spawn(a));
  }
  std::cerr << "pippyctl local: state (jobs, models, checkpoints) in " << std::filesystem::absolute(f.state_dir).string()
            << (f.port != 7070 ? absl::StrCat("; for pippyctl in another shell: export PIPPY_COORDINATOR=", where) : "")
            << "\n";
  std::cerr << "pippyctl local: coordinator on " << where << " with " << f.workers
            << " workers (Ctrl-C stops them)\n";
  signal(SIGINT, [](int) { g_stop = 1; });
  signal(SIGTERM, [](int) { g_stop = 1; });
  int code = kExitOk;
  while (!g_stop) {
    int status = 0;
    pid_t done = waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      std::cerr << "pippyctl local: process " << done << " exited; stopping the others\n";
      for (pid_t& p : pids) {
        if (p == done) p = -1;
      }
      code = kExitInternal;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  for (pid_t p : pids) {
    if (p > 0) kill(p, SIGTERM);
  }
  for (pid_t p : pids) {
    if (p <= 0) continue;
    for (int i = 0; i < 50 && waitpid(p, nullptr, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    kill(p, SIGKILL);
    waitpid(p, nullptr, 0);
  }
  return code;
}

}  // namespace

void AddLocalCommand(CLI::App& root, const GlobalFlags&, int* exit_code) {
  auto f = std::make_shared<LocalFlags>();
  CLI::App* cmd = root.add_subcommand(
      "local", "Run a coordinator on 127.0.0.1:PORT and N workers in the foreground; Ctrl-C stops them all");
  cmd->fallthrough();
  cmd->add_option("--workers", f->workers, "workers to start")->check(CLI::Range(1, 256))->capture_default_str();
  cmd->add_option("--port", f->port, "the coordinator's port")->check(CLI::Range(1, 65535))->capture_default_str();
  cmd->add_option("--state-dir", f->state_dir, "the coordinator's state directory")->capture_default_str();
  cmd->add_option("--threads", f->threads, "compute threads per worker")->check(CLI::Range(1, 1024))->capture_default_str();
  cmd->add_option("--ucx-tls", f->ucx_tls, "UCX transports for the workers (e.g. sm,self)");
  cmd->callback([f, exit_code] { *exit_code = RunLocal(*f); });
}

}  // namespace pippy::cli
