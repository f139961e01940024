// Pipeline schedules as per-rank action lists, like torch.distributed.pipelining's
// PipelineScheduleMulti: GPipe, 1F1B, Interleaved 1F1B, Looped BFS, Interleaved Zero
// Bubble (ZB1P), ZBV and forward-only, plus custom schedules read from torch's CSV.
//
// Placement: GPipe, 1F1B and forward-only put stage s on rank s. Interleaved 1F1B,
// Looped BFS and ZB1P hold V stages per rank in a loop (stage s on rank s mod R).
// ZBV holds 2 per rank in a V (rank r: stages r and 2R-1-r).
//
// Preconditions (violations are INVALID_ARGUMENT with the reason):
//   every schedule: ranks >= 1, micro-batches >= 1
//   1F1B, ZB1P, ZBV: micro-batches >= ranks
//   Interleaved 1F1B: micro-batches a multiple of ranks
//   GPipe, 1F1B, ZBV: stages per rank fixed (1, 1, 2)
#ifndef PIPPY_PIPELINE_SCHEDULE_SCHEDULE_H_
#define PIPPY_PIPELINE_SCHEDULE_SCHEDULE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/schedule/action.h"
#include "proto/job.pb.h"

namespace pippy::schedule {

// Which stages take which stages' outputs (a skip connection adds a non-adjacent
// edge). Chain(S): s -> s+1.
struct StageGraph {
  std::vector<std::vector<int>> consumers;

  static StageGraph Chain(int num_stages);
  int num_stages() const { return static_cast<int>(consumers.size()); }
  std::vector<int> Producers(int stage) const;
};

// The kinds are the job spec's ScheduleKind (proto/job.proto); their names, as users
// type them, are proto/names.h's (names::Parse<ScheduleKind>, names::Name).
// Stages per rank the kind uses by default (1, or 2 for interleaved kinds and ZBV).
int DefaultStagesPerRank(ScheduleKind kind);

struct Schedule {
  std::string name;
  int num_ranks = 0;
  int num_stages = 0;
  int num_microbatches = 0;
  bool forward_only = false;
  std::vector<int> stage_to_rank;
  std::vector<ActionList> ranks;  // one ordered list per rank
  StageGraph graph;

  std::vector<int> StagesOf(int rank) const;
  bool HasCommunication() const;
};

struct ScheduleOptions {
  int num_ranks = 1;
  int num_microbatches = 1;
  int stages_per_rank = 0;  // 0: the kind's default
  StageGraph graph;         // empty: a chain of ranks * stages_per_rank stages
};

// Which rank holds each stage (see the placement rules above).
std::vector<int> Placement(ScheduleKind kind, int num_ranks, int num_stages);

// Generates the compute actions and inserts SEND/RECV actions.
absl::StatusOr<Schedule> MakeSchedule(ScheduleKind kind, const ScheduleOptions& options);

// Adds SEND_F/RECV_F/SEND_B/RECV_B around compute actions whose data crosses ranks:
// RECV right before the compute action that needs it, SEND right after the one that
// makes it. REQUIRES: `schedule` has no communication actions yet.
void InsertCommunication(Schedule* schedule);

// torch's CSV format: one row per rank, one action per cell ("0F3"; "" for none).
std::string ToCsv(const Schedule& schedule);
// Reads a CSV schedule. Placement is inferred from which row holds each stage's
// compute actions; a compute-only schedule gets its communication inserted. `graph`
// may be empty (chain). Errors: INVALID_ARGUMENT naming the row and cell.
absl::StatusOr<Schedule> FromCsv(const std::string& csv, const StageGraph& graph = {});

}  // namespace pippy::schedule

#endif  // PIPPY_PIPELINE_SCHEDULE_SCHEDULE_H_
