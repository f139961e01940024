// The Coordinator's answers to users' questions (coordinator.h): jobs, workers,
// results, traces, metrics, and the routing of a serving request to its job. Each
// reads the jobs and the registry under the coordinator's mutex and changes nothing.
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "coordinator/coordinator.h"

namespace pippy::coordinator {

absl::StatusOr<Job> Coordinator::GetJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  JobRun* run = Find(job_id);
  if (run == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' (pippyctl list shows them)"));
  return run->View();
}

std::vector<Job> Coordinator::ListJobs() {
  absl::MutexLock lock(&mu_);
  std::vector<Job> out;
  for (const auto& [id, run] : jobs_) out.push_back(run->View());
  std::sort(out.begin(), out.end(), [](const Job& a, const Job& b) { return a.created_unix_ms() < b.created_unix_ms(); });
  return out;
}

absl::StatusOr<Job> Coordinator::WaitForChange(const std::string& job_id, int64_t* version, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    JobRun* run = Find(job_id);
    return run == nullptr || run->version() != *version || stop_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
  JobRun* run = Find(job_id);
  if (run == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  *version = run->version();
  return run->View();
}

absl::StatusOr<std::string> Coordinator::ResultPath(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  JobRun* run = Find(job_id);
  if (run == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  if (!run->job().model_ready()) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " has no trained model yet (state ",
                                                      JobState_Name(run->state()), ")"));
  }
  return artifacts_->FetchPath(job_id);
}

std::vector<WorkerInfo> Coordinator::ListWorkers() {
  absl::MutexLock lock(&mu_);
  return workers_->List();
}

absl::StatusOr<StepTrace> Coordinator::GetTrace(const std::string& job_id, int step) {
  absl::MutexLock lock(&mu_);
  JobRun* run = Find(job_id);
  if (run == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' (pippyctl list shows them)"));
  return run->Trace(step, [this, run](int rank) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    // Called within this call, with mu_ held.
    const std::string& wid = rank < run->job().workers_size() ? run->job().workers(rank) : "";
    const WorkerRegistry::Worker* w = workers_->Find(wid);
    return w != nullptr ? w->info.name() : wid;
  });
}

absl::Status Coordinator::Infer(const std::string& job, std::string input, ServingQueue::Done done,
                               std::shared_ptr<const std::atomic<bool>> cancelled) {
  std::shared_ptr<ServingQueue> queue;
  {
    absl::MutexLock lock(&mu_);
    const JobRun* found = Find(job);
    if (found == nullptr) {
      // By name: the newest serving job so named that has not ended, else the newest.
      for (const auto& [id, run] : jobs_) {
        if (run->job().spec().name() != job || !run->job().spec().has_serving()) continue;
        const bool better = found == nullptr || (found->ended() && !run->ended()) ||
                            (found->ended() == run->ended() &&
                             run->job().created_unix_ms() >= found->job().created_unix_ms());
        if (better) found = run.get();
      }
    }
    if (found == nullptr) {
      return absl::NotFoundError(absl::StrCat("no serving job '", job,
                                              "' (pippyctl list shows the jobs; pippyctl serve starts one)"));
    }
    if (!found->job().spec().has_serving()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", found->id(), " is not a serving job (pippyctl "
                                                        "serve starts one; inference jobs read a data file)"));
    }
    if (found->ended()) {
      return absl::FailedPreconditionError(absl::StrCat("serving job ", found->id(), " ended (",
                                                        JobState_Name(found->state()), ": ", found->job().reason(),
                                                        "); serve the model again"));
    }
    queue = found->serving();
  }
  return queue->Submit(std::move(input), std::move(done), std::move(cancelled));
}

std::string Coordinator::MetricsText() {
  MetricsSnapshot snapshot;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = absl::Now();
    for (const auto& [id, run] : jobs_) {
      snapshot.jobs.push_back(run->View());
      if (run->ended()) continue;
      if (run->checkpoint_time() != absl::InfinitePast()) {
        snapshot.ages.push_back({id, absl::ToDoubleSeconds(now - run->checkpoint_time())});
      }
      if (run->serving() != nullptr) {
        snapshot.serving.push_back({id, run->serving()->Stats(), run->serving()->LatencySeconds()});
      }
    }
    for (const auto& [id, w] : workers_->all()) {
      snapshot.workers.push_back({id, w.info.name(), w.info.state(), absl::ToDoubleSeconds(now - w.last_heartbeat)});
    }
  }
  return metrics_.Text(snapshot);
}

}  // namespace pippy::coordinator
