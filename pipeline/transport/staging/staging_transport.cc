#include "pipeline/transport/staging/staging_transport.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status.h"

namespace pippy::transport::staging {

// A send whose host copy is posted on the inner transport once its device-to-host
// copies are done: until then it waits for the poster thread, then for the inner send.
class StagedSend : public Work {
 public:
  absl::Status Wait(absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    std::shared_ptr<Work> inner;
    {
      absl::MutexLock lock(&mu_);
      auto posted = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return inner_ != nullptr || !status_.ok(); };
      if (!mu_.AwaitWithDeadline(absl::Condition(&posted), deadline)) {
        return absl::DeadlineExceededError(absl::StrCat(what_, " was not posted within ", absl::FormatDuration(timeout),
                                                        " (its copy to host memory, or a send before it, had not "
                                                        "finished)"));
      }
      if (!status_.ok()) return status_;
      inner = inner_;
    }
    return inner->Wait(std::max(deadline - absl::Now(), absl::ZeroDuration()));
  }

  bool IsCompleted() override {
    std::shared_ptr<Work> inner;
    {
      absl::MutexLock lock(&mu_);
      if (!status_.ok()) return true;
      inner = inner_;
    }
    return inner != nullptr && inner->IsCompleted();
  }

  void Cancel() override {
    std::shared_ptr<Work> inner;
    {
      absl::MutexLock lock(&mu_);
      if (inner_ == nullptr && status_.ok()) status_ = absl::CancelledError(absl::StrCat(what_, " cancelled"));
      inner = inner_;
    }
    if (inner != nullptr) inner->Cancel();
  }

  c10::IValue Value() override { return {}; }

  StagedSend(int self, int peer, const Tag& tag)
      : what_(absl::StrCat("rank ", self, ": send of ", tag.ToString(), " to rank ", peer)) {}

  // The poster thread: whether the send still wants posting (not cancelled or failed).
  bool Wanted() {
    absl::MutexLock lock(&mu_);
    return status_.ok();
  }
  void Fail(const absl::Status& s) {
    absl::MutexLock lock(&mu_);
    if (inner_ == nullptr && status_.ok()) status_ = s;
  }
  void Posted(std::shared_ptr<Work> inner) {
    bool cancelled;
    {
      absl::MutexLock lock(&mu_);
      cancelled = !status_.ok();
      if (!cancelled) inner_ = inner;
    }
    if (cancelled) inner->Cancel();  // cancelled while it was being posted
  }
  const std::string& what() const { return what_; }

 private:
  const std::string what_;
  absl::Mutex mu_;
  std::shared_ptr<Work> inner_ ABSL_GUARDED_BY(mu_);
  absl::Status status_ ABSL_GUARDED_BY(mu_);  // not OK: failed or cancelled before it was posted
};

namespace {

// A receive whose value is handed out on the rank's device: copied there by the first
// successful Wait().
class StagedRecv : public Work {
 public:
  StagedRecv(std::shared_ptr<Work> inner, DeviceCopier* copier) : inner_(std::move(inner)), copier_(copier) {}

  absl::Status Wait(absl::Duration timeout) override {
    PIPPY_RETURN_IF_ERROR(inner_->Wait(timeout));
    absl::MutexLock lock(&mu_);
    if (!copied_) {
      absl::StatusOr<c10::IValue> v = copier_->ToDevice(inner_->Value());
      if (!v.ok()) return v.status();
      value_ = std::move(*v);
      copied_ = true;
    }
    return absl::OkStatus();
  }
  bool IsCompleted() override { return inner_->IsCompleted(); }
  void Cancel() override { inner_->Cancel(); }
  c10::IValue Value() override {
    absl::MutexLock lock(&mu_);
    return value_;
  }

 private:
  std::shared_ptr<Work> inner_;
  DeviceCopier* const copier_;
  absl::Mutex mu_;
  bool copied_ ABSL_GUARDED_BY(mu_) = false;
  c10::IValue value_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<StagingTransport>> StagingTransport::ForDevice(Transport* host,
                                                                              const c10::Device& device) {
  if (!device.is_cuda()) return std::make_unique<StagingTransport>(host, device);
  absl::StatusOr<std::unique_ptr<DeviceCopier>> copier = NewCudaCopier(device.has_index() ? device.index() : 0);
  if (!copier.ok()) return copier.status();
  return std::make_unique<StagingTransport>(host, std::move(*copier));
}

StagingTransport::StagingTransport(Transport* host, c10::Device device)
    : StagingTransport(host, std::make_unique<SyncCopier>(device)) {}

StagingTransport::StagingTransport(Transport* host, std::unique_ptr<DeviceCopier> copier, absl::Duration copy_timeout)
    : host_(host), copier_(std::move(copier)), copy_timeout_(copy_timeout) {}

StagingTransport::~StagingTransport() {
  std::deque<Pending> unposted;
  std::thread thread;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    unposted.swap(queue_);
    thread.swap(thread_);
  }
  for (Pending& p : unposted) {
    p.work->Fail(absl::CancelledError(absl::StrCat(p.work->what(), ": the transport was closed before it was posted")));
  }
  if (thread.joinable()) thread.join();  // it finishes the send it holds (bounded by copy_timeout)
}

std::shared_ptr<Work> StagingTransport::Send(int peer, const Tag& tag, c10::IValue value) {
  absl::StatusOr<DeviceCopier::Staged> staged = copier_->ToHost(value);
  if (!staged.ok()) {
    auto failed = std::make_shared<StagedSend>(rank(), peer, tag);
    failed->Fail(staged.status());
    return failed;
  }
  absl::MutexLock lock(&mu_);
  if (staged->done == nullptr && queue_.empty() && !posting_) {
    return host_->Send(peer, tag, std::move(staged->host));  // nothing to wait for, nothing ahead of it
  }
  auto work = std::make_shared<StagedSend>(rank(), peer, tag);
  if (stop_) {
    work->Fail(absl::CancelledError(absl::StrCat(work->what(), ": the transport is closing")));
    return work;
  }
  queue_.push_back({work, peer, tag, std::move(*staged)});
  if (!thread_.joinable()) thread_ = std::thread([this] { Loop(); });
  return work;
}

std::shared_ptr<Work> StagingTransport::Recv(int peer, const Tag& tag) {
  std::shared_ptr<Work> inner = host_->Recv(peer, tag);
  if (copier_->device().is_cpu()) return inner;
  return std::make_shared<StagedRecv>(std::move(inner), copier_.get());
}

void StagingTransport::Loop() {
  while (true) {
    Pending p;
    {
      absl::MutexLock lock(&mu_);
      posting_ = false;
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      // Idle until a staged send arrives; the destructor ends it (nothing is waited for).
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping
      p = std::move(queue_.front());
      queue_.pop_front();
      posting_ = true;
    }
    if (p.staged.done != nullptr) {
      absl::Status copied = p.staged.done->Wait(copy_timeout_);
      if (!copied.ok()) {
        p.work->Fail(absl::Status(copied.code(), absl::StrCat(p.work->what(), ": ", copied.message())));
        continue;
      }
    }
    if (!p.work->Wanted()) continue;
    p.work->Posted(host_->Send(p.peer, p.tag, std::move(p.staged.host)));
  }
}

}  // namespace pippy::transport::staging
