#include "pipeline/transport/loopback/loopback_transport.h"

#include <deque>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "pipeline/transport/completion.h"

namespace pippy::transport::loopback {
namespace {

c10::IValue DeepCopy(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().detach().clone();
  if (v.isTuple()) {
    std::vector<c10::IValue> out;
    for (const auto& e : v.toTupleRef().elements()) out.push_back(DeepCopy(e));
    return c10::ivalue::Tuple::create(std::move(out));
  }
  if (v.isList()) {
    c10::impl::GenericList out(c10::AnyType::get());
    for (const auto& e : v.toListRef()) out.push_back(DeepCopy(e));
    return out;
  }
  return v;
}

class LoopbackWork : public CompletionWork {
 public:
  using CompletionWork::CompletionWork;
  void Cancel() override {
    Finish(absl::CancelledError(absl::StrCat("rank ", self(), ": ", tag().ToString(), " cancelled")));
  }
};

}  // namespace

class LoopbackGroup {
 public:
  explicit LoopbackGroup(int n) : n_(n), dead_(n, false) {}

  std::shared_ptr<Work> Send(int src, int dst, const Tag& tag, c10::IValue value) {
    auto work = std::make_shared<LoopbackWork>(src, dst, tag, false);
    if (dst < 0 || dst >= n_) {
      work->Finish(absl::InvalidArgumentError(absl::StrCat("no rank ", dst, " (world size ", n_, ")")), {});
      return work;
    }
    c10::IValue copy = DeepCopy(value);
    std::shared_ptr<LoopbackWork> receiver;
    {
      absl::MutexLock lock(&mu_);
      if (dead_[dst] || dead_[src]) {
        work->Finish(absl::UnavailableError(absl::StrCat("rank ", dead_[dst] ? dst : src, " is gone")), {});
        return work;
      }
      auto key = std::make_tuple(src, dst, tag.Pack());
      auto& waiting = recvs_[key];
      while (!waiting.empty() && receiver == nullptr) {
        receiver = waiting.front();
        waiting.pop_front();
        if (receiver->IsCompleted()) receiver = nullptr;  // cancelled or timed out for good
      }
      if (receiver == nullptr) sends_[key].push_back(copy);
    }
    if (receiver != nullptr) receiver->Finish(absl::OkStatus(), copy);
    work->Finish(absl::OkStatus(), {});
    return work;
  }

  std::shared_ptr<Work> Recv(int self, int src, const Tag& tag) {
    auto work = std::make_shared<LoopbackWork>(self, src, tag, true);
    if (src < 0 || src >= n_) {
      work->Finish(absl::InvalidArgumentError(absl::StrCat("no rank ", src, " (world size ", n_, ")")), {});
      return work;
    }
    absl::MutexLock lock(&mu_);
    auto key = std::make_tuple(src, self, tag.Pack());
    auto& queued = sends_[key];
    if (!queued.empty()) {
      c10::IValue v = queued.front();
      queued.pop_front();
      work->Finish(absl::OkStatus(), v);
    } else if (dead_[src]) {
      work->Finish(absl::UnavailableError(absl::StrCat("rank ", self, ": peer rank ", src, " is gone (",
                                                       tag.ToString(), ")")),
                   {});
    } else {
      recvs_[key].push_back(work);
    }
    return work;
  }

  void Kill(int rank) {
    std::vector<std::shared_ptr<LoopbackWork>> fail;
    {
      absl::MutexLock lock(&mu_);
      dead_[rank] = true;
      for (auto& [key, waiting] : recvs_) {
        if (std::get<0>(key) == rank || std::get<1>(key) == rank) {
          fail.insert(fail.end(), waiting.begin(), waiting.end());
          waiting.clear();
        }
      }
    }
    for (auto& w : fail) {
      w->Finish(absl::UnavailableError(absl::StrCat("rank ", w->self(), ": peer rank ", w->peer(), " is gone (",
                                                    w->tag().ToString(), ")")),
                {});
    }
  }

 private:
  using Key = std::tuple<int, int, uint64_t>;  // (src, dst, tag)
  const int n_;
  absl::Mutex mu_;
  std::vector<bool> dead_ ABSL_GUARDED_BY(mu_);
  std::map<Key, std::deque<c10::IValue>> sends_ ABSL_GUARDED_BY(mu_);
  std::map<Key, std::deque<std::shared_ptr<LoopbackWork>>> recvs_ ABSL_GUARDED_BY(mu_);
};

namespace {

class LoopbackTransport : public Transport {
 public:
  LoopbackTransport(std::shared_ptr<LoopbackGroup> group, int rank, int n)
      : group_(std::move(group)), rank_(rank), n_(n) {}
  int rank() const override { return rank_; }
  int world_size() const override { return n_; }
  std::shared_ptr<Work> Send(int peer, const Tag& tag, c10::IValue value) override {
    return group_->Send(rank_, peer, tag, std::move(value));
  }
  std::shared_ptr<Work> Recv(int peer, const Tag& tag) override { return group_->Recv(rank_, peer, tag); }
  LoopbackGroup* group() { return group_.get(); }

 private:
  std::shared_ptr<LoopbackGroup> group_;
  const int rank_, n_;
};

}  // namespace

std::vector<std::unique_ptr<Transport>> Create(int world_size) {
  auto group = std::make_shared<LoopbackGroup>(world_size);
  std::vector<std::unique_ptr<Transport>> out;
  for (int r = 0; r < world_size; ++r) out.push_back(std::make_unique<LoopbackTransport>(group, r, world_size));
  return out;
}

void KillRank(Transport* any_member, int rank) {
  static_cast<LoopbackTransport*>(any_member)->group()->Kill(rank);
}

}  // namespace pippy::transport::loopback
