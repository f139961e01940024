#include "pipeline/job/job_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/schedule/simulator.h"

namespace pippy::job {

schedule::StageGraph StageGraphOf(const PipelinePlan& plan) {
  schedule::StageGraph g;
  g.consumers.resize(plan.stages_size());
  for (const StagePlan& sp : plan.stages()) {
    for (const StageInput& si : sp.inputs()) {
      if (si.source_case() != StageInput::kSourceStage) continue;
      auto& c = g.consumers[si.source_stage()];
      if (std::find(c.begin(), c.end(), sp.index()) == c.end()) c.push_back(sp.index());
    }
  }
  for (auto& c : g.consumers) std::sort(c.begin(), c.end());
  return g;
}

absl::StatusOr<int> RanksFor(const JobSpec& spec, const PipelinePlan& plan) {
  const int stages = plan.stages_size();
  const int per_worker = std::max(spec.schedule().stages_per_worker(), 1);
  if (stages % per_worker != 0) {
    return absl::InvalidArgumentError(absl::StrCat("schedule.stages_per_worker: ", stages,
                                                   " stages do not divide into ", per_worker, " per worker"));
  }
  return stages / per_worker;
}

absl::StatusOr<schedule::Schedule> ScheduleFor(const JobSpec& spec, const PipelinePlan& plan) {
  absl::StatusOr<int> ranks = RanksFor(spec, plan);
  if (!ranks.ok()) return ranks.status();
  schedule::ScheduleOptions opts;
  opts.num_ranks = *ranks;
  opts.num_microbatches = spec.schedule().microbatches();
  opts.stages_per_rank = spec.schedule().stages_per_worker();
  opts.graph = StageGraphOf(plan);
  auto sched = schedule::MakeSchedule(EngineSchedule(spec.schedule().kind()), opts);
  if (!sched.ok()) return absl::InvalidArgumentError(absl::StrCat("schedule: ", sched.status().message()));
  absl::Status valid = schedule::Validate(*sched);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("schedule: ", valid.message()));
  return sched;
}

DataNeeds DataNeedsOf(const JobSpec& spec, const PipelinePlan& plan, const schedule::Schedule& schedule, int rank) {
  DataNeeds needs;
  for (const StagePlan& sp : plan.stages()) {
    if (schedule.stage_to_rank[sp.index()] != rank) continue;
    for (const StageInput& si : sp.inputs()) {
      if (si.source_case() == StageInput::kModelInput &&
          std::find(needs.inputs.begin(), needs.inputs.end(), si.model_input()) == needs.inputs.end()) {
        needs.inputs.push_back(si.model_input());
      }
    }
    if (sp.is_last() && spec.mode() == MODE_TRAIN) needs.targets = true;
  }
  std::sort(needs.inputs.begin(), needs.inputs.end());
  return needs;
}

PipelinePlan PlanSliceFor(const PipelinePlan& plan, const schedule::Schedule& schedule, int rank) {
  PipelinePlan slice = plan;
  for (StagePlan& sp : *slice.mutable_stages()) {
    if (schedule.stage_to_rank[sp.index()] != rank) sp.clear_parameters();
  }
  return slice;
}

}  // namespace pippy::job
