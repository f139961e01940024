// The coordinator's Prometheus text (--metrics-port, /metrics): jobs and workers by
// state, steps, samples and step times, the data-plane bytes the ranks reported,
// checkpoints and restarts, heartbeat and checkpoint ages, serving counters and
// latencies. The counters since start-up live here; everything else comes from a
// snapshot of the jobs and workers taken under the coordinator's mutex, so rendering
// holds no lock of the coordinator's.
//
// Thread safety: every method may be called from any thread (one internal mutex).
#ifndef PIPPY_COORDINATOR_COORDINATOR_METRICS_H_
#define PIPPY_COORDINATOR_COORDINATOR_METRICS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/metrics.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

// A step every rank of a job has reported (JobRun::OnStepReport).
struct CompletedStep {
  int64_t samples = 0;          // the step's batch
  double seconds = 0;           // the slowest rank's step time
  int64_t bytes_sent = 0;       // tensor bytes the ranks sent to each other (SEND actions)
  int64_t bytes_received = 0;   // and received (RECV actions)
};

// What one scrape shows besides the counters.
struct MetricsSnapshot {
  std::vector<Job> jobs;                  // as the API shows them (serving counters included)
  struct Worker {
    std::string id, name;
    WorkerState state = IDLE;
    double heartbeat_age_seconds = 0;
  };
  std::vector<Worker> workers;
  struct JobAges {
    std::string job_id;
    double checkpoint_age_seconds = -1;   // < 0: no checkpoint yet
  };
  std::vector<JobAges> ages;              // unfinished jobs
  struct Serving {
    std::string job_id;
    ServingStats stats;
    metrics::Histogram latency_seconds{{}};
  };
  std::vector<Serving> serving;           // serving jobs that have not ended
  struct Generation {
    std::string job_id;
    GenerationStats stats;
    metrics::Histogram ttft_seconds{{}};
    metrics::Histogram itl_seconds{{}};
  };
  std::vector<Generation> generation;     // generation jobs that have not ended
};

class CoordinatorMetrics {
 public:
  void OnStep(const CompletedStep& step);
  void OnCheckpoint();
  void OnRestart();
  std::string Text(const MetricsSnapshot& snapshot) const;

 private:
  mutable absl::Mutex mu_;
  int64_t steps_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t samples_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t checkpoints_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t restarts_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_sent_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_received_ ABSL_GUARDED_BY(mu_) = 0;
  metrics::Histogram step_seconds_ ABSL_GUARDED_BY(mu_){
      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_COORDINATOR_METRICS_H_
