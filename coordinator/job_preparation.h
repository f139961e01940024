// What the coordinator does with a submission before queueing it, once: check the
// spec, load the model, check the data against it, split the model, make and validate
// the schedule, and write each stage's TorchScript and each rank's share of the data
// into the submission's folder. Nothing later loads the whole model again until the
// trained stages are put back into it (partition::MergeStagesIntoModel).
//
// Memory: one copy of the model (the stages share its tensors), plus one micro-batch
// of activations for the example forward pass, plus the data.
#ifndef PIPPY_COORDINATOR_JOB_PREPARATION_H_
#define PIPPY_COORDINATOR_JOB_PREPARATION_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

namespace pippy::coordinator {

struct PreparedJob {
  JobSpec spec;                 // checked, defaults filled in
  PipelinePlan plan;
  int ranks = 0;                // workers the job needs
  std::vector<int> stage_to_rank;
  std::vector<int64_t> stage_file_bytes;  // by stage
  std::vector<int64_t> share_bytes;       // by rank
};

// `dir` holds model.pt and (unless the spec asks for synthetic data) data.pt; the
// stage files and shares are written beside them (see artifact_store.h for names).
// Errors: INVALID_ARGUMENT whose message starts with the field (spec fields, "model:",
// "data:", "split:", "schedule:"); UNAVAILABLE when the folder cannot be written.
absl::StatusOr<PreparedJob> PrepareJob(const JobSpec& spec, const std::string& dir);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_JOB_PREPARATION_H_
