// Losses, optimizers and mixed precision of a training job, from LibTorch.
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

// Mixed precision for the scope of a stage's forward, as `with torch.autocast(
// device_type, dtype=...)` does it: the ops autocast lists (matrix products,
// convolutions) run in `dtype`, those it keeps in fp32 in fp32, while parameters stay
// fp32 (their reduced copies are cached for the scope and dropped at its end, since the
// optimizer changes them between steps). Thread-local: only the constructing thread's
// ops are cast, so backward (run outside the scope) is not. A scope with dtype
// Undefined does nothing. Only CPU and CUDA devices autocast.
class AutocastScope {
 public:
  AutocastScope(c10::DeviceType device, c10::ScalarType dtype);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType device_ = c10::DeviceType::CPU;
  bool was_enabled_ = false;
  c10::ScalarType was_dtype_ = c10::ScalarType::Undefined;
};

// `value` with its tensors of a reduced floating type (bf16, fp16) cast to fp32,
// through tuples and lists: the loss of a mixed-precision job is computed in fp32.
c10::IValue ToFloat32(const c10::IValue& value);

// Makes fp32 matrix products on GPUs exact fp32 (TF32 off for cuBLAS and cuDNN), as
// an fp32 job must be to compare with PyTorch. Process-wide; nothing on CPUs.
void UseExactFloat32();

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_TRAINING_H_
