#include "pipeline/stage/training.h"

#include "absl/strings/str_cat.h"
#include "common/torch_status.h"
#include "torch/nn/functional/loss.h"

namespace pippy::stage {

absl::StatusOr<at::Tensor> ComputeLoss(LossKind kind, torch::jit::Module& module, const c10::IValue& output,
                                       const c10::IValue& target) {
  if (kind != LOSS_MSE && kind != LOSS_CROSS_ENTROPY && kind != LOSS_MODEL) {
    return absl::InvalidArgumentError("no loss given: use mse, cross_entropy or model");
  }
  if (kind == LOSS_MODEL) {
    if (!module.find_method("loss")) {
      return absl::InvalidArgumentError(
          "--loss model: the model has no loss(self, output, target) method; add one with @torch.jit.export "
          "or use mse / cross_entropy");
    }
    return TorchCall("the model's loss()", [&]() -> absl::StatusOr<at::Tensor> {
      c10::IValue v = module.get_method("loss")({output, target});
      if (!v.isTensor()) return absl::InvalidArgumentError("the model's loss() must return a tensor");
      return v.toTensor();
    });
  }
  if (!output.isTensor() || !target.isTensor()) {
    return absl::InvalidArgumentError(
        "mse and cross_entropy need a tensor output and a tensor target; the model returns a tuple: "
        "use --loss model with a loss(self, output, target) method");
  }
  const at::Tensor& out = output.toTensor();
  const at::Tensor& tgt = target.toTensor();
  return TorchCall("computing the loss", [&]() -> absl::StatusOr<at::Tensor> {
    if (kind == LOSS_MSE) {
      if (out.sizes() != tgt.sizes()) {
        return absl::InvalidArgumentError(absl::StrCat("mse: output shape ", c10::str(out.sizes()),
                                                       " and target shape ", c10::str(tgt.sizes()), " differ"));
      }
      return torch::nn::functional::mse_loss(out, tgt.to(out.scalar_type()));
    }
    // cross_entropy: class scores in the last dim, integer targets of the other dims.
    if (out.numel() / out.size(-1) != tgt.numel()) {
      return absl::InvalidArgumentError(absl::StrCat("cross_entropy: output ", c10::str(out.sizes()),
                                                     " (classes in the last dim) does not fit target ",
                                                     c10::str(tgt.sizes())));
    }
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), tgt.reshape({-1}).to(at::kLong));
  });
}

absl::StatusOr<std::unique_ptr<torch::optim::Optimizer>> MakeOptimizer(const OptimizerOptions& o,
                                                                       std::vector<at::Tensor> params) {
  if (o.lr <= 0) return absl::InvalidArgumentError(absl::StrCat("learning rate must be > 0 (got ", o.lr, ")"));
  if (o.kind == OPTIMIZER_SGD) {
    return std::unique_ptr<torch::optim::Optimizer>(new torch::optim::SGD(
        params, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weight_decay)));
  }
  if (o.kind == OPTIMIZER_ADAM) {
    return std::unique_ptr<torch::optim::Optimizer>(new torch::optim::Adam(
        params,
        torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay)));
  }
  if (o.kind == OPTIMIZER_ADAMW) {
    return std::unique_ptr<torch::optim::Optimizer>(new torch::optim::AdamW(
        params,
        torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay)));
  }
  return absl::InvalidArgumentError("no optimizer given: use sgd, adam or adamw");
}

}  // namespace pippy::stage
