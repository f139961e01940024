#include "pipeline/job/job_spec.h"
#include "pipeline/job/job_plan.h"

#include <cmath>
#include <functional>
#include <limits>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pippy::job {
namespace {

using ::testing::HasSubstr;

JobSpec TrainSpec() {
  JobSpec spec;
  spec.mutable_split()->set_stages(2);
  spec.mutable_schedule()->set_kind(SCHEDULE_1F1B);
  spec.mutable_schedule()->set_microbatches(4);
  spec.set_loss(LOSS_MSE);
  spec.mutable_optimizer()->set_kind(OPTIMIZER_ADAMW);
  spec.mutable_optimizer()->set_lr(0.001);
  spec.set_steps(3);
  spec.set_batch_size(8);
  return spec;
}

TEST(JobSpecNames, ScheduleNames_RoundTrip_AndTorchNamesParse) {
  for (const char* name : {"gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "zb1p", "zbv", "inference"}) {
    auto kind = ParseSchedule(name);
    ASSERT_TRUE(kind.ok()) << name;
    EXPECT_EQ(ScheduleName(*kind), name);
  }
  EXPECT_EQ(*ParseSchedule("ZBVZeroBubble"), SCHEDULE_ZBV);
  EXPECT_EQ(*ParseSchedule("Interleaved1F1B"), SCHEDULE_INTERLEAVED_1F1B);
  EXPECT_THAT(std::string(ParseSchedule("zigzag").status().message()), HasSubstr("unknown schedule 'zigzag'"));
}

TEST(JobSpecNames, LossOptimizerBalance_RoundTrip_AndUnknownNamesListChoices) {
  for (const char* n : {"mse", "cross_entropy", "model"}) EXPECT_EQ(LossName(*ParseLoss(n)), n);
  for (const char* n : {"sgd", "adam", "adamw"}) EXPECT_EQ(OptimizerName(*ParseOptimizer(n)), n);
  for (const char* n : {"params", "flops", "time"}) EXPECT_EQ(BalanceName(*ParseBalance(n)), n);
  EXPECT_THAT(std::string(ParseOptimizer("lamb").status().message()),
              HasSubstr("unknown optimizer 'lamb': use sgd, adam, adamw"));
  EXPECT_THAT(std::string(ParseLoss("l1").status().message()), HasSubstr("use mse, cross_entropy, model"));
}

TEST(JobSpecNames, Precision_RoundTrip_DefaultsToFp32_AndRefusesOthers) {
  EXPECT_EQ(*ParsePrecision("bf16"), PRECISION_BF16);
  EXPECT_EQ(PrecisionName(*ParsePrecision("fp32")), "fp32");
  EXPECT_EQ(PrecisionName(PRECISION_UNSPECIFIED), "fp32");
  auto bad = ParsePrecision("fp16");
  ASSERT_FALSE(bad.ok());
  EXPECT_THAT(std::string(bad.status().message()), testing::HasSubstr("--dtype 'fp16': use fp32, bf16"));
  JobSpec spec = TrainSpec();
  ASSERT_TRUE(CheckSpec(&spec).ok());
  EXPECT_EQ(spec.precision(), PRECISION_FP32);
  spec.set_precision(static_cast<Precision>(7));
  EXPECT_THAT(std::string(CheckSpec(&spec).message()), testing::HasSubstr("precision: use fp32 or bf16"));
}

TEST(CheckSpec, AdamW_WithoutWeightDecay_GetsTorchDefault) {
  JobSpec spec = TrainSpec();
  ASSERT_TRUE(CheckSpec(&spec).ok());
  EXPECT_DOUBLE_EQ(spec.optimizer().weight_decay(), 0.01);
  EXPECT_DOUBLE_EQ(spec.optimizer().beta1(), 0.9);
  EXPECT_DOUBLE_EQ(spec.optimizer().beta2(), 0.999);
  EXPECT_EQ(spec.mode(), MODE_TRAIN);
  EXPECT_EQ(spec.schedule().stages_per_worker(), 1);
  EXPECT_EQ(spec.split().balance(), BALANCE_PARAMS);
}

TEST(CheckSpec, ExplicitZeroWeightDecay_IsKept) {
  JobSpec spec = TrainSpec();
  spec.mutable_optimizer()->set_weight_decay(0);
  ASSERT_TRUE(CheckSpec(&spec).ok());
  EXPECT_EQ(spec.optimizer().weight_decay(), 0);
  JobSpec sgd = TrainSpec();
  sgd.mutable_optimizer()->set_kind(OPTIMIZER_SGD);
  ASSERT_TRUE(CheckSpec(&sgd).ok());
  EXPECT_EQ(sgd.optimizer().weight_decay(), 0);
}

TEST(CheckSpec, InterleavedWithoutStagesPerWorker_DefaultsToTwo) {
  JobSpec spec = TrainSpec();
  spec.mutable_schedule()->set_kind(SCHEDULE_INTERLEAVED_1F1B);
  ASSERT_TRUE(CheckSpec(&spec).ok());
  EXPECT_EQ(spec.schedule().stages_per_worker(), 2);
}

TEST(CheckSpec, BadFields_AreNamed) {
  struct Case {
    std::function<void(JobSpec*)> change;
    std::string want;
  };
  std::vector<Case> cases = {
      {[](JobSpec* s) { s->mutable_schedule()->clear_kind(); }, "schedule.kind: missing"},
      {[](JobSpec* s) { s->mutable_schedule()->set_microbatches(0); }, "schedule.microbatches"},
      {[](JobSpec* s) { s->set_batch_size(6); }, "batch_size: 6 does not split into 4"},
      {[](JobSpec* s) { s->set_steps(0); }, "steps: must be at least 1"},
      {[](JobSpec* s) { s->clear_loss(); }, "loss: missing"},
      {[](JobSpec* s) { s->mutable_optimizer()->clear_kind(); }, "optimizer.kind: missing"},
      {[](JobSpec* s) { s->mutable_optimizer()->set_lr(0); }, "optimizer.lr"},
      {[](JobSpec* s) { s->mutable_optimizer()->set_momentum(0.9); }, "only sgd takes momentum"},
      {[](JobSpec* s) { s->mutable_optimizer()->set_lr_schedule(static_cast<LrScheduleKind>(9)); },
       "optimizer.lr_schedule: use constant, linear or cosine"},
      {[](JobSpec* s) { s->mutable_optimizer()->set_warmup_steps(-1); }, "optimizer.warmup_steps: must not be negative"},
      {[](JobSpec* s) {
         s->mutable_optimizer()->set_lr_schedule(LR_SCHEDULE_COSINE);
         s->mutable_optimizer()->set_warmup_steps(3);
       },
       "optimizer.warmup_steps: 3 leaves none of the 3 steps to decay over"},
      {[](JobSpec* s) {
         s->mutable_optimizer()->set_lr_schedule(LR_SCHEDULE_LINEAR);
         s->mutable_optimizer()->set_min_lr(0.01);
       },
       "optimizer.min_lr: 0.01 is above lr (0.001)"},
      {[](JobSpec* s) { s->mutable_optimizer()->set_min_lr(1e-4); }, "only the linear and cosine schedules decay"},
      {[](JobSpec* s) {
         s->mutable_optimizer()->set_lr_schedule(LR_SCHEDULE_COSINE);
         s->mutable_optimizer()->set_min_lr(std::nan(""));
       },
       "optimizer.min_lr: must be a finite number >= 0"},
      {[](JobSpec* s) { s->mutable_split()->set_stages(0); }, "split: give split.stages or split.split_at"},
      {[](JobSpec* s) { s->set_mode(MODE_INFERENCE); }, "an inference job runs the inference schedule"},
      {[](JobSpec* s) { s->mutable_schedule()->set_kind(SCHEDULE_INFERENCE); s->set_mode(MODE_TRAIN); },
       "inference runs forward only"},
  };
  for (const Case& c : cases) {
    JobSpec spec = TrainSpec();
    c.change(&spec);
    absl::Status s = CheckSpec(&spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.want));
  }
}

TEST(CheckSpec, LrSchedule_DefaultsToConstant_InferenceTakesNone) {
  JobSpec spec = TrainSpec();
  ASSERT_TRUE(CheckSpec(&spec).ok());
  EXPECT_EQ(spec.optimizer().lr_schedule(), LR_SCHEDULE_CONSTANT);
  JobSpec cosine = TrainSpec();
  cosine.mutable_optimizer()->set_lr_schedule(LR_SCHEDULE_COSINE);
  cosine.mutable_optimizer()->set_warmup_steps(2);
  cosine.mutable_optimizer()->set_min_lr(1e-4);
  EXPECT_TRUE(CheckSpec(&cosine).ok()) << CheckSpec(&cosine);
  JobSpec inference = TrainSpec();
  inference.mutable_schedule()->set_kind(SCHEDULE_INFERENCE);
  inference.clear_loss();
  inference.clear_optimizer();
  inference.mutable_optimizer()->set_warmup_steps(2);
  const absl::Status s = CheckSpec(&inference);
  EXPECT_THAT(std::string(s.message()), HasSubstr("an inference job has no learning rate"));
}

TEST(CheckSpec, InferenceSchedule_ImpliesInferenceMode_AndNeedsNoOptimizer) {
  JobSpec spec = TrainSpec();
  spec.mutable_schedule()->set_kind(SCHEDULE_INFERENCE);
  spec.clear_loss();
  spec.clear_optimizer();
  ASSERT_TRUE(CheckSpec(&spec).ok());
  EXPECT_EQ(spec.mode(), MODE_INFERENCE);
}

TEST(CheckSpec, FaultTolerance_DefaultsAndLimits) {
  JobSpec spec = TrainSpec();
  spec.set_steps(120);
  ASSERT_TRUE(CheckSpec(&spec).ok());
  EXPECT_EQ(spec.fault_tolerance().checkpoint_every(), 50);
  EXPECT_EQ(spec.fault_tolerance().max_restarts(), 3);
  EXPECT_DOUBLE_EQ(spec.fault_tolerance().recovery_timeout_s(), 300);
  // After steps 50 and 100, never after the last one or before the first.
  EXPECT_FALSE(CheckpointAfter(spec, 0));
  EXPECT_TRUE(CheckpointAfter(spec, 50));
  EXPECT_FALSE(CheckpointAfter(spec, 51));
  EXPECT_TRUE(CheckpointAfter(spec, 100));
  spec.set_steps(100);
  EXPECT_FALSE(CheckpointAfter(spec, 100));
  spec.mutable_fault_tolerance()->set_checkpoint_every(0);  // explicitly none
  ASSERT_TRUE(CheckSpec(&spec).ok());
  EXPECT_EQ(spec.fault_tolerance().checkpoint_every(), 0);
  EXPECT_FALSE(CheckpointAfter(spec, 50));

  JobSpec bad = TrainSpec();
  bad.mutable_fault_tolerance()->set_max_restarts(-1);
  EXPECT_THAT(std::string(CheckSpec(&bad).message()), HasSubstr("fault_tolerance.max_restarts"));
  bad = TrainSpec();
  bad.mutable_fault_tolerance()->set_recovery_timeout_s(0);
  EXPECT_THAT(std::string(CheckSpec(&bad).message()), HasSubstr("fault_tolerance.recovery_timeout_s: must be a finite number > 0"));
}


// Found by fuzz/job_spec_fuzz's seeds: a spec alone must not size the coordinator's
// memory (a schedule has an action per micro-batch and stage) or overflow its checks.
TEST(CheckSpec, HostileNumbers_AreRefused) {
  JobSpec many = TrainSpec();
  many.mutable_schedule()->set_microbatches(1 << 30);
  many.set_batch_size(1 << 30);
  EXPECT_THAT(std::string(CheckSpec(&many).message()), HasSubstr("schedule.microbatches: at most 16384"));
  JobSpec overflow = TrainSpec();
  overflow.mutable_schedule()->set_microbatches(1 << 16);
  overflow.set_batch_size(1 << 16);
  overflow.set_replicas(1 << 16);
  EXPECT_FALSE(CheckSpec(&overflow).ok());
  JobSpec inf = TrainSpec();
  inf.mutable_optimizer()->set_lr(std::numeric_limits<double>::infinity());
  EXPECT_THAT(std::string(CheckSpec(&inf).message()), HasSubstr("optimizer.lr: must be a finite number"));
  JobSpec nan = TrainSpec();
  nan.mutable_optimizer()->set_momentum(std::nan(""));
  EXPECT_THAT(std::string(CheckSpec(&nan).message()), HasSubstr("optimizer.momentum: must be a finite number"));
}

// CheckPlan: what fuzz/plan_json_fuzz checks every parsed plan with before use.
TEST(CheckSpec, Serving_FillsTheInferenceScheduleAndDefaults) {
  JobSpec spec;
  spec.mutable_split()->set_stages(3);
  spec.mutable_serving();
  ASSERT_TRUE(CheckSpec(&spec).ok()) << CheckSpec(&spec);
  EXPECT_EQ(spec.schedule().kind(), SCHEDULE_INFERENCE);
  EXPECT_EQ(spec.mode(), MODE_INFERENCE);
  EXPECT_EQ(spec.schedule().microbatches(), 1);
  EXPECT_EQ(spec.serving().max_batch(), kDefaultServingMaxBatch);
  EXPECT_EQ(spec.serving().max_delay_ms(), kDefaultServingMaxDelayMs);
  EXPECT_EQ(spec.batch_size(), kDefaultServingMaxBatch);
  EXPECT_EQ(spec.steps(), 0);
  // An explicit 0 ms delay is kept (send at once).
  JobSpec now;
  now.mutable_split()->set_stages(2);
  now.mutable_serving()->set_max_delay_ms(0);
  now.mutable_serving()->set_max_batch(7);
  ASSERT_TRUE(CheckSpec(&now).ok());
  EXPECT_EQ(now.serving().max_delay_ms(), 0);
  EXPECT_EQ(now.batch_size(), 7);
}

TEST(CheckSpec, Serving_ConflictingFieldsAreNamed) {
  auto serving = [] {
    JobSpec spec;
    spec.mutable_split()->set_stages(2);
    spec.mutable_serving();
    return spec;
  };
  struct Case {
    std::function<void(JobSpec*)> mutate;
    const char* field;
  };
  const std::vector<Case> cases = {
      {[](JobSpec* s) { s->mutable_schedule()->set_kind(SCHEDULE_1F1B); }, "schedule.kind"},
      {[](JobSpec* s) { s->set_mode(MODE_TRAIN); }, "mode"},
      {[](JobSpec* s) { s->mutable_schedule()->set_microbatches(4); }, "schedule.microbatches"},
      {[](JobSpec* s) { s->set_steps(10); }, "steps"},
      {[](JobSpec* s) { s->set_replicas(2); }, "replicas"},
      {[](JobSpec* s) { s->set_batch_size(5); }, "batch_size"},
      {[](JobSpec* s) { s->mutable_serving()->set_max_batch(-1); }, "serving.max_batch"},
      {[](JobSpec* s) { s->mutable_serving()->set_max_batch(kMaxServingBatch + 1); }, "serving.max_batch"},
      {[](JobSpec* s) { s->mutable_serving()->set_max_delay_ms(-1); }, "serving.max_delay_ms"},
      {[](JobSpec* s) { s->mutable_serving()->set_max_delay_ms(60001); }, "serving.max_delay_ms"},
      {[](JobSpec* s) { s->mutable_serving()->set_max_inflight(-1); }, "serving.max_inflight"},
  };
  for (const Case& c : cases) {
    JobSpec spec = serving();
    c.mutate(&spec);
    absl::Status s = CheckSpec(&spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field));
  }
}

TEST(CheckPlan, BrokenCrossReferences_AreNamed) {
  PipelinePlan plan;
  plan.add_inputs()->set_name("x");
  for (int s = 0; s < 2; ++s) {
    StagePlan* st = plan.add_stages();
    st->set_index(s);
    StageInput* in = st->add_inputs();
    if (s == 0) {
      in->set_model_input(0);
    } else {
      in->set_source_stage(0);
      in->set_source_output(0);
    }
    st->add_outputs()->set_name("y");
    st->set_is_last(s == 1);
  }
  plan.mutable_stages(0)->mutable_outputs(0)->add_consumers(1);
  EXPECT_TRUE(CheckPlan(plan).ok()) << CheckPlan(plan);
  auto broken = [&](auto&& edit) {
    PipelinePlan p = plan;
    edit(p);
    return std::string(CheckPlan(p).message());
  };
  EXPECT_THAT(broken([](PipelinePlan& p) { p.clear_stages(); }), HasSubstr("plan: no stages"));
  EXPECT_THAT(broken([](PipelinePlan& p) { p.mutable_stages(1)->set_index(5); }),
              HasSubstr("stages[1].index is 5"));
  EXPECT_THAT(broken([](PipelinePlan& p) { p.mutable_stages(1)->mutable_inputs(0)->set_source_stage(1); }),
              HasSubstr("stages[1].inputs[0].source_stage 1 is not an earlier stage"));
  EXPECT_THAT(broken([](PipelinePlan& p) { p.mutable_stages(1)->mutable_inputs(0)->set_source_output(3); }),
              HasSubstr("source_output 3 is not one of stage 0's 1 outputs"));
  EXPECT_THAT(broken([](PipelinePlan& p) { p.mutable_stages(0)->mutable_inputs(0)->set_model_input(2); }),
              HasSubstr("model_input 2 is not one of the 1 model inputs"));
  EXPECT_THAT(broken([](PipelinePlan& p) { p.mutable_stages(0)->mutable_outputs(0)->add_consumers(9); }),
              HasSubstr("names consumer 9, not a later stage"));
  EXPECT_THAT(broken([](PipelinePlan& p) { p.mutable_stages(0)->set_is_last(true); }),
              HasSubstr("only the last stage is"));
  EXPECT_THAT(broken([](PipelinePlan& p) { p.mutable_stages(0)->add_parameters()->set_tie_group(4); }),
              HasSubstr("tie_group 4 is not one of the 0 tied groups"));
  EXPECT_THAT(broken([](PipelinePlan& p) { p.add_tied()->add_stages(7); }), HasSubstr("tied[0] names stage 7 of 2"));
}

}  // namespace
}  // namespace pippy::job
