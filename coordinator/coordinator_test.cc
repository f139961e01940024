// The coordinator's logic with fake worker channels (no gRPC, no worker processes):
// what each worker is sent, how jobs move through their states, how results come
// back and are assembled, and what is refused.
#include "coordinator/coordinator.h"

#include <cstdlib>
#include <filesystem>
#include <set>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/torchio/model_io.h"
#include "torch/csrc/jit/runtime/graph_executor.h"
#include "torch/csrc/jit/serialization/pickle.h"

namespace pippy::coordinator {
namespace {

using ::testing::HasSubstr;

const std::string kZoo = "examples/models/zoo/";

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::string TmpDir(const std::string& name) {
  std::string dir = absl::StrCat(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp", "/coord_", name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// A worker's stream as the logic sees it: records what it is sent.
class FakeWorker : public WorkerChannel {
 public:
  bool Send(const CoordinatorMessage& m) override {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    messages_.push_back(m);
    return true;
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  // Waits (at most 30 s) until `done(messages)` holds; returns the messages.
  std::vector<CoordinatorMessage> WaitFor(const std::function<bool(const std::vector<CoordinatorMessage>&)>& done) {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done(messages_); };
    mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(30));
    return messages_;
  }
  std::vector<CoordinatorMessage> messages() {
    absl::MutexLock lock(&mu_);
    return messages_;
  }

 private:
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<CoordinatorMessage> messages_ ABSL_GUARDED_BY(mu_);
};

// What one worker received for its assignment.
struct Received {
  Assignment assignment;
  std::map<int, std::string> stages;
  std::string data;
  std::string state;  // a restart's training state
  int stage_chunks = 0;
  bool complete = false;
};

// What the last assignment in `messages` brought.
Received Collect(const std::vector<CoordinatorMessage>& messages) {
  Received r;
  std::map<int, bool> done;
  bool data_done = false, state_done = false;
  for (const auto& m : messages) {
    if (m.has_assignment()) {
      r = Received();
      done.clear();
      data_done = state_done = false;
      r.assignment = m.assignment();
    }
    if (m.has_state()) {
      r.state += m.state().chunk();
      if (m.state().last_chunk()) state_done = true;
    }
    if (m.has_stage()) {
      r.stages[m.stage().stage()] += m.stage().chunk();
      ++r.stage_chunks;
      if (m.stage().last_chunk()) done[m.stage().stage()] = true;
    }
    if (m.has_data()) {
      r.data += m.data().chunk();
      if (m.data().last_chunk()) data_done = true;
    }
  }
  r.complete = r.assignment.stages_size() > 0 && data_done &&
               static_cast<int>(done.size()) == r.assignment.stages_size() &&
               (r.assignment.state_bytes() == 0 || state_done);
  return r;
}

bool AssignmentArrived(const std::vector<CoordinatorMessage>& m) { return Collect(m).complete; }

// A complete assignment of attempt `attempt` arrived.
std::function<bool(const std::vector<CoordinatorMessage>&)> AttemptArrived(int attempt) {
  return [attempt](const std::vector<CoordinatorMessage>& m) {
    Received r = Collect(m);
    return r.complete && r.assignment.attempt() == attempt;
  };
}

bool CancelArrived(const std::vector<CoordinatorMessage>& m) {
  return std::any_of(m.begin(), m.end(), [](const CoordinatorMessage& x) { return x.has_cancel(); });
}

JobSpec MlpSpec(int stages) {
  JobSpec spec;
  spec.set_name("mlp");
  spec.mutable_split()->set_stages(stages);
  spec.mutable_schedule()->set_kind(SCHEDULE_1F1B);
  spec.mutable_schedule()->set_microbatches(4);
  spec.set_loss(LOSS_MSE);
  spec.mutable_optimizer()->set_kind(OPTIMIZER_SGD);
  spec.mutable_optimizer()->set_lr(0.01);
  spec.set_steps(2);
  spec.set_batch_size(8);
  return spec;
}

class CoordinatorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { torch::jit::setGraphExecutorOptimize(false); }

  void Start(const std::string& name, size_t chunk_bytes = 1 << 20, bool keep_state = false) {
    if (!keep_state) state_ = TmpDir(name);
    Coordinator::Options o;
    o.state_dir = state_;
    o.chunk_bytes = chunk_bytes;
    o.heartbeat_timeout = absl::Seconds(60);
    auto c = Coordinator::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = std::move(*c);
  }

  // A worker that registers a device ("cuda:0") and the memory free on it.
  std::shared_ptr<FakeWorker> AddDeviceWorker(const std::string& device, int64_t free_memory) {
    auto w = std::make_shared<FakeWorker>();
    RegisterWorker reg;
    reg.set_name(absl::StrCat("w", ids_.size()));
    reg.set_device(device);
    reg.set_free_memory(free_memory);
    if (device != "cpu") reg.set_device_name("Fake GPU");
    ids_.push_back(*coordinator_->AddWorker(reg, w));
    return w;
  }

  // `previous`: the ids the workers had (reconnecting after a restart).
  std::vector<std::shared_ptr<FakeWorker>> AddWorkers(int n, const std::vector<std::string>& previous = {}) {
    std::vector<std::shared_ptr<FakeWorker>> out;
    for (int i = 0; i < n; ++i) {
      auto w = std::make_shared<FakeWorker>();
      RegisterWorker reg;
      reg.set_name(absl::StrCat("w", ids_.size()));
      if (i < static_cast<int>(previous.size())) reg.set_worker_id(previous[i]);
      ids_.push_back(*coordinator_->AddWorker(reg, w));
      out.push_back(w);
    }
    return out;
  }

  absl::StatusOr<std::string> Submit(const JobSpec& spec, const std::string& model_bytes, const std::string& data_bytes) {
    auto upload = coordinator_->NewUpload();
    if (!upload.ok()) return upload.status();
    for (size_t off = 0; off < model_bytes.size(); off += 1000) {
      absl::Status s = (*upload)->AppendModel(absl::string_view(model_bytes).substr(off, 1000));
      if (!s.ok()) return s;
    }
    if (!data_bytes.empty()) {
      absl::Status s = (*upload)->AppendData(data_bytes);
      if (!s.ok()) return s;
    }
    return coordinator_->SubmitJob(spec, std::move(*upload));
  }

  // Waits (at most 60 s) until `done(job)` holds; returns the job as last seen.
  Job WaitForJob(const std::string& job_id, const std::function<bool(const Job&)>& done) {
    int64_t version = -1;
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    Job job;
    while (absl::Now() < deadline) {
      auto j = coordinator_->WaitForChange(job_id, &version, absl::Seconds(1));
      if (!j.ok()) break;
      job = *j;
      if (done(job)) break;
    }
    return job;
  }

  Job WaitForState(const std::string& job_id, JobState state) {
    return WaitForJob(job_id, [state](const Job& j) { return j.state() == state; });
  }

  // Plays a worker that trains nothing: reports its address, `steps` step reports,
  // sends its stages back unchanged and finishes.
  // Reports the rank's address and steps [from, to); with `checkpoint_every`, sends a
  // checkpoint (its stages as received, and "state-<rank>-<step>") after every N-th step.
  void PlaySteps(const std::string& worker_id, const Received& r, int from, int to, int checkpoint_every = 0) {
    const Assignment& a = r.assignment;
    WorkerMessage addr;
    addr.mutable_address()->set_job_id(a.job_id());
    addr.mutable_address()->set_rank(a.rank());
    addr.mutable_address()->set_ucx_address(absl::StrCat("ucx-", a.rank()));
    addr.mutable_address()->set_attempt(a.attempt());
    coordinator_->OnWorkerMessage(worker_id, addr);
    for (int step = from; step < to; ++step) {
      WorkerMessage rep;
      rep.mutable_step()->set_job_id(a.job_id());
      rep.mutable_step()->set_rank(a.rank());
      rep.mutable_step()->set_step(step);
      rep.mutable_step()->set_step_seconds(0.01);
      rep.mutable_step()->set_attempt(a.attempt());
      coordinator_->OnWorkerMessage(worker_id, rep);
      if (checkpoint_every > 0 && (step + 1) % checkpoint_every == 0) SendCheckpoint(worker_id, r, step + 1);
    }
  }

  void SendCheckpoint(const std::string& worker_id, const Received& r, int step) {
    const Assignment& a = r.assignment;
    auto piece = [&](int stage, const std::string& bytes) {
      for (size_t off = 0; off < bytes.size(); off += 4096) {
        WorkerMessage m;
        CheckpointChunk* c = m.mutable_checkpoint();
        c->set_job_id(a.job_id());
        c->set_attempt(a.attempt());
        c->set_step(step);
        c->set_rank(a.rank());
        c->set_stage(stage);
        c->set_chunk(bytes.substr(off, 4096));
        c->set_last_chunk(off + 4096 >= bytes.size());
        coordinator_->OnWorkerMessage(worker_id, m);
      }
    };
    for (const auto& [stage, bytes] : r.stages) piece(stage, bytes);
    piece(-1, absl::StrCat("state-", a.rank(), "-", step));
  }

  void PlayRank(const std::string& worker_id, const Received& r, int steps) {
    const Assignment& a = r.assignment;
    PlaySteps(worker_id, r, a.start_step(), steps);
    for (const auto& [stage, bytes] : r.stages) {
      for (size_t off = 0; off < bytes.size(); off += 4096) {
        WorkerMessage m;
        m.mutable_stage_result()->set_job_id(a.job_id());
        m.mutable_stage_result()->set_stage(stage);
        m.mutable_stage_result()->set_chunk(bytes.substr(off, 4096));
        m.mutable_stage_result()->set_last_chunk(off + 4096 >= bytes.size());
        m.mutable_stage_result()->set_attempt(a.attempt());
        coordinator_->OnWorkerMessage(worker_id, m);
      }
    }
  }

  void FinishRank(const std::string& worker_id, const Assignment& a, bool ok, const std::string& error = "") {
    WorkerMessage f;
    f.mutable_finished()->set_job_id(a.job_id());
    f.mutable_finished()->set_rank(a.rank());
    f.mutable_finished()->set_ok(ok);
    f.mutable_finished()->set_error(error);
    f.mutable_finished()->set_attempt(a.attempt());
    f.mutable_finished()->set_code(ok ? 0 : static_cast<int>(absl::StatusCode::kCancelled));
    coordinator_->OnWorkerMessage(worker_id, f);
  }

  std::string state_;
  std::unique_ptr<Coordinator> coordinator_;
  std::vector<std::string> ids_;
};

TEST_F(CoordinatorTest, ThreeStageJob_EachWorkerIsSentOnlyItsStageAndItsShareOfTheData) {
  Start("only_its_stage", /*chunk_bytes=*/4096);
  auto workers = AddWorkers(3);
  const std::string model = Slurp(kZoo + "mlp.pt");
  const std::string data = Slurp(kZoo + "mlp.data.pt");
  // Without restarts nothing needs the stage files later: none are written.
  JobSpec spec = MlpSpec(3);
  spec.mutable_fault_tolerance()->set_max_restarts(0);
  auto id = Submit(spec, model, data);
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<Received> received;
  for (int r = 0; r < 3; ++r) received.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  // The workers were idle: the stages went straight from memory, and their sizes are
  // on the job once sent.
  auto job = WaitForJob(*id, [](const Job& j) { return j.stage_file_bytes_size() == 3; });
  ASSERT_EQ(job.plan().stages_size(), 3);
  ASSERT_EQ(job.stage_file_bytes_size(), 3);
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id, "/stage_0.pt")));
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

TEST_F(CoordinatorTest, WorkerLost_WithoutRestarts_FailsTheJobNamingIt_AndTellsTheOthersToStop) {
  Start("worker_lost");
  auto workers = AddWorkers(2);
  JobSpec spec = MlpSpec(2);
  spec.mutable_fault_tolerance()->set_max_restarts(0);
  auto id = Submit(spec, Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok());
  for (int r = 0; r < 2; ++r) workers[r]->WaitFor(AssignmentArrived);
  coordinator_->RemoveWorker(ids_[1], "disconnected (test)");
  Job job = *coordinator_->GetJob(*id);
  EXPECT_EQ(job.state(), FAILED);
  EXPECT_THAT(job.reason(), HasSubstr("worker w1"));
  EXPECT_THAT(job.reason(), HasSubstr("stages 1"));
  EXPECT_THAT(job.reason(), HasSubstr("no restart left (0 of 0 used; raise it with --max-restarts)"));
  auto msgs = workers[0]->WaitFor(CancelArrived);
  EXPECT_TRUE(CancelArrived(msgs));
  // The survivor is busy until it reports back, then idle.
  FinishRank(ids_[0], Collect(msgs).assignment, false, "cancelled");
  auto listed = coordinator_->ListWorkers();
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].state(), IDLE);
}

// Checkpoints after steps 1 and 2 are committed (files on disk, the record names the
// step, the older one removed); a lost worker sends the job to RECOVERING, and it is
// placed again (attempt 1) on the survivor and the spare from the checkpoint: the
// checkpoint's stages, each rank's state, the start step. The stopped attempt's
// messages change nothing.
TEST_F(CoordinatorTest, WorkerLost_JobRestartsFromItsLastCheckpointOnTheSpare) {
  Start("restart_from_checkpoint", /*chunk_bytes=*/4096);
  auto workers = AddWorkers(3);
  JobSpec spec = MlpSpec(2);
  spec.set_steps(5);
  spec.mutable_fault_tolerance()->set_checkpoint_every(1);
  auto id = Submit(spec, Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok()) << id.status();
  // Workers 0 and 1 (ids order) hold ranks 0 and 1; worker 2 is the spare.
  std::vector<Received> got;
  for (int r = 0; r < 2; ++r) got.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  WaitForJob(*id, [this, &id](const Job&) {
    return std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id, "/stage_1.pt"));
  });
  // Trained stages differ from the originals: the checkpoint's are recognisable.
  for (auto& g : got) {
    for (auto& [s, bytes] : g.stages) bytes += "-trained";
  }
  for (int r = 0; r < 2; ++r) PlaySteps(ids_[r], got[r], 0, 0);  // addresses: RUNNING
  for (int r = 0; r < 2; ++r) PlaySteps(ids_[r], got[r], 0, 2, /*checkpoint_every=*/1);
  Job running = WaitForJob(*id, [](const Job& j) { return j.checkpoint_step() == 2; });
  ASSERT_EQ(running.checkpoint_step(), 2);
  ASSERT_EQ(running.state(), RUNNING);
  const std::string ckpt = absl::StrCat(state_, "/jobs/", *id, "/checkpoint-2");
  EXPECT_EQ(Slurp(ckpt + "/rank_1.state"), "state-1-2");
  EXPECT_EQ(Slurp(ckpt + "/stage_0.pt"), got[0].stages.at(0));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id, "/checkpoint-1")));
  // Half of a checkpoint after step 3 (rank 0 only), then rank 1's worker is lost.
  PlaySteps(ids_[0], got[0], 2, 3);
  SendCheckpoint(ids_[0], got[0], 3);
  coordinator_->RemoveWorker(ids_[1], "disconnected (test)");
  Job recovering = *coordinator_->GetJob(*id);
  EXPECT_EQ(recovering.state(), RECOVERING);
  EXPECT_EQ(recovering.restarts(), 1);
  EXPECT_EQ(recovering.attempt(), 1);
  EXPECT_EQ(recovering.step(), 2);
  EXPECT_EQ(recovering.losses_size(), 2);
  ASSERT_GT(recovering.history_size(), 0);
  EXPECT_THAT(recovering.history(recovering.history_size() - 1).message(),
              HasSubstr("worker w1 (" + ids_[1] + ", rank 1, stages 1) disconnected (test); restarting from step 2"));
  EXPECT_FALSE(std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id, "/checkpoint-3")));
  // The survivor is told to stop; until it reports back the job waits (the spare alone
  // is not enough).
  auto msgs = workers[0]->WaitFor(CancelArrived);
  ASSERT_TRUE(CancelArrived(msgs));
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), RECOVERING);
  // A late report of the stopped attempt changes nothing.
  WorkerMessage late;
  late.mutable_step()->set_job_id(*id);
  late.mutable_step()->set_rank(0);
  late.mutable_step()->set_step(3);
  late.mutable_step()->set_attempt(0);
  coordinator_->OnWorkerMessage(ids_[0], late);
  EXPECT_EQ(coordinator_->GetJob(*id)->step(), 2);
  FinishRank(ids_[0], got[0].assignment, false, "cancelled");
  // Placed again: ranks on the survivor (w0) and the spare (w2), from the checkpoint.
  std::vector<Received> again;
  for (int w : {0, 2}) again.push_back(Collect(workers[w]->WaitFor(AttemptArrived(1))));
  for (const Received& r : again) {
    ASSERT_TRUE(r.complete);
    const int rank = r.assignment.rank();
    EXPECT_EQ(r.assignment.start_step(), 2);
    EXPECT_EQ(r.state, absl::StrCat("state-", rank, "-2"));
    EXPECT_EQ(r.stages.at(rank), got[rank].stages.at(rank));
  }
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), PLACING);
  // The new attempt runs to the end and the result is assembled from its stages.
  for (const Received& r : again) {
    Received original = r;
    for (auto& [s, bytes] : original.stages) bytes = got[s].stages.at(s).substr(0, bytes.size() - 8);  // loadable
    PlayRank(r.assignment.rank() == 0 ? ids_[0] : ids_[2], original, 5);
  }
  for (const Received& r : again) FinishRank(r.assignment.rank() == 0 ? ids_[0] : ids_[2], r.assignment, true);
  Job done = WaitForState(*id, SUCCEEDED);
  EXPECT_EQ(done.state(), SUCCEEDED) << done.reason();
  EXPECT_EQ(done.step(), 5);
  EXPECT_EQ(done.losses_size(), 5);
}

TEST_F(CoordinatorTest, WorkerLost_NoWorkersWithinTheRecoveryTimeout_FailsSayingSo) {
  Start("recovery_timeout");
  auto workers = AddWorkers(2);
  JobSpec spec = MlpSpec(2);
  spec.mutable_fault_tolerance()->set_recovery_timeout_s(0.3);
  auto id = Submit(spec, Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok());
  std::vector<Received> got;
  for (int r = 0; r < 2; ++r) got.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  WaitForJob(*id, [this, &id](const Job&) {
    return std::filesystem::exists(absl::StrCat(state_, "/jobs/", *id, "/stage_1.pt"));
  });
  coordinator_->RemoveWorker(ids_[1], "disconnected (test)");
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), RECOVERING);
  FinishRank(ids_[0], got[0].assignment, false, "cancelled");
  Job failed = WaitForState(*id, FAILED);
  EXPECT_EQ(failed.state(), FAILED);
  EXPECT_THAT(failed.reason(), HasSubstr("(--recovery-timeout-s) for 2 idle workers to restart the job from step 0; "
                                         "1 of 1 registered workers are idle"));
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

TEST_F(CoordinatorTest, BadSubmissions_AreRefusedNamingTheField_AndLeaveNothingBehind) {
  Start("refused");
  AddWorkers(2);
  const std::string model = Slurp(kZoo + "mlp.pt"), data = Slurp(kZoo + "mlp.data.pt");
  struct Case {
    std::string name;
    JobSpec spec;
    std::string model, data, want;
  };
  JobSpec unknown_split = MlpSpec(2);
  unknown_split.mutable_split()->set_stages(0);
  unknown_split.mutable_split()->add_split_at("layers.99");
  JobSpec too_many = MlpSpec(3);
  JobSpec no_loss = MlpSpec(2);
  no_loss.clear_loss();
  std::vector<Case> cases = {
      {"empty model", MlpSpec(2), "", data, "model: empty"},
      {"not torchscript", MlpSpec(2), "hello", data, "model: 'model' is not a TorchScript archive"},
      {"no data", MlpSpec(2), model, "", "data: missing"},
      {"data that does not fit", MlpSpec(2), model, Slurp(kZoo + "gpt.data.pt"), "data"},
      {"unknown split point", unknown_split, model, data, "split:"},
      {"more workers than registered", too_many, model, data, "needs 3 workers"},
      {"missing loss", no_loss, model, data, "loss: missing"},
  };
  for (const Case& c : cases) {
    auto id = Submit(c.spec, c.model, c.data);
    ASSERT_FALSE(id.ok()) << c.name;
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << id.status();
    EXPECT_THAT(std::string(id.status().message()), HasSubstr(c.want)) << c.name;
  }
  EXPECT_TRUE(coordinator_->ListJobs().empty());
  EXPECT_TRUE(std::filesystem::is_empty(state_ + "/uploads"));
  EXPECT_TRUE(std::filesystem::is_empty(state_ + "/jobs"));
}

// After a restart with the same state directory: finished jobs stay fetchable, a job
// that was placed resumes (RECOVERING) once its workers reconnect, and they keep their
// ids.
TEST_F(CoordinatorTest, Restart_ResumesPlacedJobs_WorkersKeepTheirIds_FinishedOnesStayFetchable) {
  Start("restart");
  auto workers = AddWorkers(2);
  auto finished = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(finished.ok());
  std::vector<Received> got;
  for (int r = 0; r < 2; ++r) got.push_back(Collect(workers[r]->WaitFor(AssignmentArrived)));
  for (int r = 0; r < 2; ++r) PlayRank(ids_[r], got[r], 2);
  for (int r = 0; r < 2; ++r) FinishRank(ids_[r], got[r].assignment, true);
  ASSERT_EQ(WaitForState(*finished, SUCCEEDED).state(), SUCCEEDED);
  auto unfinished = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(unfinished.ok());
  WaitForJob(*unfinished, [this, &unfinished](const Job&) {
    return std::filesystem::exists(absl::StrCat(state_, "/jobs/", *unfinished, "/stage_1.pt"));
  });
  const std::vector<std::string> old_ids = ids_;
  coordinator_.reset();
  ids_.clear();
  Start("restart", 1 << 20, /*keep_state=*/true);
  EXPECT_EQ(coordinator_->GetJob(*finished)->state(), SUCCEEDED);
  EXPECT_TRUE(coordinator_->ResultPath(*finished).ok());
  auto again = coordinator_->GetJob(*unfinished);
  EXPECT_EQ(again->state(), RECOVERING);
  EXPECT_EQ(again->attempt(), 1);
  ASSERT_GT(again->history_size(), 0);
  EXPECT_THAT(again->history(again->history_size() - 1).message(),
              HasSubstr("the coordinator restarted while the job was PLACING; resuming from step 0"));
  // The workers reconnect (in the other order) under their old ids; a new one gets a new id.
  auto back = AddWorkers(2, {old_ids[1], old_ids[0]});
  EXPECT_EQ(ids_[0], old_ids[1]);
  EXPECT_EQ(ids_[1], old_ids[0]);
  auto fresh = AddWorkers(1);
  EXPECT_NE(ids_[2], old_ids[0]);
  EXPECT_NE(ids_[2], old_ids[1]);
  // The job is placed again, on the two idle workers first registered, from its stage
  // files and step 0.
  for (auto& w : back) {
    Received r = Collect(w->WaitFor(AttemptArrived(1)));
    ASSERT_TRUE(r.complete);
    EXPECT_EQ(r.assignment.start_step(), 0);
    EXPECT_EQ(r.assignment.state_bytes(), 0);
    EXPECT_EQ(r.stages.at(r.assignment.rank()), got[r.assignment.rank()].stages.at(r.assignment.rank()));
  }
  EXPECT_FALSE(Collect(fresh[0]->messages()).complete);
  EXPECT_EQ(coordinator_->GetJob(*unfinished)->state(), PLACING);
}

// A queued job (no workers yet) is queued again after a restart and placed from its
// stage files when workers come.
TEST_F(CoordinatorTest, Restart_KeepsQueuedJobsQueued) {
  Start("restart_queued");
  auto id = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_EQ(WaitForState(*id, QUEUED).state(), QUEUED);
  coordinator_.reset();
  Start("restart_queued", 1 << 20, /*keep_state=*/true);
  Job again = *coordinator_->GetJob(*id);
  EXPECT_EQ(again.state(), QUEUED);
  auto workers = AddWorkers(2);
  for (auto& w : workers) {
    Received r = Collect(w->WaitFor(AssignmentArrived));
    ASSERT_TRUE(r.complete);
    EXPECT_EQ(r.assignment.attempt(), 0);
    EXPECT_EQ(r.stages.at(r.assignment.rank()),
              Slurp(absl::StrCat(state_, "/jobs/", *id, "/stage_", r.assignment.rank(), ".pt")));
  }
  EXPECT_EQ(coordinator_->GetJob(*id)->state(), PLACING);
}

}  // namespace
}  // namespace pippy::coordinator
