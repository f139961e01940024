// Pipeline training equals unsplit training: for every schedule and zoo model, N
// ranks (threads over the loopback transport) train 3 optimizer steps and must end
// with the parameters (and BatchNorm buffers) of the unsplit model trained in one
// process on the same batches — max relative difference <= 1e-5.
//
// Two references: (a) the unsplit model accumulating gradients over the same
// micro-batches (what a pipeline computes; required for BatchNorm, whose statistics
// are per micro-batch), and (b) the unsplit model on the full batch at once (models
// without batch-coupled layers).
//
// Tensor parallelism (cases with tp = T > 1): each stage is sharded (pipeline/
// tensor_parallel) and computed by T ranks, one pipeline of P ranks per shard, every
// pipeline rank's T shards in one in-process group; each shard's parameters must equal
// the matching slice of the unsplit model's, and the replicated parameters must be
// bitwise the same on every rank of a group.
//
// Each run also records the tags every rank posts: both ends of every channel (one
// kind of message between one pair of stages) must post its messages in one order,
// which a transport that matches by order (NCCL) relies on.
#include <map>
#include <set>
#include <tuple>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/names.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/layout.h"
#include "pipeline/job/rank_job.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/partition/sequential_runner.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulator.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/stage/rank_runtime.h"
#include "pipeline/stage/testing/reference_training.h"
#include "pipeline/tensor_parallel/sharding.h"
#include "pipeline/tensor_parallel/tp_ops.h"
#include "pipeline/tensor_parallel/tp_plan.h"
#include "pipeline/transport/loopback/loopback_transport.h"
#include "torch/csrc/autograd/autograd.h"
#include "torch/nn/utils/clip_grad.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::stage {
namespace {

using ::testing::HasSubstr;

std::string Zoo(const std::string& f) { return "examples/models/zoo/" + f; }

using testing::RelDiff;

struct ModelSpec {
  std::string name;
  LossKind loss;
  bool batch_coupled;  // BatchNorm, data-dependent branches: only the micro-batched reference applies
};

const ModelSpec kModels[] = {
    {"mlp", LOSS_MSE, false},         {"gpt", LOSS_MODEL, false},  {"unet", LOSS_MSE, false},
    {"cnn_bn", LOSS_CROSS_ENTROPY, true},
    {"multi", LOSS_MODEL, true},  // branches on the batch mean: per micro-batch, like BatchNorm
};
const ModelSpec kLlama = {"llama", LOSS_MODEL, false};  // the tensor-parallel cases'
constexpr char kLlamaPlan[] =
    "layers.*.attn.q=colwise,layers.*.attn.k=colwise,layers.*.attn.v=colwise,layers.*.attn.o=rowwise,"
    "layers.*.mlp.gate=colwise,layers.*.mlp.up=colwise,layers.*.mlp.down=rowwise,tok_emb=vocab";

struct Case {
  ModelSpec model;
  ScheduleKind kind;
  int ranks;
  int stages_per_rank;
  OptimizerKind optimizer;
  double clip = 0;
  int tp = 1;  // tensor-parallel ranks per stage (kLlamaPlan)
};

OptimizerOptions Optim(OptimizerKind kind) {
  OptimizerOptions o;
  o.kind = kind;
  if (kind == OPTIMIZER_SGD) {
    o.lr = 0.05;
    o.momentum = 0.9;
    o.weight_decay = 1e-4;
  } else {
    o.lr = 1e-3;
    o.weight_decay = 0.01;
  }
  return o;
}

struct PipelineRun {
  partition::Pipe pipe;
  std::vector<std::vector<torch::jit::Module>> shards;  // [stage][tp rank] (tp > 1)
  schedule::Schedule schedule;
  std::vector<std::vector<StepResult>> results;  // [rank][step]
  std::vector<absl::Status> errors;
  // Directions whose two ends posted their messages in different orders: over all
  // messages, and within a channel (one kind between one pair of stages).
  std::vector<std::string> pair_order_mismatches, channel_order_mismatches;
};

constexpr int kMicrobatches = 4;
constexpr int kSteps = 3;

// Records the tags a rank posts, per peer: sends and receives in posting order. A
// transport that matches messages by order rather than by tag (NCCL) needs the
// sender's sends and the receiver's receives in the same order on each channel it
// matches on.
class RecordingTransport : public transport::Transport {
 public:
  explicit RecordingTransport(transport::Transport* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int world_size() const override { return inner_->world_size(); }
  std::shared_ptr<transport::Work> Send(int peer, const transport::Tag& tag, c10::IValue value) override {
    {
      absl::MutexLock lock(&mu_);
      sends_[peer].push_back(tag);
    }
    return inner_->Send(peer, tag, std::move(value));
  }
  std::shared_ptr<transport::Work> Recv(int peer, const transport::Tag& tag) override {
    {
      absl::MutexLock lock(&mu_);
      recvs_[peer].push_back(tag);
    }
    return inner_->Recv(peer, tag);
  }
  std::vector<transport::Tag> SendsTo(int peer) {
    absl::MutexLock lock(&mu_);
    return sends_[peer];
  }
  std::vector<transport::Tag> RecvsFrom(int peer) {
    absl::MutexLock lock(&mu_);
    return recvs_[peer];
  }

 private:
  transport::Transport* const inner_;
  absl::Mutex mu_;
  std::map<int, std::vector<transport::Tag>> sends_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::vector<transport::Tag>> recvs_ ABSL_GUARDED_BY(mu_);
};

// The first place where rank `from`'s sends to `to` and `to`'s receives from `from`
// are posted in different orders ("" when they agree), over all their messages
// (`per_channel` false) or within each channel: one kind of message between one pair
// of stages (kind, source and destination stage, output index).
std::string OrderMismatch(std::vector<std::unique_ptr<RecordingTransport>>& ranks, int from, int to, bool per_channel) {
  auto channel = [&](const transport::Tag& t) {
    return per_channel ? std::make_tuple(static_cast<int>(t.kind), t.src_stage, t.dst_stage, t.index)
                       : std::make_tuple(0, 0u, 0u, 0u);
  };
  std::map<std::tuple<int, uint32_t, uint32_t, uint32_t>, std::pair<std::vector<std::string>, std::vector<std::string>>>
      channels;
  for (const transport::Tag& t : ranks[from]->SendsTo(to)) channels[channel(t)].first.push_back(t.ToString());
  for (const transport::Tag& t : ranks[to]->RecvsFrom(from)) channels[channel(t)].second.push_back(t.ToString());
  for (const auto& entry : channels) {
    const std::vector<std::string>& sent = entry.second.first;
    const std::vector<std::string>& received = entry.second.second;
    for (size_t i = 0; i < std::max(sent.size(), received.size()); ++i) {
      const std::string a = i < sent.size() ? sent[i] : "(nothing)", b = i < received.size() ? received[i] : "(nothing)";
      if (a != b) return absl::StrCat("rank ", from, " -> ", to, " message #", i, ": sent ", a, ", received as ", b);
    }
  }
  return "";
}

// Trains the pipeline; inputs/targets: the zoo example batch.
void RunPipeline(const Case& c, const std::vector<c10::IValue>& inputs, const c10::IValue& target, PipelineRun* run,
                 schedule::Schedule* custom = nullptr) {
  auto model = torchio::LoadModel(Zoo(c.model.name + ".pt"));
  ASSERT_TRUE(model.ok());
  partition::SplitOptions so;
  so.num_stages = c.ranks * c.stages_per_rank;
  auto pipe = partition::SplitModel(*model, so);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  run->pipe = std::move(*pipe);
  const int T = c.tp, P = c.ranks;
  if (T > 1) {
    tp::ShardOptions sh;
    sh.spec = *tp::ParsePlan(kLlamaPlan, T);
    sh.example_inputs = inputs;
    auto shards = tp::ShardPipe(&run->pipe, sh);
    ASSERT_TRUE(shards.ok()) << shards.status();
    run->shards = std::move(*shards);
  }
  // One pipeline of P ranks per tensor-parallel rank t: transports[t * P + r].
  std::vector<std::vector<std::unique_ptr<transport::Transport>>> loopbacks;
  std::vector<std::unique_ptr<RecordingTransport>> transports;
  for (int t = 0; t < T; ++t) {
    loopbacks.push_back(transport::loopback::Create(P));
    for (auto& l : loopbacks.back()) transports.push_back(std::make_unique<RecordingTransport>(l.get()));
  }
  std::vector<std::unique_ptr<tp::LocalGroup>> groups;  // by pipeline rank
  for (int r = 0; r < P && T > 1; ++r) groups.push_back(std::make_unique<tp::LocalGroup>(T, absl::Seconds(30)));
  auto stage_module = [&](int s, int t) { return T > 1 ? run->shards[s][t] : run->pipe.stages[s]; };
  // Generated schedules: the job's spec and job::RankJob, exactly as a worker sets up
  // its rank; every step trains on the whole example batch.
  JobSpec spec;
  spec.mutable_schedule()->set_kind(c.kind);
  spec.mutable_schedule()->set_microbatches(kMicrobatches);
  spec.mutable_schedule()->set_stages_per_worker(c.stages_per_rank);
  spec.mutable_split()->set_stages(c.ranks * c.stages_per_rank);
  spec.set_steps(kSteps);
  for (const c10::IValue& in : inputs) {
    if (in.isTensor()) {
      spec.set_batch_size(static_cast<int>(in.toTensor().size(0)));
      break;
    }
  }
  if (c.kind != SCHEDULE_INFERENCE) {
    const OptimizerOptions o = Optim(c.optimizer);
    spec.set_loss(c.model.loss);
    spec.mutable_optimizer()->set_kind(o.kind);
    spec.mutable_optimizer()->set_lr(o.lr);
    spec.mutable_optimizer()->set_momentum(o.momentum);
    spec.mutable_optimizer()->set_weight_decay(o.weight_decay);
    spec.mutable_optimizer()->set_clip_grad_norm(c.clip);
  }
  if (T > 1) *spec.mutable_tensor_parallel() = run->pipe.plan.tensor_parallel();
  ASSERT_TRUE(job::CheckSpec(&spec).ok()) << job::CheckSpec(&spec);
  std::vector<std::string> names;
  for (const ModelValue& v : run->pipe.plan.inputs()) names.push_back(v.name());
  auto data = DataSource::FromValues(inputs, target, names);
  ASSERT_TRUE(data.ok()) << data.status();
  std::vector<std::unique_ptr<job::RankJob>> jobs;
  std::vector<std::unique_ptr<RankRuntime>> runtimes;  // custom schedules only
  if (custom != nullptr) {
    run->schedule = *custom;
    RuntimeOptions ro = job::RuntimeOptionsFor(spec, absl::Seconds(30));
    for (int r = 0; r < c.ranks; ++r) {
      std::map<int, torch::jit::Module> mine;
      for (int s : run->schedule.StagesOf(r)) mine[s] = run->pipe.stages[s];
      auto rt = RankRuntime::Create(r, run->pipe.plan, mine, run->schedule, transports[r].get(), ro);
      ASSERT_TRUE(rt.ok()) << rt.status();
      runtimes.push_back(std::move(*rt));
    }
  } else {
    auto sched = job::ScheduleFor(spec, run->pipe.plan);
    ASSERT_TRUE(sched.ok()) << sched.status();
    run->schedule = *sched;
    absl::StatusOr<JobLayout> layout = job::MakeLayout(spec, run->pipe.plan);
    ASSERT_TRUE(layout.ok()) << layout.status();
    for (int t = 0; t < T; ++t) {
      for (int r = 0; r < c.ranks; ++r) {
        std::map<int, torch::jit::Module> mine;
        for (int s : run->schedule.StagesOf(r)) mine[s] = stage_module(s, t);
        auto rj = job::RankJob::Create(spec, run->pipe.plan, layout->ranks(r), r, mine, transports[t * P + r].get(),
                                       absl::Seconds(30), nullptr, c10::Device(c10::kCPU),
                                       T > 1 ? groups[r]->member(t) : nullptr);
        ASSERT_TRUE(rj.ok()) << rj.status();
        jobs.push_back(std::move(*rj));
      }
    }
  }
  ASSERT_TRUE(schedule::Simulate(run->schedule).ok());
  run->results.assign(T * P, {});
  run->errors.assign(T * P, absl::OkStatus());
  std::vector<std::thread> threads;
  for (int g = 0; g < T * P; ++g) {
    threads.emplace_back([&, g] {
      const int r = g % P;
      for (int step = 0; step < kSteps; ++step) {
        absl::StatusOr<StepResult> res;
        if (!jobs.empty()) {
          res = jobs[g]->RunStep(step, *data);
        } else {
          res = run->schedule.forward_only ? runtimes[r]->InferenceStep(step, inputs)
                                           : runtimes[r]->TrainStep(step, inputs, target);
        }
        if (!res.ok()) {
          run->errors[g] = res.status();
          transport::loopback::KillRank(loopbacks[g / P][r].get(), r);  // unblock the others
          if (T > 1) groups[r]->Abort();
          return;
        }
        run->results[g].push_back(*res);
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int from = 0; from < c.ranks; ++from) {
    for (int to = 0; to < c.ranks; ++to) {
      if (from == to) continue;
      std::string mismatch = OrderMismatch(transports, from, to, /*per_channel=*/false);
      if (!mismatch.empty()) run->pair_order_mismatches.push_back(mismatch);
      mismatch = OrderMismatch(transports, from, to, /*per_channel=*/true);
      if (!mismatch.empty()) run->channel_order_mismatches.push_back(mismatch);
    }
  }
}

std::vector<double> TrainReference(torch::jit::Module& ref, const Case& c, const std::vector<c10::IValue>& inputs,
                                   const c10::IValue& target, bool microbatched) {
  return testing::TrainUnsplit(ref, c.model.loss, Optim(c.optimizer), c.clip, inputs, target,
                               microbatched ? kMicrobatches : 1, kSteps);
}

// Tensor parallelism: each shard's parameters against the matching slice of the
// reference's; the replicated ones must also be bitwise equal across a group's ranks;
// the shards gathered back into whole tensors (what fetch writes) against the reference.
double CompareShards(const PipelineRun& run, const torch::jit::Module& ref, int* compared) {
  std::map<std::string, at::Tensor> want;
  for (const auto& p : ref.named_parameters(true)) want[p.name] = p.value;
  double worst = 0;
  for (size_t s = 0; s < run.shards.size(); ++s) {
    auto whole = tp::GatherShards(run.pipe.plan.stages(s), run.shards[s]);
    EXPECT_TRUE(whole.ok()) << whole.status();
    if (whole.ok()) {
      for (const auto& [name, t] : *whole) {
        if (want.count(name)) worst = std::max(worst, RelDiff(t, want[name]));
      }
    }
    const int T = static_cast<int>(run.shards[s].size());
    for (const ParameterInfo& pi : run.pipe.plan.stages(s).parameters()) {
      if (pi.is_buffer()) continue;
      for (int t = 0; t < T; ++t) {
        at::Tensor got;
        for (const auto& p : run.shards[s][t].named_parameters(true)) {
          if (p.name == pi.name()) got = p.value;
        }
        EXPECT_TRUE(got.defined()) << pi.name();
        if (!got.defined() || !want.count(pi.name())) continue;
        const at::Tensor w = pi.has_tp_dim() ? tp::ShardOf(want[pi.name()], pi.tp_dim(), t, T) : want[pi.name()];
        EXPECT_TRUE(got.sizes().equals(w.sizes())) << pi.name();
        if (!got.sizes().equals(w.sizes())) continue;
        worst = std::max(worst, RelDiff(got, w));
        ++*compared;
        if (!pi.has_tp_dim() && t > 0) {
          for (const auto& p : run.shards[s][0].named_parameters(true)) {
            if (p.name == pi.name()) EXPECT_TRUE(at::equal(p.value, got)) << pi.name() << " differs between ranks 0 and " << t;
          }
        }
      }
    }
  }
  return worst;
}

double CompareState(const PipelineRun& run, const torch::jit::Module& ref, bool* any) {
  int compared = 0;
  double worst = run.shards.empty() ? testing::MaxRelativeDifference(run.pipe.stages, ref, &compared)
                                    : CompareShards(run, ref, &compared);
  *any = compared > 0;
  return worst;
}

class PipelineTrainingTest : public ::testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() { torch::jit::setGraphExecutorOptimize(false); }
};

double g_worst_micro = 0, g_worst_full = 0;

TEST(AutocastScope, CastsMatrixProductsInside_RestoresOutside_NestsAndIgnoresUndefined) {
  const at::Tensor a = torch::randn({4, 4});
  EXPECT_EQ(at::mm(a, a).scalar_type(), at::kFloat);
  {
    AutocastScope outer(c10::DeviceType::CPU, at::kBFloat16);
    EXPECT_EQ(at::mm(a, a).scalar_type(), at::kBFloat16);
    {
      AutocastScope off(c10::DeviceType::CPU, c10::ScalarType::Undefined);  // does nothing
      EXPECT_EQ(at::mm(a, a).scalar_type(), at::kBFloat16);
    }
    {
      AutocastScope inner(c10::DeviceType::CPU, at::kBFloat16);
      EXPECT_EQ(at::mm(a, a).scalar_type(), at::kBFloat16);
    }
    EXPECT_EQ(at::mm(a, a).scalar_type(), at::kBFloat16) << "an inner scope's end must not end the outer one";
  }
  EXPECT_EQ(at::mm(a, a).scalar_type(), at::kFloat);
  const c10::IValue mixed = c10::ivalue::Tuple::create({a.to(at::kBFloat16), a.to(at::kLong), c10::IValue(2.0)});
  const c10::IValue f32 = ToFloat32(mixed);
  EXPECT_EQ(f32.toTupleRef().elements()[0].toTensor().scalar_type(), at::kFloat);
  EXPECT_EQ(f32.toTupleRef().elements()[1].toTensor().scalar_type(), at::kLong);
}

TEST_P(PipelineTrainingTest, ThreeSteps_MatchUnsplitTraining) {
  const Case& c = GetParam();
  auto model = torchio::LoadModel(Zoo(c.model.name + ".pt"));
  ASSERT_TRUE(model.ok());
  auto inputs = torchio::LoadExampleInputs(Zoo(c.model.name + ".input.pt"), *model);
  auto target = torchio::LoadTorchSaved(Zoo(c.model.name + ".target.pt"));
  ASSERT_TRUE(inputs.ok() && target.ok());

  PipelineRun run;
  RunPipeline(c, *inputs, *target, &run);
  for (size_t r = 0; r < run.errors.size(); ++r) ASSERT_TRUE(run.errors[r].ok()) << "rank " << r << ": " << run.errors[r];
  std::cout << "[ figure   ] posting order: " << run.pair_order_mismatches.size()
            << " direction(s) whose two ends post in different orders"
            << (run.pair_order_mismatches.empty() ? "" : " (first: " + run.pair_order_mismatches[0] + ")")
            << "; per channel: " << run.channel_order_mismatches.size() << "\n";
  EXPECT_THAT(run.channel_order_mismatches, ::testing::IsEmpty())
      << "both ends of a channel must post its messages in one order (a transport matching by order relies on it)";

  auto ref = torchio::LoadModel(Zoo(c.model.name + ".pt"));
  std::vector<double> ref_losses = TrainReference(*ref, c, *inputs, *target, /*microbatched=*/true);
  bool any = false;
  double micro = CompareState(run, *ref, &any);
  EXPECT_TRUE(any);
  EXPECT_LE(micro, 1e-5);
  // The last stage's rank reports the same losses.
  const int last_rank = run.schedule.stage_to_rank.back();
  ASSERT_EQ(run.results[last_rank].size(), static_cast<size_t>(kSteps));
  for (int step = 0; step < kSteps; ++step) {
    EXPECT_TRUE(run.results[last_rank][step].has_loss);
    EXPECT_NEAR(run.results[last_rank][step].loss, ref_losses[step], 1e-5 * std::abs(ref_losses[step]) + 1e-7);
  }
  g_worst_micro = std::max(g_worst_micro, micro);
  std::string line = absl::StrCat(c.model.name, " ", names::Name(c.kind), " ranks=", c.ranks,
                                  c.tp > 1 ? absl::StrCat(" tensor-parallel=", c.tp) : "",
                                  " stages=", c.ranks * c.stages_per_rank, " ", job::OptimizerName(c.optimizer),
                                  " vs micro-batched reference: ", micro);
  if (!c.model.batch_coupled) {
    auto full_ref = torchio::LoadModel(Zoo(c.model.name + ".pt"));
    TrainReference(*full_ref, c, *inputs, *target, /*microbatched=*/false);
    double full = CompareState(run, *full_ref, &any);
    // Gradient accumulation over micro-batches and one full-batch pass round
    // differently in fp32; Adam turns sign flips of near-zero gradients into +-lr
    // steps. The pipeline may differ from the full batch by no more than the unsplit
    // model accumulating the same micro-batches does.
    double between_refs = 0;
    for (const auto& p : full_ref->named_parameters(true)) {
      for (const auto& q : ref->named_parameters(true)) {
        if (q.name == p.name) between_refs = std::max(between_refs, RelDiff(q.value, p.value));
      }
    }
    EXPECT_LE(full, std::max(1e-5, between_refs * (1 + 1e-6)));
    if (c.optimizer == OPTIMIZER_SGD) {
      EXPECT_LE(full, 1e-5);
    }
    g_worst_full = std::max(g_worst_full, full);
    absl::StrAppend(&line, ", vs full batch: ", full, " (unsplit micro-batched vs full batch: ", between_refs, ")");
  }
  std::cout << "[ figure   ] " << line << "\n";
}

std::vector<Case> TrainingCases() {
  std::vector<Case> out;
  struct K {
    ScheduleKind kind;
    int ranks, v;
  };
  const K kinds[] = {{SCHEDULE_GPIPE, 4, 1},           {SCHEDULE_1F1B, 4, 1},
                     {SCHEDULE_INTERLEAVED_1F1B, 2, 2}, {SCHEDULE_LOOPED_BFS, 2, 2},
                     {SCHEDULE_ZB1P, 4, 1}, {SCHEDULE_ZB1P, 2, 2},
                     {SCHEDULE_ZBV, 2, 2}};
  for (const ModelSpec& m : kModels) {
    for (const K& k : kinds) {
      for (OptimizerKind opt : {OPTIMIZER_SGD, OPTIMIZER_ADAMW}) out.push_back({m, k.kind, k.ranks, k.v, opt});
    }
  }
  // Tensor parallelism: the zoo's Llama, P = 2 x T = 2, every schedule kind.
  const K tp_kinds[] = {{SCHEDULE_GPIPE, 2, 1}, {SCHEDULE_1F1B, 2, 1}, {SCHEDULE_ZB1P, 2, 1},
                        {SCHEDULE_INTERLEAVED_1F1B, 2, 2}, {SCHEDULE_ZBV, 2, 2}};
  for (const K& k : tp_kinds) {
    for (OptimizerKind opt : {OPTIMIZER_SGD, OPTIMIZER_ADAMW}) out.push_back({kLlama, k.kind, k.ranks, k.v, opt, 0, 2});
  }
  out.push_back({kLlama, SCHEDULE_1F1B, 2, 1, OPTIMIZER_ADAMW, 0.05, 2});  // the norm across shards
  out.push_back({kLlama, SCHEDULE_1F1B, 2, 1, OPTIMIZER_ADAMW, 0, 1});     // the same model unsharded
  // Global gradient clipping across all stages (tight enough to clip every step).
  out.push_back({kModels[1], SCHEDULE_1F1B, 4, 1, OPTIMIZER_SGD, 0.05});
  out.push_back({kModels[0], SCHEDULE_ZBV, 2, 2, OPTIMIZER_ADAMW, 0.05});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Zoo, PipelineTrainingTest, ::testing::ValuesIn(TrainingCases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           std::string n = names::Name(i.param.kind);
                           for (char& ch : n) if (ch == '-') ch = '_';
                           return absl::StrCat(i.param.model.name, "_", n, "_r", i.param.ranks, "v",
                                               i.param.stages_per_rank, "_", job::OptimizerName(i.param.optimizer),
                                               i.param.clip > 0 ? "_clip" : "",
                                               i.param.tp > 1 ? absl::StrCat("_tp", i.param.tp) : "");
                         });

class Reporter : public ::testing::Environment {
 public:
  void TearDown() override {
    std::cout << "[ figure   ] worst max relative difference: vs micro-batched reference " << g_worst_micro
              << ", vs full-batch reference " << g_worst_full << "\n";
  }
};
::testing::Environment* const kReporter = ::testing::AddGlobalTestEnvironment(new Reporter);

}  // namespace
}  // namespace pippy::stage

namespace pippy::stage {
namespace {

class RuntimeBehaviourTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { torch::jit::setGraphExecutorOptimize(false); }
  void Load(const std::string& name) {
    auto m = torchio::LoadModel(Zoo(name + ".pt"));
    ASSERT_TRUE(m.ok());
    model_ = *m;
    inputs_ = *torchio::LoadExampleInputs(Zoo(name + ".input.pt"), model_);
    target_ = *torchio::LoadTorchSaved(Zoo(name + ".target.pt"));
  }
  // Rank 0 of the MLP split in two with 1F1B (m = 4) over loopback; rank 1 never runs.
  std::unique_ptr<RankRuntime> LoneRank0(absl::Duration timeout) {
    Load("mlp");
    auto pipe = partition::SplitModel(model_, [] { partition::SplitOptions o; o.num_stages = 2; return o; }());
    schedule::ScheduleOptions so;
    so.num_ranks = 2;
    so.num_microbatches = 4;
    auto sched = schedule::MakeSchedule(SCHEDULE_1F1B, so);
    transports_ = transport::loopback::Create(2);
    RuntimeOptions ro;
    ro.timeout = timeout;
    auto rt = RankRuntime::Create(0, pipe->plan, {{0, pipe->stages[0]}}, *sched, transports_[0].get(), ro);
    EXPECT_TRUE(rt.ok()) << rt.status();
    return rt.ok() ? std::move(*rt) : nullptr;
  }
  torch::jit::Module model_;
  std::vector<c10::IValue> inputs_;
  c10::IValue target_;
  std::vector<std::unique_ptr<transport::Transport>> transports_;
};

TEST_F(RuntimeBehaviourTest, ForwardOnly_EqualsUnsplitForward) {
  for (const char* name : {"mlp", "gpt", "unet", "multi"}) {
    Load(name);
    for (int v : {1, 2}) {
      Case c{ModelSpec{name, LOSS_MSE, false}, SCHEDULE_INFERENCE, 2, v, OPTIMIZER_SGD};
      PipelineRun run;
      RunPipeline(c, inputs_, target_, &run);
      for (const auto& e : run.errors) ASSERT_TRUE(e.ok()) << e;
      const int last = run.schedule.stage_to_rank.back();
      auto ref = torchio::LoadModel(Zoo(std::string(name) + ".pt"));
      // Inference runs the stages in eval-free mode, as the model is (train mode here).
      c10::IValue want;
      {
        torch::NoGradGuard g;
        want = ref->forward(inputs_);
      }
      // Merged micro-batch outputs vs the full-batch forward; `multi` branches on
      // the batch mean, so compare it with micro-batched forwards.
      std::vector<at::Tensor> got = partition::FlattenTensors(run.results[last][0].output);
      std::vector<at::Tensor> exp;
      if (std::string(name) == "multi") {
        auto mbs = *SplitIntoMicrobatches(inputs_, kMicrobatches);
        std::vector<c10::IValue> outs;
        for (auto& mb : mbs) outs.push_back(ref->forward(mb));
        exp = partition::FlattenTensors(*MergeMicrobatches(outs));
      } else {
        exp = partition::FlattenTensors(want);
      }
      ASSERT_EQ(got.size(), exp.size());
      for (size_t i = 0; i < got.size(); ++i) EXPECT_LE(RelDiff(got[i], exp[i]), 1e-6) << name << " v=" << v;
    }
  }
}

// Serving: steps of any size run back to back without a barrier; a step whose input
// does not fit stage 0 is abandoned on every rank (ABORTED, naming the stage), and the
// next steps still compute the unsplit model's forward.
TEST_F(RuntimeBehaviourTest, ServingSteps_BadInputAbandonsTheStepOnEveryRankAndTheNextRuns) {
  Load("mlp");
  constexpr int kRanks = 3;
  auto pipe = partition::SplitModel(model_, [] { partition::SplitOptions o; o.num_stages = kRanks; return o; }());
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  schedule::ScheduleOptions so;
  so.num_ranks = kRanks;
  so.num_microbatches = 1;
  auto sched = schedule::MakeSchedule(SCHEDULE_INFERENCE, so);
  ASSERT_TRUE(sched.ok()) << sched.status();
  transports_ = transport::loopback::Create(kRanks);
  std::vector<std::unique_ptr<RankRuntime>> rts;
  for (int r = 0; r < kRanks; ++r) {
    auto rt = RankRuntime::Create(r, pipe->plan, {{r, pipe->stages[r]}}, *sched, transports_[r].get(), RuntimeOptions{});
    ASSERT_TRUE(rt.ok()) << rt.status();
    rts.push_back(std::move(*rt));
  }
  const at::Tensor x = inputs_[0].toTensor();
  const at::Tensor bad = at::cat({x, x.narrow(1, 0, 1)}, 1);  // one feature too many
  const std::vector<at::Tensor> steps = {x.narrow(0, 0, 3), bad.narrow(0, 0, 2), x.narrow(0, 3, 5), x.narrow(0, 1, 1)};
  std::vector<std::vector<absl::StatusOr<StepResult>>> got(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      for (size_t i = 0; i < steps.size(); ++i) {
        std::vector<c10::IValue> in = {r == 0 ? c10::IValue(steps[i]) : c10::IValue()};
        got[r].push_back(rts[r]->InferenceStep(static_cast<int>(i), in));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_EQ(got[r].size(), steps.size());
    EXPECT_EQ(got[r][1].status().code(), absl::StatusCode::kAborted) << "rank " << r << ": " << got[r][1].status();
    EXPECT_THAT(std::string(got[r][1].status().message()), ::testing::HasSubstr("stage 0 forward"));
    for (size_t i : {0u, 2u, 3u}) ASSERT_TRUE(got[r][i].ok()) << "rank " << r << " step " << i << ": " << got[r][i].status();
  }
  for (size_t i : {0u, 2u, 3u}) {
    torch::NoGradGuard g;
    const at::Tensor want = model_.forward({steps[i]}).toTensor();
    const at::Tensor out = got[kRanks - 1][i]->output.toTensor();
    ASSERT_EQ(out.sizes(), want.sizes());
    EXPECT_LE(RelDiff(out, want), 1e-6) << "step " << i;
  }
}

TEST_F(RuntimeBehaviourTest, CsvScheduleReadBack_TrainsTheSame) {
  Load("gpt");
  Case c{kModels[1], SCHEDULE_1F1B, 4, 1, OPTIMIZER_ADAMW};
  PipelineRun generated;
  RunPipeline(c, inputs_, target_, &generated);
  for (const auto& e : generated.errors) ASSERT_TRUE(e.ok()) << e;
  // The CSV that `pippyctl schedule --csv` writes, read back with the plan's graph.
  auto back = schedule::FromCsv(schedule::ToCsv(generated.schedule), generated.schedule.graph);
  ASSERT_TRUE(back.ok()) << back.status();
  PipelineRun from_csv;
  RunPipeline(c, inputs_, target_, &from_csv, &*back);
  for (const auto& e : from_csv.errors) ASSERT_TRUE(e.ok()) << e;
  for (size_t s = 0; s < generated.pipe.stages.size(); ++s) {
    auto a = generated.pipe.stages[s].named_parameters(true);
    auto b = from_csv.pipe.stages[s].named_parameters(true);
    for (auto ia = a.begin(), ib = b.begin(); ia != a.end(); ++ia, ++ib) {
      EXPECT_TRUE((*ia).value.equal((*ib).value)) << (*ia).name;
    }
  }
}

TEST_F(RuntimeBehaviourTest, MissingRecv_RejectedBeforeRunningWithGrid) {
  Load("mlp");
  auto pipe = partition::SplitModel(model_, [] { partition::SplitOptions o; o.num_stages = 2; return o; }());
  ASSERT_TRUE(pipe.ok());
  schedule::ScheduleOptions so;
  so.num_ranks = 2;
  so.num_microbatches = 4;
  auto sched = schedule::MakeSchedule(SCHEDULE_1F1B, so);
  ASSERT_TRUE(sched.ok());
  auto& l = sched->ranks[1];
  l.erase(std::find(l.begin(), l.end(), schedule::Action{1, schedule::ActionType::kRecvForward, 2}));
  auto transports = transport::loopback::Create(2);
  // Each rank checks its own list (the whole schedule is checked when a job's layout is
  // made): rank 1, whose list lacks the receive, refuses it; rank 0's list is whole.
  auto rt = RankRuntime::Create(1, pipe->plan, {{1, pipe->stages[1]}}, *sched, transports[1].get(), RuntimeOptions{});
  EXPECT_EQ(rt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(rt.status().message(), HasSubstr("no RECV_F (1RECV_F2)"));
  EXPECT_THAT(rt.status().message(), HasSubstr("rank 1"));
  EXPECT_TRUE(RankRuntime::Create(0, pipe->plan, {{0, pipe->stages[0]}}, *sched, transports[0].get(), RuntimeOptions{})
                  .ok());
}

TEST_F(RuntimeBehaviourTest, PeerNeverRuns_TimeoutSaysWhereRankStood) {
  auto rt = LoneRank0(absl::Milliseconds(200));
  ASSERT_NE(rt, nullptr);
  auto res = rt->TrainStep(0, inputs_, target_);  // rank 1 never starts
  EXPECT_EQ(res.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(res.status().message(), HasSubstr("rank 0 step 0 action #"));
  EXPECT_THAT(res.status().message(), HasSubstr("(0RECV_B0)"));
  EXPECT_THAT(res.status().message(), HasSubstr("rank 1 (gradient step=0 mb=0 stage 1->0"));
}

// A daemon's cancel: the rank is stuck waiting for a peer that never sends; Cancel()
// from another thread ends the step with CANCELLED long before the 60 s wait
// timeout, naming where the rank stood, and every later step is refused.
TEST_F(RuntimeBehaviourTest, CancelFromAnotherThread_EndsTheWaitingStep) {
  auto rt = LoneRank0(absl::Seconds(60));
  ASSERT_NE(rt, nullptr);
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(300));
    rt->Cancel();
  });
  const absl::Time start = absl::Now();
  auto res = rt->TrainStep(0, inputs_, target_);  // rank 1 never starts
  const absl::Duration took = absl::Now() - start;
  canceller.join();
  EXPECT_EQ(res.status().code(), absl::StatusCode::kCancelled) << res.status();
  EXPECT_THAT(res.status().message(), HasSubstr("(0RECV_B0)"));
  EXPECT_THAT(res.status().message(), HasSubstr("cancelled"));
  EXPECT_LT(took, absl::Seconds(30)) << "the wait ran to its timeout instead of being cancelled";
  auto next = rt->TrainStep(1, inputs_, target_);
  EXPECT_EQ(next.status().code(), absl::StatusCode::kCancelled);
}

// A peer that sends something malformed where a gradient belongs (a tensor of the
// wrong shape, a string): the step ends with DATA_LOSS naming the peer, no exception.
TEST_F(RuntimeBehaviourTest, MalformedGradientFromPeer_IsDataLossNamingIt) {
  for (int variant = 0; variant < 2; ++variant) {
    auto rt = LoneRank0(absl::Seconds(20));
    ASSERT_NE(rt, nullptr);
    std::thread fake_rank1([&] {
      transport::Tag act;
      act.kind = transport::Tag::Kind::kActivation;
      act.src_stage = 0;
      act.dst_stage = 1;
      auto got = transports_[1]->Recv(0, act);
      if (!got->Wait(absl::Seconds(20)).ok()) return;
      transport::Tag grad;
      grad.kind = transport::Tag::Kind::kGradient;
      grad.src_stage = 1;
      grad.dst_stage = 0;
      c10::IValue bad = variant == 0 ? c10::IValue(at::ones({3, 3})) : c10::IValue(std::string("not a gradient"));
      transports_[1]->Send(0, grad, bad)->Wait(absl::Seconds(20)).IgnoreError();  // the test checks rank 0's error
    });
    auto res = rt->TrainStep(0, inputs_, target_);
    fake_rank1.join();
    EXPECT_EQ(res.status().code(), absl::StatusCode::kDataLoss) << res.status();
    EXPECT_THAT(std::string(res.status().message()), HasSubstr("rank 1 sent a"));
    EXPECT_THAT(std::string(res.status().message()), HasSubstr(variant == 0 ? "shape [3, 3]" : "String"));
  }
}

TEST_F(RuntimeBehaviourTest, BatchNotDivisible_ClearError) {
  Load("mlp");
  auto pipe = partition::SplitModel(model_, [] { partition::SplitOptions o; o.num_stages = 2; return o; }());
  schedule::ScheduleOptions so;
  so.num_ranks = 2;
  so.num_microbatches = 3;  // batch of 16
  auto sched = schedule::MakeSchedule(SCHEDULE_GPIPE, so);
  auto transports = transport::loopback::Create(2);
  auto rt = RankRuntime::Create(0, pipe->plan, {{0, pipe->stages[0]}}, *sched, transports[0].get(), RuntimeOptions{});
  auto res = (*rt)->TrainStep(0, inputs_, target_);
  EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(res.status().message(), HasSubstr("does not split into 3 equal micro-batches"));
  EXPECT_THAT(SplitIntoMicrobatches({at::ones({2, 3})}, 4, {}, {"x"}).status().message(),
              HasSubstr("fewer than 4 micro-batches"));
}

TEST_F(RuntimeBehaviourTest, PeakLiveActivations_1F1BBoundedByRanks_GPipeHoldsAll) {
  Load("mlp");
  const int p = 4, m = 8;
  for (ScheduleKind kind : {SCHEDULE_GPIPE, SCHEDULE_1F1B}) {
    auto pipe = partition::SplitModel(model_, [] { partition::SplitOptions o; o.num_stages = 4; return o; }());
    schedule::ScheduleOptions so;
    so.num_ranks = p;
    so.num_microbatches = m;
    auto sched = schedule::MakeSchedule(kind, so);
    auto transports = transport::loopback::Create(p);
    std::vector<int> peak(p);
    std::vector<std::thread> threads;
    for (int r = 0; r < p; ++r) {
      threads.emplace_back([&, r] {
        auto rt = RankRuntime::Create(r, pipe->plan, {{r, pipe->stages[r]}}, *sched, transports[r].get(),
                                      RuntimeOptions{});
        auto res = (*rt)->TrainStep(0, inputs_, target_);
        peak[r] = res.ok() ? res->peak_live_activations : -1;
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < p; ++r) {
      if (kind == SCHEDULE_GPIPE) {
        EXPECT_EQ(peak[r], m);
      } else {
        EXPECT_EQ(peak[r], p - r) << "1F1B rank " << r;
      }
    }
    std::cout << "[ figure   ] " << names::Name(kind) << " m=8 p=4 peak live activations per rank:";
    for (int x : peak) std::cout << " " << x;
    std::cout << "\n";
  }
}

}  // namespace
}  // namespace pippy::stage
