// pippyctl's side of `split`: listed in its help, run as pippyctl-split.
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <iostream>

#include "client/commands.h"
#include "common/cli.h"

namespace pippy::cli {

void AddSplitCommand(CLI::App& root) {
  CLI::App* cmd = root.add_subcommand("split", kSplitDescription);
  cmd->allow_extras();  // pippyctl-split parses them (pippyctl split --help lists them)
  CLI::App* plan = root.add_subcommand("plan", kPlanDescription);
  plan->allow_extras();  // pippyctl-split plan parses them
}

int RunSplitProgram(const std::vector<std::string>& args, const GlobalFlags& globals) {
  const std::string program = FindSiblingBinary(kSplitProgram, "client");
  std::vector<std::string> all = {program, "--output", globals.output};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  execv(program.c_str(), argv.data());
  execvp(program.c_str(), argv.data());  // not beside pippyctl: on PATH
  std::cerr << kProgram << ": cannot run " << kSplitProgram << " (" << std::strerror(errno)
            << "); install it beside pippyctl\n";
  return kExitInternal;
}

}  // namespace pippy::cli
