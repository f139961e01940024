#include "pipeline/transport/completion.h"

#include "absl/strings/str_cat.h"

namespace pippy::transport {

absl::Status CompletionWork::Wait(absl::Duration timeout) { return WaitRest(timeout, timeout); }

absl::Status CompletionWork::WaitRest(absl::Duration rest, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return finished_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&done), rest)) {
    return absl::DeadlineExceededError(absl::StrCat("rank ", self_, ": ", is_recv_ ? "receive from" : "send to",
                                                    " rank ", peer_, " (", tag_.ToString(),
                                                    ") did not complete within ", absl::FormatDuration(timeout)));
  }
  return status_;
}

c10::IValue CompletionWork::Value() {
  absl::MutexLock lock(&mu_);
  return value_;
}

bool CompletionWork::Finish(absl::Status status, c10::IValue value) {
  absl::MutexLock lock(&mu_);
  if (finished_) return false;
  finished_ = true;
  status_ = std::move(status);
  value_ = std::move(value);
  done_.store(true, std::memory_order_release);
  return true;
}

}  // namespace pippy::transport
