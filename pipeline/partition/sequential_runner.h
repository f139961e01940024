// Runs the stages of a Pipe one after another in this process, forward and backward,
// exactly as pipeline ranks would exchange values: every received floating-point
// activation is detached and requires grad, the gradient sent back for a value is the
// sum over its consumers, and gradients of tied parameters are summed across the
// stages that hold them. It is the reference the stage runtime is compared with and
// the executable form of a plan for tests and `pippyctl split --check`.
//
// Thread safety: not thread-safe; one Forward/Backward at a time.
#ifndef PIPPY_PIPELINE_PARTITION_SEQUENTIAL_RUNNER_H_
#define PIPPY_PIPELINE_PARTITION_SEQUENTIAL_RUNNER_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/partition/partition.h"
#include "torch/script.h"

namespace pippy::partition {

class SequentialRunner {
 public:
  // `pipe` must outlive the runner.
  explicit SequentialRunner(const Pipe* pipe) : pipe_(pipe) {}

  // Runs every stage; keeps the autograd state for Backward(). Returns the model output.
  absl::StatusOr<c10::IValue> Forward(const std::vector<c10::IValue>& inputs);

  // Backpropagates `loss` (a scalar computed from Forward()'s output) through all
  // stages, last to first. REQUIRES: Forward() was called.
  absl::Status Backward(const at::Tensor& loss);

  // Gradient of every parameter, by every name it has in the original model (tied
  // weights: the sum over stages, under each alias). Parameters without a gradient
  // are absent.
  std::map<std::string, at::Tensor> Gradients() const;

  // Every parameter and buffer of every stage by stage name (tied copies: the first).
  std::map<std::string, at::Tensor> NamedTensors() const;

 private:
  const Pipe* pipe_;
  std::vector<std::vector<c10::IValue>> stage_inputs_;   // as given to forward (leaves)
  std::vector<std::vector<c10::IValue>> stage_outputs_;  // non-final: tuple elements
  c10::IValue output_;
};

// Every tensor inside an IValue (tensor, tuple, list), in order.
std::vector<at::Tensor> FlattenTensors(const c10::IValue& value);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_SEQUENTIAL_RUNNER_H_
