// `pippyctl split`: splits a TorchScript model offline and prints or writes the plan.
// It runs as its own program, pippyctl-split (LibTorch), which pippyctl executes, so
// that pippyctl itself does not load LibTorch (its memory stays small).
#include <iostream>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/commands.h"
#include "client/table.h"
#include "common/cli.h"
#include "common/proto_json.h"
#include "common/torch_status.h"
#include <thread>

#include "pipeline/autoplan/chooser.h"
#include "pipeline/autoplan/profile.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/partition/pipe_io.h"
#include "pipeline/tensor_parallel/sharding.h"
#include "pipeline/tensor_parallel/tp_plan.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::cli {
namespace {

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
  if (plan.balance() != BALANCE_UNSPECIFIED) absl::StrAppend(&out, " (balance ", job::BalanceName(plan.balance()), ")");
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
  if (plan.tensor_parallel().size() > 1) {
    const int T = plan.tensor_parallel().size();
    absl::StrAppend(&out, "\ntensor parallel: ", T, " ranks per stage (", tp::PlanText(plan.tensor_parallel()), ")\n");
    for (const StagePlan& sp : plan.stages()) {
      int64_t sharded = 0, replicated = 0;
      int n = 0;
      for (const ParameterInfo& pi : sp.parameters()) {
        if (pi.is_buffer()) continue;
        (pi.has_tp_dim() ? sharded : replicated) += pi.bytes();
        n += pi.has_tp_dim();
      }
      absl::StrAppend(&out, "  stage ", sp.index(), ": ", n, " sharded tensors (", HumanBytes(static_cast<double>(sharded)),
                      ", ", HumanBytes(static_cast<double>(sharded / T)), " per rank), replicated ",
                      HumanBytes(static_cast<double>(replicated)), "\n");
    }
  }
  return out;
}

struct SplitFlags {
  std::string model;
  int stages = 0;
  std::string balance = "params";
  std::vector<std::string> split_at;
  std::string example_input;
  std::string out;
  bool list_cuts = false;
  bool profile = false;
  int tensor_parallel = 1;
  std::string tp_plan;
};

// `split --profile`: the model's spans measured on the example input as one batch.
int RunProfile(const torch::jit::Module& model, const std::vector<c10::IValue>& inputs, const GlobalFlags& g) {
  int64_t samples = 0;
  for (const c10::IValue& v : inputs) {
    if (v.isTensor() && v.toTensor().dim() > 0) {
      samples = v.toTensor().size(0);
      break;
    }
  }
  autoplan::ProfileOptions po;
  po.microbatch_sizes = autoplan::CandidateSizes(samples);
  absl::StatusOr<ModelProfile> profile = autoplan::ProfileModel(model, inputs, po);
  if (!profile.ok()) return Fail(kProgram, profile.status());
  std::cout << (g.output == "json" ? ProtoToJson(*profile) + "\n" : autoplan::RenderProfile(*profile));
  return kExitOk;
}

int RunSplit(const SplitFlags& f, const GlobalFlags& g) {
  torch::jit::setGraphExecutorOptimize(false);
  partition::SplitOptions opts;
  opts.num_stages = f.stages;
  opts.split_at = f.split_at;
  auto balance = job::ParseBalance(f.balance);
  if (!balance.ok()) return Fail(kProgram, balance.status());
  opts.balance = *balance;
  opts.model_name = f.model;

  auto model = torchio::LoadModel(f.model);
  if (!model.ok()) return Fail(kProgram, model.status());
  if (f.list_cuts) {
    auto cuts = partition::ListLegalCuts(*model);
    if (!cuts.ok()) return Fail(kProgram, cuts.status());
    if (g.output == "json") {
      std::cout << "{\"model\": " << JsonString(f.model) << ", \"cuts\": [";
      for (size_t i = 0; i < cuts->size(); ++i) {
        const auto& c = (*cuts)[i];
        // A cut comes after the module before it (c.before) and before the one after it.
        std::cout << (i ? ", " : "") << "{\"position\": " << c.position << ", \"name\": " << JsonString(c.name)
                  << ", \"after\": " << JsonString(c.before) << ", \"before\": " << JsonString(c.after) << "}";
      }
      std::cout << "]}\n";
      return kExitOk;
    }
    Table table({"cut", "--split-at name", "after module", "before module"});
    for (const auto& c : *cuts) {
      table.AddRow({absl::StrCat(c.position), c.name.empty() ? "-" : c.name,
                    c.before.empty() ? "(root)" : c.before, c.after.empty() ? "(root)" : c.after});
    }
    std::cout << cuts->size() << " legal cut points in " << f.model << "\n\n" << table.Render();
    return kExitOk;
  }
  if (!f.example_input.empty()) {
    auto inputs = torchio::LoadExampleInputs(f.example_input, *model);
    if (!inputs.ok()) return Fail(kProgram, inputs.status());
    opts.example_inputs = *inputs;
  }
  if (f.profile) {
    if (f.example_input.empty()) {
      return Fail(kProgram, absl::InvalidArgumentError("--profile needs --example-input FILE (a batch to measure on)"));
    }
    return RunProfile(*model, opts.example_inputs, g);
  }
  std::optional<TensorParallelSpec> tp_spec;
  if (f.tensor_parallel > 1 || !f.tp_plan.empty()) {
    auto spec = tp::ParsePlan(f.tp_plan, f.tensor_parallel);
    if (!spec.ok()) return Fail(kProgram, spec.status());
    tp_spec = *spec;
  }
  auto pipe = partition::SplitModel(*model, opts);
  if (!pipe.ok()) return Fail(kProgram, pipe.status());
  std::vector<std::vector<torch::jit::Module>> shards;
  if (tp_spec) {
    tp::ShardOptions so;
    so.spec = *tp_spec;
    so.example_inputs = opts.example_inputs;
    auto sharded = tp::ShardPipe(&*pipe, so);
    if (!sharded.ok()) return Fail(kProgram, sharded.status());
    shards = std::move(*sharded);
  }
  if (!f.out.empty()) {
    absl::Status written = partition::WritePipe(*pipe, f.out);
    if (!written.ok()) return Fail(kProgram, written);
    for (size_t s = 0; s < shards.size(); ++s) {
      for (size_t r = 0; r < shards[s].size(); ++r) {
        const std::string path = absl::StrCat(f.out, "/stage_", s, ".tp_", r, ".pt");
        absl::Status saved = TorchCall(absl::StrCat("writing '", path, "'"), [&] { shards[s][r].save(path); },
                                       absl::StatusCode::kInternal);
        if (!saved.ok()) return Fail(kProgram, saved);
      }
    }
  }
  if (g.output == "json") {
    std::cout << ProtoToJson(pipe->plan) << "\n";  // the CLI's JSON (docs/cli.md); plan.json files stay protobuf's
  } else {
    std::cout << RenderPlan(pipe->plan);
    if (!f.out.empty()) {
      std::cout << "\nwrote " << pipe->stages.size() << " stage files"
                << (shards.empty() ? "" : absl::StrCat(", their ", shards.size() * shards[0].size(),
                                                      " tensor-parallel shards (stage_N.tp_R.pt)"))
                << " and plan.json to " << f.out << "\n";
    }
  }
  return kExitOk;
}

struct PlanFlags {
  std::string model, data, schedule = "auto", microbatches = "auto", stages = "auto", optimizer = "sgd";
  int batch_size = 0, workers = 2, threads = 1, hosts = 0, host_cpus = 0, replicas = 1;
  double momentum = 0;
  int64_t memory = 0;
};

// `pippyctl plan`: what `submit` with auto values would choose, offline: the model
// measured here, the candidates simulated for the workers described by the flags.
int RunPlan(const PlanFlags& f, const GlobalFlags& g) {
  torch::jit::setGraphExecutorOptimize(false);
  auto model = torchio::LoadModel(f.model);
  if (!model.ok()) return Fail(kProgram, model.status());
  absl::StatusOr<std::string> bytes = torchio::ReadFile(f.data);
  if (!bytes.ok()) return Fail(kProgram, bytes.status());
  const std::vector<std::string> names = torchio::ForwardArgumentNames(*model);
  absl::StatusOr<stage::DataSource> data = stage::DataSource::FromBytes(*bytes, names);
  if (!data.ok()) return Fail(kProgram, data.status());
  JobSpec spec;
  spec.set_mode(MODE_TRAIN);
  spec.set_batch_size(f.batch_size);
  spec.set_replicas(f.replicas);
  AutoPlanSpec* a = spec.mutable_auto_plan();
  if (f.schedule == "auto") {
    a->set_schedule(true);
  } else {
    absl::StatusOr<ScheduleKind> kind = job::ParseSchedule(f.schedule);
    if (!kind.ok()) return Fail(kProgram, kind.status());
    spec.mutable_schedule()->set_kind(*kind);
    if (*kind == SCHEDULE_INFERENCE) spec.set_mode(MODE_INFERENCE);
  }
  if (f.microbatches == "auto") {
    a->set_microbatches(true);
  } else {
    spec.mutable_schedule()->set_microbatches(std::stoi(f.microbatches));
  }
  if (f.stages == "auto") {
    a->set_stages(true);
  } else {
    spec.mutable_split()->set_stages(std::stoi(f.stages));
  }
  absl::StatusOr<OptimizerKind> optimizer = job::ParseOptimizer(f.optimizer);
  if (!optimizer.ok()) return Fail(kProgram, optimizer.status());
  spec.mutable_optimizer()->set_kind(*optimizer);
  spec.mutable_optimizer()->set_momentum(f.momentum);
  const int hosts = f.hosts > 0 ? f.hosts : f.workers;
  const int cpus = f.host_cpus > 0 ? f.host_cpus : static_cast<int>(std::thread::hardware_concurrency());
  for (int w = 0; w < f.workers; ++w) {
    WorkerCapacity* c = a->add_workers();
    c->set_host(absl::StrCat("host-", w % hosts));
    c->set_threads(f.threads);
    c->set_host_cpus(cpus);
    c->set_free_memory(f.memory);
  }
  absl::StatusOr<PlanChoice> choice = autoplan::MeasureAndChoose(spec, *model, data->Inputs(0, f.batch_size));
  if (!choice.ok()) return Fail(kProgram, choice.status());
  if (g.output == "json") {
    std::cout << ProtoToJson(*choice) << "\n";
  } else {
    std::cout << "model " << f.model << ", batch " << f.batch_size << ", " << f.workers << " workers of " << f.threads
              << " thread(s) on " << hosts << " host(s) of " << cpus << " cores; measured in "
              << absl::StrFormat("%.1f s", choice->profile().seconds()) << "\n\n"
              << autoplan::RenderChoice(*choice);
  }
  return kExitOk;
}

}  // namespace

void AddPlanOptions(CLI::App* cmd, const GlobalFlags& globals, int* exit_code) {
  auto f = std::make_shared<PlanFlags>();
  cmd->add_option("MODEL", f->model, "the TorchScript file")->required()->check(CLI::ExistingFile);
  cmd->add_option("--data", f->data, "torch.save({\"inputs\": ..., \"targets\": ...}); the first batch is measured")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--batch-size", f->batch_size, "samples per step")->required()->check(cli::Positive());
  cmd->add_option("--schedule", f->schedule, "a schedule, or auto")->capture_default_str();
  cmd->add_option("--microbatches", f->microbatches, "N or auto")->check(cli::PositiveOrAuto())->capture_default_str();
  cmd->add_option("--stages", f->stages, "N or auto (up to --workers)")->check(cli::PositiveOrAuto())
      ->capture_default_str();
  cmd->add_option("--workers", f->workers, "workers to plan for")->check(cli::Positive())->capture_default_str();
  cmd->add_option("--threads", f->threads, "each worker's compute threads (measured with as many)")
      ->check(cli::Positive())->capture_default_str();
  cmd->add_option("--hosts", f->hosts, "hosts the workers are spread over, in turn (default: one each)")
      ->check(cli::Positive());
  cmd->add_option("--host-cpus", f->host_cpus, "cores per host (default: this machine's)")->check(cli::Positive());
  cmd->add_option("--memory", f->memory, "free memory per worker, bytes (default: not checked)")
      ->check(cli::NonNegative());
  cmd->add_option("--replicas", f->replicas, "data-parallel copies of the pipeline")->check(cli::Positive())
      ->capture_default_str();
  cli::AddNameOption<OptimizerKind>(cmd, "--optimizer", &f->optimizer, "optimizer", "the optimizer")
      ->capture_default_str();
  cmd->add_option("--momentum", f->momentum, "sgd momentum")->check(cli::NonNegative());
  cmd->callback([f, &globals, exit_code] { *exit_code = RunPlan(*f, globals); });
}

void AddSplitOptions(CLI::App* cmd, const GlobalFlags& globals, int* exit_code) {
  auto f = std::make_shared<SplitFlags>();
  cmd->add_option("MODEL", f->model, "the TorchScript file")->required();
  cmd->add_option("--stages", f->stages, "automatic split into this many stages")->check(cli::Positive());
  cmd->add_option("--split-at", f->split_at,
                  "cut before each named module (paths as in named_modules(), e.g. blocks.4); NAME:end cuts "
                  "after it")
      ->delimiter(',');
  cli::AddNameOption<Balance>(cmd, "--balance", &f->balance, "balance",
                              "what an automatic split equalises (flops and time need --example-input)")
      ->capture_default_str();
  cmd->add_option("--example-input", f->example_input,
                  "a batch written by torch.save: a tensor, a tuple (forward's arguments in order) or a dict "
                  "{argument name: value}; adds shapes and activation bytes to the plan");
  cmd->add_option("--out", f->out, "write DIR/stage_N.pt (standalone TorchScript modules with the original "
                                   "parameter names) and DIR/plan.json");
  cmd->add_flag("--list-cuts", f->list_cuts, "list every legal cut and its --split-at name instead of splitting");
  cmd->add_flag("--profile", f->profile,
                "measure the model instead of splitting: per span between legal cuts, forward, input-backward and "
                "weight-backward times for micro-batches of the --example-input batch / 1, 2, 4, ... 32 (the costs "
                "auto plans are chosen from; docs/autoplan.md)");
  cmd->add_option("--tensor-parallel", f->tensor_parallel,
                  "shard every stage across T ranks (tensor parallelism, as --tp-plan says); needs --example-input, "
                  "on which the shards are checked against the unsplit stages")
      ->check(cli::Positive());
  cmd->add_option("--tp-plan", f->tp_plan,
                  "PATTERN=STYLE,... with STYLE colwise | rowwise (nn.Linear) | vocab (nn.Embedding), patterns "
                  "matching module paths atom by atom, e.g. layers.*.attn.q=colwise,layers.*.attn.o=rowwise; "
                  "with --out also writes DIR/stage_N.tp_R.pt (they need pippy's ops to load)");
  cmd->callback([f, &globals, exit_code] { *exit_code = RunSplit(*f, globals); });
}

}  // namespace pippy::cli
