// RankJob's checkpoint state: a job stopped after k steps and resumed from its saved
// stages (TorchScript) and SaveState() ends with exactly (bitwise) the parameters of
// the uninterrupted job, for SGD with momentum and for AdamW (with a cosine
// learning-rate schedule and warm-up); the random number
// generator comes back; bad state bytes are DATA_LOSS.
#include "pipeline/job/layout.h"
#include "pipeline/job/rank_job.h"
#include "pipeline/stage/data_source.h"

#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/transport/gloo/gloo_group.h"
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
  if (optimizer == OPTIMIZER_ADAMW) {
    // A schedule whose warm-up ends before the interruption at step 3: the resumed
    // ranks must go on with the decay's step 3, not the restored optimizer's lr.
    spec.mutable_optimizer()->set_lr_schedule(LR_SCHEDULE_COSINE);
    spec.mutable_optimizer()->set_warmup_steps(2);
    spec.mutable_optimizer()->set_min_lr(1e-5);
  }
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
  absl::StatusOr<JobLayout> layout = MakeLayout(spec, plan);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (int r = 0; r < 2; ++r) {
    auto rj = RankJob::Create(spec, plan, layout->ranks(r), r, {{r, stages[r]}}, out->transports[r].get(),
                              absl::Seconds(30));
    ASSERT_TRUE(rj.ok()) << rj.status();
    out->jobs.push_back(std::move(*rj));
  }
}

void RunSteps(Ranks& ranks, int from, int to, stage::DataSource& data) {
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
  absl::Status s = torchio::WriteModule(m, [&](absl::string_view piece) {
    bytes.append(piece.data(), piece.size());
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  auto loaded = torchio::LoadModelFromBytes(bytes, "stage");
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  return *loaded;
}

// The zoo's MLP split into 2 stages, with its example batch as the data, for a job of
// `optimizer` (SpecFor).
struct MlpJob {
  torch::jit::Module model;
  std::vector<c10::IValue> inputs;
  c10::IValue target;
  JobSpec spec;
  std::optional<partition::Pipe> pipe;
  std::optional<stage::DataSource> data;
};

void LoadMlpJob(OptimizerKind optimizer, MlpJob* j) {
  auto model = torchio::LoadModel(Zoo("mlp.pt"));
  ASSERT_TRUE(model.ok());
  auto inputs = torchio::LoadExampleInputs(Zoo("mlp.input.pt"), *model);
  auto target = torchio::LoadTorchSaved(Zoo("mlp.target.pt"));
  ASSERT_TRUE(inputs.ok() && target.ok());
  j->model = *model;
  j->inputs = *inputs;
  j->target = *target;
  j->spec = SpecFor(optimizer, static_cast<int>(j->inputs[0].toTensor().size(0)));
  ASSERT_TRUE(CheckSpec(&j->spec).ok());
  partition::SplitOptions so;
  so.num_stages = 2;
  auto pipe = partition::SplitModel(j->model, so);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  j->pipe = std::move(*pipe);
  std::vector<std::string> names;
  for (const ModelValue& v : j->pipe->plan.inputs()) names.push_back(v.name());
  auto data = stage::DataSource::FromValues(j->inputs, j->target, names);
  ASSERT_TRUE(data.ok());
  j->data = std::move(*data);
}

class RankJobStateTest : public ::testing::TestWithParam<OptimizerKind> {
 protected:
  static void SetUpTestSuite() { torch::jit::setGraphExecutorOptimize(false); }
};

TEST_P(RankJobStateTest, ResumedFromSavedState_BitwiseEqualsUninterrupted) {
  MlpJob job;
  ASSERT_NO_FATAL_FAILURE(LoadMlpJob(GetParam(), &job));
  const JobSpec& spec = job.spec;
  auto& pipe = job.pipe;
  auto& data = job.data;

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

// An evaluation batch: forward only, micro-batch by micro-batch, over its own message
// kind; on the last rank the mean of the micro-batches' losses, as the unsplit model in
// eval mode computes it; the parameters and gradients stay as they were.
TEST(RankJobEvalTest, EvalStepEqualsTheUnsplitModelsLossAndChangesNothing) {
  torch::jit::setGraphExecutorOptimize(false);
  MlpJob job;
  ASSERT_NO_FATAL_FAILURE(LoadMlpJob(OPTIMIZER_SGD, &job));
  torch::jit::Module* model = &job.model;
  const JobSpec& spec = job.spec;
  auto& pipe = job.pipe;
  auto& data = job.data;
  Ranks ranks;
  MakeRanks(spec, pipe->plan, {Reload(pipe->stages[0]), Reload(pipe->stages[1])}, &ranks);
  std::vector<at::Tensor> before;
  std::vector<bool> modes;
  for (int r = 0; r < 2; ++r) {
    for (const auto& [s, m] : ranks.jobs[r]->stages()) {
      modes.push_back(m.is_training());
      for (const auto& p : m.parameters()) before.push_back(p.clone());
    }
  }
  std::vector<absl::StatusOr<stage::StepResult>> results(2, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] { results[r] = ranks.jobs[r]->EvalStep(/*eval_step=*/0, /*batch_index=*/0, &*data); });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  EXPECT_FALSE(results[0]->has_loss);
  ASSERT_TRUE(results[1]->has_loss);
  // The reference: the unsplit model, eval mode, no gradients, 4 micro-batches.
  torch::NoGradGuard no_grad;
  model->eval();
  const at::Tensor x = job.inputs[0].toTensor(), y = job.target.toTensor();
  double want = 0;
  for (int k = 0; k < 4; ++k) {
    const at::Tensor out = model->forward({x.chunk(4, 0)[k]}).toTensor();
    want += at::mse_loss(out, y.chunk(4, 0)[k]).item<double>();
  }
  want /= 4;
  EXPECT_NEAR(results[1]->loss, want, 1e-6 * std::abs(want));
  size_t i = 0, k = 0;
  for (int r = 0; r < 2; ++r) {
    for (const auto& [s, m] : ranks.jobs[r]->stages()) {
      EXPECT_EQ(m.is_training(), modes[k++]) << "stage " << s << " was left in another mode";
      for (const auto& p : m.parameters()) {
        EXPECT_TRUE(torch::equal(p, before[i++]));
        EXPECT_FALSE(p.grad().defined());
      }
    }
  }
}

// Data parallelism: 2 replicas x 2 ranks (replica groups over real gloo TCP on
// 127.0.0.1, each replica's ranks over loopback) train like one pipeline on the whole
// batch with twice the micro-batches: each replica takes half of every batch and the
// gradients are averaged. Not bitwise: the sums are grouped differently.
TEST(RankJobReplicas, TwoReplicas_TrainLikeOnePipelineOnTheWholeBatch) {
  torch::jit::setGraphExecutorOptimize(false);
  auto model = torchio::LoadModel(Zoo("mlp.pt"));
  ASSERT_TRUE(model.ok());
  auto inputs = torchio::LoadExampleInputs(Zoo("mlp.input.pt"), *model);
  auto target = torchio::LoadTorchSaved(Zoo("mlp.target.pt"));
  ASSERT_TRUE(inputs.ok() && target.ok());
  const int batch = static_cast<int>((*inputs)[0].toTensor().size(0));
  partition::SplitOptions so;
  so.num_stages = 2;
  auto pipe = partition::SplitModel(*model, so);
  ASSERT_TRUE(pipe.ok());
  std::vector<std::string> names;
  for (const ModelValue& v : pipe->plan.inputs()) names.push_back(v.name());
  auto data = stage::DataSource::FromValues(*inputs, *target, names);
  ASSERT_TRUE(data.ok());

  JobSpec one = SpecFor(OPTIMIZER_SGD, batch);
  one.mutable_schedule()->set_microbatches(4);
  ASSERT_TRUE(CheckSpec(&one).ok());
  Ranks whole;
  MakeRanks(one, pipe->plan, {Reload(pipe->stages[0]), Reload(pipe->stages[1])}, &whole);
  RunSteps(whole, 0, kSteps, *data);

  JobSpec two = SpecFor(OPTIMIZER_SGD, batch);
  two.mutable_schedule()->set_microbatches(2);
  two.set_replicas(2);
  ASSERT_TRUE(CheckSpec(&two).ok()) << CheckSpec(&two);
  // groups[p][r]: pipeline rank p of replica r.
  std::vector<std::vector<std::unique_ptr<transport::gloo_group::GlooGroup>>> groups(2);
  for (int p = 0; p < 2; ++p) {
    std::vector<std::string> addresses;
    for (int r = 0; r < 2; ++r) {
      auto g = transport::gloo_group::GlooGroup::Create(r, 2, "127.0.0.1", absl::Seconds(30));
      ASSERT_TRUE(g.ok()) << g.status();
      addresses.push_back((*g)->address());
      groups[p].push_back(std::move(*g));
    }
    std::vector<std::thread> connect;
    for (int r = 0; r < 2; ++r) {
      connect.emplace_back([&, p, r] { EXPECT_TRUE(groups[p][r]->Connect(addresses).ok()); });
    }
    for (auto& t : connect) t.join();
  }
  std::vector<Ranks> replicas(2);
  absl::StatusOr<JobLayout> layout = MakeLayout(two, pipe->plan);
  ASSERT_TRUE(layout.ok()) << layout.status();
  for (int r = 0; r < 2; ++r) {
    replicas[r].transports = transport::loopback::Create(2);
    for (int p = 0; p < 2; ++p) {
      auto rj = RankJob::Create(two, pipe->plan, layout->ranks(p), p, {{p, Reload(pipe->stages[p])}},
                                replicas[r].transports[p].get(), absl::Seconds(30), groups[p][r].get());
      ASSERT_TRUE(rj.ok()) << rj.status();
      replicas[r].jobs.push_back(std::move(*rj));
    }
  }
  std::vector<std::thread> runs;
  for (int r = 0; r < 2; ++r) runs.emplace_back([&, r] { RunSteps(replicas[r], 0, kSteps, *data); });
  for (auto& t : runs) t.join();
  // The buckets' all-reduces start from the gradient hooks, inside the stage's last
  // backward (not after it): one more step, on every rank of both replicas.
  std::vector<std::thread> extra;
  std::vector<stage::StepResult> last(4);
  for (int r = 0; r < 2; ++r) {
    for (int p = 0; p < 2; ++p) {
      extra.emplace_back([&, r, p] {
        auto res = replicas[r].jobs[p]->RunStep(kSteps, *data);
        ASSERT_TRUE(res.ok()) << res.status();
        last[r * 2 + p] = *res;
      });
    }
  }
  for (auto& t : extra) t.join();
  for (const auto& res : last) {
    EXPECT_GT(res.allreduce_buckets, 0);
    EXPECT_EQ(res.allreduce_buckets_in_backward, res.allreduce_buckets);
    bool traced = false;
    for (const auto& e : res.trace) traced |= e.name.rfind("all-reduce ", 0) == 0;
    EXPECT_TRUE(traced);
  }

  RunSteps(whole, kSteps, kSteps + 1, *data);
  double worst = 0;
  for (int p = 0; p < 2; ++p) {
    auto a = whole.jobs[p]->stages().at(p).named_parameters(true);
    for (int r = 0; r < 2; ++r) {
      auto b = replicas[r].jobs[p]->stages().at(p).named_parameters(true);
      auto ia = a.begin();
      for (auto ib = b.begin(); ia != a.end() && ib != b.end(); ++ia, ++ib) {
        const double rel = ((*ia).value - (*ib).value).abs().max().item<double>() /
                           std::max(1e-12, (*ia).value.abs().max().item<double>());
        worst = std::max(worst, rel);
      }
    }
    // The replicas hold the same parameters, bitwise: they took the same averaged step.
    auto x = replicas[0].jobs[p]->stages().at(p).named_parameters(true);
    auto y = replicas[1].jobs[p]->stages().at(p).named_parameters(true);
    auto ix = x.begin();
    for (auto iy = y.begin(); ix != x.end() && iy != y.end(); ++ix, ++iy) {
      EXPECT_TRUE(torch::equal((*ix).value, (*iy).value)) << (*ix).name;
    }
  }
  std::cout << "[ figure   ] 2 replicas x 2 ranks vs 1 pipeline on the whole batch: max relative difference " << worst
            << "\n";
  EXPECT_LE(worst, 1e-6);
}

TEST(RankJobReplicas, GroupThatDoesNotMatchTheSpec_IsRefused) {
  auto model = torchio::LoadModel(Zoo("mlp.pt"));
  ASSERT_TRUE(model.ok());
  partition::SplitOptions so;
  so.num_stages = 2;
  auto pipe = partition::SplitModel(*model, so);
  ASSERT_TRUE(pipe.ok());
  JobSpec two = SpecFor(OPTIMIZER_SGD, 16);
  two.set_replicas(2);
  ASSERT_TRUE(CheckSpec(&two).ok());
  auto transports = transport::loopback::Create(2);
  absl::StatusOr<JobLayout> layout = MakeLayout(two, pipe->plan);
  ASSERT_TRUE(layout.ok()) << layout.status();
  auto rj = RankJob::Create(two, pipe->plan, layout->ranks(0), 0, {{0, pipe->stages[0]}}, transports[0].get(),
                            absl::Seconds(1));
  EXPECT_TRUE(absl::IsInvalidArgument(rj.status())) << rj.status();
  JobSpec odd = SpecFor(OPTIMIZER_SGD, 12);
  odd.set_replicas(2);  // 12 rows do not split into 2 replicas x 4 micro-batches
  EXPECT_THAT(std::string(CheckSpec(&odd).message()),
              ::testing::HasSubstr("12 does not split into 2 replicas x 4 equal micro-batches"));
}

class RankJobStateErrorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = torchio::LoadModel(Zoo("mlp.pt"));
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
