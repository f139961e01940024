// What the workers measured against what the chooser predicted (docs/autoplan.md): a
// job whose plan was chosen compares each compute action its ranks ran in a few steps
// with the candidate's per-stage F, I, W; the coordinator keeps the ratios, by ranks per
// host, and gives them to later auto jobs (AutoPlanSpec.calibration), whose chooser
// scales the profile's costs by them. No LibTorch.
#ifndef PIPPY_PIPELINE_AUTOPLAN_CALIBRATION_H_
#define PIPPY_PIPELINE_AUTOPLAN_CALIBRATION_H_

#include <optional>
#include <string>
#include <vector>

#include "google/protobuf/repeated_field.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

namespace pippy::autoplan {

// One compute action a rank timed: its name as the trace writes it ("1F3": stage 1,
// forward, micro-batch 3; B, I, W alike) and how long it took.
struct TimedCompute {
  std::string name;
  double micros = 0;
};

// A job's measurements against its chosen candidate.
class CalibrationSample {
 public:
  explicit CalibrationSample(const PlanCandidate& chosen) : chosen_(chosen) {}
  // One rank's compute actions of one step (actions it cannot parse are skipped).
  void Add(const std::vector<TimedCompute>& actions);
  // measured / predicted per kind, for a job with `ranks_on_host`; nullopt when nothing
  // was measured (or the candidate has no per-stage costs).
  std::optional<ActionFactors> Factors(int ranks_on_host) const;

 private:
  PlanCandidate chosen_;
  double measured_[4] = {0, 0, 0, 0};   // F, B, I, W
  double predicted_[4] = {0, 0, 0, 0};
};

// Folds a job's factors into `table` (one entry per ranks_on_host): the new job weighs
// 1 / (n + 1) against the n (at most 4) jobs before it.
void Merge(const ActionFactors& learned, std::vector<ActionFactors>* table);

// The factors for ranks sharing a host `together` at a time: the entry with the most
// ranks_on_host not over `together` (a host with more ranks than ever measured uses
// the most measured); nullptr when none applies (one rank alone is not scaled by what
// ranks sharing a host measured).
const ActionFactors* FactorsFor(const google::protobuf::RepeatedPtrField<ActionFactors>& table, int together);

// "F x1.31, B x1.12" for the kinds learned.
std::string DescribeFactors(const ActionFactors& f);

}  // namespace pippy::autoplan

#endif  // PIPPY_PIPELINE_AUTOPLAN_CALIBRATION_H_
