// The coordinator's service logic, apart from gRPC (the adapter is grpc_service.h): the
// registry of workers, the jobs and their queue, and the dispatch of jobs onto idle
// workers. Each job's own lifecycle is its JobRun's (job_run.h); streaming files to
// workers is rank_sender.h's, the metrics text coordinator_metrics.h's, the traces
// step_trace.h's and a result's assembly result_assembly.h's.
//
// A submission is prepared once, when it arrives (job_preparation.h), in a child
// process: the model is loaded, checked against the data and split, its layout made,
// its stage files and each rank's share of the data written; an invalid submission is
// refused then, with INVALID_ARGUMENT naming the field, and SubmitJob returns (a
// detached submission returns after the upload: PARTITIONING while it is prepared on a
// task thread, FAILED with the same message if it is refused). The
// coordinator's own process never loads the model nor runs its code. The job is
// QUEUED until enough idle workers are registered (no earlier job waiting for them
// first), then PLACING: each worker receives only its own stages and its share of the
// data, all workers in parallel, from the files. Several jobs run at once on disjoint
// workers. When every rank has finished, the trained stages (sent back in chunks,
// written to disk as they come) are put back into the submitted model, in a child
// process too (result_assembly.h), which FetchModel then serves from a file.
//
// Memory: the coordinator holds no model; one child at a time loads one (preparing a
// submission, or assembling a result), so a second submission waits for the first's
// child to end (each child has deadlines). Files move in chunks.
//
// Fault tolerance (docs/fault_tolerance.md): a job whose worker is lost (its stream
// breaks, its heartbeats stop for `heartbeat_timeout`, or a rank reports a peer gone)
// goes to RECOVERING: its other workers are told to stop, and once enough workers are
// idle it is placed again from its last checkpoint (JobRun::Recover); after
// max_restarts, or when no workers come within recovery_timeout_s, it FAILS naming why.
//
// Job records and layouts persist in SQLite (JobStore). After a restart with the same
// state directory, queued jobs stay queued, and jobs that were placed or running
// resume (RECOVERING) from their last checkpoint once workers reconnect; workers keep
// their ids. Jobs of older coordinators whose stages were still only in memory
// (PARTITIONING) are FAILED, unless the model is in the job's folder (a detached
// submission): then it is prepared again.
//
// Thread safety: every public method may be called from any thread. One mutex guards
// the registry, the jobs and the queue; messages to workers are sent after it is
// released, and file work (preparation, streaming, assembling) runs outside it: on the
// caller's thread for SubmitJob, on the coordinator's task threads otherwise.
#ifndef PIPPY_COORDINATOR_COORDINATOR_H_
#define PIPPY_COORDINATOR_COORDINATOR_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/liveness.h"
#include "coordinator/artifact_store.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/job_preparation.h"
#include "coordinator/job_run.h"
#include "coordinator/job_store.h"
#include "coordinator/serving.h"
#include "coordinator/task_runner.h"
#include "coordinator/worker_channel.h"
#include "coordinator/worker_registry.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

class Coordinator {
 public:
  struct Options {
    std::string state_dir;
    absl::Duration heartbeat_timeout = absl::Seconds(10);
    absl::Duration tick = absl::Milliseconds(100);
    size_t chunk_bytes = 1 << 20;  // pieces of the files streamed to workers
    // The largest gRPC message the coordinator receives (--max-message-mib): serving
    // micro-batches and their outputs stay within it (and within a worker's 64 MiB).
    int64_t max_message_bytes = int64_t{16} << 20;
    // Jobs a user may have waiting (QUEUED, or being prepared and staged) at once; 0: no limit.
    int max_queued_per_user = 0;
    // Submissions are prepared and results assembled in children of this
    // pippy-coordinator binary (--prepare, --merge); empty: in this process (the unit
    // tests of the coordinator's logic only). See job_preparation.h.
    std::string child_binary;
    absl::Duration prepare_timeout = absl::Minutes(5);  // a child, whole
    absl::Duration probe_timeout = absl::Minutes(2);    // the model's forward passes in it
    // Folders a job's dataset may be indexed in (--dataset-root; none: datasets refused).
    std::vector<std::string> dataset_roots;
    // Ended jobs are deleted (record and files) once older than this (0: kept)...
    absl::Duration job_retention = absl::ZeroDuration();
    // ... and beyond this many ended jobs, the longest-ended first (0: no limit).
    int max_finished_jobs = 0;
  };

  // Errors: UNAVAILABLE when the state directory cannot be opened.
  static absl::StatusOr<std::unique_ptr<Coordinator>> Create(const Options& options);
  ~Coordinator();

  // The coordinator is stopping (SIGTERM): children preparing or assembling are killed,
  // their callers answered UNAVAILABLE, and no new one starts. Safe from any thread.
  void BeginStop() { stopping_ = true; }
  // Whether the coordinator's loop (heartbeats, the queue, retention) turned within
  // `limit`: false when it is stuck (main.cc turns health NOT_SERVING and stops the
  // systemd watchdog's pings).
  bool LoopAlive(absl::Duration limit) const { return loop_alive_.Alive(limit); }

  // ---- users ----
  // A place for a submission's model and data while they arrive (removed unless the
  // job is accepted). Errors: UNAVAILABLE.
  absl::StatusOr<std::unique_ptr<Upload>> NewUpload();
  // Prepares the job from the spec and the finished upload, and queues it.
  // Errors: INVALID_ARGUMENT naming the field (spec, model, data, split, schedule), or
  // when more workers are needed than are registered (none registered: it waits);
  // RESOURCE_EXHAUSTED when `user` has max_queued_per_user jobs waiting.
  // `user` (from a token; "" without auth) is recorded as the job's submitter.
  // `notices` (if given) receives what was accepted but is probably not meant (also
  // added to the job's history): workers the schedule leaves idle, a batch larger
  // than the data.
  // `detach` (SubmitJobRequest.detach): returns the id once the upload is stored; the
  // job is PARTITIONING while a task thread prepares it, then QUEUED, or FAILED with
  // what would have been the error's message as its reason (notices go only to its
  // history). Errors then: RESOURCE_EXHAUSTED (the user's queue), UNAVAILABLE.
  absl::StatusOr<std::string> SubmitJob(const JobSpec& spec, std::unique_ptr<Upload> upload,
                                        const std::string& user = "", std::vector<std::string>* notices = nullptr,
                                        bool detach = false);
  absl::StatusOr<Job> GetJob(const std::string& job_id);
  // A page of job summaries (ListJobsRequest says how it pages and filters).
  // Errors: INVALID_ARGUMENT naming the request field.
  absl::StatusOr<ListJobsResponse> ListJobs(const ListJobsRequest& request);
  // Deletes an ended job: its record and files. Errors: NOT_FOUND; FAILED_PRECONDITION
  // for a job that has not ended; PERMISSION_DENIED when `user` is not its submitter.
  absl::Status DeleteJob(const std::string& job_id, const std::string& user = "");
  // Errors: NOT_FOUND; FAILED_PRECONDITION for a job that already ended;
  // PERMISSION_DENIED when `user` is not the job's submitter (both known).
  absl::StatusOr<Job> CancelJob(const std::string& job_id, const std::string& user = "");
  // The file FetchModel serves: the trained model, or an inference job's outputs.
  // Errors: NOT_FOUND; FAILED_PRECONDITION while the job has none (yet).
  absl::StatusOr<std::string> ResultPath(const std::string& job_id);
  // The job's last checkpoint merged into one TorchScript model (FetchModelRequest
  // .checkpoint), in a child as results are, kept until a later checkpoint replaces it.
  // Errors: NOT_FOUND; FAILED_PRECONDITION for a job without a checkpoint (yet);
  // PERMISSION_DENIED for another user's job; the merge's (result_assembly.h).
  absl::StatusOr<std::string> CheckpointPath(const std::string& job_id, const std::string& user = "");
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
  // One prompt to a generation job (pippyctl serve --generate), found as Infer finds a
  // serving job; its tokens come through `on_event` (see GenerationQueue). Errors:
  // NOT_FOUND; FAILED_PRECONDITION for a job that is not a generation job or has
  // ended; GenerationQueue::Submit's.
  absl::Status Generate(const std::string& job, GenerationQueue::Request request, GenerationQueue::OnEvent on_event,
                        std::shared_ptr<const std::atomic<bool>> cancelled = nullptr);

  // Prometheus text exposition of the coordinator's state (coordinator_metrics.h), for
  // --metrics-port.
  std::string MetricsText();

  // ---- workers ----
  // Registers a worker (it may have had an id before a restart). Returns its id.
  // Errors: INVALID_ARGUMENT for a device that does not parse.
  absl::StatusOr<std::string> AddWorker(const RegisterWorker& info, std::shared_ptr<WorkerChannel> channel);
  void RemoveWorker(const std::string& worker_id, const std::string& why);
  void OnWorkerMessage(const std::string& worker_id, const WorkerMessage& message);

 private:
  explicit Coordinator(const Options& options) : options_(options) {}
  void Loop();
  // At most one child holding a model at a time: preparing and assembling take the one
  // slot (each child has deadlines). Errors: UNAVAILABLE when the coordinator is stopping.
  absl::Status AcquireModelSlot();
  void ReleaseModelSlot();
  // The checks of a prepared submission against the workers registered (enough of
  // them; with only GPU workers, every rank fits one). Errors: INVALID_ARGUMENT.
  absl::Status Admit(const PreparedJob& prepared) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status CheckUserQueue(const std::string& user);
  // How children prepare submissions (deadlines, binary), stopping with the coordinator
  // and when `ended` (a detached job's stop flag; may be null) is set.
  // An uploaded dataset's folder (spec's) is one more root, for that job only.
  PrepareOptions PrepareOptionsFor(std::shared_ptr<const std::atomic<bool>> ended, const JobSpec& spec) const;
  // A spec that leaves its plan to pippy (JobSpec.auto_plan) with the workers it may
  // use filled in: the idle ones, or every registered one when none is idle, in the
  // order placement takes them. Other specs as they are.
  JobSpec WithWorkers(const JobSpec& spec) ABSL_LOCKS_EXCLUDED(mu_);
  // A detached submission (PARTITIONING, its files in its job folder): prepared on a
  // task thread, then queued or FAILED. Ends quietly when the job was cancelled or
  // deleted meanwhile; when the coordinator stops, the record stays PARTITIONING and a
  // restart prepares it again.
  void PrepareDetached(const std::string& job_id, const JobSpec& spec);
  // A prepared submission, checked against the workers, becomes QUEUED (and is placed
  // if workers are idle); its notices go into the job's history (and `notices`).
  absl::Status Queue(JobRun& run, const PreparedJob& prepared, std::vector<std::string>* notices)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A prepared submission with spec.resume_from (of `user`): the job it resumes, checked
  // (resume.h). Errors: NOT_FOUND and CheckResume's.
  absl::StatusOr<const JobRun*> ResumeSource(const PreparedJob& prepared, const std::string& user)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Links `source`'s checkpoint into `run`'s folder and starts `run` there.
  // Errors: LinkCheckpoint's.
  absl::Status ResumeFrom(const JobRun& source, JobRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Places queued jobs (whose stages are on disk) on idle workers; starts their senders.
  void Schedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Chooses workers for the job and places it there (none: empty). `no_fit`: the
  // needs (device memory by rank) that did not fit earlier in this pass, added to.
  using NoFit = absl::flat_hash_set<std::vector<int64_t>>;
  std::vector<RankSend> PlaceOnIdleWorkers(JobRun& run, NoFit* no_fit = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the job and frees its workers: those still on its attempt are told to stop
  // (each is idle again once it reports its rank finished); after SUCCEEDED they are idle.
  void EndJob(JobRun& run, JobState state, const std::string& reason, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A worker of the job's current attempt is lost (`what` says which and how): the job
  // restarts from its last checkpoint, queued first, or FAILS when no restart is left.
  void LoseAttempt(JobRun& run, const std::string& what, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the workers still holding the job to stop: those on `attempt` (-1: on any).
  void CancelWorkers(const JobRun& run, const std::string& reason, int attempt, Outbox* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job records and layouts found at start-up.
  void RestoreJobs() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  JobRun* Find(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The queue of the serving (or generation) job `job` (an id, or the newest serving job
  // so named), for Infer and Generate.
  absl::StatusOr<std::shared_ptr<RequestQueue>> ServingQueueOf(const std::string& job, bool generation)
      ABSL_LOCKS_EXCLUDED(mu_);
  void AddJob(std::unique_ptr<JobRun> run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Forgets an ended job (its record too); its files are the caller's to remove, after
  // the mutex is released (artifacts_->RemoveAllOf).
  void ForgetJob(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The ended jobs the retention rule drops now (forgotten; their files to remove).
  std::vector<std::string> Retain(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank's address, step report or end, of its job's current attempt.
  void OnRankMessage(WorkerRegistry::Worker& w, const WorkerMessage& m, Outbox* out, std::string* assemble)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void OnCheckpointChunk(const CheckpointChunk& chunk);
  // `stage`: -1 for an inference job's outputs; `tp_rank`: the shard it is of.
  void OnResultChunk(const std::string& job_id, int attempt, int stage, const std::string& chunk, bool last,
                     int tp_rank);
  void OnServeResult(const std::string& worker_id, const ServeResult& result);
  // Sends a placed rank its files (rank_sender.h); an error other than the attempt ending
  // or the worker going fails the attempt.
  void SendOrFail(const std::string& job_id, const RankSend& send, const StageWriter& writer,
                  std::map<int, int64_t>* stage_bytes);
  // Fails the job if it is still at `attempt` (a placement that could not be sent).
  void FailAttempt(const std::string& job_id, int attempt, const std::string& reason);
  // All ranks finished: assemble the result on a task thread, then end the job.
  void Assemble(const std::string& job_id);

  const Options options_;
  std::unique_ptr<JobStore> store_;
  std::unique_ptr<ArtifactStore> artifacts_;
  CoordinatorMetrics metrics_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<bool> stopping_{false};  // BeginStop: children are killed
  Liveness loop_alive_;                 // beaten by each pass of Loop
  bool model_in_memory_ ABSL_GUARDED_BY(mu_) = false;  // the model slot is taken
  int64_t next_job_ ABSL_GUARDED_BY(mu_) = 1;
  std::unique_ptr<WorkerRegistry> workers_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<JobRun>> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, JobRun*> by_number_ ABSL_GUARDED_BY(mu_);  // job-N by N: ListJobs' order
  absl::Time retained_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  bool schedule_soon_ ABSL_GUARDED_BY(mu_) = false;  // workers registered since the last pass
  absl::Time scheduled_at_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  std::vector<std::string> queue_ ABSL_GUARDED_BY(mu_);  // queued job ids, oldest first
  // What auto jobs' compute actions took on the workers against their predictions, by
  // ranks per host (pipeline/autoplan/calibration.h): given to later auto jobs. Kept in
  // memory only: a restarted coordinator learns again.
  std::vector<ActionFactors> calibration_ ABSL_GUARDED_BY(mu_);
  std::thread loop_;
  // Declared last: destroyed (its threads joined) first.
  TaskRunner tasks_;
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_COORDINATOR_H_
