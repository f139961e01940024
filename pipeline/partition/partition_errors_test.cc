// Every way a user can hand the partitioner bad input gets INVALID_ARGUMENT (or
// NOT_FOUND) with a message that names the thing and says what to do.
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"

namespace pippy::partition {
namespace {

using testing::AllOf;
using testing::HasSubstr;

std::string Zoo(const std::string& f) { return "examples/models/zoo/" + f; }

absl::Status SplitError(const std::string& model, SplitOptions opts) {
  auto m = torchio::LoadModel(Zoo(model));
  EXPECT_TRUE(m.ok()) << m.status();
  return SplitModel(*m, opts).status();
}

TEST(SplitAt, UnknownModule_ListsNearestNames) {
  SplitOptions opts;
  opts.split_at = {"blocks.3.atn"};
  absl::Status s = SplitError("gpt.pt", opts);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("no module 'blocks.3.atn'"), HasSubstr("blocks.3.attn")));
}

TEST(SplitAt, CutCarryingInt_NamesValueAndNearestLegalCut) {
  // Attention computes B, T, C = x.size() first and uses them in its last view():
  // a cut before qkv would carry those ints.
  SplitOptions opts;
  opts.split_at = {"blocks.3.attn.qkv"};
  absl::Status s = SplitError("gpt.pt", opts);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("cannot split at 'blocks.3.attn.qkv'"), HasSubstr("(int,"),
                                 HasSubstr("only tensors can be sent"),
                                 HasSubstr("nearest legal split points are 'blocks.3.attn'")));
}

TEST(SplitAt, SamePositionTwice_Rejected) {
  SplitOptions opts;
  opts.split_at = {"blocks.2", "blocks.1:end"};
  absl::Status s = SplitError("gpt.pt", opts);
  EXPECT_THAT(s.message(), HasSubstr("same position"));
}

TEST(SplitAt, AtStartOfForward_SaysStageWouldBeEmpty) {
  SplitOptions opts;
  opts.split_at = {"0"};
  absl::Status s = SplitError("mlp.pt", opts);
  EXPECT_THAT(s.message(), HasSubstr("one stage would be empty"));
}

TEST(SplitAt, EndSuffix_CutsAfterModule) {
  auto m = torchio::LoadModel(Zoo("gpt.pt"));
  ASSERT_TRUE(m.ok());
  SplitOptions opts;
  opts.split_at = {"blocks.1:end", "blocks.5"};
  auto pipe = SplitModel(*m, opts);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  ASSERT_EQ(pipe->stages.size(), 3u);
  EXPECT_EQ(pipe->plan.stages(1).first_module().rfind("blocks.2", 0), 0u);
  EXPECT_EQ(pipe->plan.stages(2).first_module().rfind("blocks.5", 0), 0u);
}

TEST(SplitAt, PlanSplitPoints_ReproduceTheSplit) {
  // Workers re-split at the coordinator's recorded split points; unnamed cuts are op:N.
  auto m = torchio::LoadModel(Zoo("multi.pt"));
  ASSERT_TRUE(m.ok());
  SplitOptions opts;
  opts.num_stages = 4;
  auto first = SplitModel(*m, opts);
  ASSERT_TRUE(first.ok()) << first.status();
  bool has_op = false;
  for (const auto& p : first->plan.split_points()) has_op |= p.rfind("op:", 0) == 0;
  EXPECT_TRUE(has_op) << "this case should exercise an unnamed cut";
  SplitOptions again;
  again.split_at.assign(first->plan.split_points().begin(), first->plan.split_points().end());
  auto second = SplitModel(*m, again);
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_EQ(second->plan.stages_size(), first->plan.stages_size());
  for (int s = 0; s < first->plan.stages_size(); ++s) {
    EXPECT_EQ(second->plan.stages(s).first_node(), first->plan.stages(s).first_node());
  }
  EXPECT_THAT(SplitError("mlp.pt", [] { SplitOptions o; o.split_at = {"op:x"}; return o; }()).message(),
              HasSubstr("op:N needs a number"));
}

TEST(AutoSplit, MoreStagesThanLegalCuts_SaysHowMany) {
  SplitOptions opts;
  opts.num_stages = 500;
  absl::Status s = SplitError("mlp.pt", opts);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("cannot make 500 stages"), HasSubstr("legal cut point(s)"),
                                 HasSubstr("use fewer stages")));
}

TEST(AutoSplit, FlopsWithoutExample_AsksForExampleInput) {
  SplitOptions opts;
  opts.num_stages = 2;
  opts.balance = BALANCE_FLOPS;
  absl::Status s = SplitError("mlp.pt", opts);
  EXPECT_THAT(s.message(), HasSubstr("needs --example-input"));
}

TEST(Inline, ModuleInterfaceCall_SaysHowToMakeItSplittable) {
  SplitOptions opts;
  opts.num_stages = 2;
  absl::Status s = SplitError("iface.pt", opts);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("cannot inline the call to 'impl.forward'"),
                                 HasSubstr("module interface"), HasSubstr("declare the attribute")));
}

TEST(Markers, PipeSplitModules_GiveTheCuts) {
  auto m = torchio::LoadModel(Zoo("mlp_marked.pt"));
  ASSERT_TRUE(m.ok());
  auto pipe = SplitModel(*m, SplitOptions{});
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  EXPECT_EQ(pipe->plan.split_method(), "markers");
  EXPECT_EQ(pipe->stages.size(), 3u);
}

TEST(Markers, StagesDisagreeingWithMarkers_UsesAutoSplit) {
  auto m = torchio::LoadModel(Zoo("mlp_marked.pt"));
  ASSERT_TRUE(m.ok());
  SplitOptions opts;
  opts.num_stages = 5;
  auto pipe = SplitModel(*m, opts);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  EXPECT_EQ(pipe->plan.split_method(), "auto");
  EXPECT_EQ(pipe->stages.size(), 5u);
}

TEST(ExampleInput, WrongArity_NamesArguments) {
  auto m = torchio::LoadModel(Zoo("multi.pt"));
  ASSERT_TRUE(m.ok());
  auto in = torchio::LoadExampleInputs(Zoo("mlp.input.pt"), *m);
  EXPECT_EQ(in.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(in.status().message(), AllOf(HasSubstr("forward() takes 2 (x, y)")));
}

TEST(ExampleInput, UnknownDictKey_NamesIt) {
  auto m = torchio::LoadModel(Zoo("mlp.pt"));
  ASSERT_TRUE(m.ok());
  auto in = torchio::LoadExampleInputs(Zoo("multi.input.pt"), *m);
  EXPECT_THAT(in.status().message(), HasSubstr("unknown argument(s) x, y"));
}

TEST(ExampleInput, WrongShape_ErrorFromTheStageRun) {
  auto m = torchio::LoadModel(Zoo("mlp.pt"));
  ASSERT_TRUE(m.ok());
  auto bad = torchio::LoadExampleInputs(Zoo("unet.input.pt"), *m);  // 4-d images into an MLP
  ASSERT_TRUE(bad.ok());
  SplitOptions opts;
  opts.num_stages = 2;
  opts.example_inputs = *bad;
  auto pipe = SplitModel(*m, opts);
  EXPECT_EQ(pipe.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(pipe.status().message(), HasSubstr("running the example input through the stages"));
}

TEST(ExampleInput, DictTupleAndTensorForms_AllLoad) {
  auto multi = torchio::LoadModel(Zoo("multi.pt"));
  ASSERT_TRUE(multi.ok());
  auto dict_in = torchio::LoadExampleInputs(Zoo("multi.input.pt"), *multi);
  ASSERT_TRUE(dict_in.ok()) << dict_in.status();
  EXPECT_EQ(dict_in->size(), 2u);
  auto mlp = torchio::LoadModel(Zoo("mlp.pt"));
  auto tensor_in = torchio::LoadExampleInputs(Zoo("mlp.input.pt"), *mlp);
  ASSERT_TRUE(tensor_in.ok());
  EXPECT_TRUE((*tensor_in)[0].isTensor());
}

}  // namespace
}  // namespace pippy::partition
