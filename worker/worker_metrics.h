// The worker's Prometheus text (--metrics-port, /metrics): whether it is registered and
// busy, steps and checkpoints its ranks completed, tensor bytes moved to and from peer
// ranks, all-reduce time, and a histogram of step times.
//
// Thread safety: every method may be called from any thread.
#ifndef PIPPY_WORKER_WORKER_METRICS_H_
#define PIPPY_WORKER_WORKER_METRICS_H_

#include <atomic>
#include <cstdint>
#include <string>

#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "pipeline/stage/rank_runtime.h"

namespace pippy::worker {

class WorkerMetrics {
 public:
  // A step a rank of this worker completed (a serving micro-batch: its time only).
  void OnStep(const stage::StepResult& result, bool serving);
  // A serving micro-batch its stages refused (abandoned on every rank): counted, untimed.
  void OnAbortedStep() { ++steps_; }
  void OnCheckpoint() { ++checkpoints_; }
  void SetBusy(bool busy) { busy_ = busy; }
  std::string Text(bool registered) const;

 private:
  std::atomic<bool> busy_{false};
  std::atomic<int64_t> steps_{0}, checkpoints_{0}, bytes_sent_{0}, bytes_received_{0}, allreduce_us_{0};
  mutable absl::Mutex mu_;
  metrics::Histogram step_seconds_ ABSL_GUARDED_BY(mu_){
      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
};

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_WORKER_METRICS_H_
