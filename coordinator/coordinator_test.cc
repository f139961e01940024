// The coordinator's logic with fake worker channels (no gRPC, no worker processes):
// what each worker is sent, how jobs move through their states, how results come
// back and are assembled, and what is refused.
#include "coordinator/coordinator_test_fixture.h"
#include "proto/job_state.h"

namespace pippy::coordinator {
namespace {

using ::testing::HasSubstr;

TEST_F(CoordinatorTest, ThreeStageJob_EachWorkerIsSentOnlyItsStageAndItsShareOfTheData) {
  Start("only_its_stage", /*chunk_bytes=*/4096);
  auto workers = AddWorkers(3);
  const std::string model = Slurp(kZoo + "mlp.pt");
  const std::string data = Slurp(kZoo + "mlp.data.pt");
  JobSpec spec = MlpSpec(3);
  spec.mutable_fault_tolerance()->set_max_restarts(0);
  auto id = Submit(spec, model, data);
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Received> received;
  for (int r = 0; r < 3; ++r) received.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  // The preparation wrote every stage file before the job was accepted; the workers
  // were idle, so it was placed at once, from those files.
  auto job = WaitForJob(*id, [](const Job& j) { return j.state() == PLACING; });
  ASSERT_EQ(job.plan().stages_size(), 3);
  ASSERT_EQ(job.stage_file_bytes_size(), 3);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(std::filesystem::file_size(absl::StrCat(state_, "/jobs/", *id, "/stage_", s, ".pt")),
              static_cast<uintmax_t>(job.stage_file_bytes(s)));
  }
  int64_t total = 0;
  for (int r = 0; r < 3; ++r) {
    const Received& got = received[r];
    ASSERT_TRUE(got.complete) << "worker " << r;
    const Assignment& a = got.assignment;
    // Only its own stage (1F1B: stage r on rank r), whole, in several chunks.
    ASSERT_EQ(got.stages.size(), 1u);
    const int stage = got.stages.begin()->first;
    EXPECT_EQ(stage, a.rank());
    const std::string& bytes = got.stages.begin()->second;
    EXPECT_EQ(static_cast<int64_t>(bytes.size()), job.stage_file_bytes(stage));
    EXPECT_GT(got.stage_chunks, 1);
    // The bytes are a loadable stage module holding exactly the plan's parameters.
    auto module = torchio::LoadModelFromBytes(bytes, "stage");
    ASSERT_TRUE(module.ok()) << module.status();
    std::set<std::string> names;
    for (const auto& p : module->named_parameters(true)) names.insert(p.name);
    for (const ParameterInfo& pi : job.plan().stages(stage).parameters()) {
      if (!pi.is_buffer()) {
        EXPECT_TRUE(names.count(pi.name())) << pi.name();
      }
    }
    // Its slice of the plan: other stages' parameter lists are left out.
    for (const StagePlan& sp : a.plan().stages()) {
      EXPECT_EQ(sp.parameters_size() > 0, sp.index() == stage) << "stage " << sp.index();
    }
    // Its piece of the job's layout: the action list the job was prepared with, made
    // here again from the spec and plan the job reports (an independent computation).
    JobSpec checked = job.spec();
    auto layout = job::MakeLayout(checked, job.plan());
    ASSERT_TRUE(layout.ok()) << layout.status();
    EXPECT_EQ(a.layout().SerializeAsString(), layout->ranks(a.rank()).SerializeAsString()) << "rank " << a.rank();
    EXPECT_GT(a.layout().actions_size(), 0);
    EXPECT_EQ(a.layout().num_ranks(), 3);
    // Data: inputs for the first stage's rank, targets for the last's, nothing between.
    EXPECT_EQ(static_cast<int64_t>(got.data.size()), a.data_bytes());
    if (a.rank() == 1) {
      EXPECT_TRUE(got.data.empty());
    }
    if (a.rank() != 1) {
      std::vector<char> raw(got.data.begin(), got.data.end());
      auto share = torch::jit::pickle_load(raw).toGenericDict();
      EXPECT_EQ(share.contains("targets"), a.rank() == 2);
      EXPECT_EQ(share.at("inputs").toGenericDict().size(), a.rank() == 0 ? 1u : 0u);
    }
    EXPECT_LE(static_cast<double>(bytes.size() + got.data.size()),
              1.1 * static_cast<double>(job.stage_file_bytes(stage) + a.data_bytes()));
    total += static_cast<int64_t>(bytes.size());
  }
  // Together the workers received about one model, not one each.
  EXPECT_LT(static_cast<double>(total), 1.5 * static_cast<double>(model.size()));
  std::cout << "[ figure   ] model " << model.size() << " bytes; 3 workers received " << total
            << " bytes of stages in all\n";
}

// Placement by device memory (issue 17's CPU-side part, with fake GPU workers): a job
// whose rank fits no GPU is refused with the numbers; otherwise each rank goes to the
// smallest GPU that holds it, else to a CPU worker, and never to a GPU too small.
TEST_F(CoordinatorTest, GpuWorkers_PlacementByDeviceMemory) {
  Start("device_memory", /*chunk_bytes=*/4096);
  const std::string model = Slurp(kZoo + "mlp.pt");
  const std::string data = Slurp(kZoo + "mlp.data.pt");
  AddDeviceWorker("cuda:0", 1000);
  AddDeviceWorker("cuda:1", 1000);
  auto refused = Submit(MlpSpec(2), model, data);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("bytes of device memory"));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("the largest GPU worker registered has 1000 bytes"));
  // A big GPU and a CPU worker join: the job runs on them, not on the small GPUs.
  AddDeviceWorker("cuda:0", int64_t{1} << 40);
  AddDeviceWorker("cpu", 0);
  JobSpec spec = MlpSpec(2);
  spec.mutable_fault_tolerance()->set_max_restarts(0);
  auto id = Submit(spec, model, data);
  ASSERT_TRUE(id.ok()) << id.status();
  Job job = WaitForJob(*id, [](const Job& j) { return j.workers_size() == 2; });
  ASSERT_EQ(job.workers_size(), 2);
  const std::set<std::string> used(job.workers().begin(), job.workers().end());
  EXPECT_EQ(used, (std::set<std::string>{ids_[2], ids_[3]}));
  // The rank that needs more memory is the big GPU's.
  std::vector<int> stage_to_rank(job.stage_ranks().begin(), job.stage_ranks().end());
  const int64_t r0 = job::RankMemoryBytes(job.spec(), job.plan(), stage_to_rank, 0);
  const int64_t r1 = job::RankMemoryBytes(job.spec(), job.plan(), stage_to_rank, 1);
  EXPECT_GT(r0, 1000);
  EXPECT_EQ(job.workers(r0 >= r1 ? 0 : 1), ids_[2]);
  // A GPU rank next to a CPU rank: their edge stages through host memory.
  ASSERT_EQ(job.edges_size(), 1);
  EXPECT_EQ(job.edges(0).transport(), "ucx+staging");
  // ListWorkers shows each GPU's name and the memory it registered.
  for (const WorkerInfo& w : coordinator_->ListWorkers()) {
    EXPECT_EQ(w.device_name(), w.device() == "cpu" ? "" : "Fake GPU") << w.name();
    if (w.device() == "cuda:1") {
      EXPECT_EQ(w.free_memory(), 1000);
    }
  }
  EXPECT_TRUE(coordinator_->CancelJob(*id).ok());
}

TEST_F(CoordinatorTest, NoIdleWorkers_StagesGoToFiles_AndStreamFromThemOnceWorkersCome) {
  Start("queued", /*chunk_bytes=*/4096);
  auto id = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok()) << id.status();
  Job queued = WaitForState(*id, QUEUED);
  ASSERT_EQ(queued.state(), QUEUED);
  ASSERT_EQ(queued.stage_file_bytes_size(), 2);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(std::filesystem::file_size(absl::StrCat(state_, "/jobs/", *id, "/stage_", s, ".pt")),
              static_cast<uintmax_t>(queued.stage_file_bytes(s)));
  }
  auto workers = AddWorkers(2);
  for (int r = 0; r < 2; ++r) {
    Received got = Collect(workers[r]->WaitFor(AssignmentArrived));
    ASSERT_TRUE(got.complete);
    ASSERT_EQ(got.stages.size(), 1u);
    const int stage = got.stages.begin()->first;
    EXPECT_EQ(got.assignment.stages(0).bytes(), queued.stage_file_bytes(stage));
    EXPECT_EQ(got.stages.begin()->second, Slurp(absl::StrCat(state_, "/jobs/", *id, "/stage_", stage, ".pt")));
  }
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), PLACING);
}

// The GPT of the zoo: tied weights, a loss() method, types its stages share with it.
TEST_F(CoordinatorTest, WholeJob_RunsToSucceeded_AndServesTheAssembledModel) {
  Start("whole_job");
  auto workers = AddWorkers(2);
  JobSpec spec = MlpSpec(2);
  spec.set_loss(LOSS_MODEL);
  auto id = Submit(spec, Slurp(kZoo + "gpt.pt"), Slurp(kZoo + "gpt.data.pt"));
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Received> got;
  for (int r = 0; r < 2; ++r) got.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), PLACING);
  for (int r = 0; r < 2; ++r) PlayRank(ids_[r], got[r], 2);
  // Every rank has its peers' addresses once all reported theirs.
  for (int r = 0; r < 2; ++r) {
    auto msgs = workers[r]->WaitFor([](const std::vector<CoordinatorMessage>& m) {
      return std::any_of(m.begin(), m.end(), [](const CoordinatorMessage& x) { return x.has_peers(); });
    });
    auto peers = std::find_if(msgs.begin(), msgs.end(), [](const CoordinatorMessage& x) { return x.has_peers(); });
    ASSERT_NE(peers, msgs.end());
    EXPECT_EQ(peers->peers().ucx_addresses_size(), 2);
  }
  auto running = coordinator_->GetJob(*id);
  EXPECT_EQ(running->step(), 2);
  EXPECT_EQ(running->losses_size(), 2);
  for (int r = 0; r < 2; ++r) FinishRank(ids_[r], got[r].assignment, true);
  Job done = WaitForState(*id, SUCCEEDED);
  ASSERT_EQ(done.state(), SUCCEEDED) << done.reason();
  EXPECT_TRUE(done.model_ready());
  auto path = coordinator_->ResultPath(*id);
  ASSERT_TRUE(path.ok()) << path.status();
  // The assembled model has the original structure and (untrained here) its parameters.
  auto merged = torchio::LoadModel(*path);
  auto original = torchio::LoadModel(kZoo + "gpt.pt");
  ASSERT_TRUE(merged.ok() && original.ok());
  auto a = original->named_parameters(true);
  auto b = merged->named_parameters(true);
  ASSERT_EQ(a.size(), b.size());
  for (auto ia = a.begin(), ib = b.begin(); ia != a.end(); ++ia, ++ib) {
    EXPECT_EQ((*ia).name, (*ib).name);
    EXPECT_TRUE((*ia).value.equal((*ib).value)) << (*ia).name;
  }
  // The job's inputs are gone from the state directory; the result stays.
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id)));
  for (const WorkerInfo& w : coordinator_->ListWorkers()) EXPECT_EQ(w.state(), IDLE) << w.name();
}

TEST_F(CoordinatorTest, MissingResult_FailsTheJobInsteadOfServingAPartialModel) {
  Start("missing_result");
  auto workers = AddWorkers(2);
  auto id = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Received> got;
  for (int r = 0; r < 2; ++r) got.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  PlayRank(ids_[0], got[0], 1);
  Received no_stages = got[1];
  no_stages.stages.clear();  // rank 1 "forgets" to send its trained stage
  PlayRank(ids_[1], no_stages, 1);
  for (int r = 0; r < 2; ++r) FinishRank(ids_[r], got[r].assignment, true);
  Job done = WaitForState(*id, FAILED);
  EXPECT_EQ(done.state(), FAILED);
  EXPECT_THAT(done.reason(), HasSubstr("without sending all of its trained stages"));
  EXPECT_FALSE(coordinator_->ResultPath(*id).ok());
}

TEST_F(CoordinatorTest, Cancel_EndsTheJob_AndFreesWorkersWhenTheyReport) {
  Start("cancel");
  auto workers = AddWorkers(2);
  auto id = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok());
  std::vector<Received> got;
  for (int r = 0; r < 2; ++r) got.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  auto cancelled = coordinator_->CancelJob(*id);
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->state(), CANCELLED);
  EXPECT_EQ(coordinator_->CancelJob(*id).status().code(), absl::StatusCode::kFailedPrecondition);
  for (int r = 0; r < 2; ++r) FinishRank(ids_[r], got[r].assignment, false, "cancelled");
  for (const WorkerInfo& w : coordinator_->ListWorkers()) EXPECT_EQ(w.state(), IDLE);
  // The job's files go (a stage-file writer still running when the job ended removes
  // what it wrote when it is done: wait for it, at most 10 s).
  const std::string dir = absl::StrCat(state_, "/jobs/", *id);
  for (int i = 0; i < 1000 && std::filesystem::exists(dir); ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_FALSE(std::filesystem::exists(dir));
}

struct BadCase {
  std::string name;
  JobSpec spec;
  std::string model, data, want;
};

// Submissions the preparation refuses (2 workers registered), with what the refusal says.
std::vector<BadCase> BadSubmissions() {
  const std::string model = Slurp(kZoo + "mlp.pt"), data = Slurp(kZoo + "mlp.data.pt");
  JobSpec unknown_split = MlpSpec(2);
  unknown_split.mutable_split()->set_stages(0);
  unknown_split.mutable_split()->add_split_at("layers.99");
  JobSpec too_many = MlpSpec(3);
  JobSpec no_loss = MlpSpec(2);
  no_loss.clear_loss();
  return {
      {"empty model", MlpSpec(2), "", data, "model: empty"},
      {"not torchscript", MlpSpec(2), "hello", data, "model: 'model' is not a TorchScript archive"},
      {"no data", MlpSpec(2), model, "", "data: missing"},
      {"data that does not fit", MlpSpec(2), model, Slurp(kZoo + "gpt.data.pt"), "data"},
      {"unknown split point", unknown_split, model, data, "split:"},
      {"more workers than registered", too_many, model, data, "needs 3 workers"},
      {"missing loss", no_loss, model, data, "loss: missing"},
  };
}

TEST_F(CoordinatorTest, BadSubmissions_AreRefusedNamingTheField_AndLeaveNothingBehind) {
  Start("refused");
  AddWorkers(2);
  for (const BadCase& c : BadSubmissions()) {
    auto id = Submit(c.spec, c.model, c.data);
    ASSERT_FALSE(id.ok()) << c.name;
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << id.status();
    EXPECT_THAT(std::string(id.status().message()), HasSubstr(c.want)) << c.name;
  }
  EXPECT_EQ(coordinator_->ListJobs(ListJobsRequest())->jobs_size(), 0);
  EXPECT_TRUE(std::filesystem::is_empty(state_ + "/uploads"));
  EXPECT_TRUE(std::filesystem::is_empty(state_ + "/jobs"));
}

// A detached submission is answered with its id once the upload is stored: it is
// PARTITIONING, then QUEUED (and placed); the same bad submissions as above are then
// FAILED with the message a synchronous submission is refused with, files removed.
TEST_F(CoordinatorTest, DetachedSubmissions_AnswerAfterTheUpload_ThenQueueOrFailWithTheRefusalsMessage) {
  Start("detached");
  auto workers = AddWorkers(2);
  auto id = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"), "ann", /*detach=*/true);
  ASSERT_TRUE(id.ok()) << id.status();
  Job placed = WaitForState(*id, PLACING);
  ASSERT_EQ(placed.state(), PLACING);
  EXPECT_EQ(placed.user(), "ann");
  EXPECT_EQ(placed.plan().stages_size(), 2);
  EXPECT_EQ(placed.num_stages(), 2);
  EXPECT_EQ(placed.stage_file_bytes_size(), 2);
  ASSERT_GE(placed.history_size(), 1);
  EXPECT_THAT(placed.history(0).message(), HasSubstr("being prepared"));
  for (auto& w : workers) EXPECT_TRUE(Collect(w->WaitFor(AssignmentArrived)).complete);
  ASSERT_TRUE(coordinator_->CancelJob(*id).ok());

  Start("detached_refused");
  AddWorkers(2);
  for (const BadCase& c : BadSubmissions()) {
    auto refused = Submit(c.spec, c.model, c.data);
    ASSERT_FALSE(refused.ok()) << c.name;
    auto detached = Submit(c.spec, c.model, c.data, "", /*detach=*/true);
    ASSERT_TRUE(detached.ok()) << c.name << ": " << detached.status();
    Job failed = WaitForJob(*detached, [](const Job& j) { return IsTerminal(j.state()); });
    EXPECT_EQ(failed.state(), FAILED) << c.name;
    EXPECT_EQ(failed.reason(), refused.status().message()) << c.name;
    EXPECT_THAT(failed.reason(), HasSubstr(c.want)) << c.name;
    EXPECT_FALSE(std::filesystem::exists(absl::StrCat(state_, "/jobs/", *detached))) << c.name;
  }
  EXPECT_TRUE(std::filesystem::is_empty(state_ + "/uploads"));
}

}  // namespace
}  // namespace pippy::coordinator
