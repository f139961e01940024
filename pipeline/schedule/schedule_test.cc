#include <cmath>
#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulator.h"
#include "proto/names.h"

namespace pippy::schedule {
namespace {

using testing::HasSubstr;

Schedule Make(ScheduleKind kind, int ranks, int mbs, int v = 0) {
  ScheduleOptions o;
  o.num_ranks = ranks;
  o.num_microbatches = mbs;
  o.stages_per_rank = v;
  auto s = MakeSchedule(kind, o);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

TEST(Action, ParseAndPrint_RoundTrip) {
  for (const char* text : {"0F3", "12B7", "2I0", "2W0", "0SEND_F3", "1RECV_F3", "1SEND_B3", "0RECV_B3"}) {
    auto a = ParseAction(text);
    ASSERT_TRUE(a.ok()) << text;
    EXPECT_EQ(a->ToString(), text);
  }
  EXPECT_THAT(ParseAction("F3").status().message(), HasSubstr("is not an action"));
  EXPECT_FALSE(ParseAction("0X3").ok());
  EXPECT_FALSE(ParseAction("0F").ok());
}

struct KindCase {
  ScheduleKind kind;
  int ranks, mbs, v;
};

class EveryScheduleTest : public testing::TestWithParam<KindCase> {};

TEST_P(EveryScheduleTest, GeneratedSchedule_ValidatesAndRunsWithoutDeadlock) {
  const KindCase& c = GetParam();
  Schedule s = Make(c.kind, c.ranks, c.mbs, c.v);
  auto res = Simulate(s);
  ASSERT_TRUE(res.ok()) << res.status();
  EXPECT_GT(res->makespan, 0);
  // Simulating the CSV form gives the same makespan.
  auto back = FromCsv(ToCsv(s));
  ASSERT_TRUE(back.ok()) << back.status();
  auto res2 = Simulate(*back);
  ASSERT_TRUE(res2.ok()) << res2.status();
  EXPECT_DOUBLE_EQ(res2->makespan, res->makespan);
}

std::vector<KindCase> AllCases() {
  std::vector<KindCase> out;
  for (int r : {1, 2, 3, 4}) {
    std::set<int> mbs = {r, 2 * r, 8, 2 * r + 1};
    for (int m : mbs) {
      out.push_back({SCHEDULE_GPIPE, r, m, 1});
      out.push_back({SCHEDULE_1F1B, r, m, 1});
      out.push_back({SCHEDULE_LOOPED_BFS, r, m, 2});
      out.push_back({SCHEDULE_LOOPED_BFS, r, m, 3});
      out.push_back({SCHEDULE_ZB1P, r, m, 1});
      out.push_back({SCHEDULE_ZB1P, r, m, 2});
      out.push_back({SCHEDULE_ZBV, r, m, 2});
      out.push_back({SCHEDULE_INFERENCE, r, m, 1});
      out.push_back({SCHEDULE_INFERENCE, r, m, 2});
      if (m % r == 0) {
        out.push_back({SCHEDULE_INTERLEAVED_1F1B, r, m, 2});
        out.push_back({SCHEDULE_INTERLEAVED_1F1B, r, m, 3});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Grid, EveryScheduleTest, testing::ValuesIn(AllCases()),
                         [](const testing::TestParamInfo<KindCase>& i) {
                           std::string n = names::Name(i.param.kind);
                           for (char& ch : n) if (ch == '-') ch = '_';
                           return n + "_r" + std::to_string(i.param.ranks) + "_m" + std::to_string(i.param.mbs) +
                                  "_v" + std::to_string(i.param.v);
                         });

TEST(Bubble, GPipeAnd1F1B_MatchClosedForm) {
  for (ScheduleKind kind : {SCHEDULE_GPIPE, SCHEDULE_1F1B}) {
    for (int p : {2, 4, 8}) {
      for (int m : {p, 8, 16}) {
        auto res = Simulate(Make(kind, p, m), Costs{1, 1, 0.0001});
        ASSERT_TRUE(res.ok());
        double want = static_cast<double>(p - 1) / (m + p - 1);
        for (double b : res->bubble_fraction) EXPECT_NEAR(b, want, 1e-3) << names::Name(kind) << p << m;
      }
    }
  }
}

TEST(Bubble, ZB1P_IdleIsAThirdOf1F1B_WithEqualFBW) {
  for (int p : {2, 4, 8}) {
    for (int m : {p, 2 * p, 16}) {
      Costs c{1, 1, 1};
      auto zb = Simulate(Make(SCHEDULE_ZB1P, p, m, 1), c);
      auto ob = Simulate(Make(SCHEDULE_1F1B, p, m), c);
      ASSERT_TRUE(zb.ok() && ob.ok());
      // Zero Bubble paper: 1F1B idles (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W): a third.
      double zb_idle = zb->makespan - zb->busy[0], ob_idle = ob->makespan - ob->busy[0];
      EXPECT_NEAR(ob_idle, (p - 1) * 3.0, 1e-9);
      EXPECT_NEAR(zb_idle / ob_idle, 1.0 / 3.0, 0.02) << "p=" << p << " m=" << m;
      EXPECT_NEAR(zb->mean_bubble_fraction, (p - 1.0) / (3.0 * m + p - 1.0), 0.02);
      // Micro-batches awaiting I are capped as in 1F1B; those only awaiting W add up to p-1.
      for (int r = 0; r < p; ++r) EXPECT_LE(zb->peak_live_per_rank[r], 2 * p - 1);
    }
  }
}

TEST(Bubble, ZBVAndInterleaved_BeatOneFOneB) {
  for (int p : {2, 4}) {
    const int m = 4 * p;
    // Same total work per rank: a V or interleaved chunk is half a 1F1B stage.
    auto ob = Simulate(Make(SCHEDULE_1F1B, p, m), Costs{2, 2, 2});
    auto zbv = Simulate(Make(SCHEDULE_ZBV, p, m, 2), Costs{1, 1, 1});
    auto il = Simulate(Make(SCHEDULE_INTERLEAVED_1F1B, p, m, 2), Costs{1, 1, 1});
    ASSERT_TRUE(ob.ok() && zbv.ok() && il.ok());
    EXPECT_LT(zbv->mean_bubble_fraction, ob->mean_bubble_fraction / 2);
    EXPECT_LT(il->mean_bubble_fraction, ob->mean_bubble_fraction);
  }
}

TEST(Memory, OneFOneB_PeakLiveAtMostRanks_GPipeHoldsAll) {
  const int p = 4, m = 8;
  auto ob = Simulate(Make(SCHEDULE_1F1B, p, m));
  auto gp = Simulate(Make(SCHEDULE_GPIPE, p, m));
  ASSERT_TRUE(ob.ok() && gp.ok());
  for (int r = 0; r < p; ++r) {
    EXPECT_EQ(ob->peak_live_per_rank[r], p - r);
    EXPECT_EQ(gp->peak_live_per_rank[r], m);
  }
}

TEST(Validate, MissingRecv_RejectedWithGrid) {
  Schedule s = Make(SCHEDULE_1F1B, 2, 2);
  auto& l = s.ranks[1];
  l.erase(std::find(l.begin(), l.end(), Action{1, ActionType::kRecvForward, 1}));
  absl::Status st = Validate(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(st.message(), HasSubstr("no RECV_F (1RECV_F1)"));
  EXPECT_THAT(st.message(), HasSubstr("rank 1"));
  EXPECT_THAT(st.message(), HasSubstr("step"));  // the grid
}

TEST(Simulate, Deadlock_ReportsStuckActionsMarked) {
  // Rank 0 waits for gradients before sending the activations they depend on.
  auto s = FromCsv("0RECV_B0,0F0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n");
  ASSERT_TRUE(s.ok()) << s.status();
  auto res = Simulate(*s);
  EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(res.status().message(), HasSubstr("deadlocks"));
  EXPECT_THAT(res.status().message(), HasSubstr("*0RECV_B0*"));
  EXPECT_THAT(res.status().message(), HasSubstr("*1RECV_F0*"));
}

TEST(Csv, ComputeOnly_GetsCommunicationInserted) {
  auto s = FromCsv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->HasCommunication());
  EXPECT_EQ(s->ranks[1][0].ToString(), "1RECV_F0");
  EXPECT_TRUE(Simulate(*s).ok());
}

TEST(Csv, BadCell_NamesRowAndCell) {
  auto s = FromCsv("0F0,0B0\n1F0,oops\n");
  EXPECT_THAT(s.status().message(), HasSubstr("CSV row 1 (rank 1), cell 1"));
}

// Found by fuzz/schedule_csv_fuzz (the first two) and by reading FromCsv while fixing
// them: a CSV must not size anything by the numbers in it before they are checked.
TEST(Csv, HostileSchedules_AreRefused) {
  EXPECT_THAT(FromCsv("None\t").status().message(), HasSubstr("CSV row 0 (rank 0) has no action"));
  EXPECT_THAT(FromCsv("0SEND_F0\n").status().message(), HasSubstr("no compute action"));
  EXPECT_THAT(FromCsv("0F0\n\n\n\x0c,").status().message(), HasSubstr("CSV row 1 (rank 1) has no action"));
  EXPECT_THAT(FromCsv("0F0,0F1\n2000000000F0\n").status().message(), HasSubstr("stage 1 has no compute action"));
  EXPECT_THAT(FromCsv("0F0,0F1\n1F2000000000\n").status().message(), HasSubstr("micro-batch 2000000000 is named"));
  EXPECT_THAT(FromCsv("0F0,0F99999999999\n").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(FromCsv("0F0,0F900\n").status().message(), HasSubstr("micro-batch 900 is named"));
}

TEST(Preconditions, Violations_SayWhatToChange) {
  ScheduleOptions o;
  o.num_ranks = 4;
  o.num_microbatches = 2;
  EXPECT_THAT(MakeSchedule(SCHEDULE_1F1B, o).status().message(),
              HasSubstr("at least as many micro-batches as ranks"));
  o.num_microbatches = 6;
  EXPECT_THAT(MakeSchedule(SCHEDULE_INTERLEAVED_1F1B, o).status().message(),
              HasSubstr("use --microbatches 8"));
  o.stages_per_rank = 2;
  EXPECT_THAT(MakeSchedule(SCHEDULE_GPIPE, o).status().message(), HasSubstr("one stage per rank"));
  EXPECT_THAT(MakeSchedule(SCHEDULE_KIND_UNSPECIFIED, o).status().message(),
              HasSubstr("schedule kind 0 is not a schedule: use gpipe, 1f1b"));
  EXPECT_THAT(names::Parse<ScheduleKind>("schedule", "zigzag").status().message(),
              HasSubstr("unknown schedule 'zigzag'"));
  EXPECT_TRUE(names::Parse<ScheduleKind>("schedule", "ZBVZeroBubble").ok());
  EXPECT_TRUE(names::Parse<ScheduleKind>("schedule", "Interleaved1F1B").ok());
}

TEST(SkipConnections, NonAdjacentConsumer_GetsDirectSendAndRecv) {
  ScheduleOptions o;
  o.num_ranks = 3;
  o.num_microbatches = 3;
  o.graph = StageGraph::Chain(3);
  o.graph.consumers[0].push_back(2);  // U-Net style skip
  auto s = MakeSchedule(SCHEDULE_1F1B, o);
  ASSERT_TRUE(s.ok());
  auto res = Simulate(*s);
  ASSERT_TRUE(res.ok()) << res.status();
}

TEST(Render, TimelineAndSvg_ShowEveryRankAndIdle) {
  Schedule s = Make(SCHEDULE_1F1B, 2, 2);
  auto res = Simulate(s);
  ASSERT_TRUE(res.ok());
  std::string text = RenderTimeline(s, *res);
  EXPECT_THAT(text, HasSubstr("rank 0"));
  EXPECT_THAT(text, HasSubstr("1F0"));
  EXPECT_THAT(text, HasSubstr("."));
  std::string svg = RenderSvg(s, *res);
  EXPECT_THAT(svg, HasSubstr("<svg"));
  EXPECT_THAT(svg, HasSubstr("idle"));
}

}  // namespace
}  // namespace pippy::schedule
