// What an automatic split balances: a cost per top-level op of the inlined forward.
//   params  parameter bytes an op reads first (each tensor counted once)
//   flops   estimated FLOPs with the shapes of an example input: 2 x multiply-adds of
//           matrix products and convolutions, ~5 per element for normalisations and
//           softmax, 1 per output element otherwise
// (time, measured on stages, is in partition.cc: it needs built stages.)
#ifndef PIPPY_PIPELINE_PARTITION_COST_MODEL_H_
#define PIPPY_PIPELINE_PARTITION_COST_MODEL_H_

#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/partition/model_graph.h"
#include "torch/script.h"

namespace pippy::partition {

std::vector<double> ParamCosts(const ModelGraph& mg);

// Runs the model once on `inputs` (buffers restored) to see every op's shapes.
// Errors: INVALID_ARGUMENT when the input does not fit the model.
absl::StatusOr<std::vector<double>> FlopCosts(const ModelGraph& mg, const std::vector<c10::IValue>& inputs);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_COST_MODEL_H_
