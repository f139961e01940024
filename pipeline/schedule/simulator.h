// Validates and simulates a schedule before anything runs.
//
// Validate() checks the action lists statically: every stage's actions on the rank
// that holds it, every (stage, micro-batch) forwarded once and backpropagated once
// (B, or I and W), every SEND with its RECV and every cross-rank input with a RECV
// before the compute that needs it. Simulate() then executes the lists against each
// other with per-action costs — SEND posts without blocking, RECV waits for its
// sends — and reports a deadlock with the rank x step grid, the first stuck action
// of each rank marked; otherwise the makespan, bubble fraction per rank and the peak
// number of micro-batches holding activations.
#ifndef PIPPY_PIPELINE_SCHEDULE_SIMULATOR_H_
#define PIPPY_PIPELINE_SCHEDULE_SIMULATOR_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/schedule/schedule.h"

namespace pippy::schedule {

// Per-action costs. B (full backward) costs backward_input + backward_weight; the Zero
// Bubble paper's F=B=W means forward = backward_input = backward_weight.
struct Costs {
  double forward = 1.0;
  double backward_input = 1.0;
  double backward_weight = 1.0;
  double communication = 0.0;  // latency added to each RECV
  // Per stage, where a stage's costs differ (a measured cost model): empty, or one value
  // per stage replacing the scalar above for that stage's actions. recv_forward[s] is
  // added to s's RECV_F, recv_backward[s] to its RECV_B (a cut's bytes over the link).
  std::vector<double> stage_forward, stage_backward_input, stage_backward_weight;
  std::vector<double> stage_recv_forward, stage_recv_backward;

  double Forward(int stage) const { return Of(stage_forward, stage, forward); }
  double BackwardInput(int stage) const { return Of(stage_backward_input, stage, backward_input); }
  double BackwardWeight(int stage) const { return Of(stage_backward_weight, stage, backward_weight); }
  double RecvForward(int stage) const { return Of(stage_recv_forward, stage, communication); }
  double RecvBackward(int stage) const { return Of(stage_recv_backward, stage, communication); }

 private:
  static double Of(const std::vector<double>& v, int stage, double otherwise) {
    return stage >= 0 && static_cast<size_t>(stage) < v.size() ? v[static_cast<size_t>(stage)] : otherwise;
  }
};

// Parses "F,B,W" (e.g. "1,1,1"; B is the input-gradient part, W the weight part).
absl::StatusOr<Costs> ParseCosts(const std::string& text);

struct TimedAction {
  Action action;
  double start = 0;
  double end = 0;
};

struct SimulationResult {
  double makespan = 0;
  std::vector<double> busy;             // per rank: compute time
  std::vector<double> bubble_fraction;  // per rank: 1 - busy / makespan
  double mean_bubble_fraction = 0;
  std::vector<int> peak_live_per_rank;  // micro-batches holding activations, summed over the rank's stages
  std::vector<int> peak_live_per_stage;
  std::vector<std::vector<TimedAction>> timeline;  // per rank, compute and comm actions
};

// Errors: INVALID_ARGUMENT with what is wrong and the grid.
absl::Status Validate(const Schedule& schedule);

// Validate's checks of one rank's action list alone, for a rank that was sent only its
// own (the whole schedule was validated, and simulated, when the job's layout was
// made): every action on a stage it holds and in range, each of its stages forwarded
// and backpropagated once per micro-batch, and every SEND and RECV its stages' edges
// to other ranks need. Whether the ranks' lists fit together is not checked here.
// Errors: INVALID_ARGUMENT with what is wrong and the grid.
absl::Status ValidateRank(const Schedule& schedule, int rank);

// Validates, then simulates. Errors: INVALID_ARGUMENT (invalid or deadlocks).
absl::StatusOr<SimulationResult> Simulate(const Schedule& schedule, const Costs& costs = {});

// The rank x step grid of action names; `marks[r]` (if >= 0) is a step to mark as
// stuck with "*...*".
std::string RenderSteps(const Schedule& schedule, const std::vector<int>& marks = {});

// The timeline as text: one row per rank, one cell per time unit, idle as ".".
std::string RenderTimeline(const Schedule& schedule, const SimulationResult& result);

// The timeline as SVG: one row per rank, F/B/I/W as coloured blocks, idle visible.
std::string RenderSvg(const Schedule& schedule, const SimulationResult& result);

}  // namespace pippy::schedule

#endif  // PIPPY_PIPELINE_SCHEDULE_SIMULATOR_H_
