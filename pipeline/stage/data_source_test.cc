#include "pipeline/stage/data_source.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "torch/csrc/jit/serialization/pickle.h"

namespace pippy::stage {
namespace {

using ::testing::HasSubstr;

std::string Saved(const c10::IValue& v) {
  std::vector<char> bytes = torch::jit::pickle_save(v);
  return std::string(bytes.begin(), bytes.end());
}

std::string TwoInputFile() {
  c10::impl::GenericDict inputs(c10::StringType::get(), c10::AnyType::get());
  inputs.insert("x", torch::arange(10).reshape({5, 2}).to(torch::kFloat));
  inputs.insert("y", torch::arange(5));
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("inputs", inputs);
  d.insert("targets", torch::arange(5) * 10);
  return Saved(d);
}

TEST(DataSource, Batches_WrapAroundTheEnd) {
  auto ds = DataSource::FromBytes(TwoInputFile(), {"x", "y"});
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->num_samples(), 5);
  auto in = ds->Inputs(1, 3);  // rows 3, 4, 0
  EXPECT_TRUE(in[1].toTensor().equal(torch::tensor({3, 4, 0})));
  EXPECT_TRUE(ds->Target(1, 3).toTensor().equal(torch::tensor({30, 40, 0})));
}

TEST(DataSource, Share_HoldsOnlyWhatTheRankNeeds_AndGivesTheSameBatches) {
  auto ds = DataSource::FromBytes(TwoInputFile(), {"x", "y"});
  ASSERT_TRUE(ds.ok());
  // A rank reading only input y, and a rank computing the loss only.
  auto y_share = ds->ShareBytes({1}, false);
  auto loss_share = ds->ShareBytes({}, true);
  ASSERT_TRUE(y_share.ok() && loss_share.ok());
  auto y_rank = DataSource::FromShareBytes(*y_share, {"x", "y"});
  auto loss_rank = DataSource::FromShareBytes(*loss_share, {"x", "y"});
  ASSERT_TRUE(y_rank.ok()) << y_rank.status();
  ASSERT_TRUE(loss_rank.ok()) << loss_rank.status();
  for (int step = 0; step < 4; ++step) {
    auto want = ds->Inputs(step, 3);
    auto got = y_rank->Inputs(step, 3);
    EXPECT_TRUE(got[0].isNone());
    EXPECT_TRUE(got[1].toTensor().equal(want[1].toTensor()));
    EXPECT_FALSE(y_rank->has_targets());
    EXPECT_TRUE(loss_rank->Target(step, 3).toTensor().equal(ds->Target(step, 3).toTensor()));
    EXPECT_TRUE(loss_rank->Inputs(step, 3)[0].isNone());
  }
  EXPECT_TRUE(ds->ShareBytes({}, false)->empty());
  auto nothing = DataSource::FromShareBytes("", {"x", "y"});
  ASSERT_TRUE(nothing.ok());
  EXPECT_EQ(nothing->Inputs(0, 2).size(), 2u);
}

TEST(DataSource, BadFiles_AreNamed) {
  EXPECT_THAT(std::string(DataSource::FromBytes("hello", {"x"}).status().message()), HasSubstr("not a file written by torch.save"));
  EXPECT_THAT(std::string(DataSource::FromBytes(Saved(torch::ones({2})), {"x"}).status().message()),
              HasSubstr("expected a dict"));
  EXPECT_THAT(std::string(DataSource::FromBytes(TwoInputFile(), {"x"}).status().message()), HasSubstr("unknown argument"));
  EXPECT_THAT(std::string(DataSource::FromShareBytes(TwoInputFile(), {"x", "y"}).status().message()),
              HasSubstr("lacks"));
}

}  // namespace
}  // namespace pippy::stage
