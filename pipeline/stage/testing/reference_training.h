// The independent reference for pipeline training: the unsplit model trained in one
// process (test-only).
#ifndef PIPPY_PIPELINE_STAGE_TESTING_REFERENCE_TRAINING_H_
#define PIPPY_PIPELINE_STAGE_TESTING_REFERENCE_TRAINING_H_

#include <string>
#include <vector>

#include "pipeline/stage/training.h"
#include "torch/script.h"

namespace pippy::stage::testing {

// max |a - b| / max |b| over the whole tensor (0 when equal).
double RelDiff(const at::Tensor& a, const at::Tensor& b);

// Trains the unsplit `model` for `steps` optimizer steps on the same batch: with
// `microbatches` > 1, gradients accumulate over that many equal micro-batches (loss
// scaled by 1/microbatches), as a pipeline computes; 1 is one full-batch pass.
// Tied weights are one parameter. Returns the mean loss of each step.
std::vector<double> TrainUnsplit(torch::jit::Module& model, LossKind loss,
                                 const OptimizerOptions& optimizer, double clip_grad_norm,
                                 const std::vector<c10::IValue>& inputs, const c10::IValue& target,
                                 int microbatches, int steps);

// Worst RelDiff between every parameter (and floating buffer) of the stage modules and
// the reference parameter of the same name. `compared` counts the parameters.
double MaxRelativeDifference(const std::vector<torch::jit::Module>& stages, const torch::jit::Module& reference,
                             int* compared);

}  // namespace pippy::stage::testing

#endif  // PIPPY_PIPELINE_STAGE_TESTING_REFERENCE_TRAINING_H_
