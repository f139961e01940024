// The shared transport suite: every backend is instantiated here (loopback today;
// the process backends add their factories).
#include <thread>

#include "ATen/ATen.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/transport/loopback/loopback_transport.h"
#include "pipeline/transport/nccl/nccl_transport.h"
#include "pipeline/transport/ucx/ucx_transport.h"
#include "pipeline/transport/transport.h"

namespace pippy::transport {
namespace {

using testing::HasSubstr;

struct Backend {
  std::string name;
  std::function<std::vector<std::unique_ptr<Transport>>(int)> create;
  // Makes `rank` vanish (its process or worker gone).
  std::function<void(std::vector<std::unique_ptr<Transport>>&, int)> kill;
  // Non-empty: why this backend cannot run here (the suite skips with it).
  std::function<std::string()> unavailable = [] { return std::string(); };
  bool matches_by_order = false;  // NCCL: the n-th send meets the n-th receive
};

// Tensors compare equal whatever device they arrived on.
bool Same(const at::Tensor& a, const at::Tensor& b) { return a.cpu().equal(b.cpu()); }

class TransportSuite : public testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    std::string why = GetParam().unavailable();
    if (!why.empty()) GTEST_SKIP() << why;
    ranks_ = GetParam().create(2);
    ASSERT_EQ(ranks_.size(), 2u) << "backend " << GetParam().name << " did not start";
  }
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
  absl::Status sent = a().Send(1, T(0), x)->Wait(kWait);
  ASSERT_TRUE(sent.ok()) << sent;
  auto r = b().Recv(0, T(0));
  absl::Status got = r->Wait(kWait);
  ASSERT_TRUE(got.ok()) << got;
  EXPECT_TRUE(Same(r->Value().toTensor(), x));
}

TEST_P(TransportSuite, RecvThenSend_FromAnotherThread) {
  auto r = b().Recv(0, T(1));
  EXPECT_FALSE(r->IsCompleted());
  std::thread sender([&] { a().Send(1, T(1), at::arange(5))->Wait(kWait).IgnoreError(); });
  ASSERT_TRUE(r->Wait(kWait).ok());
  sender.join();
  EXPECT_TRUE(Same(r->Value().toTensor(), at::arange(5)));
}

TEST_P(TransportSuite, OutOfOrderTags_MatchByTag) {
  if (GetParam().matches_by_order) GTEST_SKIP() << "this backend matches messages by order, not by tag (by design)";
  for (int mb = 0; mb < 8; ++mb) a().Send(1, T(mb), at::full({2}, mb));
  for (int mb = 7; mb >= 0; --mb) {
    auto r = b().Recv(0, T(mb));
    ASSERT_TRUE(r->Wait(kWait).ok());
    EXPECT_EQ(r->Value().toTensor()[0].cpu().item<float>(), mb);
  }
}

TEST_P(TransportSuite, ShapesAndDtypesChange_BetweenMessages) {
  std::vector<at::Tensor> xs = {at::randn({2, 3}), at::randint(0, 9, {7}, at::kLong), at::ones({0}),
                                at::randn({4, 1, 2}).to(at::kDouble), at::zeros({3}, at::kBool)};
  for (size_t i = 0; i < xs.size(); ++i) a().Send(1, T(0, i), xs[i]);
  for (size_t i = 0; i < xs.size(); ++i) {
    auto r = b().Recv(0, T(0, i));
    ASSERT_TRUE(r->Wait(kWait).ok());
    EXPECT_TRUE(Same(r->Value().toTensor(), xs[i]));
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
  EXPECT_TRUE(Same(elems[0].toTensor(), view));
  EXPECT_TRUE(elems[1].isNone());
  EXPECT_EQ(elems[2].toInt(), 7);
}

TEST_P(TransportSuite, SenderModifiesAfterSendCompletes_ReceiverUnaffected) {
  at::Tensor x = at::zeros({3});
  ASSERT_TRUE(a().Send(1, T(3), x)->Wait(kWait).ok());
  x.fill_(5);
  auto r = b().Recv(0, T(3));
  ASSERT_TRUE(r->Wait(kWait).ok());
  EXPECT_EQ(r->Value().toTensor().sum().cpu().item<float>(), 0);
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
  if (!GetParam().kill) {
    GTEST_SKIP() << "UCX notices a dead shared-memory peer by its process exiting; a peer in this process "
                    "never exits. Covered with a real child process killed by SIGKILL in ucx_process_test.";
  }
  auto r = b().Recv(0, T(11));
  GetParam().kill(ranks_, 0);
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
    EXPECT_EQ(recvs_a[i]->Value().toTensor().cpu().item<float>(), -i);
    EXPECT_EQ(recvs_b[i]->Value().toTensor().cpu().item<float>(), i);
  }
}

TEST_P(TransportSuite, BadPeer_InvalidArgument) {
  EXPECT_EQ(a().Send(5, T(0), at::ones({1}))->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
}

TEST_P(TransportSuite, SizesFromZeroTo256MiB_ArriveIntact) {
  for (int64_t bytes : {int64_t{0}, int64_t{4}, int64_t{1} << 10, int64_t{64} << 10, int64_t{1} << 20,
                        int64_t{16} << 20, int64_t{256} << 20}) {
    at::Tensor x = at::arange(bytes / 4, at::kInt);
    auto sent = a().Send(1, T(20, static_cast<uint32_t>(bytes % 4096)), x);
    auto r = b().Recv(0, T(20, static_cast<uint32_t>(bytes % 4096)));
    ASSERT_TRUE(r->Wait(absl::Seconds(60)).ok()) << bytes;
    ASSERT_TRUE(sent->Wait(absl::Seconds(60)).ok()) << bytes;
    EXPECT_TRUE(Same(r->Value().toTensor(), x)) << bytes;
  }
}

TEST_P(TransportSuite, EveryDtypeTheRuntimeSends_RoundTrips) {
  std::vector<c10::ScalarType> types = {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong,
                                        at::kInt,   at::kShort,  at::kChar, at::kByte,     at::kBool};
  for (size_t i = 0; i < types.size(); ++i) {
    at::Tensor x = at::randn({5, 3}).mul(10).to(types[i]);
    a().Send(1, T(21, i), x);
    auto r = b().Recv(0, T(21, i));
    ASSERT_TRUE(r->Wait(kWait).ok());
    EXPECT_EQ(r->Value().toTensor().scalar_type(), types[i]);
    EXPECT_TRUE(Same(r->Value().toTensor(), x)) << c10::toString(types[i]);
  }
}

std::vector<std::unique_ptr<Transport>> Ucx(int n, const char* tls) {
  ucx::Options o;
  o.ucx_config = {{"TLS", tls}};
  if (std::string(tls).find("tcp") != std::string::npos) o.ucx_config.push_back({"NET_DEVICES", "lo"});
  auto g = ucx::CreateLocalGroup(n, o);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? std::move(*g) : std::vector<std::unique_ptr<Transport>>{};
}

std::vector<std::unique_ptr<Transport>> Nccl(int n) {
  std::vector<std::unique_ptr<Transport>> out(n);
  auto id = nccl::NewUniqueId();
  EXPECT_TRUE(id.ok()) << id.status();
  if (!id.ok()) return {};
  std::vector<std::thread> threads;  // joining a communicator is collective
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      nccl::Options o;
      o.device = r;
      o.abort_after = absl::Seconds(3);
      auto t = nccl::Create(r, n, *id, o);
      if (t.ok()) out[r] = std::move(*t);
    });
  }
  for (auto& t : threads) t.join();
  for (auto& t : out) {
    if (!t) return {};
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    Backends, TransportSuite,
    testing::Values(
        Backend{"loopback", loopback::Create,
                [](std::vector<std::unique_ptr<Transport>>& g, int r) { loopback::KillRank(g[1 - r].get(), r); }},
        Backend{"ucx_shm", [](int n) { return Ucx(n, "sm,self"); }, nullptr},
        Backend{"ucx_tcp", [](int n) { return Ucx(n, "tcp,self"); },
                [](std::vector<std::unique_ptr<Transport>>& g, int r) { g[r].reset(); }},
        Backend{"nccl", Nccl, [](std::vector<std::unique_ptr<Transport>>& g, int r) { g[r].reset(); },
                [] {
                  int n = nccl::VisibleDevices();
                  return n >= 2 ? std::string()
                                : "NCCL needs two GPUs; " + std::to_string(n) +
                                      " visible here (scripts/gpu-check runs this suite on a GPU machine)";
                },
                /*matches_by_order=*/true}),
                         [](const testing::TestParamInfo<Backend>& i) { return i.param.name; });

}  // namespace
}  // namespace pippy::transport
