#include "pipeline/autoplan/chooser.h"

#include <functional>

#include "gtest/gtest.h"

namespace pippy::autoplan {
namespace {

// A profile of `spans` spans, each first_node = 10 * index, with per-span costs given
// by `cost(span, size)` (F = I = W = that), `param_bytes` each.
ModelProfile MakeProfile(int spans, const std::vector<int>& sizes, const std::function<double(int, int)>& cost,
                         int64_t param_bytes = 1 << 20, int64_t act_per_sample = 1 << 10) {
  ModelProfile p;
  for (int b : sizes) p.add_microbatch_sizes(b);
  p.set_optimizer_us_per_mib(10);
  for (int j = 0; j < spans; ++j) {
    SpanCost* s = p.add_spans();
    s->set_first_node(10 * j);
    s->set_num_nodes(10);
    s->set_param_bytes(param_bytes);
    for (int b : sizes) {
      SpanSize* z = s->add_sizes();
      z->set_forward_us(cost(j, b));
      z->set_backward_input_us(cost(j, b));
      z->set_backward_weight_us(cost(j, b));
      z->set_activation_bytes(act_per_sample * b);
      z->set_cut_bytes(256 * b);
    }
  }
  return p;
}

JobSpec TrainSpec(int batch) {
  JobSpec spec;
  spec.set_mode(MODE_TRAIN);
  spec.set_batch_size(batch);
  spec.mutable_optimizer()->set_kind(OPTIMIZER_SGD);
  return spec;
}

std::vector<WorkerCapacity> Workers(int n, const std::string& host, int cpus, int64_t free_memory = 0) {
  std::vector<WorkerCapacity> w(n);
  for (WorkerCapacity& c : w) {
    c.set_host(host);
    c.set_threads(1);
    c.set_host_cpus(cpus);
    c.set_free_memory(free_memory);
  }
  return w;
}

void SetWorkers(const std::vector<WorkerCapacity>& w, JobSpec* spec) {
  for (const WorkerCapacity& c : w) *spec->mutable_auto_plan()->add_workers() = c;
}

const std::vector<int> kSizes = {2, 4, 8, 16, 32, 64};

TEST(Chooser, CutsBalanceMeasuredTimeNotSpans) {
  // Seven light spans and a heavy last one: two stages cut right before the heavy span.
  ModelProfile p = MakeProfile(8, {64}, [](int j, int) { return j == 7 ? 9000.0 : 1000.0; });
  JobSpec spec = TrainSpec(64);
  absl::StatusOr<PlanCandidate> c =
      Predict(spec, p, SCHEDULE_GPIPE, 1, 2, 1, Workers(2, "h", 0), DefaultLink());
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_EQ(c->cuts_size(), 1);
  EXPECT_EQ(c->cuts(0), 70);
  ASSERT_EQ(c->stage_compute_us_size(), 2);
  EXPECT_DOUBLE_EQ(c->stage_compute_us(0), 3 * 7000.0);
  EXPECT_DOUBLE_EQ(c->stage_compute_us(1), 3 * 9000.0);
}

TEST(Chooser, OneRankStepIsItsComputeAndOverheads) {
  ModelProfile p = MakeProfile(2, {8}, [](int, int) { return 500.0; }, 4 << 20);
  JobSpec spec = TrainSpec(8);
  absl::StatusOr<PlanCandidate> c = Predict(spec, p, SCHEDULE_GPIPE, 1, 1, 1, Workers(1, "h", 0), DefaultLink());
  ASSERT_TRUE(c.ok()) << c.status();
  // F, I, W of both spans, F and I (B) with the action overhead, no transfer (one rank),
  // the optimizer over 8 MiB at 10 us/MiB, the step's overhead.
  const double step_us = 6 * 500.0 + 2 * kActionOverheadUs + 8 * 10.0 + kStepOverheadUs;
  EXPECT_NEAR(c->step_seconds(), step_us / 1e6, 1e-9);
  EXPECT_NEAR(c->samples_per_second(), 8 / (step_us / 1e6), 1e-6);
  EXPECT_DOUBLE_EQ(c->bubble_fraction(), 0.0);
}

TEST(Chooser, LinearComputeTakesTheMostMicrobatches) {
  // Cost proportional to the samples (no small-matrix penalty) and large against the
  // overheads: only the bubble differs, and it shrinks with more micro-batches.
  ModelProfile p = MakeProfile(8, kSizes, [](int, int b) { return 2000.0 * b; });
  JobSpec spec = TrainSpec(64);
  spec.mutable_auto_plan()->set_microbatches(true);
  spec.mutable_schedule()->set_kind(SCHEDULE_1F1B);
  spec.mutable_split()->set_stages(4);
  SetWorkers(Workers(4, "h", 0), &spec);
  absl::StatusOr<PlanChoice> choice = ChoosePlan(spec, p);
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->candidates(0).microbatches(), 32);
  EXPECT_EQ(choice->candidates(0).schedule(), SCHEDULE_1F1B);
  // 1F1B needs micro-batches >= ranks: 1 and 2 are not candidates.
  for (const PlanCandidate& c : choice->candidates()) EXPECT_GE(c.microbatches(), 4);
  EXPECT_NE(choice->why().find("micro-batch"), std::string::npos) << choice->why();
}

TEST(Chooser, SlowSmallMicrobatchesAreAvoided) {
  // Micro-batches under 16 samples run 10x slower per sample.
  ModelProfile p = MakeProfile(8, kSizes, [](int, int b) { return (b < 16 ? 10.0 : 1.0) * 2000.0 * b; });
  JobSpec spec = TrainSpec(64);
  spec.mutable_auto_plan()->set_microbatches(true);
  spec.mutable_auto_plan()->set_schedule(true);
  spec.mutable_split()->set_stages(2);
  SetWorkers(Workers(2, "h", 0), &spec);
  absl::StatusOr<PlanChoice> choice = ChoosePlan(spec, p);
  ASSERT_TRUE(choice.ok()) << choice.status();
  const PlanCandidate& w = choice->candidates(0);
  EXPECT_GE(64 / w.microbatches(), 16) << RenderChoice(*choice);
  for (const PlanCandidate& c : choice->candidates()) {
    if (64 / c.microbatches() < 16) {
      EXPECT_LT(c.samples_per_second(), 0.5 * w.samples_per_second()) << RenderChoice(*choice);
    }
  }
}

TEST(Chooser, WorkersSharingCoresAreNotFaster) {
  // Four one-thread workers on a host of two cores: four ranks run at half speed, so
  // two ranks (no contention) win; one rank has no parallelism at all.
  ModelProfile p = MakeProfile(8, kSizes, [](int, int b) { return 2000.0 * b; });
  JobSpec spec = TrainSpec(64);
  spec.mutable_auto_plan()->set_stages(true);
  spec.mutable_schedule()->set_kind(SCHEDULE_GPIPE);
  spec.mutable_schedule()->set_microbatches(8);
  SetWorkers(Workers(4, "h", 2), &spec);
  absl::StatusOr<PlanChoice> choice = ChoosePlan(spec, p);
  ASSERT_TRUE(choice.ok()) << choice.status();
  EXPECT_EQ(choice->candidates(0).workers(), 2) << RenderChoice(*choice);
  double four = 0, two = 0, one = 0;
  for (const PlanCandidate& c : choice->candidates()) {
    if (c.workers() == 4) four = c.samples_per_second();
    if (c.workers() == 2) two = c.samples_per_second();
    if (c.workers() == 1) one = c.samples_per_second();
  }
  EXPECT_LT(four, two);
  EXPECT_LT(one, two);
  // The same workers on four hosts: four ranks win.
  JobSpec spread = spec;
  spread.mutable_auto_plan()->clear_workers();
  for (int i = 0; i < 4; ++i) SetWorkers(Workers(1, "h" + std::to_string(i), 2), &spread);
  absl::StatusOr<PlanChoice> spread_choice = ChoosePlan(spread, p);
  ASSERT_TRUE(spread_choice.ok()) << spread_choice.status();
  EXPECT_EQ(spread_choice->candidates(0).workers(), 4) << RenderChoice(*spread_choice);
}

TEST(Chooser, CandidatesOverMemoryAreRefused) {
  // 8 spans of 64 MiB of parameters; SGD without momentum holds parameters and gradients:
  // 1 GiB on one rank, 512 MiB on each of two. GPU workers with 700 MiB free each.
  ModelProfile p = MakeProfile(8, {64}, [](int, int) { return 1000.0; }, int64_t{64} << 20, 0);
  JobSpec spec = TrainSpec(64);
  spec.mutable_auto_plan()->set_stages(true);
  spec.mutable_schedule()->set_kind(SCHEDULE_GPIPE);
  spec.mutable_schedule()->set_microbatches(1);
  std::vector<WorkerCapacity> w = Workers(2, "h", 0, int64_t{700} << 20);
  for (WorkerCapacity& c : w) c.set_gpu(true);
  SetWorkers(w, &spec);
  absl::StatusOr<PlanChoice> choice = ChoosePlan(spec, p);
  ASSERT_TRUE(choice.ok()) << choice.status();
  ASSERT_EQ(choice->candidates_size(), 2);
  EXPECT_EQ(choice->candidates(0).workers(), 2);
  EXPECT_TRUE(choice->candidates(0).refused().empty());
  EXPECT_EQ(choice->candidates(1).workers(), 1);
  EXPECT_NE(choice->candidates(1).refused().find("1024 MiB"), std::string::npos) << choice->candidates(1).refused();
  // With 300 MiB each, nothing fits: refused, naming the memory.
  JobSpec small = spec;
  for (WorkerCapacity& c : *small.mutable_auto_plan()->mutable_workers()) c.set_free_memory(int64_t{300} << 20);
  absl::StatusOr<PlanChoice> none = ChoosePlan(small, p);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("memory"), std::string::npos) << none.status();
  // CPU workers on one host share its memory: two ranks of 512 MiB do not fit 700 MiB.
  JobSpec cpu = spec;
  for (WorkerCapacity& c : *cpu.mutable_auto_plan()->mutable_workers()) c.set_gpu(false);
  absl::StatusOr<PlanChoice> shared = ChoosePlan(cpu, p);
  ASSERT_FALSE(shared.ok());
  EXPECT_NE(shared.status().message().find("on h need"), std::string::npos) << shared.status();
}

TEST(Chooser, StagesAutoNeedsWorkers) {
  ModelProfile p = MakeProfile(4, {8}, [](int, int) { return 100.0; });
  JobSpec spec = TrainSpec(8);
  spec.mutable_auto_plan()->set_stages(true);
  spec.mutable_schedule()->set_kind(SCHEDULE_GPIPE);
  spec.mutable_schedule()->set_microbatches(1);
  absl::StatusOr<PlanChoice> choice = ChoosePlan(spec, p);
  ASSERT_FALSE(choice.ok());
  EXPECT_NE(choice.status().message().find("start workers or give --stages N"), std::string::npos);
}

TEST(Chooser, InterleavedHoldsTwoStagesPerWorker) {
  ModelProfile p = MakeProfile(8, kSizes, [](int, int b) { return 2000.0 * b; });
  JobSpec spec = TrainSpec(64);
  spec.mutable_auto_plan()->set_schedule(true);
  spec.mutable_auto_plan()->set_microbatches(true);
  spec.mutable_auto_plan()->set_stages(true);
  SetWorkers(Workers(2, "h", 0), &spec);
  absl::StatusOr<PlanChoice> choice = ChoosePlan(spec, p);
  ASSERT_TRUE(choice.ok()) << choice.status();
  bool saw_interleaved = false;
  for (const PlanCandidate& c : choice->candidates()) {
    if (c.schedule() == SCHEDULE_INTERLEAVED_1F1B || c.schedule() == SCHEDULE_ZBV) {
      saw_interleaved = true;
      EXPECT_EQ(c.stages(), 2 * c.workers());
      if (c.schedule() == SCHEDULE_INTERLEAVED_1F1B) {
        EXPECT_EQ(c.microbatches() % c.workers(), 0);
      }
    }
  }
  EXPECT_TRUE(saw_interleaved);
  // Ranked: the first is at least 98% of every other that can run.
  for (const PlanCandidate& c : choice->candidates()) {
    EXPECT_GE(choice->candidates(0).samples_per_second(), (1 - kSimplerWithin) * c.samples_per_second() - 1e-9);
  }
  JobSpec applied = spec;
  Apply(choice->candidates(0), &applied);
  EXPECT_EQ(applied.schedule().kind(), choice->candidates(0).schedule());
  EXPECT_EQ(applied.split().stages(), choice->candidates(0).stages());
}

TEST(Chooser, OneWorkerRunsTheSimplestScheduleAndOneStage) {
  // One worker: every schedule does the same work; none gets two stages on it, and the
  // tie goes to the simplest (GPipe).
  ModelProfile p = MakeProfile(8, kSizes, [](int, int b) { return 2000.0 * b; });
  JobSpec spec = TrainSpec(64);
  spec.mutable_auto_plan()->set_schedule(true);
  spec.mutable_auto_plan()->set_microbatches(true);
  spec.mutable_auto_plan()->set_stages(true);
  SetWorkers(Workers(1, "h", 2), &spec);
  absl::StatusOr<PlanChoice> choice = ChoosePlan(spec, p);
  ASSERT_TRUE(choice.ok()) << choice.status();
  for (const PlanCandidate& c : choice->candidates()) EXPECT_EQ(c.stages(), 1) << RenderChoice(*choice);
  EXPECT_EQ(choice->candidates(0).schedule(), SCHEDULE_GPIPE) << RenderChoice(*choice);
  EXPECT_NE(choice->why().find("best other schedule, 1f1b with 1 micro-batch, 1 stage on 1 worker: "), std::string::npos)
      << choice->why();
  EXPECT_NE(choice->why().find("as fast (the simpler plan is preferred)"), std::string::npos) << choice->why();
}

TEST(Chooser, FallbackTakesTheDefaults) {
  JobSpec spec = TrainSpec(64);
  spec.mutable_auto_plan()->set_schedule(true);
  spec.mutable_auto_plan()->set_microbatches(true);
  spec.mutable_auto_plan()->set_stages(true);
  SetWorkers(Workers(3, "h", 0), &spec);
  PlanChoice c = Fallback(spec, "the backward failed");
  ASSERT_EQ(c.candidates_size(), 1);
  EXPECT_EQ(c.candidates(0).schedule(), SCHEDULE_1F1B);
  EXPECT_EQ(c.candidates(0).workers(), 3);
  EXPECT_EQ(c.candidates(0).stages(), 3);
  EXPECT_EQ(c.candidates(0).microbatches(), 4);  // 4 divides 64 and is >= 3 ranks
  EXPECT_EQ(c.fallback(), "the backward failed");
  EXPECT_NE(RenderChoice(c).find("costs not measured"), std::string::npos);
}

}  // namespace
}  // namespace pippy::autoplan
