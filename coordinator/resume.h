// What a submission with spec.resume_from (pippyctl submit --resume-from JOB) needs of
// the job it resumes: a training job, the submitter's own, with a checkpoint on disk
// (JobRun keeps a training job's last one once it ended), whose stages have the same
// parameters (names and shapes) on as many ranks and replicas with the same stages per
// rank, the same optimizer, and fewer steps done than the new job's steps (which count
// the whole run). The checkpoint's files are then linked into the new job's folder as
// its own checkpoint (ArtifactStore::LinkCheckpoint) and the job starts there as a
// restarted one does (JobRun::Resumed): parameters, optimizer state, random
// generators; the learning-rate schedule and the sampler are functions of the step.
#ifndef PIPPY_COORDINATOR_RESUME_H_
#define PIPPY_COORDINATOR_RESUME_H_

#include <string>

#include "absl/status/status.h"
#include "proto/coordinator.pb.h"
#include "proto/plan.pb.h"

namespace pippy::coordinator {

// `source` (with its layout) against the prepared submission (`spec`, `plan`, `layout`)
// of `user` ("" without auth). Errors: FAILED_PRECONDITION when the source is not a
// training job or has no checkpoint; PERMISSION_DENIED for another user's job;
// INVALID_ARGUMENT starting "resume_from:" naming what differs (a stage's parameter,
// ranks, replicas, the optimizer, steps).
absl::Status CheckResume(const Job& source, const JobLayout& source_layout, const std::string& user,
                         const JobSpec& spec, const PipelinePlan& plan, const JobLayout& layout);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_RESUME_H_
