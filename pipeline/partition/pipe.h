// A split model: the plan and the standalone stage modules it describes. What
// SplitModel (partition.h) returns and plan_builder fills; its own header so that the
// builder does not include the API that calls it.
#ifndef PIPPY_PIPELINE_PARTITION_PIPE_H_
#define PIPPY_PIPELINE_PARTITION_PIPE_H_

#include <vector>

#include "proto/plan.pb.h"
#include "torch/script.h"

namespace pippy::partition {

struct Pipe {
  PipelinePlan plan;
  std::vector<torch::jit::Module> stages;  // standalone; see stage_builder.h
};

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_PIPE_H_
