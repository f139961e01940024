#include "client/split_command.h"

#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/args.h"
#include "client/exit_codes.h"
#include "client/table.h"
#include "pipeline/partition/model_io.h"
#include "pipeline/partition/partition.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::cli {
namespace {

constexpr char kHelp[] = R"(usage: pippyctl split MODEL.pt (--stages K [--balance params|flops|time] | --split-at A,B,...)
                      [--example-input FILE] [--out DIR] [--output table|json]

Splits a TorchScript model (torch.jit.script(model).save("MODEL.pt")) into pipeline
stages, like torch.distributed.pipelining.pipeline(), and prints the plan.

Where to cut (first that applies):
  --split-at A,B,...   cut before each named module (full paths as in named_modules(),
                       e.g. blocks.4); "NAME:end" cuts after that module instead.
  PipeSplit markers    any submodule whose class is named PipeSplit (an identity module)
                       marks a cut; used when --split-at is not given.
  --stages K           automatic split into K stages, only at legal places (where only
                       tensors cross the cut), preferring module boundaries.
  --balance MODE       what the automatic split equalises:
                         params  parameter bytes (default; needs no input)
                         flops   estimated FLOPs: 2 x multiply-adds of linear, matmul and
                                 convolution ops, ~5 per element for normalisation and
                                 softmax, 1 per output element otherwise, with the shapes
                                 of --example-input
                         time    measured forward time of spans between legal cuts on
                                 --example-input (min of 3 runs, this machine's CPU)

Other options:
  --example-input FILE a batch written by Python's torch.save: a tensor (one argument),
                       a tuple of values (forward's arguments in order) or a dict
                       {argument name: value}. Adds shapes and activation bytes sent to
                       the plan. Example:  torch.save({"x": x, "y": y}, "in.pt")
  --out DIR            write DIR/stage_N.pt (standalone TorchScript modules with the
                       original parameter names; torch.jit.load opens them) and
                       DIR/plan.json
  --output table|json  a table for people (default) or the plan as JSON
  --list-cuts          list every legal cut and its --split-at name instead of splitting

Exit codes: 0 success, 2 bad input (the message says what to change), 1 internal error.
)";

std::string FormatCost(double cost, const std::string& unit) {
  if (unit == "bytes") return HumanBytes(cost);
  if (unit == "flop") {
    if (cost >= 1e9) return absl::StrFormat("%.2f GFLOP", cost / 1e9);
    if (cost >= 1e6) return absl::StrFormat("%.2f MFLOP", cost / 1e6);
    return absl::StrFormat("%.1f kFLOP", cost / 1e3);
  }
  if (unit == "us") return absl::StrFormat("%.0f us", cost);
  return absl::StrFormat("%g", cost);
}

std::string RenderPlan(const PipelinePlan& plan) {
  double total = 0;
  for (const StagePlan& sp : plan.stages()) total += sp.cost();
  Table table({"stage", "first module", "last module", "ops", "#params", "param bytes",
               "est. cost", "sends"});
  for (const StagePlan& sp : plan.stages()) {
    std::vector<std::string> sends;
    for (const StageOutput& so : sp.outputs()) {
      if (so.consumers_size() == 0) continue;
      std::vector<std::string> to;
      for (int c : so.consumers()) to.push_back(absl::StrCat(c));
      std::string what = absl::StrCat(so.name(), "->", absl::StrJoin(to, ","));
      if (so.has_example()) absl::StrAppend(&what, " ", HumanBytes(static_cast<double>(so.example().bytes())));
      sends.push_back(what);
    }
    if (sp.is_last()) sends.push_back("(model output)");
    table.AddRow({absl::StrCat(sp.index()), sp.first_module().empty() ? "(root)" : sp.first_module(),
                  sp.last_module().empty() ? "(root)" : sp.last_module(), absl::StrCat(sp.num_nodes()),
                  absl::StrCat(sp.num_params()), HumanBytes(static_cast<double>(sp.param_bytes())),
                  absl::StrFormat("%s (%.0f%%)", FormatCost(sp.cost(), plan.cost_unit()),
                                  total > 0 ? 100.0 * sp.cost() / total : 0.0),
                  absl::StrJoin(sends, "; ")});
  }
  std::string out = absl::StrCat("model ", plan.model(), ": ", plan.num_nodes(), " ops, ",
                                 plan.num_legal_cuts(), " legal cut points; split by ",
                                 plan.split_method());
  if (!plan.balance().empty()) absl::StrAppend(&out, " (balance ", plan.balance(), ")");
  if (plan.split_points_size() > 0) {
    absl::StrAppend(&out, " at ", absl::StrJoin(plan.split_points(), ", "));
  }
  absl::StrAppend(&out, "\n\n", table.Render());
  for (const TiedParameter& tp : plan.tied()) {
    std::vector<std::string> stages;
    for (int s : tp.stages()) stages.push_back(absl::StrCat(s));
    absl::StrAppend(&out, "\ntied: ", absl::StrJoin(tp.names(), " = "), " in stages ",
                    absl::StrJoin(stages, ", "), " (gradients summed across them)");
  }
  if (plan.tied_size() > 0) out += "\n";
  return out;
}

}  // namespace

int RunSplitCommand(int argc, char** argv, int first) {
  auto args = Args::Parse(argc, argv, first,
                          {{"stages"}, {"balance"}, {"split-at"}, {"example-input"}, {"out"}, {"output"}, {"list-cuts", false}});
  if (!args.ok()) return Fail(args.status());
  if (args->Has("help")) {
    std::cout << kHelp;
    return kExitOk;
  }
  if (args->positional().size() != 1) {
    return Fail(absl::InvalidArgumentError("split takes one MODEL.pt (see pippyctl split --help)"));
  }
  const std::string model_path = args->positional()[0];
  const std::string output = args->Get("output", "table");
  if (output != "table" && output != "json") {
    return Fail(absl::InvalidArgumentError("--output must be table or json"));
  }
  torch::jit::setGraphExecutorOptimize(false);
  partition::SplitOptions opts;
  auto stages = args->GetInt("stages", 0);
  if (!stages.ok()) return Fail(stages.status());
  opts.num_stages = *stages;
  if (args->Has("stages") && opts.num_stages < 1) {
    return Fail(absl::InvalidArgumentError("--stages must be at least 1"));
  }
  opts.split_at = SplitList(args->Get("split-at"));
  if (args->Has("split-at") && opts.split_at.empty()) {
    return Fail(absl::InvalidArgumentError("--split-at needs module paths, e.g. --split-at blocks.4,blocks.8"));
  }
  auto balance = partition::ParseBalance(args->Get("balance", "params"));
  if (!balance.ok()) return Fail(balance.status());
  opts.balance = *balance;
  opts.model_name = model_path;

  auto model = partition::LoadModel(model_path);
  if (!model.ok()) return Fail(model.status());
  if (args->Has("list-cuts")) {
    auto cuts = partition::ListLegalCuts(*model);
    if (!cuts.ok()) return Fail(cuts.status());
    Table table({"cut", "--split-at name", "after module", "before module"});
    for (const auto& c : *cuts) {
      table.AddRow({absl::StrCat(c.position), c.name.empty() ? "-" : c.name,
                    c.before.empty() ? "(root)" : c.before, c.after.empty() ? "(root)" : c.after});
    }
    std::cout << cuts->size() << " legal cut points in " << model_path << "\n\n" << table.Render();
    return kExitOk;
  }
  if (args->Has("example-input")) {
    auto inputs = partition::LoadExampleInputs(args->Get("example-input"), *model);
    if (!inputs.ok()) return Fail(inputs.status());
    opts.example_inputs = *inputs;
  }
  auto pipe = partition::SplitModel(*model, opts);
  if (!pipe.ok()) return Fail(pipe.status());
  if (args->Has("out")) {
    absl::Status written = partition::WritePipe(*pipe, args->Get("out"));
    if (!written.ok()) return Fail(written);
  }
  if (output == "json") {
    std::cout << partition::PlanToJson(pipe->plan) << "\n";
  } else {
    std::cout << RenderPlan(pipe->plan);
    if (args->Has("out")) {
      std::cout << "\nwrote " << pipe->stages.size() << " stage files and plan.json to "
                << args->Get("out") << "\n";
    }
  }
  return kExitOk;
}

}  // namespace pippy::cli
