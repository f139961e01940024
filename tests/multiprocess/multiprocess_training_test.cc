// Pipeline training across real processes: the model is split here (as `pippyctl
// split --out` does), then N pippy-rank processes (one rank each) load only their own
// stage files and train over UCX (shared memory or TCP on 127.0.0.1); they must end
// with the parameters of the unsplit model trained in this process — and a rank whose
// peer is killed must fail with a message naming the peer, not hang.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/partition/pipe_io.h"
#include "torch/csrc/jit/serialization/pickle.h"
#include "pipeline/stage/testing/reference_training.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

extern char** environ;

namespace pippy {
namespace {

using ::testing::HasSubstr;

std::string TmpDir(const std::string& name) {
  std::string dir = absl::StrCat(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp", "/", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Processes started by a test, each stopped by its own pid at the end.
class Ranks {
 public:
  ~Ranks() {
    for (pid_t p : pids_) {
      if (p > 0) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
      }
    }
  }
  void Start(const std::vector<std::string>& args, const std::string& log) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    pid_t pid = -1;
    EXPECT_EQ(posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    pids_.push_back(pid);
  }
  // Waits for rank i; returns its exit code, or -1 if it ran past the deadline.
  int Wait(size_t i, std::chrono::seconds deadline) {
    auto until = std::chrono::steady_clock::now() + deadline;
    while (std::chrono::steady_clock::now() < until) {
      int status = 0;
      pid_t r = waitpid(pids_[i], &status, WNOHANG);
      if (r == pids_[i]) {
        pids_[i] = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }
  void Kill(size_t i) {
    kill(pids_[i], SIGKILL);
    waitpid(pids_[i], nullptr, 0);
    pids_[i] = -1;
  }

 private:
  std::vector<pid_t> pids_;
};

struct Case {
  std::string name, model, schedule, loss, optimizer, tls;
  int ranks, stages_per_rank;
};

const std::string kZoo = "examples/models/zoo/";

stage::OptimizerOptions Optim(const std::string& name) {
  stage::OptimizerOptions o;
  o.kind = name == "sgd" ? OPTIMIZER_SGD : OPTIMIZER_ADAMW;
  o.lr = name == "sgd" ? 0.05 : 1e-3;
  o.momentum = name == "sgd" ? 0.9 : 0.0;
  o.weight_decay = name == "sgd" ? 1e-4 : 0.01;
  return o;
}

LossKind Loss(const std::string& name) {
  return name == "mse" ? LOSS_MSE : name == "model" ? LOSS_MODEL : LOSS_CROSS_ENTROPY;
}

// Splits the zoo model into dir/stages (stage_N.pt + plan.json) and writes its example
// batch as a data file; returns the batch size.
int64_t PrepareFiles(const Case& c, const std::string& dir) {
  auto model = *torchio::LoadModel(kZoo + c.model + ".pt");
  partition::SplitOptions so;
  so.num_stages = c.ranks * c.stages_per_rank;
  auto pipe = partition::SplitModel(model, so);
  EXPECT_TRUE(pipe.ok()) << pipe.status();
  EXPECT_TRUE(partition::WritePipe(*pipe, dir + "/stages").ok());
  auto inputs = *torchio::LoadExampleInputs(kZoo + c.model + ".input.pt", model);
  auto target = *torchio::LoadTorchSaved(kZoo + c.model + ".target.pt");
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("inputs", c10::ivalue::Tuple::create(inputs));
  d.insert("targets", target);
  std::vector<char> bytes = torch::jit::pickle_save(d);
  std::ofstream(dir + "/data.pt", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  for (const auto& in : inputs) {
    if (in.isTensor()) return in.toTensor().size(0);
  }
  return 0;
}

std::vector<std::string> RankArgs(const Case& c, int r, const std::string& dir, int steps, int64_t batch) {
  stage::OptimizerOptions o = Optim(c.optimizer);
  return {"worker/pippy-rank", "--rank", std::to_string(r), "--world", std::to_string(c.ranks),
          "--rendezvous", dir + "/rendezvous", "--stages-dir", dir + "/stages", "--schedule", c.schedule,
          "--stages-per-rank", std::to_string(c.stages_per_rank), "--microbatches", "4", "--steps",
          std::to_string(steps), "--batch-size", std::to_string(batch), "--data", dir + "/data.pt",
          "--loss", c.loss, "--optimizer", c.optimizer, "--lr", absl::StrCat(o.lr), "--momentum",
          absl::StrCat(o.momentum), "--weight-decay", absl::StrCat(o.weight_decay), "--tls", c.tls,
          "--timeout-s", "60", "--out", dir + "/out"};
}

class MultiProcessTraining : public ::testing::TestWithParam<Case> {};

TEST_P(MultiProcessTraining, RanksAsProcessesOverUcx_MatchUnsplitTraining) {
  const Case& c = GetParam();
  const std::string dir = TmpDir(c.name);
  torch::jit::setGraphExecutorOptimize(false);
  const int64_t batch = PrepareFiles(c, dir);
  Ranks ranks;
  for (int r = 0; r < c.ranks; ++r) {
    ranks.Start(RankArgs(c, r, dir, 3, batch), absl::StrCat(dir, "/rank", r, ".log"));
  }
  for (int r = 0; r < c.ranks; ++r) {
    int code = ranks.Wait(r, std::chrono::seconds(180));
    ASSERT_EQ(code, 0) << "rank " << r << ":\n" << Slurp(absl::StrCat(dir, "/rank", r, ".log"));
  }
  std::vector<torch::jit::Module> stages;
  for (int s = 0; s < c.ranks * c.stages_per_rank; ++s) {
    stages.push_back(torch::jit::load(absl::StrCat(dir, "/out/stage_", s, ".pt")));
  }
  auto ref = *torchio::LoadModel(kZoo + c.model + ".pt");
  auto inputs = *torchio::LoadExampleInputs(kZoo + c.model + ".input.pt", ref);
  auto target = *torchio::LoadTorchSaved(kZoo + c.model + ".target.pt");
  stage::testing::TrainUnsplit(ref, Loss(c.loss), Optim(c.optimizer), 0, inputs, target, 4, 3);
  int compared = 0;
  double worst = stage::testing::MaxRelativeDifference(stages, ref, &compared);
  EXPECT_GT(compared, 0);
  EXPECT_LE(worst, 1e-5);
  std::cout << "[ figure   ] " << c.name << ": " << c.ranks << " processes, max relative difference " << worst
            << " over " << compared << " parameters\n";
}

INSTANTIATE_TEST_SUITE_P(
    Zoo, MultiProcessTraining,
    ::testing::Values(Case{"gpt_1f1b_shm", "gpt", "1f1b", "model", "adamw", "sm,self", 2, 1},
                      Case{"unet_gpipe_tcp", "unet", "gpipe", "mse", "sgd", "tcp,self", 3, 1},
                      Case{"mlp_zbv_shm", "mlp", "zbv", "mse", "adamw", "sm,self", 2, 2},
                      Case{"cnn_bn_zb1p_tcp", "cnn_bn", "zb1p", "cross_entropy", "sgd", "tcp,self", 2, 1}),
    [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(MultiProcessFailure, PeerKilled_SurvivorExitsNamingIt) {
  Case c{"killed", "gpt", "1f1b", "model", "sgd", "sm,self", 2, 1};
  const std::string dir = TmpDir("killed");
  torch::jit::setGraphExecutorOptimize(false);
  const int64_t batch = PrepareFiles(c, dir);
  Ranks ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.Start(RankArgs(c, r, dir, 100000, batch), absl::StrCat(dir, "/rank", r, ".log"));
  }
  // Let training get going, then kill rank 1.
  for (int i = 0; i < 600 && Slurp(dir + "/rank0.log").find("step=2") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_NE(Slurp(dir + "/rank0.log").find("step=2"), std::string::npos) << Slurp(dir + "/rank0.log");
  auto start = std::chrono::steady_clock::now();
  ranks.Kill(1);
  int code = ranks.Wait(0, std::chrono::seconds(30));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(code, 1) << Slurp(dir + "/rank0.log");
  const std::string log = Slurp(dir + "/rank0.log");
  EXPECT_THAT(log, HasSubstr("peer rank 1 is gone"));
  EXPECT_THAT(log, HasSubstr("rank 0 step "));
  std::cout << "[ figure   ] rank 0 stopped " << seconds << " s after rank 1 was killed\n";
}

}  // namespace
}  // namespace pippy
