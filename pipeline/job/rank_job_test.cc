// RankJob's checkpoint state: a job stopped after k steps and resumed from its saved
// stages (TorchScript) and SaveState() ends with exactly (bitwise) the parameters of
// the uninterrupted job, for SGD with momentum and for AdamW; the random number
// generator comes back; bad state bytes are DATA_LOSS.
#include "pipeline/job/rank_job.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/partition/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/transport/loopback/loopback_transport.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::job {
namespace {

constexpr int kSteps = 6;

std::string Zoo(const std::string& f) { return "examples/models/zoo/" + f; }

JobSpec SpecFor(OptimizerKind optimizer, int batch) {
  JobSpec spec;
  spec.mutable_schedule()->set_kind(SCHEDULE_1F1B);
  spec.mutable_schedule()->set_microbatches(4);
  spec.mutable_split()->set_stages(2);
  spec.set_steps(kSteps);
  spec.set_batch_size(batch);
  spec.set_loss(LOSS_MSE);
  spec.mutable_optimizer()->set_kind(optimizer);
  spec.mutable_optimizer()->set_lr(optimizer == OPTIMIZER_SGD ? 0.05 : 1e-3);
  if (optimizer == OPTIMIZER_SGD) spec.mutable_optimizer()->set_momentum(0.9);
  return spec;
}

struct Ranks {
  std::vector<std::unique_ptr<transport::Transport>> transports;
  std::vector<std::unique_ptr<RankJob>> jobs;
};

// Two ranks of the spec's job over loopback, holding `stages`.
void MakeRanks(const JobSpec& spec, const PipelinePlan& plan, const std::vector<torch::jit::Module>& stages,
               Ranks* out) {
  out->transports = transport::loopback::Create(2);
  for (int r = 0; r < 2; ++r) {
    auto rj = RankJob::Create(spec, plan, r, {{r, stages[r]}}, out->transports[r].get(), absl::Seconds(30));
    ASSERT_TRUE(rj.ok()) << rj.status();
    out->jobs.push_back(std::move(*rj));
  }
}

void RunSteps(Ranks& ranks, int from, int to, const stage::DataSource& data) {
  std::vector<std::thread> threads;
  std::vector<absl::Status> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      for (int step = from; step < to; ++step) {
        auto res = ranks.jobs[r]->RunStep(step, data);
        if (!res.ok()) {
          errors[r] = res.status();
          return;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(errors[r].ok()) << "rank " << r << ": " << errors[r];
}

// A deep copy of a module through its TorchScript bytes (what a checkpoint stores).
torch::jit::Module Reload(const torch::jit::Module& m) {
  std::string bytes;
  absl::Status s = partition::WriteModule(m, [&](absl::string_view piece) {
    bytes.append(piece.data(), piece.size());
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  auto loaded = partition::LoadModelFromBytes(bytes, "stage");
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  return *loaded;
}

class RankJobStateTest : public ::testing::TestWithParam<OptimizerKind> {
 protected:
  static void SetUpTestSuite() { torch::jit::setGraphExecutorOptimize(false); }
};

TEST_P(RankJobStateTest, ResumedFromSavedState_BitwiseEqualsUninterrupted) {
  auto model = partition::LoadModel(Zoo("mlp.pt"));
  ASSERT_TRUE(model.ok());
  auto inputs = partition::LoadExampleInputs(Zoo("mlp.input.pt"), *model);
  auto target = partition::LoadTorchSaved(Zoo("mlp.target.pt"));
  ASSERT_TRUE(inputs.ok() && target.ok());
  const int batch = static_cast<int>((*inputs)[0].toTensor().size(0));
  JobSpec spec = SpecFor(GetParam(), batch);
  ASSERT_TRUE(CheckSpec(&spec).ok());
  partition::SplitOptions so;
  so.num_stages = 2;
  auto pipe = partition::SplitModel(*model, so);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  std::vector<std::string> names;
  for (const ModelValue& v : pipe->plan.inputs()) names.push_back(v.name());
  auto data = stage::DataSource::FromValues(*inputs, *target, names);
  ASSERT_TRUE(data.ok());

  // Uninterrupted: kSteps steps on copies of the stages.
  Ranks whole;
  MakeRanks(spec, pipe->plan, {Reload(pipe->stages[0]), Reload(pipe->stages[1])}, &whole);
  RunSteps(whole, 0, kSteps, *data);

  // Interrupted after 3 steps: the stages and each rank's state are saved, everything
  // else is thrown away, and new ranks resume at step 3.
  Ranks first;
  MakeRanks(spec, pipe->plan, {Reload(pipe->stages[0]), Reload(pipe->stages[1])}, &first);
  RunSteps(first, 0, 3, *data);
  std::vector<torch::jit::Module> saved;
  std::vector<std::string> states;
  for (int r = 0; r < 2; ++r) {
    saved.push_back(Reload(first.jobs[r]->stages().at(r)));
    auto st = first.jobs[r]->SaveState();
    ASSERT_TRUE(st.ok()) << st.status();
    states.push_back(*st);
  }
  first.jobs.clear();
  Ranks resumed;
  MakeRanks(spec, pipe->plan, saved, &resumed);
  for (int r = 0; r < 2; ++r) {
    absl::Status s = resumed.jobs[r]->RestoreState(states[r]);
    ASSERT_TRUE(s.ok()) << s;
  }
  RunSteps(resumed, 3, kSteps, *data);

  int compared = 0;
  for (int r = 0; r < 2; ++r) {
    auto a = whole.jobs[r]->stages().at(r).named_parameters(true);
    auto b = resumed.jobs[r]->stages().at(r).named_parameters(true);
    auto ia = a.begin();
    for (auto ib = b.begin(); ia != a.end() && ib != b.end(); ++ia, ++ib) {
      ASSERT_EQ((*ia).name, (*ib).name);
      EXPECT_TRUE(torch::equal((*ia).value, (*ib).value)) << "rank " << r << " " << (*ia).name;
      ++compared;
    }
  }
  EXPECT_GT(compared, 0);
  // Without the optimizer's state the resumed run would differ (the test can fail).
  Ranks fresh;
  MakeRanks(spec, pipe->plan, saved, &fresh);
  RunSteps(fresh, 3, kSteps, *data);
  bool any_differs = false;
  for (int r = 0; r < 2; ++r) {
    auto a = whole.jobs[r]->stages().at(r).named_parameters(true);
    auto b = fresh.jobs[r]->stages().at(r).named_parameters(true);
    auto ia = a.begin();
    for (auto ib = b.begin(); ia != a.end() && ib != b.end(); ++ia, ++ib) {
      if (!torch::equal((*ia).value, (*ib).value)) any_differs = true;
    }
  }
  EXPECT_TRUE(any_differs);
}

INSTANTIATE_TEST_SUITE_P(Optimizers, RankJobStateTest, ::testing::Values(OPTIMIZER_SGD, OPTIMIZER_ADAMW),
                         [](const auto& info) { return OptimizerName(info.param); });

class RankJobStateErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = partition::LoadModel(Zoo("mlp.pt"));
    ASSERT_TRUE(model.ok());
    partition::SplitOptions so;
    so.num_stages = 2;
    auto pipe = partition::SplitModel(*model, so);
    ASSERT_TRUE(pipe.ok());
    spec_ = SpecFor(OPTIMIZER_ADAM, 16);
    ASSERT_TRUE(CheckSpec(&spec_).ok());
    MakeRanks(spec_, pipe->plan, pipe->stages, &ranks_);
  }
  JobSpec spec_;
  Ranks ranks_;
};

TEST_F(RankJobStateErrorsTest, RandomGeneratorComesBack) {
  auto state = ranks_.jobs[0]->SaveState();
  ASSERT_TRUE(state.ok()) << state.status();
  at::Tensor a = torch::rand({8});
  ASSERT_TRUE(ranks_.jobs[0]->RestoreState(*state).ok());
  at::Tensor b = torch::rand({8});
  EXPECT_TRUE(torch::equal(a, b));
}

TEST_F(RankJobStateErrorsTest, OtherRanksState_IsDataLossNamingBoth) {
  auto state = ranks_.jobs[1]->SaveState();
  ASSERT_TRUE(state.ok());
  absl::Status s = ranks_.jobs[0]->RestoreState(*state);
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  EXPECT_NE(s.message().find("rank 1's, not rank 0's"), std::string::npos) << s;
}

TEST_F(RankJobStateErrorsTest, Garbage_IsDataLoss) {
  absl::Status s = ranks_.jobs[0]->RestoreState("not a checkpoint");
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
  auto state = ranks_.jobs[0]->SaveState();
  ASSERT_TRUE(state.ok());
  s = ranks_.jobs[0]->RestoreState(state->substr(0, state->size() / 2));
  EXPECT_TRUE(absl::IsDataLoss(s)) << s;
}

}  // namespace
}  // namespace pippy::job
