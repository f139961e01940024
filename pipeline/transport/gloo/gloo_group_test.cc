// GlooGroup: real gloo TCP endpoints on 127.0.0.1, members as threads of one process.
#include "pipeline/transport/gloo/gloo_group.h"

#include <thread>

#include "gtest/gtest.h"
#include "torch/torch.h"

namespace pippy::transport::gloo_group {
namespace {

// Creates `n` members and connects them (in parallel, as separate hosts would).
std::vector<std::unique_ptr<GlooGroup>> Connected(int n, absl::Duration timeout) {
  std::vector<std::unique_ptr<GlooGroup>> g;
  std::vector<std::string> addresses;
  for (int i = 0; i < n; ++i) {
    auto m = GlooGroup::Create(i, n, "127.0.0.1", timeout);
    EXPECT_TRUE(m.ok()) << m.status();
    addresses.push_back((*m)->address());
    g.push_back(std::move(*m));
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> st(n);
  for (int i = 0; i < n; ++i) threads.emplace_back([&, i] { st[i] = g[i]->Connect(addresses); });
  for (auto& t : threads) t.join();
  for (int i = 0; i < n; ++i) EXPECT_TRUE(st[i].ok()) << st[i];
  return g;
}

TEST(GlooGroup, ThreeMembers_SumInPlace_InOrder) {
  auto g = Connected(3, absl::Seconds(20));
  std::vector<at::Tensor> a, b;
  for (int i = 0; i < 3; ++i) {
    a.push_back(torch::full({1000}, static_cast<float>(i + 1)));
    b.push_back(torch::arange(10, torch::kFloat) * (i + 1));
  }
  std::vector<std::thread> threads;
  std::vector<absl::Status> st(3);
  for (int i = 0; i < 3; ++i) {
    threads.emplace_back([&, i] {
      st[i] = g[i]->AllReduceSum(a[i]);
      if (st[i].ok()) st[i] = g[i]->AllReduceSum(b[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(st[i].ok()) << st[i];
    EXPECT_TRUE(torch::equal(a[i], torch::full({1000}, 6.0f)));
    EXPECT_TRUE(torch::equal(b[i], torch::arange(10, torch::kFloat) * 6));
  }
}

TEST(GlooGroup, MemberThatNeverJoinsTheCollective_OthersFailWithinTheTimeout) {
  auto g = Connected(2, absl::Milliseconds(500));
  at::Tensor x = torch::ones({16});
  const absl::Time start = absl::Now();
  absl::Status s = g[0]->AllReduceSum(x);  // member 1 never calls it
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(absl::IsDeadlineExceeded(s) || absl::IsUnavailable(s)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(GlooGroup, BadInput_ClearErrors) {
  EXPECT_TRUE(absl::IsInvalidArgument(GlooGroup::Create(2, 2, "127.0.0.1", absl::Seconds(1)).status()));
  auto m = GlooGroup::Create(0, 2, "127.0.0.1", absl::Seconds(1));
  ASSERT_TRUE(m.ok());
  EXPECT_TRUE(absl::IsInvalidArgument((*m)->Connect({(*m)->address()})));
  EXPECT_TRUE(absl::IsInvalidArgument((*m)->Connect({(*m)->address(), "xy"})));
  at::Tensor d = torch::ones({4}, torch::kDouble);
  EXPECT_TRUE(absl::IsFailedPrecondition((*m)->AllReduceSum(d)));
}

}  // namespace
}  // namespace pippy::transport::gloo_group
