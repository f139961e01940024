#include "pipeline/stage/training.h"

#include "absl/strings/str_cat.h"
#include "common/torch_status.h"
#include "pipeline/transport/transport.h"
#include "ATen/autocast_mode.h"
#include "torch/nn/functional/loss.h"
#include "torch/version.h"

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

// LibTorch 2.4 named autocast's switches by device type; earlier ones had one pair of
// functions per device.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define PIPPY_AUTOCAST_BY_DEVICE_TYPE 1
#endif

namespace {

bool AutocastEnabled(c10::DeviceType device) {
#ifdef PIPPY_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

c10::ScalarType AutocastDtype(c10::DeviceType device) {
#ifdef PIPPY_AUTOCAST_BY_DEVICE_TYPE
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::DeviceType::CUDA ? at::autocast::get_autocast_gpu_dtype()
                                         : at::autocast::get_autocast_cpu_dtype();
#endif
}

void SetAutocast(c10::DeviceType device, bool enabled, c10::ScalarType dtype) {
#ifdef PIPPY_AUTOCAST_BY_DEVICE_TYPE
  at::autocast::set_autocast_enabled(device, enabled);
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(enabled);
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_cpu_enabled(enabled);
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
#endif
}

}  // namespace

AutocastScope::AutocastScope(c10::DeviceType device, c10::ScalarType dtype) {
  if (dtype == c10::ScalarType::Undefined) return;
  if (device != c10::DeviceType::CPU && device != c10::DeviceType::CUDA) return;
  active_ = true;
  device_ = device;
  was_enabled_ = AutocastEnabled(device);
  was_dtype_ = AutocastDtype(device);
  SetAutocast(device, true, dtype);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  // As torch.autocast's __exit__: the cached casts of the weights go with the outermost scope.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  SetAutocast(device_, was_enabled_, was_dtype_);
}

c10::IValue ToFloat32(const c10::IValue& value) {
  return transport::MapTensors(value, [](const at::Tensor& t) {
    const bool reduced = at::isFloatingType(t.scalar_type()) && t.scalar_type() != at::kFloat &&
                         t.scalar_type() != at::kDouble;
    return reduced ? t.to(at::kFloat) : t;
  });
}

void UseExactFloat32() {
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setAllowTF32CuDNN(false);
}

}  // namespace pippy::stage
