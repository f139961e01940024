// What the worker's reader thread and its rank's thread share about the rank it runs:
// which job and attempt it is, the peers' addresses when they come, a serving job's
// micro-batches in step order, and cancellation (a cancel from the coordinator, or the
// coordinator lost) that reaches the rank wherever it waits.
//
// Thread safety: every method may be called from any thread (one mutex).
#ifndef PIPPY_WORKER_RANK_CONTROL_H_
#define PIPPY_WORKER_RANK_CONTROL_H_

#include <deque>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pipeline/job/rank_job.h"
#include "proto/coordinator.pb.h"

namespace pippy::worker {

class RankControl {
 public:
  // The peers' addresses: the UCX addresses of the rank's replica (by rank) and, with
  // data parallelism, its replica group's gloo addresses (by replica).
  struct Peers {
    std::vector<std::string> ucx;
    std::vector<std::string> replicas;
    std::vector<std::string> tensor_parallel;  // the rank's tensor-parallel group (by shard)
  };

  // A new rank (job `job_id`, `attempt`): not cancelled, no peers, no micro-batches.
  void Reset(const std::string& job_id, int attempt);
  // Whether a message for (`job_id`, `attempt`) is this rank's.
  bool Matches(const std::string& job_id, int attempt) const;

  // The peers' addresses arrived (ignored unless they are this rank's).
  void SetPeers(const PeerAddresses& peers);
  // Errors: DEADLINE_EXCEEDED after `timeout`; CANCELLED once cancelled.
  absl::StatusOr<Peers> WaitForPeers(absl::Duration timeout);

  // A serving job's next micro-batch (ignored unless it is this rank's).
  void PushServe(const ServeBatch& batch);
  // The next micro-batch, waiting as long as it takes. Errors: CANCELLED once cancelled.
  absl::StatusOr<ServeBatch> NextServe();

  // Ends the rank: a wait here returns CANCELLED, and the running rank job's step in
  // progress (if any) ends with CANCELLED.
  void Cancel();
  // The rank job runs from now on: Cancel reaches it. Errors: CANCELLED if cancelled
  // already. Detach (before the job is destroyed) forgets it.
  absl::Status Attach(job::RankJob* rank_job);
  void Detach();

 private:
  mutable absl::Mutex mu_;
  std::string job_id_ ABSL_GUARDED_BY(mu_);  // the job assigned last
  int attempt_ ABSL_GUARDED_BY(mu_) = 0;     // and its attempt
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool have_peers_ ABSL_GUARDED_BY(mu_) = false;
  Peers peers_ ABSL_GUARDED_BY(mu_);
  std::deque<ServeBatch> serve_ ABSL_GUARDED_BY(mu_);  // in step order
  job::RankJob* running_ ABSL_GUARDED_BY(mu_) = nullptr;
};

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_RANK_CONTROL_H_
