// One job's lifecycle on the coordinator: its record (Job) and layout, placement onto
// workers, the ranks' addresses, step reports, checkpoints, recovery from a lost
// worker, and its end. The Coordinator (coordinator.h) keeps the registry of workers,
// the queue and the dispatch, and hands each job's events to its JobRun.
//
//   [PARTITIONING ->] QUEUED (stage files written) -> PLACING -> RUNNING | SERVING -> SUCCEEDED
//                                    any state -> FAILED | CANCELLED
//   (PARTITIONING: a detached submission being prepared; it has no layout until then)
//   a worker lost: PLACING | RUNNING | SERVING -> RECOVERING -> PLACING (attempt + 1),
//   restarting from the last committed checkpoint.
//
// The layout (pipeline/job/layout.h) is made once, when the submission is prepared,
// stored beside the record (JobStore::PutLayout) and read back by a restarted
// coordinator; Place sends each rank its piece. Messages of an earlier attempt are
// not this run's to handle: the Coordinator asks IsCurrent first.
//
// Thread safety: none of its own. The Coordinator owns every JobRun and calls it with
// its mutex held, as leveldb's DBImpl calls its VersionSet. What outlives a call and
// is used without that mutex is thread-safe itself: the stop flag the file senders
// poll, and a serving job's ServingQueue.
#ifndef PIPPY_COORDINATOR_JOB_RUN_H_
#define PIPPY_COORDINATOR_JOB_RUN_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/device.h"
#include "coordinator/artifact_store.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/job_store.h"
#include "coordinator/rank_sender.h"
#include "coordinator/generation.h"
#include "coordinator/serving.h"
#include "coordinator/step_trace.h"
#include "coordinator/worker_channel.h"
#include "pipeline/autoplan/calibration.h"
#include "proto/coordinator.pb.h"
#include "proto/plan.pb.h"

namespace pippy::coordinator {

class JobRun {
 public:
  // Where a job's record and files live. Both outlive the JobRun.
  struct Stores {
    JobStore* records = nullptr;
    ArtifactStore* artifacts = nullptr;
  };

  // An accepted submission: `job` holds its id, user, spec, plan and sizes; its stage
  // files (of `stage_bytes`) and data shares are written: it is QUEUED.
  // Saves the record and the layout.
  JobRun(Stores stores, Job job, JobLayout layout, std::vector<int64_t> share_bytes,
         std::vector<int64_t> stage_bytes);
  // A detached submission whose upload is in its job folder: PARTITIONING, without a
  // plan or layout until Prepared. Saves the record.
  static std::unique_ptr<JobRun> Preparing(Stores stores, Job job);
  // Its preparation is done (spec checked, plan, layout, files written): QUEUED, as the
  // constructor above makes a job. Saves the record and the layout.
  void Prepared(JobSpec spec, PipelinePlan plan, JobLayout layout, std::vector<int64_t> share_bytes,
                std::vector<int64_t> stage_bytes);

  // A record found at start-up, with its stored layout: a finished job as it is; a
  // queued one queued again (if its stage files are whole); a placed, running or
  // recovering one RECOVERING from its last complete checkpoint; a detached submission
  // whose model is on disk PARTITIONING again (the caller prepares it); else FAILED,
  // saying why (stage files or checkpoint incomplete, stages only in memory, no layout).
  enum class Restored { kEnded, kQueued, kRecovering, kPreparing };
  static std::unique_ptr<JobRun> Restore(Stores stores, const Job& record, absl::StatusOr<JobLayout> layout,
                                         Restored* restored);

  // ---- the record ----
  const std::string& id() const { return job_.job_id(); }
  const Job& job() const { return job_; }
  Job View() const;  // as the API shows it: with a serving job's counters
  // As ListJobs shows it: View without the plan, history, breakdowns, edges and the
  // per-step arrays (num_stages and last_loss stand in).
  Job Summary() const;
  JobState state() const { return job_.state(); }
  bool ended() const;
  int attempt() const { return job_.attempt(); }
  int64_t version() const { return version_; }
  const JobLayout& layout() const { return layout_; }
  int ranks_per_replica() const { return layout_.ranks_size(); }
  // Tensor parallelism: T shards of every stage, each run by its own copy of the ranks.
  int tensor_parallel() const { return std::max(1, layout_.tensor_parallel()); }
  // Every replica's ranks, every shard's: indexed GlobalRank(replica, shard, rank).
  int ranks() const { return ranks_per_replica() * layout_.replicas() * tensor_parallel(); }
  int GlobalRank(int replica, int tp_rank, int rank) const {
    return (replica * tensor_parallel() + tp_rank) * ranks_per_replica() + rank;
  }
  // The job's stage files (stage_<k>.pt, result_<k>.pt, a checkpoint's): one per stage,
  // or with tensor parallelism one per stage and shard, k = stage * T + shard.
  int FileKey(int stage, int tp_rank) const { return stage * tensor_parallel() + tp_rank; }
  int stage_files() const { return job_.plan().stages_size() * tensor_parallel(); }
  // Device memory each rank needs (by global rank), for placement.
  const std::vector<int64_t>& RankMemory() const { return rank_memory_; }
  std::vector<int> StagesOfRank(int rank) const;  // rank within a replica
  absl::Time checkpoint_time() const { return checkpoint_time_; }
  // Appends to the job's history (and the log); saves the record.
  void AddEvent(const std::string& message);

  // ---- stages out ----
  // Whether Place can read its stages: a checkpoint's, or the original files.
  bool StagesOnDisk() const { return stage_files_ready_ || job_.checkpoint_step() > 0; }
  // Reads the stages a placement sends: the last checkpoint's, or the original files.
  // The writer takes a file key (FileKey).
  StageWriter StagesFromFiles(size_t chunk_bytes) const;

  // ---- placement ----
  struct PlacedWorker {
    std::string id;
    std::string host;
    Device device;
    std::shared_ptr<WorkerChannel> channel;
  };
  // PLACING on `workers` (by global rank): what each rank must be sent.
  std::vector<RankSend> Place(const std::vector<PlacedWorker>& workers);

  // ---- the ranks' messages ----
  // Whether a message of `attempt` is the current placement's (not of a stopped one,
  // and the job neither ended nor waits to restart).
  bool IsCurrent(int attempt) const;
  // A rank is connected. Once every rank is, each gets its peers' addresses (into
  // `out`) and the job is RUNNING (SERVING: requests start to flow).
  void OnAddress(const RankAddress& address, Outbox* out);
  // A rank's report of a step; once every rank's is in, the step is complete.
  std::optional<CompletedStep> OnStepReport(const StepReport& report);
  // What a rank's end asks of the coordinator.
  struct RankOutcome {
    enum Kind { kNothing, kRecover, kFail, kAssemble } kind = kNothing;
    std::string reason;  // kRecover, kFail: which rank, on which worker, and why
  };
  RankOutcome OnRankFinished(const RankFinished& finished, const std::string& worker_name);
  // An auto-planned job's compute actions in its steps 1 to kCalibrationSteps (the first
  // warms up) against what its chosen candidate predicted: once those steps are in, the
  // factors learned (with the most ranks its placement put on one host), once per job.
  static constexpr int kCalibrationSteps = 3;
  std::optional<ActionFactors> TakeCalibration();
  // A checkpoint chunk: its global rank if it belongs to the running attempt's next
  // checkpoint and names a stage and rank of the job; nullopt to drop it.
  std::optional<int> CheckpointRank(const CheckpointChunk& chunk) const;
  // A piece of the checkpoint (`chunk`'s stage or rank state) is written whole: once
  // every stage and every rank's state is, the checkpoint is committed (synced, then
  // named by the record) and earlier ones go. Returns whether it committed.
  bool OnCheckpointPiece(const CheckpointChunk& chunk, int global_rank);

  // ---- ending and recovery ----
  // Ends the job (a no-op once ended): its senders stop, a serving job's requests
  // fail, its files go, the record is saved. The Coordinator frees the workers.
  void Finish(JobState state, const std::string& reason);
  // The coordinator stops: the attempt's file senders stop (the record stays as it is,
  // for a restart to resume).
  void StopSenders() { stop_->store(true); }
  // Set when the job ends (and when the coordinator stops): what a detached
  // preparation polls to stop its child.
  std::shared_ptr<const std::atomic<bool>> StopFlag() const { return stop_; }
  // The results are in and every rank sent its state after the last step: the results
  // become the stages of a checkpoint after the last step, committed (else the job
  // keeps its last periodic one). Call before Succeed. Errors: UNAVAILABLE (the job
  // keeps its earlier checkpoint).
  absl::Status CommitFinalCheckpoint();
  // A job submitted with spec.resume_from starts from `source`'s checkpoint after
  // `step`, whose files are linked in as its own: its record says so and carries the
  // source's losses, learning rates and step times of the steps before.
  void Resumed(const Job& source, int step);
  // The result is in place (FetchModel can serve it): SUCCEEDED.
  void Succeed();
  bool CanRestart() const;
  // A worker of the current attempt is lost (`what`): RECOVERING, attempt + 1, from
  // the last checkpoint, until `recovery_timeout_s`. REQUIRES: CanRestart().
  void Recover(const std::string& what);
  bool RecoveryExpired(absl::Time now) const { return state() == RECOVERING && now >= recover_deadline_; }

  // ---- serving and traces ----
  // A serving job's queue: a ServingQueue, or a GenerationQueue for a generation job.
  std::shared_ptr<RequestQueue> serving() const { return serving_; }
  absl::StatusOr<StepTrace> Trace(int step, const std::function<std::string(int global_rank)>& worker_name) const;

 private:
  JobRun(Stores stores, Job job, JobLayout layout);
  // The layout and what follows from it (each rank's memory, the stage count).
  void SetLayout(JobLayout layout);
  // Saves the record; bumps the version WaitForChange watches.
  void Touch();
  void StartServing();
  CoordinatorMessage AssignmentFor(int global) const;

  const Stores stores_;
  Job job_;
  JobLayout layout_;
  int64_t version_ = 0;
  std::vector<int64_t> share_bytes_;                   // by rank (every replica reads the same)
  std::vector<int64_t> rank_memory_;                  // by global rank, from the layout
  bool stage_files_ready_ = false;                     // jobs/<id>/stage_<s>.pt are whole
  // Set when the attempt ends: its file senders stop. Each attempt has its own.
  std::shared_ptr<std::atomic<bool>> stop_ = std::make_shared<std::atomic<bool>>(false);
  std::shared_ptr<RequestQueue> serving_;              // a serving job's requests, for its whole life
  // The current attempt.
  std::vector<std::shared_ptr<WorkerChannel>> channels_;  // by global rank
  std::map<int, std::string> addresses_;               // global rank -> UCX address
  std::map<int, std::string> gloo_addresses_;          // global rank -> replica-group address
  std::map<int, std::string> tp_gloo_addresses_;       // global rank -> tensor-parallel group address
  std::map<int, std::map<int, StepReport>> reports_;   // step -> global rank -> report, until complete
  std::set<int> finished_;                             // global ranks that finished ok
  bool assembling_ = false;
  std::map<int, std::set<std::pair<int, int>>> checkpoint_pieces_;  // step -> (rank, stage); stage -1: state
  bool final_states_ready_ = false;  // every rank's state after the last step arrived
  absl::Time checkpoint_time_ = absl::InfinitePast();  // when the last one was committed
  absl::Time recover_deadline_;
  StepTraces traces_;
  std::optional<autoplan::CalibrationSample> calibration_;  // an auto plan's, until taken
  int calibration_steps_ = 0;
  int ranks_on_host_ = 1;                              // the most ranks of this placement on one host
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_JOB_RUN_H_
