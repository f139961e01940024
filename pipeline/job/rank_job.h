// One rank of a job, set up the one way every caller sets it up: the worker daemon,
// pippy-rank, the benchmarks and the tests. From the checked spec, the plan (or the
// rank's slice of it), the rank's piece of the job's layout (layout.h: its action list,
// run as it is, never made again), the rank's stage modules and a transport, it makes
// the runtime options and the RankRuntime, and runs steps on a BatchSource.
//
// Thread safety: as RankRuntime (one thread runs steps; Cancel from any thread).
#ifndef PIPPY_PIPELINE_JOB_RANK_JOB_H_
#define PIPPY_PIPELINE_JOB_RANK_JOB_H_

#include <map>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/stage/batch_source.h"
#include "pipeline/stage/rank_runtime.h"
#include "pipeline/transport/transport.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"
#include "torch/script.h"

namespace pippy::job {

// The runtime options a checked spec asks for; `timeout` bounds each wait in a step.
stage::RuntimeOptions RuntimeOptionsFor(const JobSpec& spec, absl::Duration timeout);

// Seeds this process's random number generator for `rank` of `replica` of a job
// (spec.seed + replica * ranks per replica + rank), so that dropout and other random
// ops repeat from run to run. For processes that run one rank; ranks sharing a process
// share the generator.
void SeedProcessForRank(const JobSpec& spec, int rank, int replica = 0, int ranks_per_replica = 0);

class RankJob {
 public:
  // REQUIRES: CheckSpec(&spec) passed; `piece` is `rank`'s part of the job's layout
  // (MakeLayout, made from the same spec and plan). `stages`: stage index -> module,
  // exactly the stages the piece places on `rank`. The transport must outlive the RankJob.
  // Errors: INVALID_ARGUMENT when the piece does not fit the plan (RankSchedule), or
  // the stages, plan and piece disagree.
  // Data parallelism (spec.replicas > 1): `replicas` is this rank's group across the
  // replicas (its index is the replica), which must outlive the RankJob; the rank then
  // trains on its replica's slice of every batch. Errors: also INVALID_ARGUMENT when
  // the group does not match spec.replicas.
  // Tensor parallelism (spec.tensor_parallel.size T > 1): `stages` are this rank's
  // shards (pipeline/tensor_parallel) and `tensor_parallel` the group of T ranks holding
  // the other shards (its index is the shard), which must outlive the RankJob. Errors:
  // also INVALID_ARGUMENT when the group or the plan do not match spec.tensor_parallel.
  // `device`: where the stages, activations, gradients and optimizer state live (see
  // RuntimeOptions::device; a GPU rank's transport must deliver there). An fp32 job on
  // a GPU turns TF32 off for the process, so that it computes what PyTorch's fp32 does.
  static absl::StatusOr<std::unique_ptr<RankJob>> Create(const JobSpec& spec, const PipelinePlan& plan,
                                                         const RankLayout& piece, int rank,
                                                         std::map<int, torch::jit::Module> stages,
                                                         transport::Transport* transport, absl::Duration timeout,
                                                         transport::ReplicaGroup* replicas = nullptr,
                                                         c10::Device device = c10::Device(c10::kCPU),
                                                         transport::ReplicaGroup* tensor_parallel = nullptr);

  // Step `step` of the job on its batch from `data`: a training step, or forward only
  // for an inference job (the last stage's rank returns the merged output).
  // Errors: the runtime's, or reading the batch's (a dataset's, naming the shard).
  absl::StatusOr<stage::StepResult> RunStep(int step, stage::BatchSource& data);

  // Evaluation batch `batch_index` of a training job (RankRuntime::EvalStep) read from
  // `data` (this replica's slice; nullptr on a rank that reads neither inputs nor
  // targets), numbered `eval_step` (consecutive over the job's evaluation batches).
  absl::StatusOr<stage::StepResult> EvalStep(int eval_step, int64_t batch_index, stage::BatchSource* data);

  // A serving job's step: forward only on `inputs` (forward()'s arguments, None where
  // this rank reads none; any number of rows). See RankRuntime::InferenceStep, whose
  // ABORTED means the inputs did not fit the model and the next step may run.
  absl::StatusOr<stage::StepResult> ServeStep(int step, const std::vector<c10::IValue>& inputs) {
    return runtime_->InferenceStep(step, inputs);
  }

  // The rank's training state after a step, for a checkpoint: the optimizer's state
  // and this process's random number generator (dropout draws from it). The stages'
  // parameters and buffers are not in it: they are in the stage modules (stages()),
  // which a checkpoint saves as TorchScript. Errors: INTERNAL from LibTorch.
  absl::StatusOr<std::string> SaveState();
  // Restores what SaveState wrote, before the first step of a resumed job, so that the
  // resumed steps compute exactly what the uninterrupted ones would have. Errors:
  // DATA_LOSS when the bytes do not parse, come from another rank or do not fit this
  // rank's optimizer.
  absl::Status RestoreState(absl::string_view bytes);

  // See RankRuntime::Cancel.
  void Cancel() { runtime_->Cancel(); }

  int rank() const { return rank_; }
  // The schedule as this rank runs it: its own action list only (RankSchedule).
  const schedule::Schedule& schedule() const { return schedule_; }
  // The rank's stage modules; a training job trains their parameters in place.
  const std::map<int, torch::jit::Module>& stages() const { return runtime_->stages(); }

 private:
  RankJob() = default;

  JobSpec spec_;
  int rank_ = 0;
  int replica_ = 0;
  c10::Device device_ = c10::Device(c10::kCPU);
  schedule::Schedule schedule_;
  std::unique_ptr<stage::RankRuntime> runtime_;
};

}  // namespace pippy::job

#endif  // PIPPY_PIPELINE_JOB_RANK_JOB_H_
