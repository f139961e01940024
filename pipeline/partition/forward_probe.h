// Forward passes run only to look at a model (to check that an input fits, to record
// shapes, to estimate costs): they change nothing in it. Buffers a forward updates
// (batch-norm statistics) are copied before and written back after — no copy of the
// parameters is needed.
#ifndef PIPPY_PIPELINE_PARTITION_FORWARD_PROBE_H_
#define PIPPY_PIPELINE_PARTITION_FORWARD_PROBE_H_

#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "torch/script.h"

namespace pippy::partition {

// The buffers of a module (batch-norm statistics and the like), copied at
// construction and written back at destruction: a forward pass run only to measure
// leaves the module as it was, without a copy of its parameters.
class BufferSnapshot {
 public:
  explicit BufferSnapshot(const torch::jit::Module& module) {
    for (const auto& b : module.named_buffers(/*recurse=*/true)) {
      if (b.value.defined()) saved_.emplace_back(b.value, b.value.clone());
    }
  }
  BufferSnapshot(BufferSnapshot&&) = default;
  BufferSnapshot& operator=(BufferSnapshot&&) = default;
  ~BufferSnapshot() {
    torch::NoGradGuard no_grad;
    for (auto& [live, copy] : saved_) {
      if (live.defined()) live.copy_(copy);
    }
  }

 private:
  std::vector<std::pair<at::Tensor, at::Tensor>> saved_;
};

// Runs `model`'s forward once on `inputs` without gradients and puts back what the
// run changed in its buffers. Errors: INVALID_ARGUMENT with LibTorch's message.
absl::StatusOr<c10::IValue> RunForwardOnce(const torch::jit::Module& model, const std::vector<c10::IValue>& inputs);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_FORWARD_PROBE_H_
