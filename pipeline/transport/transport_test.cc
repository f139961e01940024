// The shared transport suite: every backend is instantiated here (loopback today;
// the process backends add their factories).
#include <thread>

#include "ATen/ATen.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/transport/loopback/loopback_transport.h"
#include "pipeline/transport/transport.h"

namespace pippy::transport {
namespace {

using testing::HasSubstr;

struct Backend {
  std::string name;
  std::function<std::vector<std::unique_ptr<Transport>>(int)> create;
  std::function<void(Transport*, int)> kill;
};

class TransportSuite : public testing::TestWithParam<Backend> {
 protected:
  void SetUp() override { ranks_ = GetParam().create(2); }
  Transport& a() { return *ranks_[0]; }
  Transport& b() { return *ranks_[1]; }
  std::vector<std::unique_ptr<Transport>> ranks_;
  const absl::Duration kWait = absl::Seconds(10);
};

Tag T(uint32_t mb, uint32_t index = 0) {
  Tag t;
  t.kind = Tag::Kind::kActivation;
  t.step = 1;
  t.microbatch = mb;
  t.src_stage = 0;
  t.dst_stage = 1;
  t.index = index;
  return t;
}

TEST(Tag, PackUnpack_RoundTrips) {
  Tag t{Tag::Kind::kGradient, 513, 77, 3, 250, 4000};
  Tag u = Tag::Unpack(t.Pack());
  EXPECT_EQ(u.Pack(), t.Pack());
  EXPECT_EQ(u.step, 513u);
  EXPECT_EQ(u.dst_stage, 250u);
  EXPECT_EQ(u.ToString(), "gradient step=513 mb=77 stage 3->250 #4000");
}

TEST_P(TransportSuite, SendThenRecv_DeliversEqualTensor) {
  at::Tensor x = at::randn({3, 4});
  ASSERT_TRUE(a().Send(1, T(0), x)->Wait(kWait).ok());
  auto r = b().Recv(0, T(0));
  ASSERT_TRUE(r->Wait(kWait).ok());
  EXPECT_TRUE(r->Value().toTensor().equal(x));
}

TEST_P(TransportSuite, RecvThenSend_FromAnotherThread) {
  auto r = b().Recv(0, T(1));
  EXPECT_FALSE(r->IsCompleted());
  std::thread sender([&] { a().Send(1, T(1), at::arange(5))->Wait(kWait).IgnoreError(); });
  ASSERT_TRUE(r->Wait(kWait).ok());
  sender.join();
  EXPECT_TRUE(r->Value().toTensor().equal(at::arange(5)));
}

TEST_P(TransportSuite, OutOfOrderTags_MatchByTag) {
  for (int mb = 0; mb < 8; ++mb) a().Send(1, T(mb), at::full({2}, mb));
  for (int mb = 7; mb >= 0; --mb) {
    auto r = b().Recv(0, T(mb));
    ASSERT_TRUE(r->Wait(kWait).ok());
    EXPECT_EQ(r->Value().toTensor()[0].item<float>(), mb);
  }
}

TEST_P(TransportSuite, ShapesAndDtypesChange_BetweenMessages) {
  std::vector<at::Tensor> xs = {at::randn({2, 3}), at::randint(0, 9, {7}, at::kLong), at::ones({0}),
                                at::randn({4, 1, 2}).to(at::kDouble), at::zeros({3}, at::kBool)};
  for (size_t i = 0; i < xs.size(); ++i) a().Send(1, T(0, i), xs[i]);
  for (size_t i = 0; i < xs.size(); ++i) {
    auto r = b().Recv(0, T(0, i));
    ASSERT_TRUE(r->Wait(kWait).ok());
    EXPECT_TRUE(r->Value().toTensor().equal(xs[i]));
    EXPECT_EQ(r->Value().toTensor().scalar_type(), xs[i].scalar_type());
  }
}

TEST_P(TransportSuite, NonContiguousAndStructuredValues_Arrive) {
  at::Tensor base = at::randn({4, 6});
  at::Tensor view = base.t();
  c10::IValue tuple = c10::ivalue::Tuple::create({view, c10::IValue(), c10::IValue(int64_t{7})});
  a().Send(1, T(2), tuple);
  auto r = b().Recv(0, T(2));
  ASSERT_TRUE(r->Wait(kWait).ok());
  auto elems = r->Value().toTupleRef().elements();
  ASSERT_EQ(elems.size(), 3u);
  EXPECT_TRUE(elems[0].toTensor().equal(view));
  EXPECT_TRUE(elems[1].isNone());
  EXPECT_EQ(elems[2].toInt(), 7);
}

TEST_P(TransportSuite, SenderModifiesAfterSendCompletes_ReceiverUnaffected) {
  at::Tensor x = at::zeros({3});
  ASSERT_TRUE(a().Send(1, T(3), x)->Wait(kWait).ok());
  x.fill_(5);
  auto r = b().Recv(0, T(3));
  ASSERT_TRUE(r->Wait(kWait).ok());
  EXPECT_EQ(r->Value().toTensor().sum().item<float>(), 0);
}

TEST_P(TransportSuite, NothingSent_WaitTimesOutNamingPeerAndTag) {
  auto r = b().Recv(0, T(9));
  absl::Status s = r->Wait(absl::Milliseconds(50));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("rank 0"));
  EXPECT_THAT(s.message(), HasSubstr("mb=9"));
}

TEST_P(TransportSuite, Cancel_WaitReturnsCancelled) {
  auto r = b().Recv(0, T(10));
  r->Cancel();
  EXPECT_EQ(r->Wait(kWait).code(), absl::StatusCode::kCancelled);
}

TEST_P(TransportSuite, PeerKilled_PendingRecvFailsUnavailable) {
  auto r = b().Recv(0, T(11));
  GetParam().kill(&b(), 0);
  absl::Status s = r->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(s.message(), HasSubstr("rank 0"));
}

TEST_P(TransportSuite, ManyOutstandingBothDirections_AllArrive) {
  const int n = 200;
  std::vector<std::shared_ptr<Work>> recvs_a, recvs_b;
  for (int i = 0; i < n; ++i) {
    recvs_a.push_back(a().Recv(1, T(i % 4000, 1)));
    recvs_b.push_back(b().Recv(0, T(i % 4000, 2)));
  }
  std::thread ta([&] { for (int i = 0; i < n; ++i) a().Send(1, T(i, 2), at::full({1}, i)); });
  std::thread tb([&] { for (int i = 0; i < n; ++i) b().Send(0, T(i, 1), at::full({1}, -i)); });
  ta.join();
  tb.join();
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(recvs_a[i]->Wait(kWait).ok());
    ASSERT_TRUE(recvs_b[i]->Wait(kWait).ok());
    EXPECT_EQ(recvs_a[i]->Value().toTensor().item<float>(), -i);
    EXPECT_EQ(recvs_b[i]->Value().toTensor().item<float>(), i);
  }
}

TEST_P(TransportSuite, BadPeer_InvalidArgument) {
  EXPECT_EQ(a().Send(5, T(0), at::ones({1}))->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Backends, TransportSuite,
                         testing::Values(Backend{"loopback", loopback::Create, loopback::KillRank}),
                         [](const testing::TestParamInfo<Backend>& i) { return i.param.name; });

}  // namespace
}  // namespace pippy::transport
