// The coordinator's service logic, apart from gRPC (the adapter is grpc_service.h).
//
// Jobs: QUEUED -> PARTITIONING -> PLACING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED,
// the reason for a failure kept on the job. A job waits in the queue until enough
// idle workers are registered; several jobs run at once on disjoint workers. Job
// records persist in SQLite (JobStore); after a restart, jobs that were not finished
// are FAILED with that reason.
//
// Workers: each has one WorkerChannel (its stream). A worker whose stream breaks or
// whose heartbeats stop for `heartbeat_timeout` is removed, and its job fails with a
// reason naming the worker and its stages; the job's other workers are told to stop
// and return to idle when they report back.
//
// Thread safety: every public method may be called from any thread. One mutex guards
// all state; messages to workers are sent after it is released.
#ifndef PIPPY_COORDINATOR_COORDINATOR_H_
#define PIPPY_COORDINATOR_COORDINATOR_H_

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/job_store.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

// How the logic reaches one connected worker. Send returns false when the stream is gone.
class WorkerChannel {
 public:
  virtual ~WorkerChannel() = default;
  virtual bool Send(const CoordinatorMessage& message) = 0;
};

class Coordinator {
 public:
  struct Options {
    std::string state_dir;
    absl::Duration heartbeat_timeout = absl::Seconds(10);
    absl::Duration tick = absl::Milliseconds(100);
  };

  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(const Options& options);
  ~Coordinator();

  // ---- users ----
  // Errors: INVALID_ARGUMENT naming the field (spec, model, data).
  absl::StatusOr<std::string> SubmitJob(const JobSpec& spec, std::string model, std::string data);
  absl::StatusOr<Job> GetJob(const std::string& job_id);
  std::vector<Job> ListJobs();
  absl::StatusOr<Job> CancelJob(const std::string& job_id);
  absl::StatusOr<std::string> TrainedModel(const std::string& job_id);
  // Blocks until the job differs from `*version` (or `timeout`); updates *version.
  absl::StatusOr<Job> WaitForChange(const std::string& job_id, int64_t* version, absl::Duration timeout);
  std::vector<WorkerInfo> ListWorkers();

  // ---- workers ----
  std::string AddWorker(const RegisterWorker& info, std::shared_ptr<WorkerChannel> channel);
  void RemoveWorker(const std::string& worker_id, const std::string& why);
  void OnWorkerMessage(const std::string& worker_id, const WorkerMessage& message);

 private:
  struct JobEntry {
    Job job;
    std::string model;
    std::string data;
    int ranks = 0;
    int64_t version = 0;
    std::map<int, std::string> addresses;             // rank -> UCX address
    std::map<int, std::vector<StepReport>> reports;   // step -> reports
    std::map<int, std::string> stage_bytes;           // stage -> trained archive
    std::map<int, bool> finished;                      // rank -> ok
  };
  struct WorkerEntry {
    WorkerInfo info;
    std::shared_ptr<WorkerChannel> channel;
    absl::Time last_heartbeat;
  };
  using Outbox = std::vector<std::pair<std::shared_ptr<WorkerChannel>, CoordinatorMessage>>;

  explicit Coordinator(const Options& options) : options_(options) {}
  void Loop();
  void Schedule(Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Place(JobEntry& entry, const std::vector<std::string>& workers, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish(JobEntry& entry, JobState state, const std::string& reason, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Touch(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnStageDone(JobEntry& entry, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static void Deliver(Outbox* out);

  const Options options_;
  std::unique_ptr<JobStore> store_;
  std::thread loop_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int64_t next_job_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_worker_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, JobEntry> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> queue_ ABSL_GUARDED_BY(mu_);  // queued job ids, oldest first
  std::map<std::string, WorkerEntry> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_COORDINATOR_H_
