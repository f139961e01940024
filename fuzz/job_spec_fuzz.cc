// Fuzz target: the job spec checks of SubmitJob. The input is a serialized JobSpec (what
// a client sends as the first message of SubmitJob); CheckSpec must refuse it or fill
// it in, and a checked spec must give, for a chain of stages like a split would make,
// a schedule, every rank's plan slice and data needs, or an error — never a crash, a
// hang or an allocation that the spec alone can make as large as it likes.
#include <algorithm>
#include <cstdint>
#include <string>

#include "google/protobuf/stubs/logging.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/layout.h"
#include "pipeline/job/job_spec.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

namespace {

// What partition::SplitModel makes for `n` stages in a chain: stage s reads stage
// s-1's output (stage 0 the model input).
pippy::PipelinePlan ChainPlan(int n) {
  pippy::PipelinePlan plan;
  plan.add_inputs()->set_name("x");
  for (int s = 0; s < n; ++s) {
    pippy::StagePlan* st = plan.add_stages();
    st->set_index(s);
    pippy::StageInput* in = st->add_inputs();
    in->set_name("x");
    if (s == 0) {
      in->set_model_input(0);
    } else {
      in->set_source_stage(s - 1);
      in->set_source_output(0);
    }
    pippy::StageOutput* out = st->add_outputs();
    out->set_name("y");
    if (s + 1 < n) out->add_consumers(s + 1);
    st->set_is_last(s + 1 == n);
  }
  plan.mutable_output()->set_name("y");
  return plan;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // invalid UTF-8 in a string field is refused, and logged
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pippy::JobSpec spec;
  if (!spec.ParseFromArray(data, static_cast<int>(size))) return 0;
  if (!pippy::job::CheckSpec(&spec).ok()) return 0;
  // A split never has more stages than the model has operations; 64 stands for that.
  int stages = spec.split().stages() > 0 ? spec.split().stages() : spec.split().split_at_size() + 1;
  stages = std::min(stages, 64);
  const pippy::PipelinePlan plan = ChainPlan(stages);
  if (!pippy::job::RanksFor(spec, plan).ok()) return 0;
  auto layout = pippy::job::MakeLayout(spec, plan);
  if (!layout.ok()) return 0;
  for (int r = 0; r < layout->ranks_size(); ++r) {
    (void)pippy::job::PlanSlice(plan, layout->ranks(r), r);
    if (!pippy::job::RankSchedule(layout->ranks(r), r, plan).ok()) __builtin_trap();  // what was made must run
  }
  (void)pippy::job::CheckpointAfter(spec, 1);
  return 0;
}
