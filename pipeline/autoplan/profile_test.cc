#include "pipeline/autoplan/profile.h"

#include <string>

#include "gtest/gtest.h"
#include "pipeline/autoplan/chooser.h"
#include "pipeline/partition/model_graph.h"
#include "pipeline/partition/partition.h"
#include "pipeline/torchio/model_io.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::autoplan {
namespace {

std::string ZooPath(const std::string& name) { return "examples/models/zoo/" + name; }

struct Loaded {
  torch::jit::Module model;
  std::vector<c10::IValue> batch;
  int64_t samples = 0;
};

Loaded Load(const std::string& name) {
  torch::jit::setGraphExecutorOptimize(false);  // as the coordinator's preparation runs
  Loaded l;
  absl::StatusOr<torch::jit::Module> m = torchio::LoadModel(ZooPath(name + ".pt"));
  EXPECT_TRUE(m.ok()) << m.status();
  l.model = *m;
  absl::StatusOr<std::vector<c10::IValue>> in = torchio::LoadExampleInputs(ZooPath(name + ".input.pt"), l.model);
  EXPECT_TRUE(in.ok()) << in.status();
  l.batch = *in;
  for (const c10::IValue& v : l.batch) {
    if (v.isTensor()) {
      l.samples = v.toTensor().size(0);
      break;
    }
  }
  return l;
}

class ProfileZoo : public ::testing::TestWithParam<std::string> {};

TEST_P(ProfileZoo, SpansCoverTheModelAndEveryCostIsMeasured) {
  Loaded l = Load(GetParam());
  std::vector<at::Tensor> before;
  for (const auto& p : l.model.named_parameters(true)) before.push_back(p.value.clone());
  for (const auto& b : l.model.named_buffers(true)) before.push_back(b.value.clone());
  ProfileOptions po;
  po.microbatch_sizes = CandidateSizes(l.samples);
  po.repeats = 1;
  absl::StatusOr<ModelProfile> p = ProfileModel(l.model, l.batch, po);
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->microbatch_sizes_size(), static_cast<int>(po.microbatch_sizes.size()));
  EXPECT_EQ(p->microbatch_sizes(p->microbatch_sizes_size() - 1), l.samples);
  absl::StatusOr<std::unique_ptr<partition::ModelGraph>> mg = partition::ModelGraph::Build(l.model);
  ASSERT_TRUE(mg.ok());
  int next = 0;
  int64_t params = 0;
  for (const SpanCost& s : p->spans()) {
    EXPECT_EQ(s.first_node(), next);
    next = s.first_node() + s.num_nodes();
    ASSERT_EQ(s.sizes_size(), p->microbatch_sizes_size());
    for (const SpanSize& z : s.sizes()) {
      EXPECT_GT(z.forward_us(), 0);
      if (s.param_bytes() > 0) {
        EXPECT_GT(z.backward_weight_us(), 0) << s.first_module();
      }
    }
    params += s.param_bytes();
  }
  EXPECT_EQ(next, (*mg)->num_ops());
  int64_t model_params = 0;
  for (const at::Tensor& t : l.model.parameters(true)) model_params += t.numel() * t.element_size();
  EXPECT_GE(params, model_params);  // tied weights count in each span that reads them
  EXPECT_GT(p->optimizer_us_per_mib(), 0);
  // The model is as it was: parameters and buffers (batch-norm statistics) untouched.
  size_t i = 0;
  for (const auto& q : l.model.named_parameters(true)) EXPECT_TRUE(at::equal(q.value, before[i++])) << q.name;
  for (const auto& b : l.model.named_buffers(true)) EXPECT_TRUE(at::equal(b.value, before[i++])) << b.name;
  // The chooser's cuts, from these spans, are legal cuts of the model.
  JobSpec spec;
  spec.set_mode(MODE_TRAIN);
  spec.set_batch_size(static_cast<int32_t>(l.samples));
  spec.mutable_schedule()->set_kind(SCHEDULE_GPIPE);
  spec.mutable_schedule()->set_microbatches(1);
  spec.mutable_auto_plan()->set_stages(true);
  for (int w = 0; w < 3; ++w) spec.mutable_auto_plan()->add_workers()->set_host("h" + std::to_string(w));
  absl::StatusOr<PlanChoice> choice = ChoosePlan(spec, *p);
  ASSERT_TRUE(choice.ok()) << choice.status();
  for (const PlanCandidate& c : choice->candidates()) {
    partition::SplitOptions so;
    so.cuts.assign(c.cuts().begin(), c.cuts().end());
    if (so.cuts.empty()) continue;
    absl::StatusOr<partition::Pipe> pipe = partition::SplitModel(l.model, so);
    ASSERT_TRUE(pipe.ok()) << pipe.status();
    EXPECT_EQ(pipe->plan.stages_size(), c.stages());
    EXPECT_EQ(pipe->plan.split_method(), "auto-plan");
  }
}

INSTANTIATE_TEST_SUITE_P(Zoo, ProfileZoo, ::testing::Values("mlp", "gpt", "unet", "cnn_bn", "multi", "llama"));

TEST(Profile, CutBytesAreTheActivationsCrossing) {
  // The zoo's GPT: d = 32, 16 positions; between blocks only the residual stream
  // [b, 16, 32] float32 crosses: 2048 bytes per sample.
  Loaded l = Load("gpt");
  ProfileOptions po;
  po.microbatch_sizes = {2, 8};
  po.repeats = 1;
  absl::StatusOr<ModelProfile> p = ProfileModel(l.model, l.batch, po);
  ASSERT_TRUE(p.ok()) << p.status();
  int block_cuts = 0;
  for (int j = 0; j + 1 < p->spans_size(); ++j) {
    const SpanCost& s = p->spans(j);
    if (s.sizes(0).cut_bytes() == 2 * 2048) {
      ++block_cuts;
      EXPECT_EQ(s.sizes(1).cut_bytes(), 8 * 2048) << s.last_module();
    }
  }
  EXPECT_GE(block_cuts, 4);
  EXPECT_EQ(p->spans(p->spans_size() - 1).sizes(0).cut_bytes(), 0);  // nothing after the last
}

TEST(Profile, LargerMicrobatchesHoldMoreAndTakeLonger) {
  Loaded l = Load("mlp");
  ProfileOptions po;
  po.microbatch_sizes = {1, 16};
  po.repeats = 2;
  absl::StatusOr<ModelProfile> p = ProfileModel(l.model, l.batch, po);
  ASSERT_TRUE(p.ok()) << p.status();
  int64_t act1 = 0, act16 = 0;
  for (const SpanCost& s : p->spans()) {
    act1 += s.sizes(0).activation_bytes();
    act16 += s.sizes(1).activation_bytes();
  }
  EXPECT_GT(act16, act1);
  // The mlp's hidden activations alone: 16 samples x 32 floats per Linear's output.
  EXPECT_GE(act16, 8 * 16 * 32 * 4);
}

TEST(Profile, ForwardOnlyMeasuresNoBackward) {
  Loaded l = Load("mlp");
  ProfileOptions po;
  po.train = false;
  po.repeats = 1;
  absl::StatusOr<ModelProfile> p = ProfileModel(l.model, l.batch, po);
  ASSERT_TRUE(p.ok()) << p.status();
  for (const SpanCost& s : p->spans()) {
    EXPECT_EQ(s.sizes(0).backward_input_us(), 0);
    EXPECT_EQ(s.sizes(0).backward_weight_us(), 0);
  }
}

TEST(Profile, BadInputsAreRefused) {
  Loaded l = Load("mlp");
  ProfileOptions po;
  po.microbatch_sizes = {3};
  absl::StatusOr<ModelProfile> p = ProfileModel(l.model, l.batch, po);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("do not divide"), std::string::npos) << p.status();
  std::vector<c10::IValue> wrong = {torch::zeros({16, 7})};
  absl::StatusOr<ModelProfile> q = ProfileModel(l.model, wrong, ProfileOptions{});
  ASSERT_FALSE(q.ok());
  EXPECT_TRUE(absl::IsInvalidArgument(q.status())) << q.status();
}

}  // namespace
}  // namespace pippy::autoplan
