// The pieces a job's layout (layout.h) is made of, from a checked job spec and the
// partitioner's plan: the plan's checks and stage graph, the schedule (per-rank action
// lists and the stage -> rank placement), the data and memory each rank needs, and the
// transport of an edge between two placed ranks. No LibTorch.
#ifndef PIPPY_PIPELINE_JOB_JOB_PLAN_H_
#define PIPPY_PIPELINE_JOB_JOB_PLAN_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/device.h"
#include "pipeline/schedule/schedule.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

namespace pippy::job {

// Checks that a plan's cross references hold, as every function here and the runtime
// assume: at least one stage; stage k has index k; each stage input names a model input
// that exists or an output of an earlier stage; consumers are later stages; tied groups
// name stages that exist, with at least one holder; parameters' tie groups exist; the
// last stage, and only it, is marked last. Plans made by the partitioner pass; a plan
// read from a file (pippy-rank's plan.json) or received over the network is checked
// before use. Errors: INVALID_ARGUMENT naming the stage and field.
absl::Status CheckPlan(const PipelinePlan& plan);

// A generation job (ServingSpec.generation) against its plan: forward() takes (idx,
// input_pos, slots) and returns logits, and every buffer forward() writes is a KV cache
// [max_slots, heads, max_seq, head_dim]. Fills in max_slots and max_seq from the caches
// where unset. Errors: INVALID_ARGUMENT starting with "model:" (naming the buffer and
// its shape, or the inputs) or "serving.generation.max_slots"/"max_seq" (larger than a cache).
absl::Status ResolveGeneration(const PipelinePlan& plan, JobSpec* spec);
// The vocabulary of a generation model: the last dimension of its example output (0: unknown).
int64_t VocabularyOf(const PipelinePlan& plan);

// The stage graph (who consumes whose outputs) of a plan. REQUIRES: CheckPlan passed.
schedule::StageGraph StageGraphOf(const PipelinePlan& plan);

// Ranks (workers) the job needs: stages / stages per worker.
// Errors: INVALID_ARGUMENT ("schedule.stages_per_worker: ...") when they do not divide.
absl::StatusOr<int> RanksFor(const JobSpec& spec, const PipelinePlan& plan);

// The job's schedule over RanksFor ranks, with the plan's stage graph, validated
// (no deadlock). REQUIRES: CheckSpec(spec) passed. Errors: INVALID_ARGUMENT naming
// the precondition the schedule misses ("schedule: 1f1b needs ...").
absl::StatusOr<schedule::Schedule> ScheduleFor(const JobSpec& spec, const PipelinePlan& plan);

// What a rank needs of the data: the model inputs its stages read, and the targets
// if it holds the last stage of a training job (the loss is computed there).
struct DataNeeds {
  std::vector<int> inputs;
  bool targets = false;
};
DataNeeds DataNeedsOf(const JobSpec& spec, const PipelinePlan& plan, const schedule::Schedule& schedule, int rank);

// Device memory a rank's stages need (a GPU worker's placement is checked against it):
// their parameters, plus for a training job their gradients and the optimizer's state
// (SGD with momentum: one buffer; Adam and AdamW: two). Activations are not counted.
// With tensor parallelism, a rank holds its shard: a T-th of each sharded tensor and all
// of each replicated one.
// REQUIRES: CheckSpec(spec) passed; stage_to_rank covers the plan.
int64_t RankMemoryBytes(const JobSpec& spec, const PipelinePlan& plan, const std::vector<int>& stage_to_rank, int rank);

// The bytes of stage `sp`'s parameters and buffers one rank holds: all of them, or with
// tensor parallelism its shard (a T-th of the sharded tensors, the replicated ones whole).
int64_t StageBytesPerRank(const PipelinePlan& plan, const StagePlan& sp);

// Where a rank runs: the worker's host and its device.
struct RankPlace {
  std::string host;
  Device device;
};

// Whether the workers run NCCL between a job's GPU ranks. Not yet: the NCCL backend
// (transport/nccl) is built and tested on its own, but workers do not build a job's
// communicator, so every GPU edge is "ucx+staging" for now. Before they can, the
// backend must stop running its batches one after another (see nccl_transport.h:
// a pipeline rank's interleaved sends and receives can deadlock across batches), and
// checking it needs two GPUs.
inline constexpr bool kJobsUseNccl = false;

// How activations and gradients cross an edge of the stage graph from a rank placed at
// `from` to one at `to`:
//   "ucx"          both ranks on CPUs;
//   "nccl"         both on GPUs, and not the same one (another host, or another
//                  ordinal on the same host), where NCCL is used (`use_nccl`);
//   "ucx+staging"  a GPU and a CPU rank, or two workers sharing one GPU (NCCL needs a
//                  device per rank): CUDA tensors staged through pinned host buffers
//                  and sent over UCX.
// With `use_nccl` false, edges between different GPUs stage over UCX too.
std::string TransportFor(const RankPlace& from, const RankPlace& to, bool use_nccl = kJobsUseNccl);

}  // namespace pippy::job

#endif  // PIPPY_PIPELINE_JOB_JOB_PLAN_H_
