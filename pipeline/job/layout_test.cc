#include "pipeline/job/layout.h"

#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/job/job_spec.h"
#include "proto/names.h"

namespace pippy::job {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// A chain of `stages` stages reading model input 0 (stage 0) and input 1 (the last
// stage), with a skip connection 0 -> 2 when there are at least 3; each stage holds
// 1000 parameter bytes.
PipelinePlan ChainWithSkip(int stages = 4) {
  PipelinePlan plan;
  plan.add_inputs()->set_name("x");
  plan.add_inputs()->set_name("mask");
  for (int s = 0; s < stages; ++s) {
    StagePlan* sp = plan.add_stages();
    sp->set_index(s);
    sp->set_is_last(s == stages - 1);
    sp->set_param_bytes(1000);
    StageInput* in = sp->add_inputs();
    if (s == 0) {
      in->set_model_input(0);
    } else {
      in->set_source_stage(s - 1);
      in->set_source_output(0);
    }
    if (s == stages - 1) sp->add_inputs()->set_model_input(1);
    if (s < stages - 1) sp->add_outputs()->add_consumers(s + 1);
  }
  if (stages >= 3) {
    plan.mutable_stages(0)->mutable_outputs(0)->add_consumers(2);
    StageInput* skip = plan.mutable_stages(2)->add_inputs();
    skip->set_source_stage(0);
    skip->set_source_output(0);
  }
  return plan;
}

JobSpec Spec(ScheduleKind kind, int microbatches, int stages_per_worker = 0) {
  JobSpec spec;
  spec.mutable_split()->set_stages(4);
  spec.mutable_schedule()->set_kind(kind);
  spec.mutable_schedule()->set_microbatches(microbatches);
  spec.mutable_schedule()->set_stages_per_worker(stages_per_worker);
  spec.set_loss(LOSS_MSE);
  spec.mutable_optimizer()->set_kind(OPTIMIZER_ADAM);
  spec.mutable_optimizer()->set_lr(0.01);
  spec.set_steps(1);
  spec.set_batch_size(microbatches);
  EXPECT_TRUE(CheckSpec(&spec).ok());
  return spec;
}

std::vector<std::string> ActionsOf(const schedule::ActionList& list) {
  std::vector<std::string> out;
  for (const schedule::Action& a : list) out.push_back(a.ToString());
  return out;
}

// The layout holds the schedule ScheduleFor makes, rank by rank, and each piece gives
// back exactly its rank's list: what the rank runs is what was validated.
TEST(MakeLayout, EveryRankRunsTheValidatedSchedule) {
  const PipelinePlan plan = ChainWithSkip();
  for (auto [kind, v] : std::vector<std::pair<ScheduleKind, int>>{{SCHEDULE_GPIPE, 1},
                                                                   {SCHEDULE_1F1B, 1},
                                                                   {SCHEDULE_INTERLEAVED_1F1B, 2},
                                                                   {SCHEDULE_ZB1P, 2},
                                                                   {SCHEDULE_ZBV, 2},
                                                                   {SCHEDULE_INFERENCE, 1}}) {
    const JobSpec spec = Spec(kind, 4, v);
    absl::StatusOr<schedule::Schedule> reference = ScheduleFor(spec, plan);
    ASSERT_TRUE(reference.ok()) << reference.status();
    absl::StatusOr<JobLayout> layout = MakeLayout(spec, plan);
    ASSERT_TRUE(layout.ok()) << layout.status();
    ASSERT_EQ(layout->ranks_size(), reference->num_ranks);
    EXPECT_EQ(layout->replicas(), 1);
    for (int r = 0; r < layout->ranks_size(); ++r) {
      absl::StatusOr<schedule::Schedule> mine = RankSchedule(layout->ranks(r), r, plan);
      ASSERT_TRUE(mine.ok()) << mine.status();
      EXPECT_EQ(ActionsOf(mine->ranks[static_cast<size_t>(r)]), ActionsOf(reference->ranks[static_cast<size_t>(r)]))
          << names::Name(kind) << " rank " << r;
      EXPECT_EQ(mine->stage_to_rank, reference->stage_to_rank);
      EXPECT_EQ(mine->num_microbatches, 4);
      EXPECT_EQ(mine->forward_only, kind == SCHEDULE_INFERENCE);
      EXPECT_EQ(mine->graph.consumers, reference->graph.consumers);
      for (int other = 0; other < layout->ranks_size(); ++other) {
        if (other != r) {
          EXPECT_TRUE(mine->ranks[static_cast<size_t>(other)].empty());
        }
      }
    }
  }
}

TEST(MakeLayout, DataNeedsAndMemory_PerRank) {
  const PipelinePlan plan = ChainWithSkip();
  absl::StatusOr<JobLayout> layout = MakeLayout(Spec(SCHEDULE_1F1B, 4), plan);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_THAT(layout->ranks(0).model_inputs(), ElementsAre(0));
  EXPECT_THAT(layout->ranks(1).model_inputs(), ElementsAre());
  EXPECT_THAT(layout->ranks(3).model_inputs(), ElementsAre(1));
  EXPECT_FALSE(layout->ranks(0).targets());
  EXPECT_TRUE(layout->ranks(3).targets());
  // Adam: parameters, gradients and two moments.
  for (const RankLayout& piece : layout->ranks()) EXPECT_EQ(piece.memory_bytes(), 4000);
  // Inference: parameters only, no targets.
  absl::StatusOr<JobLayout> inference = MakeLayout(Spec(SCHEDULE_INFERENCE, 2), plan);
  ASSERT_TRUE(inference.ok());
  EXPECT_EQ(inference->ranks(0).memory_bytes(), 1000);
  EXPECT_FALSE(inference->ranks(3).targets());
}

TEST(MakeLayout, TensorParallelRankHoldsItsShard) {
  PipelinePlan plan = ChainWithSkip();
  plan.mutable_tensor_parallel()->set_size(2);
  // Stage 0: 800 bytes sharded (400 per rank) and 200 replicated.
  StagePlan* sp = plan.mutable_stages(0);
  ParameterInfo* w = sp->add_parameters();
  w->set_bytes(800);
  w->set_tp_dim(0);
  sp->add_parameters()->set_bytes(200);
  EXPECT_EQ(StageBytesPerRank(plan, plan.stages(0)), 600);
  EXPECT_EQ(StageBytesPerRank(plan, plan.stages(1)), 1000);  // no parameter list: the stage's bytes
  plan.mutable_tensor_parallel()->set_size(1);
  EXPECT_EQ(StageBytesPerRank(plan, plan.stages(0)), 1000);
}

TEST(MakeLayout, ImpossibleSchedule_IsRefusedNamingIt) {
  absl::StatusOr<JobLayout> layout = MakeLayout(Spec(SCHEDULE_1F1B, 2), ChainWithSkip());
  EXPECT_EQ(layout.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(layout.status().message()), HasSubstr("schedule: "));
}

TEST(PlanSlice, KeepsParameterListsOfTheRanksStagesOnly) {
  PipelinePlan plan = ChainWithSkip();
  for (StagePlan& sp : *plan.mutable_stages()) sp.add_parameters()->set_name(absl::StrCat("w", sp.index()));
  absl::StatusOr<JobLayout> layout = MakeLayout(Spec(SCHEDULE_INTERLEAVED_1F1B, 4, 2), plan);
  ASSERT_TRUE(layout.ok()) << layout.status();
  const PipelinePlan slice = PlanSlice(plan, layout->ranks(1), 1);
  EXPECT_THAT(StagesOf(layout->ranks(1), 1), ElementsAre(1, 3));
  for (const StagePlan& sp : slice.stages()) {
    EXPECT_EQ(sp.parameters_size(), sp.index() % 2 == 1 ? 1 : 0) << sp.index();
    EXPECT_EQ(sp.inputs_size(), plan.stages(sp.index()).inputs_size());
  }
}

// A piece comes over the network: a rank refuses one that does not fit its plan, naming
// the field, instead of running off the end of a vector.
TEST(RankSchedule, MalformedPieces_AreRefusedNamingTheField) {
  const PipelinePlan plan = ChainWithSkip();
  absl::StatusOr<JobLayout> layout = MakeLayout(Spec(SCHEDULE_1F1B, 4), plan);
  ASSERT_TRUE(layout.ok());
  const RankLayout good = layout->ranks(1);
  struct Case {
    std::string want;
    std::function<void(RankLayout*)> mutate;
    int rank = 1;
  };
  const std::vector<Case> cases = {
      {"num_ranks is 0", [](RankLayout* p) { p->set_num_ranks(0); }},
      {"the rank must be one of them", [](RankLayout*) {}, 7},
      {"microbatches is 0", [](RankLayout* p) { p->set_microbatches(0); }},
      {"stage_to_rank places 3 stages; the plan has 4", [](RankLayout* p) { p->mutable_stage_to_rank()->RemoveLast(); }},
      {"stage_to_rank[2] is 9", [](RankLayout* p) { p->set_stage_to_rank(2, 9); }},
      {"model_inputs names input 5", [](RankLayout* p) { p->add_model_inputs(5); }},
      {"actions[0]: 'x' is not an action", [](RankLayout* p) { p->set_actions(0, "x"); }},
      {"0F0 belongs to stage 0, which lives on rank 0", [](RankLayout* p) { p->set_actions(0, "0F0"); }},
      {"1F4 is out of range (4 stages, 4 micro-batches)", [](RankLayout* p) { p->set_actions(0, "1F4"); }},
      {"in a forward-only schedule", [](RankLayout* p) { p->set_forward_only(true); }},
      {"appears twice", [](RankLayout* p) { p->add_actions(p->actions(0)); }},
      {"is never forwarded", [](RankLayout* p) { p->mutable_actions()->erase(p->mutable_actions()->begin() + 1); }},
  };
  for (const Case& c : cases) {
    RankLayout piece = good;
    c.mutate(&piece);
    absl::StatusOr<schedule::Schedule> s = RankSchedule(piece, c.rank, plan);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(std::string(s.status().message()), HasSubstr(c.want));
  }
  EXPECT_TRUE(RankSchedule(good, 1, plan).ok());
}

// A rank on `host` with the device `device` ("cpu", "cuda:N").
RankPlace P(const std::string& host, const std::string& device) { return {host, *ParseDevice(device)}; }

TEST(WithTransports, ChoosesPerPairOfRanks) {
  const PipelinePlan plan = ChainWithSkip();
  JobLayout layout;
  for (StageEdge& e : EdgesBetweenRanks(plan, {0, 1, 2, 3})) *layout.add_edges() = std::move(e);
  auto kinds = [&](const std::vector<RankPlace>& ranks, bool use_nccl = kJobsUseNccl) {
    std::vector<std::string> out;
    for (const StageEdge& e : WithTransports(layout, ranks, use_nccl)) {
      out.push_back(absl::StrCat(e.from_stage(), "->", e.to_stage(), " ", e.transport()));
    }
    return out;
  };
  using V = std::vector<std::string>;
  // CPU workers: UCX everywhere (the skip connection is an edge of its own).
  EXPECT_EQ(kinds({P("a", "cpu"), P("a", "cpu"), P("b", "cpu"), P("b", "cpu")}),
            (V{"0->1 ucx", "0->2 ucx", "1->2 ucx", "2->3 ucx"}));
  // GPUs: NCCL between different GPUs (same host or not); two workers sharing a GPU,
  // and a GPU rank next to a CPU rank, stage through host memory over UCX.
  const std::vector<RankPlace> gpus = {P("a", "cuda:0"), P("a", "cuda:1"), P("b", "cuda:0"), P("b", "cuda:0")};
  EXPECT_EQ(kinds(gpus), (V{"0->1 ucx+staging", "0->2 ucx+staging", "1->2 ucx+staging", "2->3 ucx+staging"}))
      << "workers do not run NCCL in jobs yet (kJobsUseNccl)";
  EXPECT_EQ(kinds(gpus, /*use_nccl=*/true), (V{"0->1 nccl", "0->2 nccl", "1->2 nccl", "2->3 ucx+staging"}));
  EXPECT_EQ(kinds({P("a", "cuda:0"), P("a", "cpu"), P("a", "cuda:0"), P("b", "cpu")}),
            (V{"0->1 ucx+staging", "0->2 ucx+staging", "1->2 ucx+staging", "2->3 ucx+staging"}));
  // Stages on the same rank are no edge.
  auto same = EdgesBetweenRanks(plan, {0, 0, 1, 1});
  ASSERT_EQ(same.size(), 2u);
  EXPECT_EQ(same[0].from_stage(), 0);
  EXPECT_EQ(same[0].to_stage(), 2);
  EXPECT_EQ(same[1].from_stage(), 1);
  EXPECT_EQ(same[1].from_rank(), 0);
  EXPECT_EQ(same[1].to_rank(), 1);
  EXPECT_EQ(same[1].transport(), "");
}

}  // namespace
}  // namespace pippy::job
