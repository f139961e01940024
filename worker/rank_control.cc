#include "worker/rank_control.h"

#include "absl/strings/str_cat.h"

namespace pippy::worker {

void RankControl::Reset(const std::string& job_id, int attempt) {
  absl::MutexLock lock(&mu_);
  job_id_ = job_id;
  attempt_ = attempt;
  cancelled_ = false;
  have_peers_ = false;
  peers_ = Peers();
  serve_.clear();
}

bool RankControl::Matches(const std::string& job_id, int attempt) const {
  absl::MutexLock lock(&mu_);
  return job_id == job_id_ && attempt == attempt_;
}

void RankControl::SetPeers(const PeerAddresses& p) {
  absl::MutexLock lock(&mu_);
  if (p.job_id() != job_id_ || p.attempt() != attempt_) return;
  peers_.ucx.assign(p.ucx_addresses().begin(), p.ucx_addresses().end());
  peers_.replicas.assign(p.gloo_addresses().begin(), p.gloo_addresses().end());
  peers_.tensor_parallel.assign(p.tp_gloo_addresses().begin(), p.tp_gloo_addresses().end());
  have_peers_ = true;
}

absl::StatusOr<RankControl::Peers> RankControl::WaitForPeers(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return have_peers_ || cancelled_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("the peers' addresses did not arrive within ",
                                                    absl::FormatDuration(timeout)));
  }
  if (cancelled_) return absl::CancelledError("cancelled");
  return peers_;
}

void RankControl::PushServe(const ServeBatch& batch) {
  absl::MutexLock lock(&mu_);
  if (batch.job_id() != job_id_ || batch.attempt() != attempt_) return;
  serve_.push_back(batch);
}

absl::StatusOr<ServeBatch> RankControl::NextServe() {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !serve_.empty() || cancelled_; };
  // Idle until the next micro-batch, however long: a lost coordinator cancels the rank.
  mu_.Await(absl::Condition(&ready));
  if (cancelled_) return absl::CancelledError("serving stopped");
  ServeBatch batch = std::move(serve_.front());
  serve_.pop_front();
  return batch;
}

void RankControl::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (running_ != nullptr) running_->Cancel();
}

absl::Status RankControl::Attach(job::RankJob* rank_job) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) return absl::CancelledError("cancelled");
  running_ = rank_job;
  return absl::OkStatus();
}

void RankControl::Detach() {
  absl::MutexLock lock(&mu_);
  running_ = nullptr;
}

}  // namespace pippy::worker
