// The inverse of the split: trained stage modules written back into the original
// model, giving ONE TorchScript file with the original module structure.
#ifndef PIPPY_PIPELINE_PARTITION_MERGE_H_
#define PIPPY_PIPELINE_PARTITION_MERGE_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"

namespace pippy::partition {

// `model_bytes`: the submitted model; `stages`: stage index -> TorchScript archive of
// the trained stage. Every parameter and buffer of every stage is copied into the
// model under its name (tied weights: the same tensor, written once per name).
// Returns the merged model's archive. Errors: INVALID_ARGUMENT naming a stage
// parameter the model does not have or whose shape differs.
absl::StatusOr<std::string> MergeStagesIntoModel(const std::string& model_bytes,
                                                 const std::map<int, std::string>& stages);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_MERGE_H_
