// The lifecycle every backend's Work shares, written once: the first completion wins
// (OK with a value, or an error), Wait blocks with a deadline and says which peer and
// tag it waited for. Backends derive from it and add how to cancel.
//
// Thread safety: all methods may be called from any thread.
#ifndef PIPPY_PIPELINE_TRANSPORT_COMPLETION_H_
#define PIPPY_PIPELINE_TRANSPORT_COMPLETION_H_

#include <atomic>
#include <string>

#include "absl/synchronization/mutex.h"
#include "pipeline/transport/transport.h"

namespace pippy::transport {

class CompletionWork : public Work {
 public:
  CompletionWork(int self, int peer, const Tag& tag, bool is_recv)
      : self_(self), peer_(peer), tag_(tag), is_recv_(is_recv) {}

  absl::Status Wait(absl::Duration timeout) override;
  bool IsCompleted() override { return done_.load(std::memory_order_acquire); }
  c10::IValue Value() override;

  // Completes the operation; later calls are ignored. Returns whether this one won.
  bool Finish(absl::Status status, c10::IValue value = {});

  // Blocks for the `rest` of a Wait(timeout) that already spent some of it elsewhere;
  // the error names the whole `timeout`.
  absl::Status WaitRest(absl::Duration rest, absl::Duration timeout);

  int self() const { return self_; }
  int peer() const { return peer_; }
  const Tag& tag() const { return tag_; }
  bool is_recv() const { return is_recv_; }

 private:
  const int self_, peer_;
  const Tag tag_;
  const bool is_recv_;
  std::atomic<bool> done_{false};  // mirrors finished_ for lock-free polling
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  c10::IValue value_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pippy::transport

#endif  // PIPPY_PIPELINE_TRANSPORT_COMPLETION_H_
