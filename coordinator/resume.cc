#include "coordinator/resume.h"

#include <algorithm>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/layout.h"
#include "proto/job_state.h"

namespace pippy::coordinator {
namespace {

absl::Status Differs(const std::string& id, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("resume_from: ", id, "'s checkpoint does not fit this job: ", what));
}

std::string Shape(const ParameterInfo& p) { return absl::StrCat("[", absl::StrJoin(p.shape(), ", "), "]"); }

}  // namespace

absl::Status CheckResume(const Job& source, const JobLayout& source_layout, const std::string& user,
                         const JobSpec& spec, const PipelinePlan& plan, const JobLayout& layout) {
  const std::string& id = source.job_id();
  if (!user.empty() && !source.user().empty() && user != source.user()) {
    return absl::PermissionDeniedError(
        absl::StrCat("resume_from: job ", id, " was submitted by ", source.user(), "; resume only your own jobs"));
  }
  if (source.spec().mode() != MODE_TRAIN || source.spec().has_serving()) {
    return absl::FailedPreconditionError(
        absl::StrCat("resume_from: job ", id, " is not a training job: only training jobs have checkpoints"));
  }
  const int step = source.checkpoint_step();
  if (step <= 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "resume_from: job ", id, " (", JobState_Name(source.state()), ", step ", source.step(),
        ") has no checkpoint: a job keeps one after every --checkpoint-every steps and, when it succeeds, after its "
        "last step (unless --checkpoint-every 0)"));
  }
  if (spec.mode() != MODE_TRAIN || spec.has_serving()) {
    return absl::InvalidArgumentError("resume_from: only a training job resumes from a checkpoint");
  }
  if (spec.steps() <= step) {
    return absl::InvalidArgumentError(absl::StrCat(
        "resume_from: ", id, "'s checkpoint is after step ", step, " and this job has ", spec.steps(),
        " steps: steps count the whole run (the resumed job runs the steps after ", step, "); give more than ", step));
  }
  if (source.spec().optimizer().kind() != spec.optimizer().kind()) {
    return Differs(id, absl::StrCat("its optimizer is ", job::OptimizerName(source.spec().optimizer().kind()),
                                    ", this job's ", job::OptimizerName(spec.optimizer().kind()),
                                    " (the optimizer state is kept; give the same --optimizer)"));
  }
  if (source.plan().stages_size() != plan.stages_size()) {
    return Differs(id, absl::StrCat("it has ", source.plan().stages_size(), " stages, this job ", plan.stages_size(),
                                    " (give the same --split-at or --stages)"));
  }
  for (int s = 0; s < plan.stages_size(); ++s) {
    std::map<std::string, const ParameterInfo*> before;
    for (const ParameterInfo& p : source.plan().stages(s).parameters()) before[p.name()] = &p;
    for (const ParameterInfo& p : plan.stages(s).parameters()) {
      auto it = before.find(p.name());
      if (it == before.end()) {
        return Differs(id, absl::StrCat("stage ", s, " has no '", p.name(), "' there (the model or the split differs)"));
      }
      if (Shape(*it->second) != Shape(p)) {
        return Differs(id, absl::StrCat("stage ", s, "'s '", p.name(), "' is ", Shape(*it->second), " there and ",
                                        Shape(p), " here"));
      }
      before.erase(it);
    }
    if (!before.empty()) {
      return Differs(id, absl::StrCat("stage ", s, " has '", before.begin()->first,
                                      "' there and not here (the model or the split differs)"));
    }
  }
  const int replicas_before = std::max(1, source.spec().replicas()), replicas = std::max(1, spec.replicas());
  if (replicas_before != replicas) {
    return Differs(id, absl::StrCat("it ran ", replicas_before, " replica(s), this job ", replicas,
                                    " (each rank's random generator is kept; give the same --replicas)"));
  }
  if (source_layout.ranks_size() != layout.ranks_size()) {
    return Differs(id, absl::StrCat("it ran on ", source_layout.ranks_size(), " ranks, this job on ",
                                    layout.ranks_size(), " (give the same schedule and stages per worker)"));
  }
  for (int r = 0; r < layout.ranks_size(); ++r) {
    const std::vector<int> before = job::StagesOf(source_layout.ranks(r), r), now = job::StagesOf(layout.ranks(r), r);
    if (before != now) {
      return Differs(id, absl::StrCat("rank ", r, " ran stages ", absl::StrJoin(before, ","), " there and ",
                                      absl::StrJoin(now, ","), " here (give the same schedule)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace pippy::coordinator
