// The coordinator's logic with fake worker channels (no gRPC, no worker processes): a
// fixture shared by coordinator_test (placement, runs, results, refusals) and
// coordinator_recovery_test (lost workers, restarts of the coordinator).
#ifndef PIPPY_COORDINATOR_COORDINATOR_TEST_FIXTURE_H_
#define PIPPY_COORDINATOR_COORDINATOR_TEST_FIXTURE_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/coordinator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/layout.h"
#include "pipeline/torchio/model_io.h"
#include "torch/csrc/jit/runtime/graph_executor.h"
#include "torch/csrc/jit/serialization/pickle.h"

namespace pippy::coordinator {

inline const std::string kZoo = "examples/models/zoo/";

inline std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline std::string TmpDir(const std::string& name) {
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
inline Received Collect(const std::vector<CoordinatorMessage>& messages) {
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

inline bool AssignmentArrived(const std::vector<CoordinatorMessage>& m) { return Collect(m).complete; }

// A complete assignment of attempt `attempt` arrived.
inline std::function<bool(const std::vector<CoordinatorMessage>&)> AttemptArrived(int attempt) {
  return [attempt](const std::vector<CoordinatorMessage>& m) {
    Received r = Collect(m);
    return r.complete && r.assignment.attempt() == attempt;
  };
}

inline bool CancelArrived(const std::vector<CoordinatorMessage>& m) {
  return std::any_of(m.begin(), m.end(), [](const CoordinatorMessage& x) { return x.has_cancel(); });
}

inline JobSpec MlpSpec(int stages) {
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
    o.job_retention = retention_;
    o.max_finished_jobs = max_finished_jobs_;
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

  absl::StatusOr<std::string> Submit(const JobSpec& spec, const std::string& model_bytes, const std::string& data_bytes,
                                     const std::string& user = "", bool detach = false) {
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
    return coordinator_->SubmitJob(spec, std::move(*upload), user, nullptr, detach);
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

  // Starts a coordinator named `name`, submits the zoo's MLP (2 stages), waits for it
  // to be QUEUED (no workers come) and stops the coordinator: the job's id, for a test
  // that starts it again with keep_state.
  absl::StatusOr<std::string> QueueMlpAndStop(const std::string& name) {
    Start(name);
    auto id = Submit(MlpSpec(2), Slurp(kZoo + "mlp.pt"), Slurp(kZoo + "mlp.data.pt"));
    if (!id.ok()) return id.status();
    if (const Job j = WaitForState(*id, QUEUED); j.state() != QUEUED) {
      return absl::InternalError(absl::StrCat(*id, " is ", JobState_Name(j.state()), ", not QUEUED"));
    }
    coordinator_.reset();
    return id;
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
  absl::Duration retention_ = absl::ZeroDuration();  // Start's retention rule
  int max_finished_jobs_ = 0;
  std::unique_ptr<Coordinator> coordinator_;
  std::vector<std::string> ids_;
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_COORDINATOR_TEST_FIXTURE_H_
