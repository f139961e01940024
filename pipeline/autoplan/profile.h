// The measured half of the automatic plan (docs/autoplan.md): the model cut at up to
// `max_spans` - 1 evenly spread legal cuts into spans, and each span timed, for each
// micro-batch size, as training runs a stage: its forward with autograd recording, the
// gradients of its inputs (I), then of its parameters (W); with the memory it holds
// from forward to backward and the bytes a cut after it would send (the medians of
// repeated runs, interleaved span by span as a rank runs them). The spans run in
// order on the first micro-batch of the example batch, each span's inputs the previous
// spans' outputs. The chooser (chooser.h) sums spans into stages.
//
// It runs the submitted model's code: the coordinator calls it only in its preparation
// child (coordinator/job_preparation.h), pippyctl plan and split --profile locally.
#ifndef PIPPY_PIPELINE_AUTOPLAN_PROFILE_H_
#define PIPPY_PIPELINE_AUTOPLAN_PROFILE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"
#include "torch/script.h"

namespace pippy::autoplan {

struct ProfileOptions {
  // Samples per micro-batch to measure, each dividing the batch (empty: the batch's
  // own size only). Measured in ascending order.
  std::vector<int> microbatch_sizes;
  // Each time is the median of up to `repeats` runs after `warmups` untimed ones; a
  // size stops repeating once its runs took `seconds_per_size` (with at least 3 runs:
  // one run of a fast model is noise, more of a slow one only cost time).
  int repeats = 7;
  int warmups = 2;
  double seconds_per_size = 1.0;
  int max_spans = 24;
  bool train = true;          // false: forward only, without autograd
  OptimizerKind optimizer = OPTIMIZER_SGD;
};

// The micro-batch sizes worth measuring for a batch: batch / m for m = 1, 2, 4, ... up
// to 32 (and `also`, if it divides the batch), ascending.
std::vector<int> CandidateSizes(int64_t batch, int also = 0);

// How much k one-thread computations running at once on this host slow each other, for
// k = 1 .. max_k: the mean time of a fixed workload (matrix products and element-wise
// ops, as a model's) run by k threads together over its time alone (element 0 is 1).
// Takes about 0.1 s per k.
std::vector<double> MeasureColocation(int max_k);

// `batch` is forward()'s arguments for a whole batch (dim 0 the samples).
// Errors: INVALID_ARGUMENT when the batch does not fit the model (or a size does not
// divide it), with LibTorch's message.
absl::StatusOr<ModelProfile> ProfileModel(const torch::jit::Module& model, const std::vector<c10::IValue>& batch,
                                          const ProfileOptions& options);

// The auto plan of a job (the coordinator's preparation child and pippyctl plan): the
// first replica's share of `batch` (a whole batch of forward()'s arguments, dim 0 the
// samples) measured at every micro-batch size the spec leaves open, with as many
// threads as the fewest of spec.auto_plan.workers compute with (this process's are
// put back after), then chooser.h's ChoosePlan. Costs that cannot be measured give
// chooser.h's Fallback, its `fallback` saying why. REQUIRES: the spec's mode, batch_size,
// replicas and optimizer set (job::CheckSpec fills them in).
// Errors: ChoosePlan's; INVALID_ARGUMENT when the batch does not split into the replicas.
absl::StatusOr<PlanChoice> MeasureAndChoose(const JobSpec& spec, const torch::jit::Module& model,
                                            const std::vector<c10::IValue>& batch);

}  // namespace pippy::autoplan

#endif  // PIPPY_PIPELINE_AUTOPLAN_PROFILE_H_
