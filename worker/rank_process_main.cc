// pippy-rank: runs ONE pipeline rank as its own process, over UCX — the engine the
// worker daemon wraps (the daemon adds registration, assignments and progress over
// gRPC). Every rank splits the same model the same way, so no stage files are
// shipped; ranks find each other through a rendezvous folder.
//
//   pippy-rank --rank R --world N --rendezvous DIR --model M.pt --schedule NAME
//              [--stages-per-rank V] --microbatches M --steps S --input FILE --target FILE
//              [--loss mse|cross_entropy|model] [--optimizer sgd|adam|adamw] [--lr X]
//              [--momentum X] [--weight-decay X] [--clip-grad-norm X] [--tls sm,self]
//              [--timeout-s T] --out DIR
//
// Writes DIR/stage_<s>.pt for the stages it held (trained) and prints one line per
// step: "rank=R step=k loss=... busy_s=... step_s=...". Exit 0 on success; 2 on bad
// input; 1 on failure (the message names the step, action and peer).
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "client/args.h"
#include "client/exit_codes.h"
#include "common/log.h"
#include "pipeline/partition/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/stage/rank_runtime.h"
#include "pipeline/transport/ucx/ucx_transport.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy {
namespace {

// Publishes this rank's address and collects everyone's (atomic renames; deadline).
absl::StatusOr<std::vector<std::string>> Rendezvous(const std::string& dir, int rank, int world,
                                                    const std::string& address, absl::Duration timeout) {
  std::filesystem::create_directories(dir);
  const std::string tmp = absl::StrCat(dir, "/.rank_", rank, ".tmp");
  std::ofstream(tmp) << absl::BytesToHexString(address);
  std::filesystem::rename(tmp, absl::StrCat(dir, "/rank_", rank, ".addr"));
  std::vector<std::string> out(world);
  const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoSeconds(timeout);
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


int Run(int argc, char** argv) {
  auto args = cli::Args::Parse(argc, argv, 1,
                               {{"rank"}, {"world"}, {"rendezvous"}, {"model"}, {"schedule"}, {"stages-per-rank"},
                                {"microbatches"}, {"steps"}, {"input"}, {"target"}, {"loss"}, {"optimizer"},
                                {"lr"}, {"momentum"}, {"weight-decay"}, {"clip-grad-norm"}, {"tls"},
                                {"timeout-s"}, {"out"}});
  if (!args.ok()) return cli::Fail(args.status());
  auto rank = args->GetInt("rank", -1), world = args->GetInt("world", 0), v = args->GetInt("stages-per-rank", 0),
       m = args->GetInt("microbatches", 0), steps = args->GetInt("steps", 1), timeout = args->GetInt("timeout-s", 60);
  auto lr = args->GetDouble("lr", 0.01), momentum = args->GetDouble("momentum", 0),
       wd = args->GetDouble("weight-decay", 0), clip = args->GetDouble("clip-grad-norm", 0);
  for (const absl::Status& s : {rank.status(), world.status(), v.status(), m.status(), steps.status(),
                                timeout.status(), lr.status(), momentum.status(), wd.status(), clip.status()}) {
    if (!s.ok()) return cli::Fail(s);
  }
  for (const char* required : {"rendezvous", "model", "schedule", "input", "out"}) {
    if (!args->Has(required)) return cli::Fail(absl::InvalidArgumentError(absl::StrCat("--", required, " is required")));
  }
  log::Init(absl::StrCat("rank-", *rank));
  torch::jit::setGraphExecutorOptimize(false);

  auto kind = schedule::ParseScheduleKind(args->Get("schedule"));
  if (!kind.ok()) return cli::Fail(kind.status());
  const int per_rank = *v > 0 ? *v : schedule::DefaultStagesPerRank(*kind);
  auto model = partition::LoadModel(args->Get("model"));
  if (!model.ok()) return cli::Fail(model.status());
  partition::SplitOptions so;
  so.num_stages = *world * per_rank;
  auto pipe = partition::SplitModel(*model, so);
  if (!pipe.ok()) return cli::Fail(pipe.status());
  schedule::ScheduleOptions opts;
  opts.num_ranks = *world;
  opts.num_microbatches = *m;
  opts.stages_per_rank = per_rank;
  opts.graph = stage::StageGraphOf(pipe->plan);
  auto sched = schedule::MakeSchedule(*kind, opts);
  if (!sched.ok()) return cli::Fail(sched.status());

  auto inputs = partition::LoadExampleInputs(args->Get("input"), *model);
  if (!inputs.ok()) return cli::Fail(inputs.status());
  c10::IValue target;
  if (args->Has("target")) {
    auto t = partition::LoadTorchSaved(args->Get("target"));
    if (!t.ok()) return cli::Fail(t.status());
    target = *t;
  }

  transport::ucx::Options uo;
  uo.ucx_config = {{"TLS", args->Get("tls", "sm,self")}};
  if (args->Get("tls", "").find("tcp") != std::string::npos) uo.ucx_config.push_back({"NET_DEVICES", "lo"});
  auto ucx = transport::ucx::UcxTransport::Create(*rank, *world, uo);
  if (!ucx.ok()) return cli::Fail(ucx.status());
  auto addresses = Rendezvous(args->Get("rendezvous"), *rank, *world, (*ucx)->address(), absl::Seconds(*timeout));
  if (!addresses.ok()) return cli::Fail(addresses.status());
  absl::Status connected = (*ucx)->Connect(*addresses);
  if (!connected.ok()) return cli::Fail(connected);

  std::map<int, torch::jit::Module> mine;
  for (int s : sched->StagesOf(*rank)) mine[s] = pipe->stages[s];
  stage::RuntimeOptions ro;
  ro.loss = args->Get("loss", "mse");
  ro.optimizer.name = args->Get("optimizer", "sgd");
  ro.optimizer.lr = *lr;
  ro.optimizer.momentum = *momentum;
  ro.optimizer.weight_decay = *wd;
  ro.clip_grad_norm = *clip;
  ro.timeout = absl::Seconds(*timeout);
  auto rt = stage::RankRuntime::Create(*rank, pipe->plan, mine, *sched, ucx->get(), ro);
  if (!rt.ok()) return cli::Fail(rt.status());
  for (int step = 0; step < *steps; ++step) {
    auto res = sched->forward_only ? (*rt)->InferenceStep(step, *inputs) : (*rt)->TrainStep(step, *inputs, target);
    if (!res.ok()) {
      std::cerr << "pippy-rank: " << res.status().message() << "\n";
      return cli::kExitInternal;
    }
    std::cout << "rank=" << *rank << " step=" << step;
    if (res->has_loss) std::cout << " loss=" << res->loss;
    std::cout << " busy_s=" << res->busy_seconds << " step_s=" << res->step_seconds << std::endl;
  }
  std::filesystem::create_directories(args->Get("out"));
  for (auto& [s, module] : mine) module.save(absl::StrCat(args->Get("out"), "/stage_", s, ".pt"));
  return cli::kExitOk;
}

}  // namespace
}  // namespace pippy

int main(int argc, char** argv) { return pippy::Run(argc, argv); }
