// The deciding half of the automatic plan (docs/autoplan.md): every candidate plan —
// schedule x micro-batches x stages, as far as the spec leaves them to pippy
// (JobSpec.auto_plan) — simulated (schedule/simulator.h) with per-stage costs summed
// from a measured ModelProfile (profile.h), and ranked by predicted throughput.
//
// The prediction of one candidate, with b = batch / (replicas x micro-batches):
//   cuts        the profile's spans split into the stages so that the slowest stage's
//               F + I + W at b is least (exact, by dynamic programming)
//   compute     each stage's F, I, W at b, plus kActionOverheadUs per action; a rank on
//               a host whose chosen workers' threads exceed its cores runs slower by
//               that ratio (ranks are taken to go to the workers in the order given)
//   transfer    each RECV: the link's latency + the cut's bytes / its bandwidth
//   step        the simulated makespan + the slowest rank's optimizer step (parameter
//               MiB x the measured us/MiB) + kStepOverheadUs (+ the replicas' all-reduce)
//   memory      per rank: parameters, gradients and optimizer state, buffers, and the
//               activations of the micro-batches the simulation holds at once; a
//               candidate over its worker's free memory is refused
// The winner is the fastest that is not refused, except that a simpler one (fewer
// workers, then fewer micro-batches) within kSimplerWithin of it is preferred.
//
// The spec's mode must be set (job::CheckSpec sets it from the schedule).
// No LibTorch: the coordinator's child, pippyctl plan and the unit tests call it.
#ifndef PIPPY_PIPELINE_AUTOPLAN_CHOOSER_H_
#define PIPPY_PIPELINE_AUTOPLAN_CHOOSER_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

namespace pippy::autoplan {

inline constexpr double kActionOverheadUs = 60;    // per compute action: dispatch, slicing
inline constexpr double kStepOverheadUs = 1500;    // per step: reports, the step's end
inline constexpr double kSimplerWithin = 0.02;     // a simpler plan this close wins

// The link between two workers where none was measured: UCX over loopback on this
// project's CI machine (bench/ucx_bench), 60 us per message and 2 GB/s.
LinkModel DefaultLink();

// One candidate's prediction. `workers`: the workers its ranks would take, in order
// (replica-major: replica q's rank r on workers[q * ranks + r]); fewer than it needs is
// INVALID_ARGUMENT, as is a micro-batch size the profile did not measure or a schedule
// whose preconditions do not hold (the message says which).
absl::StatusOr<PlanCandidate> Predict(const JobSpec& spec, const ModelProfile& profile, ScheduleKind kind,
                                      int microbatches, int ranks, int stages_per_worker,
                                      const std::vector<WorkerCapacity>& workers, const LinkModel& link);

// Every candidate the spec leaves open, ranked (PlanChoice.candidates: the chosen
// first, refused ones last), with why the first won. spec.auto_plan.workers are the
// workers to choose among. The spec's fixed values (schedule.kind, microbatches,
// split.stages) are kept where auto_plan does not choose them.
// Errors: INVALID_ARGUMENT when no candidate can run (naming why the best could not),
// or when --stages auto has no workers to choose among.
absl::StatusOr<PlanChoice> ChoosePlan(const JobSpec& spec, const ModelProfile& profile);

// The spec with the chosen candidate's values written in (schedule.kind, microbatches,
// stages_per_worker, split.stages; the cuts are the candidate's).
void Apply(const PlanCandidate& chosen, JobSpec* spec);

// Where costs could not be measured: the defaults auto fields take (1f1b, or the
// inference schedule; 4 micro-batches or the largest count up to 4 that divides the
// batch and is at least the ranks; as many stages as workers, at least 1), with
// `why` recorded as PlanChoice.fallback.
PlanChoice Fallback(const JobSpec& spec, const std::string& why);

// The ranking as a table, for pippyctl (--explain, plan): rank, schedule, micro-batches
// x size, stages / workers, predicted samples/s, bubble, peak memory per rank, refused.
std::string RenderChoice(const PlanChoice& choice, int max_rows = 20);

// The profile as a table (pippyctl split --profile): per span its modules, parameters,
// and F / I / W at each size.
std::string RenderProfile(const ModelProfile& profile);

}  // namespace pippy::autoplan

#endif  // PIPPY_PIPELINE_AUTOPLAN_CHOOSER_H_
