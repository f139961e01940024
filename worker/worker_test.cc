// The worker's rooms, each without a coordinator: collecting an assignment's files,
// building step reports, the rank's control (peers, micro-batches, cancellation),
// the result stream's chunks, and bringing a rank up (stages from bytes, UCX and
// staging) far enough to train a step that equals the unsplit model's.
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/layout.h"
#include "pipeline/job/rank_job.h"
#include "pipeline/partition/partition.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/stage/training.h"
#include "pipeline/torchio/model_io.h"
#include "worker/assignment_receiver.h"
#include "worker/rank_bringup.h"
#include "worker/rank_control.h"
#include "worker/report_builder.h"
#include "worker/result_stream.h"

namespace pippy::worker {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Zoo(const std::string& f) { return "examples/models/zoo/" + f; }

Assignment TwoStagesWithState() {
  Assignment a;
  a.set_job_id("job-1");
  a.set_attempt(2);
  a.set_rank(1);
  a.add_stages()->set_stage(1);
  a.add_stages()->set_stage(3);
  a.set_data_bytes(5);
  a.set_state_bytes(3);
  return a;
}

template <typename Chunk>
Chunk ChunkOf(const std::string& bytes, bool last, int attempt = 2, int stage = -1) {
  Chunk c;
  c.set_job_id("job-1");
  c.set_attempt(attempt);
  c.set_chunk(bytes);
  c.set_last_chunk(last);
  if constexpr (std::is_same_v<Chunk, StageChunk>) c.set_stage(stage);
  return c;
}

TEST(AssignmentReceiver, CompleteOnlyOnceEveryFileArrived_OtherAttemptsDropped) {
  AssignmentReceiver r;
  r.Start(TwoStagesWithState());
  EXPECT_TRUE(r.receiving());
  EXPECT_FALSE(r.Add(ChunkOf<StageChunk>("aa", false, 2, 1))->has_value());
  EXPECT_FALSE(r.Add(ChunkOf<StageChunk>("b", true, 2, 1))->has_value());
  EXPECT_FALSE(r.Add(ChunkOf<DataChunk>("xx", false, /*attempt=*/1)).has_value());  // an earlier attempt's
  EXPECT_FALSE(r.Add(ChunkOf<StageChunk>("ccc", true, 2, 3))->has_value());
  EXPECT_FALSE(r.Add(ChunkOf<DataChunk>("data!", true)).has_value());
  std::optional<ReceivedAssignment> done = r.Add(ChunkOf<StateChunk>("st8", true));
  ASSERT_TRUE(done.has_value());
  EXPECT_FALSE(r.receiving());
  EXPECT_EQ(done->stages.at(1), "aab");
  EXPECT_EQ(done->stages.at(3), "ccc");
  EXPECT_EQ(done->data, "data!");
  EXPECT_EQ(done->state, "st8");
  EXPECT_EQ(done->bytes_received, 3 + 3 + 5 + 3);
  EXPECT_EQ(done->assignment.job_id(), "job-1");
  // Chunks after the end belong to nothing.
  EXPECT_FALSE(r.Add(ChunkOf<DataChunk>("late", true)).has_value());
}

TEST(AssignmentReceiver, StageNotListed_IsAnError_AndDropReturnsTheAssignment) {
  AssignmentReceiver r;
  r.Start(TwoStagesWithState());
  auto bad = r.Add(ChunkOf<StageChunk>("x", true, 2, 2));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("stage 2, which is not this rank's"));
  EXPECT_EQ(r.Drop().job_id(), "job-1");
  EXPECT_FALSE(r.receiving());
}

stage::StepResult ResultWithEveryKind() {
  stage::StepResult res;
  res.has_loss = true;
  res.loss = 2.5;
  res.busy_seconds = 0.5;
  res.step_seconds = 0.75;
  res.breakdown.compute_seconds = 0.5;
  res.breakdown.wait_seconds = 0.125;
  res.breakdown.allreduce_seconds = 0.25;
  res.trace = {{"1F0", 1, 10, 5, 0, 0, schedule::ActionType::kForward},
               {"1SEND_F0", 1, 15, 2, 4096, 0, schedule::ActionType::kSendForward},
               {"1RECV_B0", 1, 17, 3, 1024, 2, schedule::ActionType::kRecvBackward},
               {"1B0", 1, 20, 6, 0, 0, schedule::ActionType::kBackward},
               {"optimizer step", -1, 26, 1, 0, 0, std::nullopt}};
  return res;
}

TEST(ReportBuilder, EveryEventKeepsItsKind_TransferBytesByKind) {
  const stage::StepResult res = ResultWithEveryKind();
  Assignment a;
  a.set_job_id("job-7");
  a.set_rank(1);
  a.set_replica(1);
  a.set_attempt(3);
  ProcessReadings readings;
  readings.steady_now_us = 1000;
  readings.unix_now_us = 5000;
  readings.peak_memory_bytes = 123 << 20;
  const StepReport r = BuildStepReport(a, 4, res, readings);
  EXPECT_EQ(r.breakdown().peak_memory_bytes(), 123 << 20);
  EXPECT_EQ(r.job_id(), "job-7");
  EXPECT_EQ(r.step(), 4);
  EXPECT_EQ(r.attempt(), 3);
  EXPECT_EQ(r.replica(), 1);
  EXPECT_TRUE(r.has_loss());
  EXPECT_EQ(r.loss(), 2.5);
  EXPECT_EQ(r.breakdown().rank(), 1);
  EXPECT_EQ(r.breakdown().step_seconds(), 0.75);
  EXPECT_EQ(r.breakdown().wait_seconds(), 0.125);
  EXPECT_EQ(r.breakdown().allreduce_seconds(), 0.25);
  std::vector<TraceKind> kinds;
  for (const TraceEvent& e : r.events()) kinds.push_back(e.kind());
  EXPECT_THAT(kinds, ElementsAre(TRACE_COMPUTE, TRACE_SEND, TRACE_RECV, TRACE_COMPUTE, TRACE_OTHER));
  EXPECT_EQ(r.events(2).wait_us(), 2);
  EXPECT_EQ(r.steady_anchor_us(), 1000);
  EXPECT_EQ(r.unix_anchor_us(), 5000);
  const TransferBytes moved = TransferBytesOf(res);
  EXPECT_EQ(moved.sent, 4096);
  EXPECT_EQ(moved.received, 1024);
}

TEST(RankControl, PeersOfThisRankOnly_AndADeadline) {
  RankControl c;
  c.Reset("job-1", 1);
  PeerAddresses other;
  other.set_job_id("job-1");
  other.set_attempt(0);  // an earlier attempt's
  other.add_ucx_addresses("old");
  c.SetPeers(other);
  const auto start = std::chrono::steady_clock::now();
  auto none = c.WaitForPeers(absl::Milliseconds(50));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(50));
  PeerAddresses mine = other;
  mine.set_attempt(1);
  mine.set_ucx_addresses(0, "a0");
  mine.add_ucx_addresses("a1");
  mine.add_gloo_addresses("g0");
  c.SetPeers(mine);
  auto peers = c.WaitForPeers(absl::Seconds(5));
  ASSERT_TRUE(peers.ok());
  EXPECT_THAT(peers->ucx, ElementsAre("a0", "a1"));
  EXPECT_THAT(peers->replicas, ElementsAre("g0"));
}

TEST(RankControl, ServeBatchesInOrder_CancelWakesAWaiter) {
  RankControl c;
  c.Reset("job-2", 0);
  for (int step : {0, 1}) {
    ServeBatch b;
    b.set_job_id("job-2");
    b.set_step(step);
    c.PushServe(b);
  }
  ServeBatch stray;
  stray.set_job_id("job-9");
  c.PushServe(stray);
  EXPECT_EQ(c.NextServe()->step(), 0);
  EXPECT_EQ(c.NextServe()->step(), 1);
  absl::StatusOr<ServeBatch> waited;
  std::thread waiter([&] { waited = c.NextServe(); });
  c.Cancel();
  waiter.join();
  EXPECT_EQ(waited.status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(c.WaitForPeers(absl::Seconds(5)).status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(c.Attach(nullptr).code(), absl::StatusCode::kCancelled);
  c.Reset("job-3", 0);
  EXPECT_TRUE(c.Attach(nullptr).ok());
}

TEST(ResultStream, OutputsInChunks_TheLastSaysSo) {
  Assignment a;
  a.set_job_id("job-4");
  a.set_attempt(1);
  std::vector<WorkerMessage> sent;
  const Writer write = [&](const WorkerMessage& m) {
    sent.push_back(m);
    return true;
  };
  ASSERT_TRUE(SendOutputs(write, a, {c10::IValue(torch::ones({64, 4})), c10::IValue(torch::zeros({64, 4}))}, 256).ok());
  ASSERT_GT(sent.size(), 2u);
  std::string bytes;
  for (size_t i = 0; i < sent.size(); ++i) {
    ASSERT_TRUE(sent[i].has_output());
    EXPECT_EQ(sent[i].output().job_id(), "job-4");
    EXPECT_EQ(sent[i].output().attempt(), 1);
    EXPECT_LE(sent[i].output().chunk().size(), 256u);
    EXPECT_EQ(sent[i].output().last_chunk(), i + 1 == sent.size());
    bytes += sent[i].output().chunk();
  }
  auto merged = torchio::PickleLoad(bytes, "outputs");
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->toTensor().size(0), 128);
  EXPECT_EQ(merged->toTensor().sum().item<double>(), 64 * 4);
  // A broken stream stops the sending and says what was being sent.
  const Writer broken = [](const WorkerMessage&) { return false; };
  absl::Status s = SendOutputs(broken, a, {c10::IValue(torch::ones({4}))});
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(s.message()), HasSubstr("while sending outputs"));
}

TEST(RankBringUp, BadStageBytes_AreRefusedNamingTheStage) {
  auto loaded = LoadStages({{3, "not an archive"}});
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr("stage 3"));
}

// Two ranks brought up as the worker brings them up (stages from archive bytes, real
// UCX over shared memory, staging for the CPU), each on its piece of the job's
// layout: the first step's loss is the unsplit model's on the same batch.
TEST(RankBringUp, TwoRanksOverUcx_FirstLossEqualsTheUnsplitModels) {
  auto model = torchio::LoadModel(Zoo("mlp.pt"));
  ASSERT_TRUE(model.ok()) << model.status();
  auto inputs = torchio::LoadExampleInputs(Zoo("mlp.input.pt"), *model);
  auto target = torchio::LoadTorchSaved(Zoo("mlp.target.pt"));
  ASSERT_TRUE(inputs.ok() && target.ok());
  partition::SplitOptions so;
  so.num_stages = 2;
  auto pipe = partition::SplitModel(*model, so);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  JobSpec spec;
  spec.mutable_split()->set_stages(2);
  spec.mutable_schedule()->set_kind(SCHEDULE_1F1B);
  spec.mutable_schedule()->set_microbatches(2);
  spec.set_loss(LOSS_MSE);
  spec.mutable_optimizer()->set_kind(OPTIMIZER_SGD);
  spec.mutable_optimizer()->set_lr(0.1);
  spec.set_steps(1);
  spec.set_batch_size(static_cast<int>((*inputs)[0].toTensor().size(0)));
  ASSERT_TRUE(job::CheckSpec(&spec).ok());
  auto layout = job::MakeLayout(spec, pipe->plan);
  ASSERT_TRUE(layout.ok()) << layout.status();
  std::vector<std::string> names;
  for (const ModelValue& v : pipe->plan.inputs()) names.push_back(v.name());
  auto data = stage::DataSource::FromValues(*inputs, *target, names);
  ASSERT_TRUE(data.ok()) << data.status();

  std::vector<std::unique_ptr<RankTransports>> transports;
  std::vector<std::string> addresses;
  std::vector<LoadedStages> stages;
  for (int r = 0; r < 2; ++r) {
    std::string archive;
    ASSERT_TRUE(torchio::WriteModule(pipe->stages[static_cast<size_t>(r)], [&](absl::string_view piece) {
      archive.append(piece.data(), piece.size());
      return absl::OkStatus();
    }).ok());
    auto loaded = LoadStages({{r, std::move(archive)}});
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->param_bytes, pipe->plan.stages(r).param_bytes());
    stages.push_back(std::move(*loaded));
    auto t = RankTransports::Create(r, 2, c10::Device(c10::kCPU), {{"TLS", "sm,self"}});
    ASSERT_TRUE(t.ok()) << t.status();
    addresses.push_back((*t)->address());
    transports.push_back(std::move(*t));
  }
  std::vector<absl::Status> connected(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) threads.emplace_back([&, r] { connected[r] = transports[r]->Connect(addresses); });
  for (auto& t : threads) t.join();
  ASSERT_TRUE(connected[0].ok() && connected[1].ok()) << connected[0] << connected[1];
  std::vector<absl::StatusOr<stage::StepResult>> results(2);
  threads.clear();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto rank_job = job::RankJob::Create(spec, job::PlanSlice(pipe->plan, layout->ranks(r), r), layout->ranks(r), r,
                                           std::move(stages[r].modules), transports[r]->transport(), absl::Seconds(30));
      results[r] = rank_job.ok() ? (*rank_job)->RunStep(0, *data) : rank_job.status();
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(results[0].ok()) << results[0].status();
  ASSERT_TRUE(results[1].ok()) << results[1].status();
  ASSERT_TRUE(results[1]->has_loss);
  torch::NoGradGuard no_grad;
  const at::Tensor out = model->forward(*inputs).toTensor();
  const double reference = torch::mse_loss(out, target->toTensor()).item<double>();
  EXPECT_NEAR(results[1]->loss, reference, 1e-6 * std::abs(reference));
}

}  // namespace
}  // namespace pippy::worker
