// A generation job's spec: CheckSpec's defaults and refusals, and ResolveGeneration
// against a plan (the caches' shapes fill max_slots and max_seq; a model outside the
// contract is refused naming what is wrong).
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"

namespace pippy::job {
namespace {

using testing::HasSubstr;

JobSpec GenerationSpec() {
  JobSpec spec;
  spec.mutable_split()->set_stages(2);
  spec.mutable_serving()->mutable_generation();
  return spec;
}

PipelinePlan Plan(std::vector<std::vector<int64_t>> written) {
  PipelinePlan plan;
  for (const char* n : {"idx", "input_pos", "slots"}) plan.add_inputs()->set_name(n);
  plan.mutable_output()->set_type("Tensor");
  plan.mutable_output()->mutable_example()->set_dtype("float32");
  for (int64_t d : {2, 4, 96}) plan.mutable_output()->mutable_example()->add_shape(d);
  StagePlan* st = plan.add_stages();
  ParameterInfo* w = st->add_parameters();
  w->set_name("blocks.0.attn.q.weight");  // a parameter, not written
  for (int64_t d : {64, 64}) w->add_shape(d);
  for (size_t i = 0; i < written.size(); ++i) {
    ParameterInfo* c = st->add_parameters();
    c->set_name("blocks." + std::to_string(i) + ".attn.k_cache");
    c->set_is_buffer(true);
    c->set_written(true);
    for (int64_t d : written[i]) c->add_shape(d);
  }
  return plan;
}

TEST(GenerationSpec, CheckSpecFillsDefaultsAndRefusesWhatGenerationCannotDo) {
  JobSpec spec = GenerationSpec();
  ASSERT_TRUE(CheckSpec(&spec).ok()) << CheckSpec(&spec);
  EXPECT_EQ(spec.serving().generation().prefill_chunk(), kDefaultPrefillChunk);
  EXPECT_EQ(spec.serving().max_queued(), kDefaultServingMaxQueued);
  EXPECT_EQ(spec.schedule().kind(), SCHEDULE_INFERENCE);

  JobSpec tp = GenerationSpec();
  tp.mutable_tensor_parallel()->set_size(2);
  tp.mutable_tensor_parallel()->add_rules()->set_pattern("blocks.*.attn.q");
  tp.mutable_tensor_parallel()->mutable_rules(0)->set_style(TP_COLWISE);
  EXPECT_THAT(std::string(CheckSpec(&tp).message()), HasSubstr("generation with tensor parallelism"));

  JobSpec bf16 = GenerationSpec();
  bf16.set_precision(PRECISION_BF16);
  EXPECT_THAT(std::string(CheckSpec(&bf16).message()), HasSubstr("generation in bf16"));

  JobSpec bad = GenerationSpec();
  bad.mutable_serving()->mutable_generation()->set_max_slots(-1);
  EXPECT_THAT(std::string(CheckSpec(&bad).message()), HasSubstr("serving.generation.max_slots"));
}

TEST(GenerationSpec, ResolveTakesSlotsAndLengthFromTheCaches) {
  JobSpec spec = GenerationSpec();
  ASSERT_TRUE(CheckSpec(&spec).ok());
  ASSERT_TRUE(ResolveGeneration(Plan({{8, 4, 128, 16}, {8, 4, 96, 16}}), &spec).ok());
  EXPECT_EQ(spec.serving().generation().max_slots(), 8);
  EXPECT_EQ(spec.serving().generation().max_seq(), 96);       // the shortest cache
  EXPECT_EQ(spec.serving().max_batch(), 8);                   // a micro-batch holds at most every slot
  EXPECT_EQ(VocabularyOf(Plan({})), 96);

  JobSpec more = GenerationSpec();
  ASSERT_TRUE(CheckSpec(&more).ok());
  more.mutable_serving()->mutable_generation()->set_max_slots(9);
  absl::Status s = ResolveGeneration(Plan({{8, 4, 128, 16}}), &more);
  EXPECT_THAT(std::string(s.message()), HasSubstr("serving.generation.max_slots: 9 is more than the model's caches hold (8"));
}

TEST(GenerationSpec, ResolveRefusesModelsOutsideTheContract) {
  JobSpec spec = GenerationSpec();
  ASSERT_TRUE(CheckSpec(&spec).ok());
  absl::Status none = ResolveGeneration(Plan({}), &spec);
  EXPECT_THAT(std::string(none.message()), HasSubstr("forward() writes no buffer"));
  absl::Status flat = ResolveGeneration(Plan({{128, 16}}), &spec);
  EXPECT_THAT(std::string(flat.message()),
              HasSubstr("'blocks.0.attn.k_cache' (shape [128, 16]) is written by forward() but is not a cache with a "
                        "slot dimension"));
  PipelinePlan two = Plan({{8, 4, 128, 16}});
  two.mutable_inputs()->RemoveLast();
  EXPECT_THAT(std::string(ResolveGeneration(two, &spec).message()), HasSubstr("forward() takes 2 argument(s) (idx, input_pos)"));
}

}  // namespace
}  // namespace pippy::job
