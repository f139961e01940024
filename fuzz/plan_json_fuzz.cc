// Fuzz target: plan.json (pippyctl split --out; read by pippy-rank and checked by every
// worker that is sent a plan). Any text is refused by the JSON parser or by
// job::CheckPlan, or is a plan whose stage graph, schedule, per-rank slices and data
// needs can be computed without reading out of bounds.
#include <cstdint>
#include <string>

#include "google/protobuf/util/json_util.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pippy::PipelinePlan plan;
  const std::string json(reinterpret_cast<const char*>(data), size);
  if (!google::protobuf::util::JsonStringToMessage(json, &plan).ok()) return 0;
  if (!pippy::job::CheckPlan(plan).ok()) return 0;
  (void)pippy::job::StageGraphOf(plan);
  for (pippy::ScheduleKind kind : {pippy::SCHEDULE_GPIPE, pippy::SCHEDULE_1F1B, pippy::SCHEDULE_INFERENCE}) {
    pippy::JobSpec spec;
    spec.mutable_schedule()->set_kind(kind);
    spec.mutable_schedule()->set_microbatches(2);
    spec.mutable_schedule()->set_stages_per_worker(1);
    spec.set_steps(1);
    spec.set_batch_size(2);
    spec.mutable_optimizer()->set_lr(0.1);
    spec.mutable_split()->set_stages(plan.stages_size());
    if (!pippy::job::CheckSpec(&spec).ok()) continue;
    auto sched = pippy::job::ScheduleFor(spec, plan);
    if (!sched.ok()) continue;
    for (int r = 0; r < sched->num_ranks; ++r) {
      (void)pippy::job::PlanSliceFor(plan, *sched, r);
      (void)pippy::job::DataNeedsOf(spec, plan, *sched, r);
    }
  }
  return 0;
}
