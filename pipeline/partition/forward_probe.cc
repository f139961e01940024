#include "pipeline/partition/forward_probe.h"

#include "common/torch_status.h"

namespace pippy::partition {

absl::StatusOr<c10::IValue> RunForwardOnce(const torch::jit::Module& model, const std::vector<c10::IValue>& inputs) {
  BufferSnapshot restore(model);
  return TorchCall("forward", [&] {
    torch::NoGradGuard no_grad;
    torch::jit::Module m = model;
    return m.forward(inputs);
  });
}

}  // namespace pippy::partition
