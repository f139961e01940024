// pippy-rank: runs ONE pipeline rank as its own process over UCX — the engine the
// worker daemon wraps, without the control plane. It loads only its own stages from a
// folder written by `pippyctl split --out DIR` (stage_N.pt and plan.json), sets the
// rank up with job::RankJob exactly as pippy-worker does, and finds its peers through
// a rendezvous folder.
//
//   pippy-rank --rank R --world N --rendezvous DIR --stages-dir DIR --schedule NAME
//              --microbatches M --batch-size B --steps S --data FILE --out DIR
//              [--stages-per-rank V] [--loss L] [--optimizer O] [--lr X] [--momentum X]
//              [--weight-decay X] [--clip-grad-norm X] [--seed N] [--tls sm,self]
//              [--timeout-s T] [--dtype fp32|bf16] [--device cpu|cuda:N|auto]
//
// --data is what `pippyctl submit --data` takes: torch.save({"inputs": ..., "targets": ...}).
// Writes DIR/stage_<s>.pt for the stages it held (trained) and prints one line per
// step: "rank=R step=k loss=... busy_s=... step_s=...". Exit codes as every pippy
// binary (common/cli.h): 0 success, 2 bad input, 1 failure (the message names the
// step, action and peer).
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/cli.h"
#include "common/log.h"
#include "common/memory.h"
#include "common/status.h"
#include "google/protobuf/util/json_util.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/layout.h"
#include "pipeline/job/rank_job.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/stage/data_source.h"
#include "worker/process_device.h"
#include "worker/rank_bringup.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy {
namespace {

constexpr char kProgram[] = "pippy-rank";

// Publishes this rank's address and collects everyone's (atomic renames; deadline).
absl::StatusOr<std::vector<std::string>> Rendezvous(const std::string& dir, int rank, int world,
                                                    const std::string& address, absl::Duration timeout) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot create --rendezvous ", dir, ": ", ec.message()));
  const std::string tmp = absl::StrCat(dir, "/.rank_", rank, ".tmp");
  std::ofstream(tmp) << absl::BytesToHexString(address);
  std::filesystem::rename(tmp, absl::StrCat(dir, "/rank_", rank, ".addr"), ec);
  if (ec) return absl::PermissionDeniedError(absl::StrCat("cannot write into --rendezvous ", dir));
  std::vector<std::string> out(world);
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoMilliseconds(timeout);
  for (int r = 0; r < world; ++r) {
    const std::string path = absl::StrCat(dir, "/rank_", r, ".addr");
    while (!std::filesystem::exists(path)) {
      if (std::chrono::steady_clock::now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("rank ", rank, ": rank ", r, " did not show up in ", dir,
                                                        " within ", absl::FormatDuration(timeout)));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    std::ifstream in(path);
    std::string hex;
    in >> hex;
    out[r] = absl::HexStringToBytes(hex);
  }
  return out;
}

absl::StatusOr<PipelinePlan> ReadPlan(const std::string& path) {
  PIPPY_ASSIGN_OR_RETURN(std::string json, torchio::ReadFile(path));
  PipelinePlan plan;
  auto s = google::protobuf::util::JsonStringToMessage(json, &plan);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a plan written by pippyctl split --out: ",
                                                   s.ToString()));
  }
  absl::Status valid = job::CheckPlan(plan);
  if (!valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': ", valid.message(),
                                                   " (write it again with pippyctl split --out)"));
  }
  return plan;
}

struct Flags {
  int rank = -1, world = 0, stages_per_rank = 0, microbatches = 0, steps = 1, batch_size = 0;
  double timeout_s = 60, lr = 0.01, momentum = 0, clip = 0;
  std::optional<double> weight_decay;
  uint64_t seed = 0;
  std::string rendezvous, stages_dir, schedule, data, out, loss = "mse", optimizer = "sgd", tls = "sm,self";
  std::string dtype = "fp32", device = "cpu";
};

absl::Status Run(const Flags& f) {
  log::Init(absl::StrCat("rank-", f.rank));
  torch::jit::setGraphExecutorOptimize(false);
  JobSpec spec;
  PIPPY_ASSIGN_OR_RETURN(ScheduleKind kind, job::ParseSchedule(f.schedule));
  spec.mutable_schedule()->set_kind(kind);
  spec.mutable_schedule()->set_microbatches(f.microbatches);
  spec.mutable_schedule()->set_stages_per_worker(f.stages_per_rank);
  if (kind != SCHEDULE_INFERENCE) {
    PIPPY_ASSIGN_OR_RETURN(LossKind loss, job::ParseLoss(f.loss));
    PIPPY_ASSIGN_OR_RETURN(OptimizerKind optimizer, job::ParseOptimizer(f.optimizer));
    spec.set_loss(loss);
    spec.mutable_optimizer()->set_kind(optimizer);
  }
  spec.mutable_optimizer()->set_lr(f.lr);
  spec.mutable_optimizer()->set_momentum(f.momentum);
  if (f.weight_decay) spec.mutable_optimizer()->set_weight_decay(*f.weight_decay);
  spec.mutable_optimizer()->set_clip_grad_norm(f.clip);
  PIPPY_ASSIGN_OR_RETURN(Precision precision, job::ParsePrecision(f.dtype));
  spec.set_precision(precision);
  PIPPY_ASSIGN_OR_RETURN(Device dev, worker::ProcessDevice(f.device));
  const c10::Device device = worker::TorchDevice(dev);
  spec.set_steps(f.steps);
  spec.set_batch_size(f.batch_size);
  spec.set_seed(f.seed);
  PIPPY_ASSIGN_OR_RETURN(PipelinePlan plan, ReadPlan(f.stages_dir + "/plan.json"));
  spec.mutable_split()->set_stages(plan.stages_size());
  PIPPY_RETURN_IF_ERROR(job::CheckSpec(&spec));
  // This process's preparation: the job's layout, made once; the rank runs its piece.
  PIPPY_ASSIGN_OR_RETURN(JobLayout layout, job::MakeLayout(spec, plan));
  if (layout.ranks_size() != f.world) {
    return absl::InvalidArgumentError(absl::StrCat("--world ", f.world, " but ", plan.stages_size(), " stages at ",
                                                   spec.schedule().stages_per_worker(), " per rank need ",
                                                   layout.ranks_size(), " ranks"));
  }
  if (f.rank < 0 || f.rank >= f.world) return absl::InvalidArgumentError("--rank must be in [0, --world)");
  const RankLayout& piece = layout.ranks(f.rank);
  job::SeedProcessForRank(spec, f.rank);
  PIPPY_ASSIGN_OR_RETURN(worker::LoadedStages mine, worker::LoadStageFiles(f.stages_dir, job::StagesOf(piece, f.rank)));
  std::vector<std::string> names;
  for (const ModelValue& v : plan.inputs()) names.push_back(v.name());
  PIPPY_ASSIGN_OR_RETURN(std::string data_bytes, torchio::ReadFile(f.data));
  PIPPY_ASSIGN_OR_RETURN(stage::DataSource data, stage::DataSource::FromBytes(data_bytes, names));

  // The rank's transports, brought up as pippy-worker brings them up; the peers come
  // from the rendezvous folder instead of the coordinator.
  std::vector<std::pair<std::string, std::string>> ucx_config = {{"TLS", f.tls}};
  if (f.tls.find("tcp") != std::string::npos) ucx_config.push_back({"NET_DEVICES", "lo"});
  PIPPY_ASSIGN_OR_RETURN(auto transports, worker::RankTransports::Create(f.rank, f.world, device, ucx_config));
  PIPPY_ASSIGN_OR_RETURN(auto addresses, Rendezvous(f.rendezvous, f.rank, f.world, transports->address(),
                                                    absl::Seconds(f.timeout_s)));
  PIPPY_RETURN_IF_ERROR(transports->Connect(addresses));
  PIPPY_ASSIGN_OR_RETURN(auto rank_job, job::RankJob::Create(spec, plan, piece, f.rank, std::move(mine.modules),
                                                             transports->transport(), absl::Seconds(f.timeout_s),
                                                             nullptr, device));
  KeepFreedMemory();  // the stages are loaded: from here on, buffers are reused step after step
  for (int step = 0; step < f.steps; ++step) {
    absl::StatusOr<stage::StepResult> res = rank_job->RunStep(step, data);
    if (!res.ok()) return absl::InternalError(std::string(res.status().message()));
    std::cout << "rank=" << f.rank << " step=" << step;
    if (res->has_loss) std::cout << " loss=" << res->loss;
    std::cout << " busy_s=" << res->busy_seconds << " step_s=" << res->step_seconds << std::endl;
  }
  std::error_code ec;
  std::filesystem::create_directories(f.out, ec);
  for (const auto& [s, module] : rank_job->stages()) {
    PIPPY_RETURN_IF_ERROR(torchio::SaveModule(module, absl::StrCat(f.out, "/stage_", s, ".pt")));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pippy

int main(int argc, char** argv) {
  using namespace pippy;
  CLI::App app("Runs one pipeline rank as a process over UCX, from stage files written by `pippyctl split --out`.",
               kProgram);
  cli::Configure(app);
  Flags f;
  app.add_option("--rank", f.rank, "this rank")->required()->check(cli::NonNegative());
  app.add_option("--world", f.world, "number of ranks")->required()->check(cli::Positive());
  app.add_option("--rendezvous", f.rendezvous, "a folder shared by the ranks, where they publish addresses")->required();
  app.add_option("--stages-dir", f.stages_dir, "stage_N.pt and plan.json from pippyctl split --out")->required();
  cli::AddNameOption<ScheduleKind>(&app, "--schedule", &f.schedule, "schedule", "pipeline schedule")->required();
  app.add_option("--stages-per-rank", f.stages_per_rank, "0: the schedule's default")->check(cli::NonNegative());
  app.add_option("--microbatches", f.microbatches, "micro-batches per step")->required()->check(cli::Positive());
  app.add_option("--batch-size", f.batch_size, "samples per step")->required()->check(cli::Positive());
  app.add_option("--steps", f.steps, "steps to run")->check(cli::Positive())->capture_default_str();
  app.add_option("--data", f.data, "torch.save({\"inputs\": ..., \"targets\": ...})")->required();
  app.add_option("--out", f.out, "where the trained stages are written")->required();
  cli::AddNameOption<LossKind>(&app, "--loss", &f.loss, "loss", "the loss, on the last stage")->capture_default_str();
  cli::AddNameOption<OptimizerKind>(&app, "--optimizer", &f.optimizer, "optimizer", "the optimizer")
      ->capture_default_str();
  app.add_option("--lr", f.lr, "learning rate")->check(cli::Positive())->capture_default_str();
  app.add_option("--momentum", f.momentum, "sgd momentum")->check(cli::NonNegative())->capture_default_str();
  app.add_option("--weight-decay", f.weight_decay, "default: torch's (0.01 for adamw, else 0)")
      ->check(cli::NonNegative());
  app.add_option("--clip-grad-norm", f.clip, "global gradient-norm clipping; 0: none")->check(cli::NonNegative())->capture_default_str();
  app.add_option("--seed", f.seed, "seeds this rank's random number generator (seed + rank)")->capture_default_str();
  app.add_option("--tls", f.tls, "UCX transports, e.g. sm,self or tcp,self")->capture_default_str();
  cli::AddNameOption<Precision>(&app, "--dtype", &f.dtype, "dtype", "compute precision")->capture_default_str();
  app.add_option("--device", f.device, "cpu | cuda:N | auto: where the stages run")->capture_default_str();
  app.add_option("--timeout-s", f.timeout_s, "deadline of the rendezvous and of every wait in a step")
      ->check(cli::Positive())->capture_default_str();
  if (auto code = cli::Parse(app, argc, argv)) return *code;
  absl::Status s = Run(f);
  if (!s.ok()) return cli::Fail(kProgram, s);
  return cli::kExitOk;
}
