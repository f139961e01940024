#include "worker/token_sampler.h"

#include <map>

#include "gtest/gtest.h"
#include "torch/torch.h"

namespace pippy::worker {
namespace {

google::protobuf::RepeatedPtrField<SampleRow> Rows(int n, float temperature, int top_k, float top_p, uint64_t seed) {
  google::protobuf::RepeatedPtrField<SampleRow> rows;
  for (int i = 0; i < n; ++i) {
    SampleRow* r = rows.Add();
    r->set_sample(true);
    r->set_temperature(temperature);
    r->set_top_k(top_k);
    r->set_top_p(top_p);
    r->set_seed(seed);
    r->set_token_index(i);
  }
  return rows;
}

TEST(TokenSampler, GreedyTakesTheLastPositionsArgmaxAndSkipsUnsampledRows) {
  torch::manual_seed(1);
  const at::Tensor logits = torch::randn({3, 5, 11});
  auto rows = Rows(3, 0, 0, 0, 0);
  rows[1].set_sample(false);
  auto tokens = SampleTokens(logits, rows);
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ((*tokens)[0], logits[0][4].argmax().item<int64_t>());
  EXPECT_EQ((*tokens)[1], -1);
  EXPECT_EQ((*tokens)[2], logits[2][4].argmax().item<int64_t>());
}

TEST(TokenSampler, ASeededDrawDependsOnItsSeedAndIndexOnly) {
  torch::manual_seed(2);
  const at::Tensor one = torch::randn({1, 1, 50});
  // The same row alone and as row 2 of a batch of other logits: the same token.
  at::Tensor batch = torch::randn({4, 1, 50});
  batch[2] = one[0];
  auto alone = Rows(1, 0.8f, 20, 0, 7);
  alone[0].set_token_index(5);
  auto among = Rows(4, 0.8f, 20, 0, 99);
  among[2].set_seed(7);
  among[2].set_token_index(5);
  for (int run = 0; run < 3; ++run) {
    auto a = SampleTokens(one, alone);
    auto b = SampleTokens(batch, among);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ((*a)[0], (*b)[2]);
  }
  // Other seeds give other draws (not all 32 alike).
  std::map<int64_t, int> seen;
  for (uint64_t seed = 0; seed < 32; ++seed) {
    alone[0].set_seed(seed);
    seen[(*SampleTokens(one, alone))[0]]++;
  }
  EXPECT_GT(seen.size(), 3u);
}

TEST(TokenSampler, TopKAndTopPKeepOnlyTheLikeliestTokens) {
  // Probabilities ~ 0.6, 0.3, 0.05, ... : top-k 2 and top-p 0.8 both leave tokens 3 and 7.
  at::Tensor logits = torch::full({1, 10}, -10.0);
  logits[0][3] = std::log(0.6);
  logits[0][7] = std::log(0.3);
  logits[0][1] = std::log(0.05);
  logits[0][5] = std::log(0.05);
  for (int mode = 0; mode < 2; ++mode) {
    std::map<int64_t, int> seen;
    for (uint64_t seed = 0; seed < 200; ++seed) {
      auto rows = mode == 0 ? Rows(1, 1.0f, 2, 0, seed) : Rows(1, 1.0f, 0, 0.8f, seed);
      auto t = SampleTokens(logits, rows);
      ASSERT_TRUE(t.ok());
      seen[(*t)[0]]++;
    }
    EXPECT_EQ(seen.size(), 2u) << "mode " << mode;
    EXPECT_GT(seen[3], seen[7]) << "mode " << mode;
    EXPECT_GT(seen[7], 20) << "mode " << mode;
  }
}

TEST(TokenSampler, RefusesOutputsThatAreNotLogitsPerRow) {
  auto rows = Rows(2, 0, 0, 0, 0);
  auto wrong_rows = SampleTokens(torch::zeros({3, 1, 4}), rows);
  ASSERT_FALSE(wrong_rows.ok());
  EXPECT_NE(wrong_rows.status().message().find("Float[3, 1, 4]"), std::string::npos) << wrong_rows.status();
  EXPECT_FALSE(SampleTokens(torch::zeros({2}), rows).ok());
  EXPECT_FALSE(SampleTokens(torch::zeros({2, 1, 4}, torch::kLong), rows).ok());
}

}  // namespace
}  // namespace pippy::worker
