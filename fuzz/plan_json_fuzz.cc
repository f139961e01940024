// Fuzz target: plan.json (pippyctl split --out; read by pippy-rank and checked by every
// worker that is sent a plan). Any text is refused by the JSON parser or by
// job::CheckPlan, or is a plan whose stage graph and layout (schedule, per-rank slices,
// data needs) can be made without reading out of bounds, and every rank's piece of the
// layout passes RankSchedule's checks.
#include <cstdint>
#include <string>

#include "google/protobuf/util/json_util.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/layout.h"
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
    auto layout = pippy::job::MakeLayout(spec, plan);
    if (!layout.ok()) continue;
    for (int r = 0; r < layout->ranks_size(); ++r) {
      (void)pippy::job::PlanSlice(plan, layout->ranks(r), r);
      if (!pippy::job::RankSchedule(layout->ranks(r), r, plan).ok()) __builtin_trap();  // what was made must run
    }
  }
  return 0;
}
