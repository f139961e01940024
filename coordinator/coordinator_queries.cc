// The Coordinator's answers to users' questions (coordinator.h): jobs, workers,
// results, traces, metrics, and the routing of a serving request to its job. Each
// reads the jobs and the registry under the coordinator's mutex and changes nothing
// (CheckpointPath merges a checkpoint into a file once, outside it).
#include <algorithm>
#include <iterator>
#include <optional>
#include <set>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "coordinator/coordinator.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/result_assembly.h"
#include "proto/job_state.h"

namespace pippy::coordinator {

absl::StatusOr<Job> Coordinator::GetJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  JobRun* run = Find(job_id);
  if (run == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' (pippyctl list shows them)"));
  return run->View();
}

namespace {

constexpr int kDefaultPageSize = 100;
constexpr int kMaxPageSize = 1000;

// The filters and order a page token is valid for, as one canonical string.
std::string Query(const ListJobsRequest& r, bool newest_first) {
  std::vector<int> states(r.states().begin(), r.states().end());
  std::sort(states.begin(), states.end());
  states.erase(std::unique(states.begin(), states.end()), states.end());
  return absl::StrCat(absl::StrJoin(states, ","), "|", r.user(), "|", newest_first ? "desc" : "asc");
}

uint64_t Fnv1a(absl::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

// A token: the number of the page's last job and the query it belongs to, opaque.
std::string PageToken(int64_t last, const std::string& query) {
  return absl::WebSafeBase64Escape(absl::StrCat("p1:", last, ":", absl::Hex(Fnv1a(query))));
}

absl::StatusOr<int64_t> ParsePageToken(const std::string& token, const std::string& query) {
  const auto bad = [] {
    return absl::InvalidArgumentError(
        "page_token: not a token this coordinator gave for these filters and order (pass next_page_token back "
        "unchanged, with the same states, user and order_by; or start again without it)");
  };
  std::string raw;
  if (!absl::WebSafeBase64Unescape(token, &raw)) return bad();
  std::vector<std::string> parts = absl::StrSplit(raw, ':');
  int64_t last = 0;
  if (parts.size() != 3 || parts[0] != "p1" || !absl::SimpleAtoi(parts[1], &last) || last < 0 ||
      parts[2] != absl::StrCat(absl::Hex(Fnv1a(query)))) {
    return bad();
  }
  return last;
}

}  // namespace

absl::StatusOr<ListJobsResponse> Coordinator::ListJobs(const ListJobsRequest& request) {
  if (request.page_size() < 0) {
    return absl::InvalidArgumentError("page_size: must not be negative (0 asks for the default, 100)");
  }
  const int size = request.page_size() == 0 ? kDefaultPageSize : std::min(request.page_size(), kMaxPageSize);
  const std::string& order = request.order_by();
  const bool newest_first = order == "create_time desc";
  if (!newest_first && !order.empty() && order != "create_time" && order != "create_time asc") {
    return absl::InvalidArgumentError(absl::StrCat("order_by: '", order,
                                                   "' is not an order ListJobs knows; use \"create_time\" or "
                                                   "\"create_time desc\""));
  }
  for (int st : request.states()) {
    if (!JobState_IsValid(st) || st == JOB_STATE_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat("states: ", st, " is not a job state"));
    }
  }
  const std::string query = Query(request, newest_first);
  std::optional<int64_t> after;  // the previous page's last job: this page starts past it
  if (!request.page_token().empty()) {
    absl::StatusOr<int64_t> last = ParsePageToken(request.page_token(), query);
    if (!last.ok()) return last.status();
    after = *last;
  }
  const std::set<int> states(request.states().begin(), request.states().end());
  auto wanted = [&](const JobRun& run) {
    return (states.empty() || states.count(run.state()) > 0) && (request.user().empty() || run.job().user() == request.user());
  };
  ListJobsResponse out;
  absl::MutexLock lock(&mu_);
  int64_t last = 0;
  bool more = false;
  auto take = [&](int64_t number, const JobRun& run) {
    if (!wanted(run)) return true;
    if (out.jobs_size() == size) {
      more = true;
      return false;
    }
    *out.add_jobs() = run.Summary();
    last = number;
    return true;
  };
  if (newest_first) {
    auto it = after.has_value() ? std::make_reverse_iterator(by_number_.lower_bound(*after)) : by_number_.rbegin();
    for (; it != by_number_.rend() && take(it->first, *it->second); ++it) {
    }
  } else {
    auto it = after.has_value() ? by_number_.upper_bound(*after) : by_number_.begin();
    for (; it != by_number_.end() && take(it->first, *it->second); ++it) {
    }
  }
  if (more) out.set_next_page_token(PageToken(last, query));
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
    const JobState state = run->state();
    if (IsTerminal(state)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " ended ", JobState_Name(state), ": only a job that SUCCEEDED has a trained model to fetch",
          run->job().checkpoint_step() > 0
              ? absl::StrCat("; its checkpoint after step ", run->job().checkpoint_step(),
                             " is kept: pippyctl fetch ", job_id, " --checkpoint, or submit --resume-from ", job_id)
              : ""));
    }
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " has no trained model yet (state ",
                                                      JobState_Name(state), "; pippyctl watch ", job_id,
                                                      " follows it to the end)"));
  }
  return artifacts_->FetchPath(job_id);
}

absl::StatusOr<std::string> Coordinator::CheckpointPath(const std::string& job_id, const std::string& user) {
  int step = 0, stages = 0;
  std::string staged;
  PipelinePlan plan;
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(job_id);
    if (run == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' (pippyctl list shows them)"));
    const Job& job = run->job();
    if (!user.empty() && !job.user().empty() && user != job.user()) {
      return absl::PermissionDeniedError(
          absl::StrCat("job ", job_id, " was submitted by ", job.user(), "; only they can fetch its checkpoint"));
    }
    if (job.spec().mode() != MODE_TRAIN || job.spec().has_serving()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is not a training job: it has no checkpoints"));
    }
    step = job.checkpoint_step();
    stages = job.plan().stages_size() * std::max(1, job.plan().tensor_parallel().size());
    plan = job.plan();
    if (step <= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " has no checkpoint ", run->ended() ? "" : "yet ", "(", JobState_Name(job.state()), ", step ",
          job.step(), "; one is taken every ", job.spec().fault_tolerance().checkpoint_every(),
          " steps (--checkpoint-every) and after the last step)"));
    }
    const std::string merged = artifacts_->CheckpointFetchPath(job_id, step);
    if (ArtifactStore::FileSize(merged) > 0) return merged;
    // Links, made under the lock: a checkpoint committed meanwhile removes the files,
    // not these names of them.
    PIPPY_ASSIGN_OR_RETURN(staged, artifacts_->StageCheckpointForMerge(job_id, step, stages));
  }
  PIPPY_RETURN_IF_ERROR(AcquireModelSlot());
  AssembleOptions merge;
  merge.merger = options_.child_binary;
  merge.timeout = options_.prepare_timeout;
  merge.cancelled = [this] { return stopping_.load(); };
  merge.plan = plan;
  const auto start = absl::Now();
  absl::StatusOr<std::string> assembled = MergeStagesIn(staged, stages, merge);
  ReleaseModelSlot();
  absl::Status s = assembled.status();
  if (s.ok()) s = artifacts_->PublishCheckpoint(job_id, step, *assembled, staged);
  if (!s.ok()) {
    artifacts_->RemoveMergeDir(staged);
    return absl::Status(s.code(), absl::StrCat("merging ", job_id, "'s checkpoint after step ", step, ": ", s.message()));
  }
  log::Info("job={} checkpoint after step {} merged for fetching in {}", job_id, step,
            absl::FormatDuration(absl::Now() - start));
  return artifacts_->CheckpointFetchPath(job_id, step);
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

absl::StatusOr<std::shared_ptr<RequestQueue>> Coordinator::ServingQueueOf(const std::string& job, bool generation) {
  const char* kind = generation ? "generation" : "serving";
  absl::MutexLock lock(&mu_);
  const JobRun* found = Find(job);
  // By name: the newest serving job so named that has not ended, else the newest; of
  // the kind asked for if there is one (else the other kind's, refused below).
  for (int pass = 0; pass < 2 && found == nullptr; ++pass) {
    for (const auto& [id, run] : jobs_) {
      if (run->job().spec().name() != job || !run->job().spec().has_serving()) continue;
      if (pass == 0 && run->job().spec().serving().has_generation() != generation) continue;
      const bool better = found == nullptr || (found->ended() && !run->ended()) ||
                          (found->ended() == run->ended() &&
                           run->job().created_unix_ms() >= found->job().created_unix_ms());
      if (better) found = run.get();
    }
  }
  if (found == nullptr) {
    return absl::NotFoundError(absl::StrCat("no ", kind, " job '", job, "' (pippyctl list shows the jobs; pippyctl serve",
                                            generation ? " --generate" : "", " starts one)"));
  }
  if (!found->job().spec().has_serving()) {
    return absl::FailedPreconditionError(absl::StrCat("job ", found->id(), " is not a ", kind, " job (pippyctl serve",
                                                      generation ? " --generate" : "",
                                                      " starts one; inference jobs read a data file)"));
  }
  if (found->job().spec().serving().has_generation() != generation) {
    return absl::FailedPreconditionError(
        generation ? absl::StrCat("job ", found->id(), " serves one forward per request, not generation: use pippyctl "
                                  "infer (Infer), or serve the model with --generate")
                   : absl::StrCat("job ", found->id(), " is a generation job: use pippyctl generate (Generate)"));
  }
  if (found->ended()) {
    return absl::FailedPreconditionError(absl::StrCat(kind, " job ", found->id(), " ended (",
                                                      JobState_Name(found->state()), ": ", found->job().reason(),
                                                      "); serve the model again"));
  }
  std::shared_ptr<RequestQueue> queue = found->serving();
  if (queue == nullptr) {  // a detached submission not yet prepared
    return absl::UnavailableError(absl::StrCat(kind, " job ", found->id(), " is ", JobState_Name(found->state()),
                                               ": it takes requests once it is SERVING (pippyctl serve --wait "
                                               "waits for that)"));
  }
  return queue;
}

absl::Status Coordinator::Infer(const std::string& job, std::string input, ServingQueue::Done done,
                               std::shared_ptr<const std::atomic<bool>> cancelled) {
  PIPPY_ASSIGN_OR_RETURN(std::shared_ptr<RequestQueue> queue, ServingQueueOf(job, /*generation=*/false));
  auto serving = std::dynamic_pointer_cast<ServingQueue>(queue);
  if (serving == nullptr) return absl::InternalError("a serving job without its serving queue");
  return serving->Submit(std::move(input), std::move(done), std::move(cancelled));
}

absl::Status Coordinator::Generate(const std::string& job, GenerationQueue::Request request,
                                   GenerationQueue::OnEvent on_event, std::shared_ptr<const std::atomic<bool>> cancelled) {
  PIPPY_ASSIGN_OR_RETURN(std::shared_ptr<RequestQueue> queue, ServingQueueOf(job, /*generation=*/true));
  auto generation = std::dynamic_pointer_cast<GenerationQueue>(queue);
  if (generation == nullptr) return absl::InternalError("a generation job without its generation queue");
  return generation->Submit(std::move(request), std::move(on_event), std::move(cancelled));
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
      // The counters View() put in the job (Stats() sorts its latency windows: once a scrape).
      const ServingStats& stats = snapshot.jobs.back().serving();
      if (auto serving = std::dynamic_pointer_cast<ServingQueue>(run->serving())) {
        snapshot.serving.push_back({id, stats, serving->LatencySeconds()});
      }
      if (auto generation = std::dynamic_pointer_cast<GenerationQueue>(run->serving())) {
        snapshot.generation.push_back({id, stats.generation(), generation->TtftSeconds(), generation->ItlSeconds()});
      }
    }
    for (const auto& [id, w] : workers_->all()) {
      snapshot.workers.push_back({id, w.info.name(), w.info.state(), absl::ToDoubleSeconds(now - w.last_heartbeat)});
    }
  }
  return metrics_.Text(snapshot);
}

}  // namespace pippy::coordinator
