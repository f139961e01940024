// pippyctl: the command-line client. `main` only dispatches to subcommands.
#include <cstring>
#include <iostream>
#include <string>

#include "client/exit_codes.h"
#include "client/remote_commands.h"
#include "client/schedule_command.h"
#include <cstdlib>
#include <unistd.h>
#include <climits>
#include "client/split_command.h"

namespace {

constexpr char kUsage[] = R"(usage: pippyctl [--coordinator HOST:PORT] COMMAND [options]   (COMMAND --help for details)

Coordinator commands (--coordinator, else $PIPPY_COORDINATOR, else localhost:7070):
  submit MODEL.pt    submit a training or inference job (--wait to follow it)
  list               jobs and their states
  status JOB         one job: state, step, losses, reason
  watch JOB          a live progress bar until the job ends
  cancel JOB         stop a job
  fetch JOB -o F.pt  the trained model: one TorchScript file like the submitted one
  workers            registered workers
  local --workers N  run a coordinator and N workers on this machine (Ctrl-C stops them)

Offline commands (no coordinator needed):
  split MODEL.pt     split a TorchScript model into pipeline stages; print or write the plan
  schedule           generate, validate and simulate a pipeline schedule; print its timeline

Exit codes: 0 success, 1 internal error, 2 bad input, 3 coordinator unreachable.
)";

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
      std::strcmp(argv[1], "help") == 0) {
    std::cout << kUsage;
    return argc < 2 ? pippy::cli::kExitBadInput : pippy::cli::kExitOk;
  }
  int first = 1;
  const char* env = std::getenv("PIPPY_COORDINATOR");
  std::string coordinator = env ? env : "localhost:7070";
  std::string a1 = argv[1];
  if (a1.rfind("--coordinator", 0) == 0) {
    if (a1.size() > 14 && a1[13] == '=') {
      coordinator = a1.substr(14);
      first = 2;
    } else if (argc > 2) {
      coordinator = argv[2];
      first = 3;
    }
  }
  if (first >= argc) {
    std::cerr << "pippyctl: missing command; run pippyctl --help\n";
    return pippy::cli::kExitBadInput;
  }
  std::string command = argv[first];
  if (command == "split") return pippy::cli::RunSplitCommand(argc, argv, first + 1);
  if (command == "schedule") return pippy::cli::RunScheduleCommand(argc, argv, first + 1);
  if (command == "local") {
    char self[PATH_MAX] = {0};
    ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    return pippy::cli::RunLocalCommand(argc, argv, first + 1, n > 0 ? std::string(self, n) : argv[0]);
  }
  for (const char* remote : {"submit", "list", "status", "watch", "cancel", "fetch", "workers"}) {
    if (command == remote) return pippy::cli::RunRemoteCommand(command, coordinator, argc, argv, first + 1);
  }
  std::cerr << "pippyctl: unknown command '" << command << "'; run pippyctl --help\n";
  return pippy::cli::kExitBadInput;
}
