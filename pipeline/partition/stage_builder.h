// Builds one pipeline stage as a standalone TorchScript module.
//
// The stage module mirrors the original module hierarchy for what the stage uses:
// a stage holding blocks.3 has a submodule `blocks`, with `3`, with its parameters, so
// that state_dict() names match the original model. forward(self, *inputs) runs the
// stage's ops; a non-final stage returns a tuple of its outputs, the final stage the
// model's own return value. Parameters are copies (each stage owns its tensors) unless
// the definition asks to share them with the model.
// A tensor used under several names (tied weights) appears once per stage, under the
// first of its names (in module order) that the stage reads.
#ifndef PIPPY_PIPELINE_PARTITION_STAGE_BUILDER_H_
#define PIPPY_PIPELINE_PARTITION_STAGE_BUILDER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/partition/model_graph.h"
#include "torch/script.h"

namespace pippy::partition {

struct StageDefinition {
  int index = 0;
  int begin = 0;  // first op
  int end = 0;    // one past the last op
  bool is_last = false;
  bool share_tensors = false;  // alias the model's parameters and buffers (see SplitOptions)
  std::vector<torch::jit::Value*> inputs;   // values of the model graph, in order
  std::vector<torch::jit::Value*> outputs;  // non-final stages only
};

struct BuiltStage {
  torch::jit::Module module;
  // Tensor attributes of the stage: (name in the stage, index into ModelGraph::tensors()).
  std::vector<std::pair<std::string, int>> tensors;
};

absl::StatusOr<BuiltStage> BuildStage(const ModelGraph& model_graph, const StageDefinition& stage);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_STAGE_BUILDER_H_
