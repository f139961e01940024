// The traces of a job's last few complete steps: every rank's report of a step (its
// timed actions, breakdown and clock anchors) kept once all ranks have sent theirs,
// and put together as GetTrace answers (StepTrace: one RankTrace per rank with its
// worker's name and stages).
//
// Thread safety: none of its own (its JobRun's owner serialises calls).
#ifndef PIPPY_COORDINATOR_STEP_TRACE_H_
#define PIPPY_COORDINATOR_STEP_TRACE_H_

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

class StepTraces {
 public:
  static constexpr int kKept = 4;  // steps held per job

  // Step `step` is complete: its reports by global rank. The oldest beyond kKept go.
  void Add(int step, std::map<int, StepReport> reports);

  // What a trace names beside the reports.
  struct Names {
    std::function<std::string(int global_rank)> worker;       // the rank's worker's name
    std::function<std::vector<int>(int global_rank)> stages;  // the stages it holds
  };
  // Step `step` (-1: the last one held) of job `job_id`. `ran_no_step`: the job ended
  // without completing one (said in the error).
  // Errors: NOT_FOUND for a step not (or no longer) held, naming the ones that are.
  absl::StatusOr<StepTrace> Get(const std::string& job_id, int step, bool ran_no_step, const Names& names) const;

 private:
  std::map<int, std::map<int, StepReport>> steps_;  // step -> global rank -> report
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_STEP_TRACE_H_
