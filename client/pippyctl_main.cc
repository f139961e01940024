// pippyctl: the command-line client. `main` only dispatches to subcommands.
#include <cstring>
#include <iostream>
#include <string>

#include "client/exit_codes.h"
#include "client/schedule_command.h"
#include "client/split_command.h"

namespace {

constexpr char kUsage[] = R"(usage: pippyctl COMMAND [options]   (pippyctl COMMAND --help for details)

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
  std::string command = argv[1];
  if (command == "split") return pippy::cli::RunSplitCommand(argc, argv, 2);
  if (command == "schedule") return pippy::cli::RunScheduleCommand(argc, argv, 2);
  std::cerr << "pippyctl: unknown command '" << command << "'; run pippyctl --help\n";
  return pippy::cli::kExitBadInput;
}
