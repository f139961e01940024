// The coordinator's service logic, apart from gRPC (the adapter is grpc_service.h).
//
// Jobs: QUEUED -> PARTITIONING -> PLACING -> RUNNING -> SUCCEEDED | FAILED | CANCELLED,
// the reason for a failure kept on the job. A submission is prepared once, when it
// arrives (job_preparation.h): the model is loaded, checked against the data and
// split, and each rank's share of the data is cut; an invalid submission is refused
// then, with INVALID_ARGUMENT naming the field, and SubmitJob returns. The job is then
// PARTITIONING while its stages, still in memory, go out: if enough workers are idle
// they are streamed straight to them (PLACING), each worker receiving only its own
// stages and its share of the data, all in parallel; otherwise they are written to
// stage files and the job waits in the queue (QUEUED) until enough idle workers are
// registered, then streams from those files. Several jobs run at once on disjoint
// workers. When every rank has finished, the trained stages (sent back in chunks,
// written to disk as they come) are put back into the submitted model, which
// FetchModel then serves from a file.
//
// Memory: at most one model is held at a time (preparing a submission and sending or
// writing its stages, or assembling a result), plus the largest stage of a result
// being assembled; a second submission waits for the first to let go. Files move in
// chunks.
//
// Fault tolerance (docs/fault-tolerance.md): a training job's ranks send a checkpoint
// every spec.fault_tolerance.checkpoint_every steps (each stage's TorchScript and each
// rank's optimizer and random-generator state); it is written under the job's folder
// (temp file, fsync, rename) and committed by the job record naming its step. A job
// whose worker is lost (its stream breaks, its heartbeats stop for
// `heartbeat_timeout`, or a rank reports a peer gone) goes to RECOVERING: its other
// workers are told to stop, and once enough workers are idle every stage is placed
// again (attempt + 1) and the ranks start from the checkpoint's step; after
// max_restarts, or when no workers come within recovery_timeout_s, it FAILS naming
// why. Messages of an earlier attempt are ignored.
//
// Job records persist in SQLite (JobStore). After a restart with the same state
// directory, queued jobs stay queued, and jobs that were placed or running resume
// (RECOVERING) from their last checkpoint once workers reconnect; workers keep their
// ids. Jobs whose stages were still only in memory (PARTITIONING) are FAILED.
//
// Workers: each has one WorkerChannel (its stream).
//
// Thread safety: every public method may be called from any thread. One mutex guards
// the jobs and workers; messages to workers are sent after it is released, and file
// work (preparation, streaming, assembling) runs outside it — on the caller's thread
// for SubmitJob, on the coordinator's task threads otherwise.
#ifndef PIPPY_COORDINATOR_COORDINATOR_H_
#define PIPPY_COORDINATOR_COORDINATOR_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/artifact_store.h"
#include "coordinator/job_preparation.h"
#include "coordinator/job_store.h"
#include "coordinator/serving.h"
#include "coordinator/task_runner.h"
#include "common/device.h"
#include "common/metrics.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

// How the logic reaches one connected worker. Send returns false when the stream is
// gone. Send may be called from several threads at once (the implementation orders
// them), and may block while the worker is slow to read.
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
    size_t chunk_bytes = 1 << 20;  // pieces of the files streamed to workers
    // Jobs a user may have waiting (QUEUED, or being prepared and staged) at once; 0: no limit.
    int max_queued_per_user = 0;
    // Submitted models are loaded in this pippy-coordinator binary (--check-model) first;
    // empty: only in this process. See model_check.h.
    std::string model_checker;
    absl::Duration model_check_timeout = absl::Minutes(5);
  };

  // Errors: UNAVAILABLE when the state directory cannot be opened.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(const Options& options);
  ~Coordinator();

  // ---- users ----
  // A place for a submission's model and data while they arrive (removed unless the
  // job is accepted). Errors: UNAVAILABLE.
  absl::StatusOr<std::unique_ptr<Upload>> NewUpload();
  // Prepares the job from the spec and the finished upload, and queues it.
  // Errors: INVALID_ARGUMENT naming the field (spec, model, data, split, schedule), or
  // when more workers are needed than are registered (none registered: it waits).
  // `user` (from a token; "" without auth) is recorded as the job's submitter.
  absl::StatusOr<std::string> SubmitJob(const JobSpec& spec, std::unique_ptr<Upload> upload,
                                        const std::string& user = "");
  absl::StatusOr<Job> GetJob(const std::string& job_id);
  std::vector<Job> ListJobs();
  // Errors: NOT_FOUND; FAILED_PRECONDITION for a job that already ended;
  // PERMISSION_DENIED when `user` is not the job's submitter (both known).
  absl::StatusOr<Job> CancelJob(const std::string& job_id, const std::string& user = "");
  // The file FetchModel serves: the trained model, or an inference job's outputs.
  // Errors: NOT_FOUND; FAILED_PRECONDITION while the job has none (yet).
  absl::StatusOr<std::string> ResultPath(const std::string& job_id);
  // Blocks until the job differs from `*version` (or `timeout`); updates *version.
  absl::StatusOr<Job> WaitForChange(const std::string& job_id, int64_t* version, absl::Duration timeout);
  std::vector<WorkerInfo> ListWorkers();
  // The trace of step `step` (-1: the last complete one) of a job: every rank's timed
  // actions. The coordinator keeps the last few steps of each job.
  // Errors: NOT_FOUND for an unknown job or a step no longer (or not yet) held.
  absl::StatusOr<StepTrace> GetTrace(const std::string& job_id, int step);
  // One request to a serving job (`job`: its id, or the name of the newest serving job
  // so named): queued, and answered through `done` (exactly once when OK is returned;
  // see ServingQueue). Requests that come while the job is still being placed, or is
  // RECOVERING, wait for it to serve. Errors: NOT_FOUND; FAILED_PRECONDITION for a job
  // that is not a serving job or has ended; ServingQueue::Submit's.
  absl::Status Infer(const std::string& job, std::string input, ServingQueue::Done done,
                     std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);

  // Prometheus text exposition of the coordinator's state (jobs and workers by state,
  // steps, samples, step times, data-plane bytes the ranks reported, heartbeat and
  // checkpoint ages), for --metrics-port.
  std::string MetricsText();

  // ---- workers ----
  // Registers a worker; its id. Errors: INVALID_ARGUMENT for a device that does not parse.
  absl::StatusOr<std::string> AddWorker(const RegisterWorker& info, std::shared_ptr<WorkerChannel> channel);
  void RemoveWorker(const std::string& worker_id, const std::string& why);
  void OnWorkerMessage(const std::string& worker_id, const WorkerMessage& message);

 private:
  struct JobEntry {
    Job job;
    // Ranks of one pipeline (per_replica) and of the job (ranks = replicas x
    // per_replica). Ranks are numbered replica * per_replica + pipeline rank ("global").
    int per_replica = 0;
    int ranks = 0;
    std::vector<int> stage_to_rank;     // pipeline rank of each stage
    std::vector<int64_t> share_bytes;   // by pipeline rank (every replica reads the same share)
    int64_t version = 0;
    std::map<int, std::string> addresses;             // global rank -> UCX address
    std::map<int, std::string> gloo_addresses;        // global rank -> replica-group address
    std::map<int, std::map<int, StepReport>> reports;  // step -> rank -> report, until complete
    std::map<int, std::map<int, StepReport>> traces;   // the last kTracedSteps complete steps
    std::set<int> finished;                           // ranks that finished ok
    bool assembling = false;                          // the result is being assembled
    // The original stage files are on disk (jobs/<id>/stage_<s>.pt): a restart before
    // the first checkpoint reads them.
    bool stage_files_ready = false;
    absl::Time recover_deadline;                      // RECOVERING: fail after this
    // Checkpoint pieces that arrived whole, by step: (rank, stage), stage -1 = rank state.
    std::map<int, std::set<std::pair<int, int>>> checkpoint_pieces;
    absl::Time checkpoint_time = absl::InfinitePast();  // when the last one was committed
    // PARTITIONING: the split stages, in memory, until they are sent or written out.
    std::shared_ptr<const PreparedStages> stages;
    // Set when the job ends: its file senders stop.
    std::shared_ptr<std::atomic<bool>> stop = std::make_shared<std::atomic<bool>>(false);
    // A serving job's requests (spec.serving set), for the job's whole life.
    std::shared_ptr<ServingQueue> serving;
  };
  struct WorkerEntry {
    int attempt = 0;  // of the job it holds
    WorkerInfo info;
    Device device;  // info.device(), parsed once at registration
    std::shared_ptr<WorkerChannel> channel;
    absl::Time last_heartbeat;
  };
  using Outbox = std::vector<std::pair<std::shared_ptr<WorkerChannel>, CoordinatorMessage>>;

  // What placing sends one rank: its assignment, then its stages and data share.
  struct RankSend {
    std::shared_ptr<WorkerChannel> channel;
    CoordinatorMessage assignment;
    std::vector<int> stages;
    std::string share_file;
    std::string state_file;  // a restart's training state for the rank (empty: none)
    std::shared_ptr<std::atomic<bool>> stop;
  };
  // Writes a stage's TorchScript through a sink: from memory or from its file.
  using StageWriter =
      std::function<absl::Status(int stage, const std::function<absl::Status(absl::string_view)>& sink)>;

  static constexpr int kTracedSteps = 4;

  explicit Coordinator(const Options& options) : options_(options) {}
  void Loop();
  // At most one model in memory: preparing, sending or writing stages and assembling
  // take the one slot. Errors: UNAVAILABLE when the coordinator is stopping.
  absl::Status AcquireModelSlot();
  void ReleaseModelSlot();
  // A prepared job's stages go out: to idle workers straight from memory, or to stage
  // files and the queue. Runs on a task thread; releases the model slot.
  void StageOut(const std::string& job_id);
  std::vector<std::string> IdleWorkers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Workers for the job's ranks (by global rank) among `idle`, or none if they do not
  // fit: a GPU worker takes a rank only if the rank's stages (job::RankMemoryBytes) fit
  // in the device memory it registered; the largest ranks go first, each to the
  // smallest GPU that holds it, else to a CPU worker.
  std::vector<std::string> FitWorkers(const JobEntry& e, const std::vector<std::string>& idle)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places queued jobs (whose stages are in files) on idle workers.
  void Schedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Assigns the job's ranks to `workers` and returns what each must be sent.
  std::vector<RankSend> Place(JobEntry& entry, const std::vector<std::string>& workers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends one rank its assignment, stages (through `writer`) and data share; counts
  // each stage's bytes into `stage_bytes`.
  void SendRank(const RankSend& send, const StageWriter& writer, std::map<int, int64_t>* stage_bytes);
  void Finish(JobEntry& entry, JobState state, const std::string& reason, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker of the job's current attempt is lost (`what` says which and how): the job
  // goes to RECOVERING and is queued first to restart from its last checkpoint, or
  // FAILS when no restart is left.
  void Recover(JobEntry& entry, const std::string& what, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Appends to the job's history (and the log).
  void AddEvent(JobEntry& entry, const std::string& message) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job records found at start-up: finished ones as they are, queued ones queued
  // again, placed or running ones RECOVERING.
  void RestoreJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where a placement reads the job's stages: the checkpoint's, or the original files.
  StageWriter StagesFromFiles(const std::string& job_id, int checkpoint_step) const;
  void OnCheckpointChunk(const CheckpointChunk& chunk);
  // Fails the job if it is still at `attempt` (a placement that could not be sent).
  void FailAttempt(const std::string& job_id, int attempt, const std::string& reason);
  void Touch(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job as the API shows it (with a serving job's counters).
  static Job View(const JobEntry& entry);
  static std::shared_ptr<ServingQueue> MakeServingQueue(const Job& job);
  // All ranks of a serving job are connected: requests start to flow to them.
  void StartServing(JobEntry& entry) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // All ranks finished: assemble the trained model (or publish the outputs) on a task
  // thread, then end the job.
  void Assemble(const std::string& job_id, bool inference, int stages);
  void OnResultChunk(const std::string& job_id, int attempt, int stage, const std::string& chunk, bool last);
  static void Deliver(Outbox* out);

  const Options options_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<ArtifactStore> artifacts_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool model_in_memory_ ABSL_GUARDED_BY(mu_) = false;  // the model slot is taken
  int64_t next_job_ ABSL_GUARDED_BY(mu_) = 1;
  int64_t next_worker_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, JobEntry> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> queue_ ABSL_GUARDED_BY(mu_);  // queued job ids, oldest first
  std::map<std::string, WorkerEntry> workers_ ABSL_GUARDED_BY(mu_);
  // Since this coordinator started (Prometheus counters).
  struct Counters {
    int64_t steps = 0, samples = 0, checkpoints = 0, restarts = 0;
    int64_t bytes_sent = 0, bytes_received = 0;  // data plane, as the ranks reported
  };
  Counters counters_ ABSL_GUARDED_BY(mu_);
  metrics::Histogram step_seconds_ ABSL_GUARDED_BY(mu_){
      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  std::thread loop_;
  // Declared last: destroyed (its threads joined) first.
  TaskRunner tasks_;
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_COORDINATOR_H_
