// Synthetic data for benchmarks: a job's data file made from a spec instead of sent.
//
//   "inputs=float32[256,1024];targets=float32[256,1024];seed=0"
//   "inputs=int64[64,16]@64;targets=int64[64,16]@64"      (integers in [0, 64))
//
// Several inputs: "inputs=float32[8,8],float32[8,4]" (forward()'s arguments in order).
#ifndef PIPPY_PIPELINE_STAGE_SYNTHETIC_DATA_H_
#define PIPPY_PIPELINE_STAGE_SYNTHETIC_DATA_H_

#include <string>

#include "absl/status/statusor.h"

namespace pippy::stage {

// Returns the bytes of torch.save({"inputs": ..., "targets": ...}) for `spec`.
// Errors: INVALID_ARGUMENT naming the part of the spec that does not parse.
absl::StatusOr<std::string> MakeSyntheticData(const std::string& spec);

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_SYNTHETIC_DATA_H_
