// UCX between two real processes (this test and ucx_peer): transfer across process
// boundaries, and a peer killed with SIGKILL mid-transfer — the survivor's pending
// operations fail with UNAVAILABLE within the deadline instead of hanging.
#include <chrono>
#include <iostream>

#include "ATen/ATen.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/transport/ucx/peer_process.h"
#include "pipeline/transport/ucx/ucx_transport.h"

namespace pippy::transport::ucx {
namespace {

using testing::HasSubstr;

// The child: ucx_peer in `mode`, stopped by its pid when the test ends.
std::vector<std::string> PeerArgs(const std::string& tls, const std::string& mode, int64_t bytes = 1 << 20) {
  return {"pipeline/transport/ucx/ucx_peer", "--tls", tls, "--mode", mode, "--bytes", std::to_string(bytes)};
}

class UcxProcessTest : public testing::TestWithParam<std::string> {
 protected:
  std::unique_ptr<UcxTransport> Connect(PeerProcess* peer) {
    auto t = peer->Connect(LocalOptions(GetParam()));
    EXPECT_TRUE(t.ok()) << t.status();
    return t.ok() ? std::move(*t) : nullptr;
  }
};

Tag T(uint32_t mb) {
  Tag t;
  t.kind = Tag::Kind::kActivation;
  t.microbatch = mb;
  return t;
}

TEST_P(UcxProcessTest, EchoAcrossProcesses_ValuesComeBackIntact) {
  PeerProcess peer(PeerArgs(GetParam(), "echo"));
  auto t = Connect(&peer);
  ASSERT_NE(t, nullptr);
  std::vector<c10::IValue> values = {at::randn({4, 5}), at::arange(1 << 20, at::kLong), at::ones({0}),
                                     c10::ivalue::Tuple::create({at::randn({3}).t(), c10::IValue(), int64_t{9}}),
                                     at::randn({8, 8}).t()};
  for (uint32_t i = 0; i < values.size(); ++i) {
    auto s = t->Send(1, T(i), values[i]);
    auto r = t->Recv(1, T(i));
    ASSERT_TRUE(r->Wait(absl::Seconds(20)).ok());
    ASSERT_TRUE(s->Wait(absl::Seconds(20)).ok());
    auto got = r->Value();
    if (values[i].isTensor()) {
      EXPECT_TRUE(got.toTensor().equal(values[i].toTensor())) << i;
    } else {
      EXPECT_TRUE(got.toTupleRef().elements()[0].toTensor().equal(values[i].toTupleRef().elements()[0].toTensor()));
      EXPECT_TRUE(got.toTupleRef().elements()[1].isNone());
      EXPECT_EQ(got.toTupleRef().elements()[2].toInt(), 9);
    }
  }
  t->Send(1, T(static_cast<uint32_t>(values.size())), c10::IValue());  // tell the peer to stop
}

TEST_P(UcxProcessTest, PeerKilledMidTransfer_SurvivorFailsWithinDeadline) {
  PeerProcess peer(PeerArgs(GetParam(), "stream", 64 << 20));
  auto t = Connect(&peer);
  ASSERT_NE(t, nullptr);
  auto first = t->Recv(1, T(0));
  ASSERT_TRUE(first->Wait(absl::Seconds(30)).ok());  // data is flowing
  auto pending = t->Recv(1, T(1));
  auto later = t->Recv(1, T(2));
  peer.Kill();
  auto start = std::chrono::steady_clock::now();
  absl::Status s1 = pending->Wait(absl::Seconds(15));
  absl::Status s2 = later->Wait(absl::Seconds(15));
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The first may have completed just before the kill; what is still pending must fail.
  if (!s1.ok()) {
    EXPECT_EQ(s1.code(), absl::StatusCode::kUnavailable) << s1;
    EXPECT_THAT(s1.message(), HasSubstr("rank 1"));
  }
  EXPECT_EQ(s2.code(), absl::StatusCode::kUnavailable) << s2;
  EXPECT_THAT(s2.message(), HasSubstr("peer rank 1 is gone"));
  EXPECT_LT(seconds, 15);
  std::cout << "[ figure   ] " << GetParam() << ": peer death noticed after " << seconds << " s\n";
  // Later operations with the dead peer fail at once.
  EXPECT_EQ(t->Send(1, T(3), at::ones({4}))->Wait(absl::Seconds(5)).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(t->Recv(1, T(4))->Wait(absl::Seconds(5)).code(), absl::StatusCode::kUnavailable);
}

// A peer that sends and exits at once (a pipeline's last rank finishing its step):
// whatever its completed sends handed to UCX still arrives, and messages that arrived
// before the peer left are still received after it is gone.
TEST_P(UcxProcessTest, PeerExitsRightAfterSending_EverythingItSentArrives) {
  const int n = 400;
  std::vector<std::string> args = PeerArgs(GetParam(), "burst", 8 << 10);
  args.insert(args.end(), {"--iters", std::to_string(n)});
  PeerProcess peer(args);
  auto t = Connect(&peer);
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(peer.WaitExit(absl::Seconds(30)), 0);
  absl::SleepFor(absl::Milliseconds(500));  // and this side has noticed it is gone
  for (int i = 0; i < n; ++i) {
    auto r = t->Recv(1, T(i));
    absl::Status s = r->Wait(absl::Seconds(10));
    ASSERT_TRUE(s.ok()) << "message " << i << " of " << n << ": " << s;
    at::Tensor got = r->Value().toTensor();
    ASSERT_EQ(got.numel(), 2048);
    EXPECT_EQ(got[2047].item<float>(), static_cast<float>(i));
  }
  // Nothing more is coming from it.
  EXPECT_EQ(t->Recv(1, T(n))->Wait(absl::Seconds(10)).code(), absl::StatusCode::kUnavailable);
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxProcessTest, testing::Values("sm,self", "tcp,self"),
                         [](const testing::TestParamInfo<std::string>& i) {
                           return i.param.find("tcp") != std::string::npos ? "tcp" : "shm";
                         });

}  // namespace
}  // namespace pippy::transport::ucx
