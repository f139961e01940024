#include "pipeline/autoplan/calibration.h"

#include <vector>

#include "gtest/gtest.h"
#include "pipeline/autoplan/chooser.h"

namespace pippy::autoplan {
namespace {

PlanCandidate TwoStages() {
  PlanCandidate c;
  for (double v : {100.0, 200.0}) c.add_stage_forward_us(v);
  for (double v : {0.0, 50.0}) c.add_stage_input_us(v);
  for (double v : {300.0, 100.0}) c.add_stage_weight_us(v);
  return c;
}

TEST(Calibration, MeasuredOverPredictedPerKind) {
  CalibrationSample s(TwoStages());
  // Two ranks' actions of a step; the trace's other names teach nothing.
  s.Add({{"0F0", 150}, {"0W0", 300}, {"0I0", 7}, {"0SEND_F0", 999}, {"wait for sends", 999}});
  s.Add({{"1F0", 300}, {"1I0", 100}, {"1W0", 100}, {"1B1", 300}, {"RECV", 5}});
  std::optional<ActionFactors> f = s.Factors(2);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->ranks_on_host(), 2);
  EXPECT_EQ(f->jobs(), 1);
  EXPECT_DOUBLE_EQ(f->forward(), (150.0 + 300.0) / (100.0 + 200.0));
  EXPECT_DOUBLE_EQ(f->backward_input(), 100.0 / 50.0);  // stage 0 predicts no I: its 7 us are not counted
  EXPECT_DOUBLE_EQ(f->backward_weight(), (300.0 + 100.0) / (300.0 + 100.0));
  EXPECT_DOUBLE_EQ(f->backward(), 300.0 / (50.0 + 100.0));
}

TEST(Calibration, NothingMeasuredLearnsNothing) {
  CalibrationSample s(TwoStages());
  s.Add({{"optimizer step", 10}});
  EXPECT_FALSE(s.Factors(1).has_value());
  CalibrationSample none{PlanCandidate{}};  // a candidate without per-stage costs
  none.Add({{"0F0", 10}});
  EXPECT_FALSE(none.Factors(1).has_value());
}

TEST(Calibration, MergeWeighsEachJobAgainstUpToFourBefore) {
  std::vector<ActionFactors> table;
  ActionFactors a;
  a.set_ranks_on_host(2);
  a.set_jobs(1);
  a.set_forward(2.0);
  Merge(a, &table);
  ASSERT_EQ(table.size(), 1u);
  a.set_forward(1.0);
  a.set_backward(3.0);  // not learned before: taken as it is
  Merge(a, &table);
  EXPECT_DOUBLE_EQ(table[0].forward(), 1.5);
  EXPECT_DOUBLE_EQ(table[0].backward(), 3.0);
  EXPECT_EQ(table[0].jobs(), 2);
  for (int i = 0; i < 10; ++i) Merge(a, &table);
  a.set_forward(6.0);
  const double before = table[0].forward();
  Merge(a, &table);
  EXPECT_DOUBLE_EQ(table[0].forward(), (before * 4 + 6.0) / 5);
  ActionFactors one;
  one.set_ranks_on_host(1);
  one.set_jobs(1);
  one.set_forward(0.9);
  Merge(one, &table);
  ASSERT_EQ(table.size(), 2u);
  EXPECT_EQ(table[0].ranks_on_host(), 1);  // sorted by ranks per host
}

TEST(Calibration, FactorsForTheMostRanksNotOver) {
  google::protobuf::RepeatedPtrField<ActionFactors> t;
  t.Add()->set_ranks_on_host(2);
  t.Add()->set_ranks_on_host(4);
  EXPECT_EQ(FactorsFor(t, 1), nullptr);
  EXPECT_EQ(FactorsFor(t, 2)->ranks_on_host(), 2);
  EXPECT_EQ(FactorsFor(t, 3)->ranks_on_host(), 2);
  EXPECT_EQ(FactorsFor(t, 8)->ranks_on_host(), 4);
}

// The chooser scales the costs of ranks sharing a host by the factors: zero-bubble
// schedules whose I and W were measured 3x their prediction lose to 1F1B, while the
// candidates keep the unscaled per-stage costs (what the next measurement compares with).
TEST(Calibration, ChooserScalesCostsByWhatWasMeasured) {
  ModelProfile p;
  p.add_microbatch_sizes(16);
  p.set_optimizer_us_per_mib(10);
  for (int j = 0; j < 8; ++j) {
    SpanCost* s = p.add_spans();
    s->set_first_node(10 * j);
    s->set_num_nodes(10);
    s->set_param_bytes(1 << 20);
    SpanSize* z = s->add_sizes();
    z->set_forward_us(1000);
    z->set_backward_input_us(1000);
    z->set_backward_weight_us(1000);
    z->set_activation_bytes(1 << 16);
    z->set_cut_bytes(4096);
  }
  JobSpec spec;
  spec.set_mode(MODE_TRAIN);
  spec.set_batch_size(64);
  spec.mutable_optimizer()->set_kind(OPTIMIZER_SGD);
  spec.mutable_schedule()->set_microbatches(4);
  spec.mutable_split()->set_stages(2);
  spec.mutable_auto_plan()->set_schedule(true);
  for (int i = 0; i < 2; ++i) {
    WorkerCapacity* w = spec.mutable_auto_plan()->add_workers();
    w->set_host("h");
    w->set_threads(1);
    w->set_host_cpus(2);
  }
  absl::StatusOr<PlanChoice> plain = ChoosePlan(spec, p);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->candidates(0).schedule(), SCHEDULE_ZB1P) << RenderChoice(*plain);

  ActionFactors* f = spec.mutable_auto_plan()->add_calibration();
  f->set_ranks_on_host(2);
  f->set_jobs(3);
  f->set_forward(1.0);
  f->set_backward(1.0);
  f->set_backward_input(3.0);
  f->set_backward_weight(3.0);
  absl::StatusOr<PlanChoice> scaled = ChoosePlan(spec, p);
  ASSERT_TRUE(scaled.ok()) << scaled.status();
  EXPECT_NE(scaled->candidates(0).schedule(), SCHEDULE_ZB1P) << RenderChoice(*scaled);
  EXPECT_NE(scaled->why().find("measured in 3 earlier job(s): F x1.00, B x1.00, I x3.00, W x3.00"), std::string::npos)
      << scaled->why();
  for (const PlanCandidate& c : scaled->candidates()) {
    if (c.schedule() != SCHEDULE_ZB1P) continue;
    for (const PlanCandidate& d : plain->candidates()) {
      if (d.schedule() != SCHEDULE_ZB1P) continue;
      EXPECT_LT(c.samples_per_second(), d.samples_per_second());
      ASSERT_EQ(c.stage_weight_us_size(), d.stage_weight_us_size());
      for (int s = 0; s < c.stage_weight_us_size(); ++s) EXPECT_DOUBLE_EQ(c.stage_weight_us(s), d.stage_weight_us(s));
    }
  }
}

}  // namespace
}  // namespace pippy::autoplan
