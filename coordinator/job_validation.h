// Checks a submitted job before it is queued: the spec's fields, the model, the split,
// the schedule and the data. Everything wrong is INVALID_ARGUMENT naming the field.
#ifndef PIPPY_COORDINATOR_JOB_VALIDATION_H_
#define PIPPY_COORDINATOR_JOB_VALIDATION_H_

#include <string>

#include "absl/status/statusor.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

struct ValidatedJob {
  JobSpec spec;       // with defaults filled in
  PipelinePlan plan;
  int ranks = 0;      // workers the job needs
};

absl::StatusOr<ValidatedJob> ValidateJob(const JobSpec& spec, const std::string& model, const std::string& data);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_JOB_VALIDATION_H_
