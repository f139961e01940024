// A Pipe on disk: what `pippyctl split --out DIR` writes and pippy-rank reads.
#ifndef PIPPY_PIPELINE_PARTITION_PIPE_IO_H_
#define PIPPY_PIPELINE_PARTITION_PIPE_IO_H_

#include <string>

#include "absl/status/status.h"
#include "pipeline/partition/partition.h"

namespace pippy::partition {

// Writes stage_<N>.pt for every stage and plan.json into `dir` (created if needed).
// Errors: PERMISSION_DENIED naming what cannot be written.
absl::Status WritePipe(const Pipe& pipe, const std::string& dir);

// The plan as JSON (protobuf's JSON mapping, field names as in plan.proto).
std::string PlanToJson(const PipelinePlan& plan);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_PIPE_IO_H_
