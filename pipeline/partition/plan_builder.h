// From cut positions to a Pipe: the stage definitions (what each stage takes, gives
// and to whom), the standalone stage modules, and the plan that describes them (inputs,
// outputs, consumers, parameters, tied groups, split points); then, with an example
// input, the shapes and bytes of everything that flows (RunExample).
#ifndef PIPPY_PIPELINE_PARTITION_PLAN_BUILDER_H_
#define PIPPY_PIPELINE_PARTITION_PLAN_BUILDER_H_

#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/partition/model_graph.h"
#include "pipeline/partition/pipe.h"

namespace pippy::partition {

// Builds all stages for `cuts` (op positions, ascending) and fills pipe->plan's
// stages, tied groups and split points (not costs or example shapes).
// Errors: INTERNAL when a stage cannot be built (a partitioner bug).
absl::Status BuildPipe(const ModelGraph& mg, const std::vector<int>& cuts, bool share_tensors, Pipe* pipe);

// Runs the stages in sequence on `inputs` (no gradients, buffers restored) `repeats`
// times and records the shapes and bytes of every input, output and message in the
// plan. Returns each stage's fastest forward time (microseconds).
// Errors: INVALID_ARGUMENT when the input does not fit.
// Around each stage's forward: `before(s, stage)` first (its buffers are read and it
// runs only after), `after(s, stage)` once it ran and its buffers are back; an error
// of either stops the run and is returned as it is. For stages whose tensors hold
// their data only when asked (torchio/model_records.h).
struct StageHooks {
  std::function<absl::Status(int, const torch::jit::Module&)> before, after;
};
// `output` (if given) gets the last stage's output of the last repeat.
absl::StatusOr<std::vector<double>> RunExample(Pipe* pipe, const std::vector<c10::IValue>& inputs, int repeats,
                                               const StageHooks& hooks = {}, c10::IValue* output = nullptr);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_PLAN_BUILDER_H_
