// pippyctl: the command-line client. `main` only builds the command tree and parses.
#include <iostream>

#include "client/commands.h"
#include "common/cli.h"
#include "common/memory.h"

int main(int argc, char** argv) {
  using namespace pippy::cli;
  pippy::KeepFreedMemoryForStreams(/*max_arenas=*/2);  // submit and fetch stream files in chunks (memory.h)
  CLI::App app("pippyctl: split, schedule, submit and follow pipeline-parallel jobs.\n"
               "Exit codes: 0 success, 1 internal error or a job that did not succeed, 2 bad input, "
               "3 coordinator unreachable.",
               kProgram);
  Configure(app);
  GlobalFlags globals;
  app.add_option("--coordinator", globals.coordinator, "coordinator address HOST:PORT")
      ->envname("PIPPY_COORDINATOR")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->capture_default_str();
  app.add_option("--output", globals.output, "table for people, json for programs")
      ->check(CLI::IsMember({"table", "json"}))
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->capture_default_str();
  app.add_option("--tls-ca", globals.tls_ca, "TLS to the coordinator: the CA that signed its certificate (PEM)")
      ->envname("PIPPY_TLS_CA")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->check(CLI::ExistingFile);
  app.add_option("--token-file", globals.token_file,
                 "a file holding your token for a coordinator started with --auth-token-file (else $PIPPY_TOKEN)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
      ->check(CLI::ExistingFile);
  app.require_subcommand(1);
  int exit_code = kExitOk;
  AddRemoteCommands(app, globals, &exit_code);
  AddLocalCommand(app, globals, &exit_code);
  AddSplitCommand(app);
  AddScheduleCommand(app, globals, &exit_code);
  AddCertsCommand(app, &exit_code);
  const std::vector<std::string> value_options = {"--coordinator", "--output", "--tls-ca", "--token-file"};
  // --output json anywhere on the line: errors as JSON objects on stderr too.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if ((arg == "--output" && i + 1 < argc && std::string(argv[i + 1]) == "json") || arg == "--output=json") {
      SetJsonErrors(true);
    }
  }
  if (auto unknown = UnknownCommand(app, argc, argv, value_options)) {
    return Fail(kProgram, absl::InvalidArgumentError(*unknown));
  }
  // `split` runs as pippyctl-split (LibTorch): hand it what follows the command.
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--coordinator" || arg == "--output" || arg == "--tls-ca" || arg == "--token-file") {
      if (i + 1 < argc && arg == "--output") globals.output = argv[i + 1];
      ++i;
      continue;
    }
    if (arg.rfind("--output=", 0) == 0) globals.output = arg.substr(9);
    if (arg.empty() || arg[0] == '-') continue;
    if (arg == "split") return RunSplitProgram(std::vector<std::string>(argv + i + 1, argv + argc), globals);
    if (arg == "plan") return RunSplitProgram(std::vector<std::string>(argv + i, argv + argc), globals);
    break;
  }
  if (auto code = Parse(app, argc, argv)) return *code;
  return exit_code;
}
