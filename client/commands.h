// pippyctl's commands. Each Add*Command registers one subcommand (its flags, typed and
// range-checked by CLI11, with --help derived from them) on the root app; when that
// subcommand is the one given, its callback runs the command and stores the process
// exit code (common/cli.h) in *exit_code.
#ifndef PIPPY_CLIENT_COMMANDS_H_
#define PIPPY_CLIENT_COMMANDS_H_

#include <string>
#include <vector>

#include "CLI/CLI.hpp"

namespace pippy::cli {

constexpr char kProgram[] = "pippyctl";

// Flags every command accepts, before or after the command's name.
struct GlobalFlags {
  std::string coordinator = "localhost:7070";  // --coordinator, else $PIPPY_COORDINATOR
  std::string output = "table";                // --output table|json
  std::string tls_ca;                          // --tls-ca, else $PIPPY_TLS_CA: TLS to the coordinator
  std::string token_file;                      // --token-file: the user's token (else $PIPPY_TOKEN)
};

// Offline (no coordinator): `split`, `schedule`.
//
// `split` needs LibTorch; it is its own program, pippyctl-split, which pippyctl runs
// in its place (RunSplitProgram), so that pippyctl never loads LibTorch and stays
// small. AddSplitCommand lists it in pippyctl's --help; AddSplitOptions defines its
// flags in pippyctl-split.
inline constexpr char kSplitProgram[] = "pippyctl-split";
inline constexpr char kSplitDescription[] =
    "Split a TorchScript model (torch.jit.script(model).save(\"MODEL.pt\")) into pipeline stages, like "
    "torch.distributed.pipelining.pipeline(), and print the plan. Where to cut, first that applies: --split-at; "
    "PipeSplit marker modules (any submodule whose class is named PipeSplit); --stages K (automatic, only at legal "
    "places where only tensors cross, preferring module boundaries).";
void AddSplitCommand(CLI::App& root);
void AddSplitOptions(CLI::App* split, const GlobalFlags& globals, int* exit_code);
// `plan` (also in pippyctl-split, LibTorch): the auto plan offline, for a model, its
// data and the workers described by flags (docs/autoplan.md).
inline constexpr char kPlanDescription[] =
    "Choose a plan offline, as submit with auto values does: measure the model on the data's first batch (per span: "
    "forward, input- and weight-backward for each micro-batch size) and simulate every schedule x micro-batches x "
    "stages for the workers described; prints the candidates ranked and why the first won.";
void AddPlanOptions(CLI::App* plan, const GlobalFlags& globals, int* exit_code);
// Replaces this process with pippyctl-split, passing `args` (what followed `split`)
// and the global --output. Returns only if that fails (the exit code).
int RunSplitProgram(const std::vector<std::string>& args, const GlobalFlags& globals);
void AddScheduleCommand(CLI::App& root, const GlobalFlags& globals, int* exit_code);
// Against a coordinator: `submit`, `list`, `status`, `watch`, `cancel`, `fetch`, `workers`.
void AddRemoteCommands(CLI::App& root, const GlobalFlags& globals, int* exit_code);
// `certs init DIR`: a CA, certificates and tokens for a secured coordinator (pki.h).
void AddCertsCommand(CLI::App& root, int* exit_code);
// `local`: a coordinator and N workers on this machine, in the foreground.
void AddLocalCommand(CLI::App& root, const GlobalFlags& globals, int* exit_code);

}  // namespace pippy::cli

#endif  // PIPPY_CLIENT_COMMANDS_H_
