// A training (or inference) job's rank once it is up: its steps from the assignment's
// start step to the job's end, a report to the coordinator after each
// (report_builder.h; with spec.eval, the evaluation's loss after the steps it follows,
// every rank running the evaluation's batches through the pipeline forward only, the
// ones reading inputs or targets from `eval_data`), a checkpoint every
// spec.fault_tolerance.checkpoint_every steps,
// and its results at the end: the trained stages (replica 0; the replicas hold the
// same parameters), or an inference job's merged outputs from the last stage's rank.
//
// Thread safety: runs on the rank's thread.
#ifndef PIPPY_WORKER_TRAINING_LOOP_H_
#define PIPPY_WORKER_TRAINING_LOOP_H_

#include "absl/status/status.h"
#include "pipeline/job/rank_job.h"
#include "pipeline/stage/batch_source.h"
#include "proto/coordinator.pb.h"
#include "worker/result_stream.h"
#include "worker/worker_metrics.h"

namespace pippy::worker {

// Errors: a step's (CANCELLED when the rank was cancelled; UNAVAILABLE or
// DEADLINE_EXCEEDED when a peer is gone or silent; others naming the step); the
// result stream's.
absl::Status RunTrainingSteps(const Assignment& a, job::RankJob& rank_job, stage::BatchSource& data,
                              stage::BatchSource* eval_data, const Writer& write, WorkerMetrics& metrics);

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_TRAINING_LOOP_H_
