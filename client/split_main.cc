// pippyctl-split: `pippyctl split` as its own program (LibTorch), run by pippyctl.
#include "client/commands.h"
#include "common/cli.h"

int main(int argc, char** argv) {
  using namespace pippy::cli;
  // pippyctl runs `pippyctl-split --output X plan ...` for `pippyctl plan`.
  bool plan = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--output") {
      ++i;
      continue;
    }
    plan = arg == "plan";
    break;
  }
  if (plan) {
    CLI::App app(kPlanDescription, "pippyctl plan");
    Configure(app);
    GlobalFlags globals;
    app.add_option("--output", globals.output, "table for people, json for programs")
        ->check(CLI::IsMember({"table", "json"}))
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast)
        ->capture_default_str();
    CLI::App* cmd = app.add_subcommand("plan", kPlanDescription);
    int exit_code = kExitOk;
    AddPlanOptions(cmd, globals, &exit_code);
    app.require_subcommand(1);
    if (auto code = Parse(app, argc, argv)) return *code;
    return exit_code;
  }
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
