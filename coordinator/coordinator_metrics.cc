#include "coordinator/coordinator_metrics.h"

#include <map>
#include <string>

#include "proto/job_state.h"

namespace pippy::coordinator {

void CoordinatorMetrics::OnStep(const CompletedStep& step) {
  absl::MutexLock lock(&mu_);
  ++steps_;
  samples_ += step.samples;
  bytes_sent_ += step.bytes_sent;
  bytes_received_ += step.bytes_received;
  step_seconds_.Observe(step.seconds);
}

void CoordinatorMetrics::OnCheckpoint() {
  absl::MutexLock lock(&mu_);
  ++checkpoints_;
}

void CoordinatorMetrics::OnRestart() {
  absl::MutexLock lock(&mu_);
  ++restarts_;
}

namespace {

void JobsAndWorkers(const MetricsSnapshot& s, metrics::Exposition& x) {
  std::map<std::string, int> jobs;
  for (int st = JobState_MIN; st <= JobState_MAX; ++st) {
    if (JobState_IsValid(st) && st != JOB_STATE_UNSPECIFIED) jobs[JobState_Name(static_cast<JobState>(st))] = 0;
  }
  for (const Job& j : s.jobs) ++jobs[JobState_Name(j.state())];
  x.Family("pippy_jobs", "gauge", "Jobs known to the coordinator, by state");
  for (const auto& [state, n] : jobs) x.Sample("pippy_jobs", {{"state", state}}, n);
  std::map<std::string, int> workers = {{"IDLE", 0}, {"BUSY", 0}};
  for (const MetricsSnapshot::Worker& w : s.workers) ++workers[WorkerState_Name(w.state)];
  x.Family("pippy_workers", "gauge", "Registered workers, by state");
  for (const auto& [state, n] : workers) x.Sample("pippy_workers", {{"state", state}}, n);
}

void PeakMemory(const MetricsSnapshot& s, metrics::Exposition& x) {
  x.Family("pippy_rank_peak_memory_bytes", "gauge",
           "The most resident memory a rank's worker process held during any step of an unfinished job");
  for (const Job& j : s.jobs) {
    if (IsTerminal(j.state())) continue;
    for (int rank = 0; rank < j.peak_memory_bytes_size(); ++rank) {
      x.Sample("pippy_rank_peak_memory_bytes", {{"job", j.job_id()}, {"rank", std::to_string(rank)}},
               static_cast<double>(j.peak_memory_bytes(rank)));
    }
  }
}

void LearningRates(const MetricsSnapshot& s, metrics::Exposition& x) {
  x.Family("pippy_job_learning_rate", "gauge",
           "The learning rate of the last completed step of an unfinished training job (its lr schedule's)");
  for (const Job& j : s.jobs) {
    if (IsTerminal(j.state()) || j.learning_rates_size() == 0) continue;
    x.Sample("pippy_job_learning_rate", {{"job", j.job_id()}}, j.learning_rates(j.learning_rates_size() - 1));
  }
}

void EvalLosses(const MetricsSnapshot& s, metrics::Exposition& x) {
  x.Family("pippy_job_eval_loss", "gauge",
           "The last evaluation's loss (--eval-dataset) of an unfinished training job");
  for (const Job& j : s.jobs) {
    if (IsTerminal(j.state()) || j.evals_size() == 0) continue;
    x.Sample("pippy_job_eval_loss", {{"job", j.job_id()}}, j.evals(j.evals_size() - 1).loss());
  }
}

void Ages(const MetricsSnapshot& s, metrics::Exposition& x) {
  x.Family("pippy_worker_heartbeat_age_seconds", "gauge", "Time since each worker was last heard from");
  for (const MetricsSnapshot::Worker& w : s.workers) {
    x.Sample("pippy_worker_heartbeat_age_seconds", {{"worker", w.id}, {"name", w.name}}, w.heartbeat_age_seconds);
  }
  x.Family("pippy_checkpoint_age_seconds", "gauge", "Time since the last checkpoint of each unfinished job");
  for (const MetricsSnapshot::JobAges& a : s.ages) {
    if (a.checkpoint_age_seconds >= 0) x.Sample("pippy_checkpoint_age_seconds", {{"job", a.job_id}}, a.checkpoint_age_seconds);
  }
}

void Serving(const MetricsSnapshot& snapshot, metrics::Exposition& x) {
  const auto& serving = snapshot.serving;
  x.Family("pippy_serving_requests_total", "counter", "Requests a serving job answered, by outcome");
  for (const auto& s : serving) {
    x.Sample("pippy_serving_requests_total", {{"job", s.job_id}, {"outcome", "ok"}},
             static_cast<double>(s.stats.requests() - s.stats.failed()));
    x.Sample("pippy_serving_requests_total", {{"job", s.job_id}, {"outcome", "error"}},
             static_cast<double>(s.stats.failed()));
  }
  x.Family("pippy_serving_rows_total", "counter", "Rows a serving job answered");
  for (const auto& s : serving) x.Sample("pippy_serving_rows_total", {{"job", s.job_id}}, static_cast<double>(s.stats.rows()));
  x.Family("pippy_serving_microbatches_total", "counter", "Micro-batches a serving job sent through its pipeline");
  for (const auto& s : serving) {
    x.Sample("pippy_serving_microbatches_total", {{"job", s.job_id}}, static_cast<double>(s.stats.microbatches()));
  }
  x.Family("pippy_serving_queued_requests", "gauge", "Requests waiting for a micro-batch");
  for (const auto& s : serving) x.Sample("pippy_serving_queued_requests", {{"job", s.job_id}}, s.stats.queued());
  x.Family("pippy_serving_inflight_microbatches", "gauge", "Micro-batches in a serving job's pipeline");
  for (const auto& s : serving) x.Sample("pippy_serving_inflight_microbatches", {{"job", s.job_id}}, s.stats.inflight());
  x.Family("pippy_serving_request_seconds", "histogram", "Request latency: arrival at the coordinator to answer");
  for (const auto& s : serving) x.HistogramSamples("pippy_serving_request_seconds", {{"job", s.job_id}}, s.latency_seconds);
  const auto& generation = snapshot.generation;
  x.Family("pippy_generation_tokens_total", "counter", "Tokens a generation job sampled");
  for (const auto& g : generation) x.Sample("pippy_generation_tokens_total", {{"job", g.job_id}}, static_cast<double>(g.stats.tokens()));
  x.Family("pippy_generation_prompt_tokens_total", "counter", "Prompt tokens a generation job prefilled");
  for (const auto& g : generation) {
    x.Sample("pippy_generation_prompt_tokens_total", {{"job", g.job_id}}, static_cast<double>(g.stats.prompt_tokens()));
  }
  x.Family("pippy_generation_sequences_total", "counter", "Sequences a generation job ended, by outcome");
  for (const auto& g : generation) {
    x.Sample("pippy_generation_sequences_total", {{"job", g.job_id}, {"outcome", "ok"}},
             static_cast<double>(g.stats.sequences() - g.stats.failed()));
    x.Sample("pippy_generation_sequences_total", {{"job", g.job_id}, {"outcome", "error"}},
             static_cast<double>(g.stats.failed()));
  }
  x.Family("pippy_generation_tokens_per_second", "gauge", "Tokens sampled per second over the last 10 s");
  for (const auto& g : generation) x.Sample("pippy_generation_tokens_per_second", {{"job", g.job_id}}, g.stats.tokens_per_second());
  x.Family("pippy_generation_slots_in_use", "gauge", "KV-cache slots holding a sequence");
  for (const auto& g : generation) x.Sample("pippy_generation_slots_in_use", {{"job", g.job_id}}, g.stats.slots_in_use());
  x.Family("pippy_generation_slots", "gauge", "KV-cache slots of a generation job");
  for (const auto& g : generation) x.Sample("pippy_generation_slots", {{"job", g.job_id}}, g.stats.max_slots());
  x.Family("pippy_generation_waiting_requests", "gauge", "Requests waiting for a slot");
  for (const auto& g : generation) x.Sample("pippy_generation_waiting_requests", {{"job", g.job_id}}, g.stats.waiting());
  x.Family("pippy_generation_time_to_first_token_seconds", "histogram", "Arrival at the coordinator to the first token");
  for (const auto& g : generation) {
    x.HistogramSamples("pippy_generation_time_to_first_token_seconds", {{"job", g.job_id}}, g.ttft_seconds);
  }
  x.Family("pippy_generation_inter_token_seconds", "histogram", "Between consecutive tokens of a sequence");
  for (const auto& g : generation) x.HistogramSamples("pippy_generation_inter_token_seconds", {{"job", g.job_id}}, g.itl_seconds);
}

}  // namespace

std::string CoordinatorMetrics::Text(const MetricsSnapshot& snapshot) const {
  metrics::Exposition x;
  JobsAndWorkers(snapshot, x);
  {
    absl::MutexLock lock(&mu_);
    x.Family("pippy_steps_total", "counter", "Pipeline steps completed by every rank of a job");
    x.Sample("pippy_steps_total", {}, static_cast<double>(steps_));
    x.Family("pippy_samples_total", "counter", "Samples trained on or inferred (batch size per completed step)");
    x.Sample("pippy_samples_total", {}, static_cast<double>(samples_));
    x.Family("pippy_step_seconds", "histogram", "Step time (the slowest rank's) of completed steps");
    x.HistogramSamples("pippy_step_seconds", {}, step_seconds_);
    x.Family("pippy_transport_bytes_total", "counter",
             "Tensor bytes the ranks moved between each other (UCX), as reported");
    x.Sample("pippy_transport_bytes_total", {{"transport", "ucx"}, {"direction", "sent"}},
             static_cast<double>(bytes_sent_));
    x.Sample("pippy_transport_bytes_total", {{"transport", "ucx"}, {"direction", "received"}},
             static_cast<double>(bytes_received_));
    x.Family("pippy_checkpoints_total", "counter", "Checkpoints committed");
    x.Sample("pippy_checkpoints_total", {}, static_cast<double>(checkpoints_));
    x.Family("pippy_restarts_total", "counter", "Jobs restarted after losing a worker");
    x.Sample("pippy_restarts_total", {}, static_cast<double>(restarts_));
  }
  Ages(snapshot, x);
  PeakMemory(snapshot, x);
  LearningRates(snapshot, x);
  EvalLosses(snapshot, x);
  Serving(snapshot, x);
  return x.text();
}

}  // namespace pippy::coordinator
