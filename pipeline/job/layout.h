// A job's layout: what every rank runs and reads, computed once when the job is
// prepared (MakeLayout) and carried from there: stored with the job (a restarted
// coordinator reads it back), each rank sent its piece (RankLayout) in its assignment,
// and the rank runs that piece as it is (RankSchedule). Nothing after preparation makes
// a schedule again.
//
//   JobLayout   per rank (within a replica): the action list in torch's notation, the
//               placement of every stage, the model inputs it reads, whether it computes
//               the loss, its memory; the number of replicas; the stage edges between
//               ranks (their transports are chosen at placement: WithTransports).
//
// No LibTorch; messages are proto/plan.proto's.
#ifndef PIPPY_PIPELINE_JOB_LAYOUT_H_
#define PIPPY_PIPELINE_JOB_LAYOUT_H_

#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/schedule/schedule.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

namespace pippy::job {

// The job's layout: its schedule made and validated (ScheduleFor), each rank's piece.
// REQUIRES: CheckSpec(&spec) and CheckPlan(plan) passed.
// Errors: INVALID_ARGUMENT as RanksFor and ScheduleFor ("schedule: ...").
absl::StatusOr<JobLayout> MakeLayout(const JobSpec& spec, const PipelinePlan& plan);

// The schedule `rank` runs, from its piece: its own action list (the other ranks' lists
// are empty: a rank runs only its own), the placement, and the plan's stage graph. The
// piece is checked against the plan as anything received must be: the placement covers
// the plan's stages, every action parses, and the list passes schedule::ValidateRank
// (on the rank's stages, in range, each stage forwarded and backpropagated once per
// micro-batch, the SENDs and RECVs its edges need).
// Errors: INVALID_ARGUMENT naming the field and what is wrong.
absl::StatusOr<schedule::Schedule> RankSchedule(const RankLayout& piece, int rank, const PipelinePlan& plan);

// The stages `rank` holds, ascending, and every stage's rank, from a piece.
std::vector<int> StagesOf(const RankLayout& piece, int rank);
std::vector<int> StageToRank(const RankLayout& piece);

// The plan as a rank is sent it: every stage's inputs, outputs and consumers, the
// tied-weight groups, and parameter lists only for the rank's own stages.
PipelinePlan PlanSlice(const PipelinePlan& plan, const RankLayout& piece, int rank);

// The edges (producer stage -> consumer stage) between different ranks, in stage order,
// without their transport. REQUIRES: CheckPlan passed; stage_to_rank covers the plan.
std::vector<StageEdge> EdgesBetweenRanks(const PipelinePlan& plan, const std::vector<int>& stage_to_rank);

// The layout's edges with the transport that carries each (job_plan.h's TransportFor)
// for the placement `places` (by rank, replica 0's: the replicas are placed alike).
// REQUIRES: places covers the layout's ranks.
std::vector<StageEdge> WithTransports(const JobLayout& layout, const std::vector<RankPlace>& places,
                                      bool use_nccl = kJobsUseNccl);

}  // namespace pippy::job

#endif  // PIPPY_PIPELINE_JOB_LAYOUT_H_
