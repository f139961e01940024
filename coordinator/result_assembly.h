// A finished job's result, put together from what its ranks sent back: a training
// job's trained stages (result_<s>.pt) merged into the submitted model with its
// original module structure (partition::MergeStagesIntoModel), or an inference job's
// outputs as the last rank sent them. The caller publishes the file (FetchModel).
//
// Memory: a training job's merge loads the submitted model (the coordinator's one
// model slot must be held) plus one stage at a time.
#ifndef PIPPY_COORDINATOR_RESULT_ASSEMBLY_H_
#define PIPPY_COORDINATOR_RESULT_ASSEMBLY_H_

#include <string>

#include "absl/status/statusor.h"
#include "coordinator/artifact_store.h"

namespace pippy::coordinator {

// The path of the assembled result of job `job_id` (with `stages` stages).
// Errors: DATA_LOSS when a rank finished without sending all of its results; the
// merge's errors.
absl::StatusOr<std::string> AssembleResult(ArtifactStore& files, const std::string& job_id, bool inference,
                                           int stages);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_RESULT_ASSEMBLY_H_
