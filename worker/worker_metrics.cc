#include "worker/worker_metrics.h"

#include "worker/report_builder.h"

namespace pippy::worker {

void WorkerMetrics::OnStep(const stage::StepResult& result, bool serving) {
  ++steps_;
  if (!serving) {
    const TransferBytes moved = TransferBytesOf(result);
    bytes_sent_ += moved.sent;
    bytes_received_ += moved.received;
    allreduce_us_ += static_cast<int64_t>(result.breakdown.allreduce_seconds * 1e6);
  }
  absl::MutexLock lock(&mu_);
  step_seconds_.Observe(result.step_seconds);
}

std::string WorkerMetrics::Text(bool registered) const {
  metrics::Exposition x;
  x.Family("pippy_worker_registered", "gauge", "1 while registered with a coordinator");
  x.Sample("pippy_worker_registered", {}, registered ? 1 : 0);
  x.Family("pippy_worker_busy", "gauge", "1 while the worker runs a rank");
  x.Sample("pippy_worker_busy", {}, busy_ ? 1 : 0);
  x.Family("pippy_worker_steps_total", "counter", "Steps this worker's ranks completed");
  x.Sample("pippy_worker_steps_total", {}, static_cast<double>(steps_.load()));
  x.Family("pippy_worker_checkpoints_total", "counter", "Checkpoints this worker's ranks sent");
  x.Sample("pippy_worker_checkpoints_total", {}, static_cast<double>(checkpoints_.load()));
  x.Family("pippy_worker_transport_bytes_total", "counter", "Tensor bytes sent and received to and from peer ranks");
  x.Sample("pippy_worker_transport_bytes_total", {{"transport", "ucx"}, {"direction", "sent"}},
           static_cast<double>(bytes_sent_.load()));
  x.Sample("pippy_worker_transport_bytes_total", {{"transport", "ucx"}, {"direction", "received"}},
           static_cast<double>(bytes_received_.load()));
  x.Family("pippy_worker_allreduce_seconds_total", "counter", "Time spent in data-parallel gradient all-reduces");
  x.Sample("pippy_worker_allreduce_seconds_total", {}, allreduce_us_.load() * 1e-6);
  x.Family("pippy_worker_step_seconds", "histogram", "Step time of this worker's ranks");
  absl::MutexLock lock(&mu_);
  x.HistogramSamples("pippy_worker_step_seconds", {}, step_seconds_);
  return x.text();
}

}  // namespace pippy::worker
