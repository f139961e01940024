// The job spec's vocabulary and its checks, written once.
//
// Clients parse what users type ("1f1b", "adamw", "cross_entropy") into the spec's
// enums here (the names and their help are the table on the enum values in
// proto/job.proto, read through proto/names.h); the coordinator checks a submitted
// spec with CheckSpec, once, and from then on everything takes the typed spec.
// Nothing downstream compares names.
#ifndef PIPPY_PIPELINE_JOB_JOB_SPEC_H_
#define PIPPY_PIPELINE_JOB_JOB_SPEC_H_

#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "pipeline/schedule/schedule.h"
#include "proto/job.pb.h"

namespace pippy::job {

// Schedules: pippy's names (gpipe, 1f1b, interleaved-1f1b, looped-bfs, zb1p, zbv,
// inference) and torch's class names. Errors: INVALID_ARGUMENT listing the names.
absl::StatusOr<ScheduleKind> ParseSchedule(absl::string_view name);
std::string ScheduleName(ScheduleKind kind);  // "1f1b"; "unspecified" for 0

// "mse" | "cross_entropy" | "model".
absl::StatusOr<LossKind> ParseLoss(absl::string_view name);
std::string LossName(LossKind loss);

// "sgd" | "adam" | "adamw".
absl::StatusOr<OptimizerKind> ParseOptimizer(absl::string_view name);
std::string OptimizerName(OptimizerKind optimizer);
absl::StatusOr<LrScheduleKind> ParseLrSchedule(absl::string_view name);
// "uint16" | "uint32" (a token dataset's ids).
absl::StatusOr<TokenDtype> ParseTokenDtype(absl::string_view name);
std::string LrScheduleName(LrScheduleKind kind);

// "fp32" | "bf16" (pippyctl's --dtype; see Precision in job.proto).
absl::StatusOr<Precision> ParsePrecision(absl::string_view name);
std::string PrecisionName(Precision precision);  // "fp32" for UNSPECIFIED

// "params" | "flops" | "time".
absl::StatusOr<Balance> ParseBalance(absl::string_view name);
std::string BalanceName(Balance balance);

// "train" | "inference".
std::string ModeName(Mode mode);

// torch.optim's default weight decay: 0.01 for AdamW, 0 otherwise.
double DefaultWeightDecay(OptimizerKind optimizer);

// The most micro-batches a step may have (the schedule holds an action per micro-batch
// and stage, so an unbounded count is memory a submission could claim).
inline constexpr int kMaxMicrobatches = 16384;

// Fault tolerance's defaults: a checkpoint every 50 steps, 3 restarts, 300 s to find
// the workers for a restart.
inline constexpr int kDefaultCheckpointEvery = 50;
inline constexpr int kDefaultMaxRestarts = 3;
inline constexpr double kDefaultRecoveryTimeoutS = 300;

// Serving's defaults and limit: micro-batches of up to 32 rows, or what came within
// 5 ms; at most 65536 rows per micro-batch.
inline constexpr int kDefaultServingMaxBatch = 32;
inline constexpr int kDefaultServingMaxDelayMs = 5;
inline constexpr int kMaxServingBatch = 65536;
inline constexpr int kDefaultServingMaxQueued = 4096;
inline constexpr int kDefaultPrefillChunk = 64;

// Whether a checkpoint is taken once `steps_done` steps of the job are done: every
// checkpoint_every steps of a training job, except after the last step.
// REQUIRES: CheckSpec(&spec) passed.
bool CheckpointAfter(const JobSpec& spec, int steps_done);
// Whether the ranks send their training state after the last step, which the
// coordinator keeps with the trained stages as the job's last checkpoint (to resume
// from): a training job with checkpoints on. REQUIRES: CheckSpec(&spec) passed.
bool KeepsFinalState(const JobSpec& spec);
// Whether a training job with spec.eval evaluates once `steps_done` steps are done:
// after every eval.every-th step and after the last. REQUIRES: CheckSpec(&spec) passed.
bool EvalAfter(const JobSpec& spec, int steps_done);

// Checks the fields of `spec` that need neither the model nor the data, and fills in
// defaults: the mode from the schedule, stages per worker, weight decay, betas and eps,
// and fault tolerance's.
// Errors: INVALID_ARGUMENT whose message starts with the field ("optimizer.lr: must
// be > 0").
absl::Status CheckSpec(JobSpec* spec);

// Whether the spec leaves part of its plan to pippy (auto_plan) that is not chosen yet:
// CheckSpec then checks the rest and leaves those fields unset (schedule.kind
// UNSPECIFIED, microbatches 0, split.stages 0) for the preparation to choose.
bool PlanPending(const JobSpec& spec);
// Whether any part of the plan is left to pippy.
bool AutoPlanned(const AutoPlanSpec& a);

}  // namespace pippy::job

#endif  // PIPPY_PIPELINE_JOB_JOB_SPEC_H_
