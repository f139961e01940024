// pippyctl-split: `pippyctl split` as its own program (LibTorch), run by pippyctl.
#include "client/commands.h"
#include "common/cli.h"

int main(int argc, char** argv) {
  using namespace pippy::cli;
  CLI::App app(kSplitDescription, "pippyctl split");
  Configure(app);
  GlobalFlags globals;
  app.add_option("--output", globals.output, "table for people, json for programs")
      ->check(CLI::IsMember({"table", "json"}))
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)  // pippyctl passes its own first
      ->capture_default_str();
  int exit_code = kExitOk;
  AddSplitOptions(&app, globals, &exit_code);
  if (auto code = Parse(app, argc, argv)) return *code;
  return exit_code;
}
