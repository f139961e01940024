// The shared transport suite: every backend is instantiated here (loopback today;
// the process backends add their factories).
#include <time.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <thread>

#include "ATen/ATen.h"
#include "absl/synchronization/notification.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/transport/loopback/loopback_transport.h"
#include "pipeline/transport/staging/device_copier.h"
#include "pipeline/transport/staging/staging_transport.h"
#include "pipeline/transport/nccl/nccl_group.h"
#include "pipeline/transport/nccl/nccl_transport.h"
#include "pipeline/transport/ucx/peer_process.h"
#include "pipeline/transport/ucx/ucx_transport.h"
#include "pipeline/transport/transport.h"
#include "pipeline/transport/wire_format.h"

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

TEST_P(TransportSuite, AroundTheInlineLimit_ArriveIntact) {
  // One message (header + bytes) up to wire::kMaxInlinePayload, two above it; tuples
  // whose tensors together straddle the limit.
  const int64_t limit = static_cast<int64_t>(wire::kMaxInlinePayload);
  std::vector<c10::IValue> values;
  for (int64_t bytes : {limit - 4, limit, limit + 4}) values.push_back(at::arange(bytes / 4, at::kInt));
  values.push_back(c10::ivalue::Tuple::create(
      {at::arange(limit / 8, at::kInt), int64_t{7}, at::arange(limit / 8, at::kInt).flip(0)}));
  values.push_back(c10::ivalue::Tuple::create(
      {at::arange(limit / 8, at::kInt), c10::IValue(), at::arange(limit / 8 + 1, at::kInt)}));
  for (size_t i = 0; i < values.size(); ++i) {
    auto sent = a().Send(1, T(22, i), values[i]);
    auto r = b().Recv(0, T(22, i));
    ASSERT_TRUE(r->Wait(kWait).ok()) << i;
    ASSERT_TRUE(sent->Wait(kWait).ok()) << i;
    if (values[i].isTensor()) {
      EXPECT_TRUE(Same(r->Value().toTensor(), values[i].toTensor())) << i;
      continue;
    }
    auto got = r->Value().toTupleRef().elements();
    auto want = values[i].toTupleRef().elements();
    ASSERT_EQ(got.size(), 3u);
    EXPECT_TRUE(Same(got[0].toTensor(), want[0].toTensor())) << i;
    EXPECT_EQ(got[1].isNone(), want[1].isNone()) << i;
    EXPECT_TRUE(Same(got[2].toTensor(), want[2].toTensor())) << i;
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

// The wire format on its own: both layouts, and what a receiver refuses.
at::Tensor Alloc(const std::vector<int64_t>& sizes, c10::ScalarType dtype) {
  return at::empty(sizes, at::TensorOptions().dtype(dtype));
}

// ucx+staging's logic, seen from a CPU-only build: the "device" is `meta` (tensors with
// shapes and dtypes but no data), which LibTorch can move host tensors to.
TEST(StagingTransport, ReceivedValuesArriveOnTheRankDevice_StructureKept_HostRankPassesThrough) {
  auto group = loopback::Create(2);
  const c10::Device meta(c10::kMeta);
  staging::StagingTransport sender(group[0].get(), c10::Device(c10::kCPU));
  staging::StagingTransport receiver(group[1].get(), meta);
  EXPECT_EQ(receiver.rank(), 1);
  EXPECT_EQ(receiver.world_size(), 2);
  Tag tag;
  const at::Tensor x = at::randn({3, 4}).to(at::kBFloat16);
  const c10::IValue value = c10::ivalue::Tuple::create({x, c10::IValue(), c10::IValue(int64_t{7})});
  auto send = sender.Send(1, tag, value);
  auto recv = receiver.Recv(0, tag);
  ASSERT_TRUE(recv->Wait(absl::Seconds(10)).ok());
  ASSERT_TRUE(send->Wait(absl::Seconds(10)).ok());
  const c10::IValue got = recv->Value();
  ASSERT_TRUE(got.isTuple());
  const auto& e = got.toTupleRef().elements();
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].toTensor().device(), meta);
  EXPECT_EQ(e[0].toTensor().sizes(), x.sizes());
  EXPECT_EQ(e[0].toTensor().scalar_type(), at::kBFloat16);
  EXPECT_TRUE(e[1].isNone());
  EXPECT_EQ(e[2].toInt(), 7);
  EXPECT_TRUE(staging::HasTensorOffDevice(value, meta));
  EXPECT_FALSE(staging::HasTensorOffDevice(value, c10::Device(c10::kCPU)));
  // A rank on the host hands values through unchanged: the same tensor, not a copy.
  Tag back;
  back.microbatch = 1;
  auto s2 = receiver.Send(0, back, x);
  auto r2 = sender.Recv(1, back);
  ASSERT_TRUE(r2->Wait(absl::Seconds(10)).ok());
  EXPECT_TRUE(r2->Value().toTensor().equal(x));
  EXPECT_TRUE(transport::ToDevice(c10::IValue(x), c10::Device(c10::kCPU)).toTensor().is_same(x));
}

TEST(WireFormat, SeparateAndInlinePayload_RoundTrip) {
  c10::IValue v = c10::ivalue::Tuple::create({at::arange(6, at::kFloat).view({2, 3}), int64_t{3}, c10::IValue(),
                                              std::string("x"), at::ones({2}, at::kLong)});
  std::string header;
  std::vector<at::Tensor> sent;
  ASSERT_TRUE(wire::EncodeHeader(v, &header, &sent).ok());
  ASSERT_EQ(sent.size(), 2u);
  // Separate: the header describes, the tensors come empty.
  std::vector<at::Tensor> got;
  bool inline_payload = true;
  auto d = wire::DecodeHeader(header.data(), header.size(), Alloc, &got, &inline_payload);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(inline_payload);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].sizes(), sent[0].sizes());
  // Inline: the same value, bytes included.
  wire::AppendInlinePayload(sent, &header);
  got.clear();
  d = wire::DecodeHeader(header.data(), header.size(), Alloc, &got, &inline_payload);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(inline_payload);
  auto elems = d->toTupleRef().elements();
  EXPECT_TRUE(elems[0].toTensor().equal(sent[0]));
  EXPECT_EQ(elems[1].toInt(), 3);
  EXPECT_TRUE(elems[2].isNone());
  EXPECT_EQ(elems[3].toStringRef(), "x");
  EXPECT_TRUE(elems[4].toTensor().equal(sent[1]));
}

TEST(WireFormat, MalformedMessages_DataLossNamingTheProblem) {
  std::string header;
  std::vector<at::Tensor> sent, got;
  ASSERT_TRUE(wire::EncodeHeader(at::ones({4}), &header, &sent).ok());
  wire::AppendInlinePayload(sent, &header);
  bool inline_payload = false;
  // Short of bytes, bytes to spare, an inline message where only headers are expected
  // (NCCL), and something that is not a pippy message at all.
  auto short_of = wire::DecodeHeader(header.data(), header.size() - 1, Alloc, &got, &inline_payload);
  EXPECT_EQ(short_of.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(short_of.status().message(), HasSubstr("fewer payload bytes"));
  std::string longer = header + "z";
  auto spare = wire::DecodeHeader(longer.data(), longer.size(), Alloc, &got, &inline_payload);
  EXPECT_THAT(spare.status().message(), HasSubstr("more payload bytes"));
  EXPECT_EQ(wire::DecodeHeader(header.data(), header.size(), Alloc, &got).status().code(),
            absl::StatusCode::kDataLoss);
  std::string junk = "GET / HTTP/1.1";
  auto j = wire::DecodeHeader(junk.data(), junk.size(), Alloc, &got, &inline_payload);
  EXPECT_THAT(j.status().message(), HasSubstr("not a pippy message"));
}

// Headers a peer could send to make the receiver allocate without bound (found by
// reading the decoder with fuzz/wire_header_fuzz): refused before anything is sized.
TEST(WireFormat, HostileHeaders_RefusedBeforeAllocating) {
  int allocations = 0;
  const wire::Allocator counting = [&](const std::vector<int64_t>& sizes, c10::ScalarType dtype) {
    ++allocations;
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  };
  std::vector<at::Tensor> got;
  auto put_u32 = [](std::string* s, uint32_t v) { s->append(reinterpret_cast<const char*>(&v), 4); };
  auto put_i64 = [](std::string* s, int64_t v) { s->append(reinterpret_cast<const char*>(&v), 8); };
  // A list that claims 4 billion elements.
  std::string list;
  put_u32(&list, wire::kMagic);
  list += '\x06';
  put_u32(&list, 0xFFFFFFFFu);
  EXPECT_EQ(wire::DecodeHeader(list.data(), list.size(), counting, &got).status().code(), absl::StatusCode::kDataLoss);
  // A float tensor of 2^62 elements (and one whose element count overflows int64).
  for (int64_t d : {int64_t{1} << 31, int64_t{1} << 62}) {
    std::string huge;
    put_u32(&huge, wire::kMagic);
    huge += '\x01';
    huge += static_cast<char>(c10::ScalarType::Float);
    huge += '\x02';
    put_i64(&huge, d);
    put_i64(&huge, d);
    auto r = wire::DecodeHeader(huge.data(), huge.size(), counting, &got);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(r.status().message(), HasSubstr("bytes in all"));
  }
  // A quantized dtype (no raw payload to receive into).
  std::string q;
  put_u32(&q, wire::kMagic);
  q += '\x01';
  q += static_cast<char>(c10::ScalarType::QInt8);
  q += '\x01';
  put_i64(&q, 4);
  EXPECT_EQ(wire::DecodeHeader(q.data(), q.size(), counting, &got).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(allocations, 0);
  // Within a caller's limit it decodes; beyond it, it is refused.
  std::string header;
  std::vector<at::Tensor> sent;
  ASSERT_TRUE(wire::EncodeHeader(at::ones({256}), &header, &sent).ok());
  EXPECT_TRUE(wire::DecodeHeader(header.data(), header.size(), counting, &got, nullptr, 1024).ok());
  EXPECT_FALSE(wire::DecodeHeader(header.data(), header.size(), counting, &got, nullptr, 1023).ok());
}

// A DeviceCopier standing in for the CUDA one on a machine without a GPU: its device is
// `meta` (so receives go through it), its "copies" are clones of host tensors that
// count as done when a gate the test holds opens, or else after a short delay — the
// asynchronous path of StagingTransport (its poster thread, ordering, failures)
// without a GPU.
class FakeAsyncCopier : public staging::DeviceCopier {
 public:
  struct Gate {
    absl::Notification opened;
    absl::Status result;  // what the copy ends with
    void Open(absl::Status s = absl::OkStatus()) {
      result = std::move(s);
      opened.Notify();
    }
  };

  const c10::Device& device() const override { return device_; }

  // The next ToHost with tensors completes when `gate` opens.
  std::shared_ptr<Gate> HoldNext() {
    auto g = std::make_shared<Gate>();
    absl::MutexLock lock(&mu_);
    gates_.push_back(g);
    return g;
  }
  void FailToDevice(absl::Status s) {
    absl::MutexLock lock(&mu_);
    to_device_error_ = std::move(s);
  }
  int to_device_calls() {
    absl::MutexLock lock(&mu_);
    return to_device_calls_;
  }

  absl::StatusOr<Staged> ToHost(const c10::IValue& value) override {
    bool any = false;
    Staged staged;
    staged.host = MapTensors(value, [&](const at::Tensor& t) {
      any = true;
      return t.clone();
    });
    if (!any) return staged;
    std::shared_ptr<Gate> gate;
    {
      absl::MutexLock lock(&mu_);
      if (!gates_.empty()) {
        gate = gates_.front();
        gates_.pop_front();
      }
    }
    if (gate == nullptr) {  // done after a delay of 0-2 ms
      gate = std::make_shared<Gate>();
      std::thread([gate, us = (++sends_ % 3) * 1000] {
        std::this_thread::sleep_for(std::chrono::microseconds(us));
        gate->Open();
      }).detach();
    }
    staged.done = std::make_unique<Done>(gate);
    return staged;
  }

  absl::StatusOr<c10::IValue> ToDevice(const c10::IValue& value) override {
    absl::MutexLock lock(&mu_);
    ++to_device_calls_;
    if (!to_device_error_.ok()) return to_device_error_;
    return MapTensors(value, [](const at::Tensor& t) { return t.clone(); });
  }

 private:
  class Done : public staging::CopyDone {
   public:
    explicit Done(std::shared_ptr<Gate> gate) : gate_(std::move(gate)) {}
    absl::Status Wait(absl::Duration timeout) override {
      if (!gate_->opened.WaitForNotificationWithTimeout(timeout)) {
        return absl::DeadlineExceededError("the fake copy did not finish");
      }
      return gate_->result;
    }

   private:
    std::shared_ptr<Gate> gate_;
  };

  const c10::Device device_{c10::kMeta};
  std::atomic<int> sends_{0};
  absl::Mutex mu_;
  std::deque<std::shared_ptr<Gate>> gates_ ABSL_GUARDED_BY(mu_);
  absl::Status to_device_error_ ABSL_GUARDED_BY(mu_);
  int to_device_calls_ ABSL_GUARDED_BY(mu_) = 0;
};

// A staged transport that owns its inner one (for the suite's factories).
struct InnerTransport {
  std::unique_ptr<Transport> inner;
};
class OwningStaging : private InnerTransport, public staging::StagingTransport {
 public:
  OwningStaging(std::unique_ptr<Transport> t, std::unique_ptr<staging::DeviceCopier> copier)
      : InnerTransport{std::move(t)}, StagingTransport(inner.get(), std::move(copier)) {}
  Transport* host() { return inner.get(); }
};

std::vector<std::unique_ptr<Transport>> Staged(std::vector<std::unique_ptr<Transport>> inner) {
  std::vector<std::unique_ptr<Transport>> out;
  for (auto& t : inner) out.push_back(std::make_unique<OwningStaging>(std::move(t), std::make_unique<FakeAsyncCopier>()));
  return out;
}

// Sends wait for their copies, and are posted in the order they were made.
TEST(StagingTransport, AsyncCopies_PostedOnlyOnceCopied_InSendOrder) {
  auto group = loopback::Create(2);
  auto copier = std::make_unique<FakeAsyncCopier>();
  FakeAsyncCopier* fake = copier.get();
  staging::StagingTransport sender(group[0].get(), std::move(copier));
  staging::StagingTransport receiver(group[1].get(), std::make_unique<FakeAsyncCopier>());
  auto g1 = fake->HoldNext(), g2 = fake->HoldNext();
  const at::Tensor x1 = at::randn({4, 5}), x2 = at::randn({7});
  auto s1 = sender.Send(1, T(0), x1);
  auto s2 = sender.Send(1, T(0), x2);  // the same tag: must arrive second
  auto s3 = sender.Send(1, T(1), c10::IValue(int64_t{5}));  // no tensors, but queued behind them
  auto r1 = receiver.Recv(0, T(0));
  g2->Open();
  EXPECT_EQ(r1->Wait(absl::Milliseconds(150)).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_FALSE(s1->IsCompleted());
  EXPECT_FALSE(s2->IsCompleted());
  EXPECT_EQ(s2->Wait(absl::Milliseconds(10)).code(), absl::StatusCode::kDeadlineExceeded);
  g1->Open();
  ASSERT_TRUE(r1->Wait(absl::Seconds(10)).ok());
  auto r2 = receiver.Recv(0, T(0));
  auto r3 = receiver.Recv(0, T(1));
  ASSERT_TRUE(r2->Wait(absl::Seconds(10)).ok());
  ASSERT_TRUE(r3->Wait(absl::Seconds(10)).ok());
  EXPECT_TRUE(r1->Value().toTensor().equal(x1));
  EXPECT_TRUE(r2->Value().toTensor().equal(x2));
  EXPECT_EQ(r3->Value().toInt(), 5);
  for (auto& s : {s1, s2, s3}) EXPECT_TRUE(s->Wait(absl::Seconds(10)).ok());
  // With nothing ahead of it, a value without tensors goes too.
  auto r4 = receiver.Recv(0, T(2));
  auto s4 = sender.Send(1, T(2), c10::IValue(2.5));
  EXPECT_TRUE(r4->Wait(absl::Seconds(10)).ok());
  EXPECT_TRUE(s4->Wait(absl::Seconds(10)).ok());
  EXPECT_EQ(r4->Value().toDouble(), 2.5);
}

TEST(StagingTransport, FailedOrCancelledCopies_NeverPosted_ErrorsNameTheSend) {
  auto group = loopback::Create(2);
  auto copier = std::make_unique<FakeAsyncCopier>();
  FakeAsyncCopier* fake = copier.get();
  staging::StagingTransport sender(group[0].get(), std::move(copier));
  auto failing = fake->HoldNext(), cancelled = fake->HoldNext();
  auto s1 = sender.Send(1, T(0), at::ones({3}));
  auto s2 = sender.Send(1, T(1), at::ones({3}));
  s2->Cancel();
  failing->Open(absl::UnavailableError("cuda:0: copy to host: an illegal memory access was encountered"));
  cancelled->Open();
  absl::Status e1 = s1->Wait(absl::Seconds(10));
  EXPECT_EQ(e1.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(e1.message(), HasSubstr("illegal memory access"));
  EXPECT_THAT(e1.message(), HasSubstr(T(0).ToString()));
  EXPECT_EQ(s2->Wait(absl::Seconds(10)).code(), absl::StatusCode::kCancelled);
  for (uint32_t mb : {0u, 1u}) {
    auto r = group[1]->Recv(0, T(mb));
    EXPECT_EQ(r->Wait(absl::Milliseconds(100)).code(), absl::StatusCode::kDeadlineExceeded) << "mb " << mb;
    r->Cancel();
  }
}

TEST(StagingTransport, ClosedWithSendsUnposted_TheyFail_NoHang) {
  auto group = loopback::Create(2);
  auto copier = std::make_unique<FakeAsyncCopier>();
  FakeAsyncCopier* fake = copier.get();
  auto sender = std::make_unique<staging::StagingTransport>(group[0].get(), std::move(copier), absl::Milliseconds(300));
  auto g1 = fake->HoldNext(), g2 = fake->HoldNext();  // never opened: a copy that hangs
  auto s1 = sender->Send(1, T(0), at::ones({3}));
  auto s2 = sender->Send(1, T(1), at::ones({3}));
  absl::SleepFor(absl::Milliseconds(50));  // the poster thread takes s1 and waits for its copy
  const absl::Time start = absl::Now();
  sender.reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  absl::Status e1 = s1->Wait(absl::Seconds(1)), e2 = s2->Wait(absl::Seconds(1));
  // The copy the thread held timed out (or, on a busy machine, the thread had not taken it yet).
  EXPECT_THAT(e1.code(), testing::AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kCancelled)) << e1;
  EXPECT_EQ(e2.code(), absl::StatusCode::kCancelled) << e2;
  EXPECT_THAT(e2.message(), HasSubstr("closed"));
}

TEST(StagingTransport, ReceiveCopyFails_WaitSaysSo) {
  auto group = loopback::Create(2);
  auto copier = std::make_unique<FakeAsyncCopier>();
  FakeAsyncCopier* fake = copier.get();
  staging::StagingTransport receiver(group[1].get(), std::move(copier));
  fake->FailToDevice(absl::UnavailableError("cuda:0: out of memory"));
  auto s = group[0]->Send(1, T(0), at::ones({2}));
  auto r = receiver.Recv(0, T(0));
  absl::Status e = r->Wait(absl::Seconds(10));
  EXPECT_EQ(e.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(e.message(), HasSubstr("out of memory"));
  EXPECT_EQ(fake->to_device_calls(), 1);
}

// The CUDA copier for real (scripts/gpu-check runs this on a GPU machine): tensors a
// kernel is still writing are sent with no synchronization by the caller, arrive on
// the GPU, and are used there at once — the copy stream's ordering against the
// compute stream, in both directions.
std::string NoGpu() {
  const int n = nccl::VisibleDevices();
  return n >= 1 ? std::string() : "no GPU visible (scripts/gpu-check runs this on a GPU machine)";
}

std::vector<std::unique_ptr<Transport>> CudaStaged(std::vector<std::unique_ptr<Transport>> inner) {
  std::vector<std::unique_ptr<Transport>> out;
  for (auto& t : inner) {
    auto copier = staging::NewCudaCopier(0);
    EXPECT_TRUE(copier.ok()) << copier.status();
    if (!copier.ok()) return {};
    out.push_back(std::make_unique<OwningStaging>(std::move(t), std::move(*copier)));
  }
  return out;
}

TEST(StagingTransport, CudaCopier_OrderedAgainstCompute_BothWays) {
  const std::string why = NoGpu();
  if (!why.empty()) GTEST_SKIP() << why;
  auto group = CudaStaged(loopback::Create(2));
  ASSERT_EQ(group.size(), 2u);
  const c10::Device gpu(c10::kCUDA, 0);
  for (int round = 0; round < 20; ++round) {
    const at::Tensor x = at::randn({1024, 1024}, at::TensorOptions().device(gpu));
    const at::Tensor y = x.matmul(x).mul_(2);  // still running when the send is made
    const at::Tensor half = y.t().to(at::kBFloat16);  // a non-contiguous source, another dtype
    auto s = group[0]->Send(1, T(round), c10::ivalue::Tuple::create({y, half, c10::IValue(int64_t{round})}));
    auto r = group[1]->Recv(0, T(round));
    ASSERT_TRUE(r->Wait(absl::Seconds(30)).ok());
    const auto& e = r->Value().toTupleRef().elements();
    const at::Tensor got = e[0].toTensor().mul(1);  // used on the compute stream at once
    ASSERT_TRUE(s->Wait(absl::Seconds(30)).ok());
    EXPECT_EQ(e[0].toTensor().device(), gpu);
    EXPECT_TRUE(got.cpu().equal(y.cpu())) << "round " << round;
    EXPECT_TRUE(e[1].toTensor().cpu().equal(half.cpu())) << "round " << round;
    EXPECT_EQ(e[2].toInt(), round);
  }
}

std::vector<std::unique_ptr<Transport>> Ucx(int n, const char* tls,
                                            std::function<at::Tensor(int64_t)> receive_buffer = nullptr) {
  ucx::Options options = ucx::LocalOptions(tls);
  options.receive_buffer = std::move(receive_buffer);
  auto g = ucx::CreateLocalGroup(n, options);
  EXPECT_TRUE(g.ok()) << g.status();
  return g.ok() ? std::move(*g) : std::vector<std::unique_ptr<Transport>>{};
}

// Large payloads land in the buffers ucx::Options::receive_buffer makes (a GPU rank's
// pinned memory), which are reused; small ones and a maker's unusable buffers fall
// back to LibTorch's allocator, and the values stay right either way.
TEST(UcxTransport, ReceiveBuffers_FromTheGivenMaker_Reused_WrongOnesReplaced) {
  for (const char* tls : {"sm,self", "tcp,self"}) {
    std::atomic<int> made{0};
    std::mutex mu;
    std::set<const void*> ours;
    auto g = Ucx(2, tls, [&](int64_t nbytes) {
      ++made;
      at::Tensor t = at::empty({nbytes}, at::kByte);
      std::lock_guard<std::mutex> lock(mu);
      ours.insert(t.data_ptr());
      return t;
    });
    ASSERT_EQ(g.size(), 2u);
    for (int round = 0; round < 3; ++round) {
      const at::Tensor big = at::full({1 << 18}, static_cast<float>(round));  // 1 MiB
      const at::Tensor small = at::full({256}, static_cast<float>(round));     // 1 KiB
      auto s = g[0]->Send(1, T(50 + round), c10::ivalue::Tuple::create({big, small}));
      auto r = g[1]->Recv(0, T(50 + round));
      ASSERT_TRUE(r->Wait(absl::Seconds(10)).ok()) << tls;
      ASSERT_TRUE(s->Wait(absl::Seconds(10)).ok()) << tls;
      const auto& e = r->Value().toTupleRef().elements();
      EXPECT_TRUE(e[0].toTensor().equal(big)) << tls;
      EXPECT_TRUE(e[1].toTensor().equal(small)) << tls;
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_TRUE(ours.count(e[0].toTensor().data_ptr())) << tls << ": the 1 MiB payload is not in a made buffer";
      EXPECT_FALSE(ours.count(e[1].toTensor().data_ptr())) << tls;
    }  // each round's value is released before the next: one buffer serves all three
    EXPECT_EQ(made.load(), 1) << tls;
  }
  for (auto bad : std::vector<std::function<at::Tensor(int64_t)>>{
           [](int64_t nbytes) { return at::empty({nbytes / 4}, at::kFloat); },    // not bytes
           [](int64_t nbytes) { return at::empty({nbytes / 2}, at::kByte); },     // too small
           [](int64_t) -> at::Tensor { throw std::runtime_error("no pinned memory"); }}) {
    auto g = Ucx(2, "sm,self", bad);
    ASSERT_EQ(g.size(), 2u);
    const at::Tensor big = at::arange(1 << 18, at::kFloat);
    g[0]->Send(1, T(60), big);
    auto r = g[1]->Recv(0, T(60));
    ASSERT_TRUE(r->Wait(absl::Seconds(10)).ok());
    EXPECT_TRUE(r->Value().toTensor().equal(big));
  }
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

// Messages that arrive before their receive is posted complete at once inside UCX
// (no request, no callback): nothing may stay behind — no leaked operation holding the
// received tensors (which also keeps the receive-buffer pool from reusing them).
TEST(UcxTransport, EarlyArrivals_LeaveNothingInFlight) {
  for (const char* tls : {"sm,self", "tcp,self"}) {
    auto g = Ucx(2, tls);
    ASSERT_EQ(g.size(), 2u);
    auto* a = static_cast<ucx::UcxTransport*>(g[0].get());
    auto* b = static_cast<ucx::UcxTransport*>(g[1].get());
    const std::vector<int64_t> sizes = {0, 64, 16 << 10, 64 << 10, 1 << 20};
    std::vector<std::shared_ptr<Work>> sends;
    for (int round = 0; round < 3; ++round) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        sends.push_back(a->Send(1, T(30 + round, i), at::full({sizes[i] / 4}, static_cast<float>(i), at::kFloat)));
      }
    }
    // Let everything that can arrive unasked arrive (the eager ones) before receiving.
    absl::SleepFor(absl::Milliseconds(200));
    for (int round = 0; round < 3; ++round) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        auto r = b->Recv(0, T(30 + round, i));
        ASSERT_TRUE(r->Wait(absl::Seconds(10)).ok()) << tls << " " << sizes[i];
        at::Tensor got = r->Value().toTensor();
        ASSERT_EQ(got.numel(), sizes[i] / 4);
        if (got.numel() > 0) {
          EXPECT_EQ(got[got.numel() - 1].item<float>(), static_cast<float>(i));
        }
      }
    }
    for (auto& s : sends) ASSERT_TRUE(s->Wait(absl::Seconds(10)).ok()) << tls;
    EXPECT_EQ(a->operations_in_flight(), 0u) << tls;
    EXPECT_EQ(b->operations_in_flight(), 0u) << tls;
  }
}

// Waiting costs no core: a transport with nothing to do sleeps on its event fd, and a
// Wait for a message that never comes drives UCX for a moment, then blocks. (A spin
// anywhere would burn ~100% of a core per thread over the 1.2 s measured here.)
double ProcessCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

TEST(UcxTransport, IdleAndBlockedWaits_DoNotSpin) {
  for (const char* tls : {"sm,self", "tcp,self"}) {
    auto g = Ucx(2, tls);
    ASSERT_EQ(g.size(), 2u);
    g[0]->Send(1, T(40), at::ones({1 << 20}));
    ASSERT_TRUE(g[1]->Recv(0, T(40))->Wait(absl::Seconds(10)).ok());
    const double before = ProcessCpuSeconds();
    absl::SleepFor(absl::Milliseconds(600));
    absl::Status s = g[1]->Recv(0, T(41))->Wait(absl::Milliseconds(600));
    const double used = ProcessCpuSeconds() - before;
    EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << tls;
    EXPECT_LT(used, 0.15) << tls << ": " << used << " s of CPU in 1.2 s of idleness";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Backends, TransportSuite,
    testing::Values(
        Backend{"loopback", loopback::Create,
                [](std::vector<std::unique_ptr<Transport>>& g, int r) { loopback::KillRank(g[1 - r].get(), r); }},
        Backend{"ucx_shm", [](int n) { return Ucx(n, "sm,self"); }, nullptr},
        // ucx+staging's asynchronous path (FakeAsyncCopier) over both host transports.
        Backend{"staged_loopback", [](int n) { return Staged(loopback::Create(n)); },
                [](std::vector<std::unique_ptr<Transport>>& g, int r) {
                  loopback::KillRank(static_cast<OwningStaging*>(g[1 - r].get())->host(), r);
                }},
        Backend{"staged_ucx_tcp", [](int n) { return Staged(Ucx(n, "tcp,self")); },
                [](std::vector<std::unique_ptr<Transport>>& g, int r) { g[r].reset(); }},
        // The CUDA copier (received values copied onto cuda:0) where a GPU is visible, with
        // UCX receiving into pinned buffers as a GPU worker's does.
        Backend{"staged_cuda",
                [](int n) {
                  return CudaStaged(Ucx(n, "sm,self", staging::ReceiveBuffersFor(c10::Device(c10::kCUDA, 0))));
                },
                nullptr, NoGpu},
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

// Data parallelism's NCCL replica group: 2 members on 2 GPUs sum a CUDA tensor in
// place and a CPU tensor through the device, twice in a row.
TEST(NcclReplicaGroup, TwoGpus_SumInPlace) {
  const int n = nccl::VisibleDevices();
  if (n < 2) {
    GTEST_SKIP() << "the NCCL replica group needs two GPUs; " << n
                 << " visible here (scripts/gpu-check runs this test on a GPU machine)";
  }
  auto id = nccl::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<std::unique_ptr<ReplicaGroup>> g(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      nccl::Options o;
      o.device = r;
      o.abort_after = absl::Seconds(20);
      auto m = nccl::CreateReplicaGroup(r, 2, *id, o);
      EXPECT_TRUE(m.ok()) << m.status();
      if (m.ok()) g[r] = std::move(*m);
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(g[0] && g[1]);
  std::vector<absl::Status> st(2);
  std::vector<at::Tensor> dev(2), host(2);
  threads.clear();
  for (int r = 0; r < 2; ++r) {
    dev[r] = at::full({1 << 20}, static_cast<float>(r + 1), at::TensorOptions().device(at::kCUDA, r));
    host[r] = at::arange(10, at::kFloat) * (r + 1);
    threads.emplace_back([&, r] {
      st[r] = g[r]->AllReduceSum(dev[r]);
      if (st[r].ok()) st[r] = g[r]->AllReduceSum(host[r]);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(st[r].ok()) << st[r];
    EXPECT_TRUE(dev[r].cpu().equal(at::full({1 << 20}, 3.0f)));
    EXPECT_TRUE(host[r].equal(at::arange(10, at::kFloat) * 3));
  }
}

TEST(NcclReplicaGroup, NoGpu_ClearError) {
  if (nccl::VisibleDevices() > 0) GTEST_SKIP() << "a GPU is visible: the error path for no GPU does not apply";
  auto id = nccl::NewUniqueId();
  auto g = nccl::CreateReplicaGroup(0, 2, id.ok() ? *id : std::string(128, '\0'));
  ASSERT_FALSE(g.ok());
  EXPECT_TRUE(absl::IsUnavailable(g.status()) || absl::IsUnimplemented(g.status())) << g.status();
  EXPECT_TRUE(absl::IsInvalidArgument(nccl::CreateReplicaGroup(2, 2, "").status()));
}

}  // namespace
}  // namespace pippy::transport
