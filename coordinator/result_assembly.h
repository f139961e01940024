// A finished job's result, put together from what its ranks sent back: a training
// job's trained stages (result_<s>.pt) merged into the submitted model with its
// original module structure (partition::MergeStagesIntoModel), or an inference job's
// outputs as the last rank sent them. The caller publishes the file (FetchModel).
//
// The merge loads the submitted model and the archives the workers sent: it runs in a
// child process (`BINARY --merge DIR STAGES`, child_process.h) with a deadline and the
// preparation's heap cap, so the coordinator's own process never holds the model and a
// corrupt archive from a worker fails that job only. Memory (the child's): the model
// plus its largest stage.
#ifndef PIPPY_COORDINATOR_RESULT_ASSEMBLY_H_
#define PIPPY_COORDINATOR_RESULT_ASSEMBLY_H_

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/artifact_store.h"
#include "proto/plan.pb.h"

namespace pippy::coordinator {

struct AssembleOptions {
  std::string merger;  // a pippy-coordinator binary; empty: in this process (unit tests only)
  absl::Duration timeout = absl::Minutes(5);
  std::function<bool()> cancelled;  // polled while the child runs: true stops it
  // The job's plan. With tensor parallelism (plan.tensor_parallel.size T > 1) the stage
  // files are its shards, result_<s * T + t>.pt: each stage's T shards are gathered into
  // whole tensors (tp::GatherShards, replicated ones checked alike) before the merge.
  PipelinePlan plan;
};

// The path of the assembled result of job `job_id` (with `stages` stage files).
// Errors: DATA_LOSS when a rank finished without sending all of its results; the
// merge's errors (INVALID_ARGUMENT for a stage file that does not fit the model, or a
// child that crashed or ran out of time); UNAVAILABLE when the child cannot be started
// or was stopped.
absl::StatusOr<std::string> AssembleResult(ArtifactStore& files, const std::string& job_id, bool inference,
                                           int stages, const AssembleOptions& options = {});

// Merges DIR/result_<s>.pt into DIR/model.pt as AssembleResult merges a job's results
// (a checkpoint's stages, staged by ArtifactStore::StageCheckpointForMerge); returns
// DIR/assembled.pt. Errors: as AssembleResult's merge.
absl::StatusOr<std::string> MergeStagesIn(const std::string& dir, int stages, const AssembleOptions& options = {});

// The child's side: `BINARY --merge DIR STAGES` merges DIR/result_<s>.pt into DIR/model.pt,
// writing DIR/assembled.pt. Exit 0, or the error reported and exit 3.
inline constexpr char kMergeFlag[] = "--merge";
int RunMergeChild(const std::string& dir, int stages);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_RESULT_ASSEMBLY_H_
