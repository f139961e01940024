// Losses and optimizers of a training job, from LibTorch.
#ifndef PIPPY_PIPELINE_STAGE_TRAINING_H_
#define PIPPY_PIPELINE_STAGE_TRAINING_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "torch/script.h"
#include "torch/optim.h"

namespace pippy::stage {

enum class LossKind { kMse, kCrossEntropy, kModel };

// "mse" | "cross_entropy" | "model" (the scripted model's loss(self, output, target)).
absl::StatusOr<LossKind> ParseLoss(const std::string& name);

// The mean loss of `output` against `target`. kModel calls `module`'s loss method.
// Errors: INVALID_ARGUMENT with the shapes when they do not fit.
absl::StatusOr<at::Tensor> ComputeLoss(LossKind kind, torch::jit::Module& module, const c10::IValue& output,
                                       const c10::IValue& target);

struct OptimizerOptions {
  std::string name = "sgd";  // sgd | adam | adamw
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
