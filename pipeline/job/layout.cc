#include "pipeline/job/layout.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/schedule/simulator.h"

namespace pippy::job {

absl::StatusOr<JobLayout> MakeLayout(const JobSpec& spec, const PipelinePlan& plan) {
  PIPPY_ASSIGN_OR_RETURN(schedule::Schedule sched, ScheduleFor(spec, plan));
  JobLayout layout;
  layout.set_replicas(std::max(1, spec.replicas()));
  layout.set_tensor_parallel(std::max(1, spec.tensor_parallel().size()));
  for (int r = 0; r < sched.num_ranks; ++r) {
    RankLayout* piece = layout.add_ranks();
    piece->set_num_ranks(sched.num_ranks);
    piece->set_microbatches(sched.num_microbatches);
    piece->set_forward_only(sched.forward_only);
    for (int rank : sched.stage_to_rank) piece->add_stage_to_rank(rank);
    for (const schedule::Action& a : sched.ranks[static_cast<size_t>(r)]) piece->add_actions(a.ToString());
    const DataNeeds needs = DataNeedsOf(spec, plan, sched, r);
    for (int i : needs.inputs) piece->add_model_inputs(i);
    piece->set_targets(needs.targets);
    piece->set_memory_bytes(RankMemoryBytes(spec, plan, sched.stage_to_rank, r));
  }
  for (StageEdge& e : EdgesBetweenRanks(plan, sched.stage_to_rank)) *layout.add_edges() = std::move(e);
  return layout;
}

namespace {

// A piece that does not fit its plan was not made by MakeLayout from that plan: most
// likely a coordinator and a worker of different versions.
absl::Status Bad(int rank, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("rank ", rank, "'s layout: ", what,
                                                 " (was this worker sent it by a coordinator of its own version?)"));
}

}  // namespace

absl::StatusOr<schedule::Schedule> RankSchedule(const RankLayout& piece, int rank, const PipelinePlan& plan) {
  const int stages = plan.stages_size();
  if (piece.num_ranks() < 1 || rank < 0 || rank >= piece.num_ranks()) {
    return Bad(rank, absl::StrCat("num_ranks is ", piece.num_ranks(), "; the rank must be one of them"));
  }
  if (piece.microbatches() < 1 || piece.microbatches() > kMaxMicrobatches) {
    return Bad(rank, absl::StrCat("microbatches is ", piece.microbatches(), "; 1 to ", kMaxMicrobatches));
  }
  if (piece.stage_to_rank_size() != stages) {
    return Bad(rank, absl::StrCat("stage_to_rank places ", piece.stage_to_rank_size(), " stages; the plan has ", stages));
  }
  for (int s = 0; s < stages; ++s) {
    if (piece.stage_to_rank(s) < 0 || piece.stage_to_rank(s) >= piece.num_ranks()) {
      return Bad(rank, absl::StrCat("stage_to_rank[", s, "] is ", piece.stage_to_rank(s), ", not one of the ",
                                    piece.num_ranks(), " ranks"));
    }
  }
  for (int i : piece.model_inputs()) {
    if (i < 0 || i >= plan.inputs_size()) {
      return Bad(rank, absl::StrCat("model_inputs names input ", i, "; the model has ", plan.inputs_size()));
    }
  }
  schedule::Schedule sched;
  sched.num_ranks = piece.num_ranks();
  sched.num_stages = stages;
  sched.num_microbatches = piece.microbatches();
  sched.forward_only = piece.forward_only();
  sched.stage_to_rank = StageToRank(piece);
  sched.graph = StageGraphOf(plan);
  sched.ranks.resize(static_cast<size_t>(sched.num_ranks));
  schedule::ActionList& mine = sched.ranks[static_cast<size_t>(rank)];
  mine.reserve(static_cast<size_t>(piece.actions_size()));
  for (int k = 0; k < piece.actions_size(); ++k) {
    absl::StatusOr<schedule::Action> a = schedule::ParseAction(piece.actions(k));
    if (!a.ok()) return Bad(rank, absl::StrCat("actions[", k, "]: ", a.status().message()));
    mine.push_back(*a);
  }
  sched.name = absl::StrCat("rank ", rank, "'s layout");
  // Every action on one of its stages and in range, each stage forwarded (and
  // backpropagated) once per micro-batch, the SENDs and RECVs its edges need.
  PIPPY_RETURN_IF_ERROR(schedule::ValidateRank(sched, rank));
  return sched;
}

std::vector<int> StageToRank(const RankLayout& piece) {
  return std::vector<int>(piece.stage_to_rank().begin(), piece.stage_to_rank().end());
}

std::vector<int> StagesOf(const RankLayout& piece, int rank) {
  std::vector<int> out;
  for (int s = 0; s < piece.stage_to_rank_size(); ++s) {
    if (piece.stage_to_rank(s) == rank) out.push_back(s);
  }
  return out;
}

PipelinePlan PlanSlice(const PipelinePlan& plan, const RankLayout& piece, int rank) {
  PipelinePlan slice = plan;
  for (StagePlan& sp : *slice.mutable_stages()) {
    const bool mine = sp.index() < piece.stage_to_rank_size() && piece.stage_to_rank(sp.index()) == rank;
    if (!mine) sp.clear_parameters();
  }
  return slice;
}

std::vector<StageEdge> EdgesBetweenRanks(const PipelinePlan& plan, const std::vector<int>& stage_to_rank) {
  std::vector<StageEdge> edges;
  std::set<std::pair<int, int>> seen;
  for (const StagePlan& sp : plan.stages()) {
    for (const StageOutput& out : sp.outputs()) {
      for (int c : out.consumers()) {
        const int from = stage_to_rank[static_cast<size_t>(sp.index())];
        const int to = stage_to_rank[static_cast<size_t>(c)];
        if (from == to || !seen.insert({sp.index(), c}).second) continue;
        StageEdge e;
        e.set_from_stage(sp.index());
        e.set_to_stage(c);
        e.set_from_rank(from);
        e.set_to_rank(to);
        edges.push_back(std::move(e));
      }
    }
  }
  std::sort(edges.begin(), edges.end(), [](const StageEdge& x, const StageEdge& y) {
    return std::make_pair(x.from_stage(), x.to_stage()) < std::make_pair(y.from_stage(), y.to_stage());
  });
  return edges;
}

std::vector<StageEdge> WithTransports(const JobLayout& layout, const std::vector<RankPlace>& places, bool use_nccl) {
  std::vector<StageEdge> out;
  for (StageEdge e : layout.edges()) {
    e.set_transport(TransportFor(places[static_cast<size_t>(e.from_rank())], places[static_cast<size_t>(e.to_rank())],
                                 use_nccl));
    out.push_back(std::move(e));
  }
  return out;
}

}  // namespace pippy::job
