// Losses and optimizers of a training job, from LibTorch.
#ifndef PIPPY_PIPELINE_STAGE_TRAINING_H_
#define PIPPY_PIPELINE_STAGE_TRAINING_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "torch/script.h"
#include "proto/job.pb.h"
#include "torch/optim.h"

namespace pippy::stage {

// The mean loss of `output` against `target` (the job spec's LossKind; names are parsed
// in pipeline/job). LOSS_MODEL calls `module`'s loss(self, output, target) method.
// Errors: INVALID_ARGUMENT with the shapes when they do not fit, or for UNSPECIFIED.
absl::StatusOr<at::Tensor> ComputeLoss(LossKind kind, torch::jit::Module& module, const c10::IValue& output,
                                       const c10::IValue& target);

// torch.optim's SGD, Adam and AdamW with the given hyper-parameters (the job spec's
// OptimizerSpec after pipeline/job's CheckSpec filled in torch's defaults).
struct OptimizerOptions {
  OptimizerKind kind = OPTIMIZER_SGD;
  double lr = 0.01;
  double momentum = 0.0;
  double weight_decay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
};

// Errors: INVALID_ARGUMENT naming an unknown optimizer or a bad option.
absl::StatusOr<std::unique_ptr<torch::optim::Optimizer>> MakeOptimizer(const OptimizerOptions& options,
                                                                       std::vector<at::Tensor> params);

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_TRAINING_H_
