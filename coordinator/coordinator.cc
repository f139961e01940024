#include "coordinator/coordinator.h"

#include <algorithm>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/chunker.h"
#include "common/device.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/job_preparation.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/partition/merge.h"
#include "proto/job_state.h"

namespace pippy::coordinator {
namespace {

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

std::vector<int> StagesOfRank(const std::vector<int>& stage_to_rank, int rank) {
  std::vector<int> out;
  for (size_t s = 0; s < stage_to_rank.size(); ++s) {
    if (stage_to_rank[s] == rank) out.push_back(static_cast<int>(s));
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(const Options& options) {
  std::unique_ptr<Coordinator> c(new Coordinator(options));
  auto artifacts = ArtifactStore::Open(options.state_dir);
  if (!artifacts.ok()) return artifacts.status();
  c->artifacts_ = std::move(*artifacts);
  auto store = JobStore::Open(options.state_dir);
  if (!store.ok()) return store.status();
  c->store_ = std::move(*store);
  {
    absl::MutexLock lock(&c->mu_);
    c->RestoreJobs();
  }
  c->loop_ = std::thread([p = c.get()] { p->Loop(); });
  return c;
}

void Coordinator::RestoreJobs() {
  next_worker_ = std::max<int64_t>(1, store_->GetCounter("next_worker", 1));
  for (const Job& job : store_->List()) {
    JobEntry& e = jobs_[job.job_id()];
    e.job = job;
    int64_t n = 0;
    if (sscanf(job.job_id().c_str(), "job-%ld", &n) == 1) next_job_ = std::max(next_job_, n + 1);
    if (IsTerminal(job.state())) continue;
    const std::string& id = job.job_id();
    if (job.spec().has_serving()) e.serving = MakeServingQueue(job);
    e.stage_to_rank.assign(job.stage_ranks().begin(), job.stage_ranks().end());
    e.per_replica =
        e.stage_to_rank.empty() ? 0 : *std::max_element(e.stage_to_rank.begin(), e.stage_to_rank.end()) + 1;
    e.ranks = e.per_replica * std::max(1, job.spec().replicas());
    for (int r = 0; r < e.per_replica; ++r) {
      e.share_bytes.push_back(std::max<int64_t>(0, ArtifactStore::FileSize(artifacts_->SharePath(id, r))));
    }
    bool files = e.ranks > 0 && static_cast<int>(e.stage_to_rank.size()) == job.plan().stages_size();
    for (int st = 0; files && st < job.plan().stages_size(); ++st) {
      files = ArtifactStore::FileSize(artifacts_->StagePath(id, st)) > 0;
    }
    const int ckpt = job.checkpoint_step();
    bool checkpoint = ckpt > 0;
    for (int st = 0; checkpoint && st < job.plan().stages_size(); ++st) {
      checkpoint = ArtifactStore::FileSize(artifacts_->CheckpointStagePath(id, ckpt, st)) > 0;
    }
    for (int r = 0; checkpoint && r < e.ranks; ++r) {
      checkpoint = ArtifactStore::FileSize(artifacts_->CheckpointStatePath(id, ckpt, r)) > 0;
    }
    // Pieces of checkpoints that were never committed go; the committed one stays.
    artifacts_->RemoveCheckpoints(id, [ckpt](int step) { return step != ckpt; });
    e.stage_files_ready = files;
    std::string failed;
    if (job.state() == QUEUED) {
      if (files) {
        queue_.push_back(id);
        AddEvent(e, "the coordinator restarted; the job is queued again");
      } else {
        failed = "the coordinator restarted while the job was QUEUED and its stage files are missing";
      }
    } else if (job.state() == PARTITIONING) {
      failed = "the coordinator restarted while the job's stages were being sent (they were only in memory)";
    } else if (ckpt > 0 && !checkpoint) {
      failed = absl::StrCat("the coordinator restarted while the job was ", JobState_Name(job.state()),
                            " and its checkpoint after step ", ckpt, " is incomplete on disk");
    } else if (!files && ckpt == 0) {
      failed = absl::StrCat("the coordinator restarted while the job was ", JobState_Name(job.state()),
                            " before its stage files were written");
    } else {
      // Placed, running or recovering: resume from the checkpoint once workers are back.
      e.job.set_state(RECOVERING);
      e.job.set_attempt(job.attempt() + 1);
      e.job.set_step(ckpt);
      e.job.mutable_losses()->Truncate(std::min(e.job.losses_size(), ckpt));
      e.job.mutable_step_seconds()->Truncate(std::min(e.job.step_seconds_size(), ckpt));
      e.job.clear_breakdown();
      e.recover_deadline = absl::Now() + absl::Seconds(job.spec().fault_tolerance().recovery_timeout_s());
      queue_.insert(queue_.begin(), id);
      AddEvent(e, absl::StrCat("the coordinator restarted while the job was ", JobState_Name(job.state()),
                               "; resuming from step ", ckpt, " once ", e.ranks, " workers are idle"));
    }
    if (!failed.empty()) {
      e.job.set_state(FAILED);
      e.job.set_reason(absl::StrCat(failed, "; submit it again"));
      artifacts_->RemoveJobFiles(id);
    }
    Touch(e);
  }
}

void Coordinator::AddEvent(JobEntry& e, const std::string& message) {
  JobEvent* ev = e.job.add_history();
  ev->set_unix_ms(NowMs());
  ev->set_message(message);
  log::Info("job={} {}", e.job.job_id(), message);
}

Coordinator::~Coordinator() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    for (auto& [id, e] : jobs_) e.stop->store(true);
  }
  if (loop_.joinable()) loop_.join();
}

void Coordinator::Deliver(Outbox* out) {
  for (auto& [channel, message] : *out) channel->Send(message);
  out->clear();
}

void Coordinator::Touch(JobEntry& entry) {
  entry.job.set_updated_unix_ms(NowMs());
  ++entry.version;
  absl::Status saved = store_->Put(entry.job);
  // The in-memory record stays authoritative; a lost write only costs the record's
  // freshness after a restart, so it is logged, not fatal.
  if (!saved.ok()) log::Warn("job={} record not saved: {}", entry.job.job_id(), saved.message());
}

absl::StatusOr<std::unique_ptr<Upload>> Coordinator::NewUpload() { return artifacts_->NewUpload(); }

absl::Status Coordinator::AcquireModelSlot() {
  absl::MutexLock lock(&mu_);
  auto free_or_stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !model_in_memory_ || stop_; };
  // No deadline needed: whoever holds the slot lets go when its own bounded work ends.
  mu_.Await(absl::Condition(&free_or_stopping));
  if (stop_) return absl::UnavailableError("the coordinator is stopping; submit again once it is back");
  model_in_memory_ = true;
  return absl::OkStatus();
}

void Coordinator::ReleaseModelSlot() {
  absl::MutexLock lock(&mu_);
  model_in_memory_ = false;
}

absl::StatusOr<std::string> Coordinator::SubmitJob(const JobSpec& spec, std::unique_ptr<Upload> upload,
                                                   const std::string& user) {
  absl::Status closed = upload->Close();
  if (!closed.ok()) return closed;
  if (options_.max_queued_per_user > 0) {
    absl::MutexLock lock(&mu_);
    int waiting = 0;
    for (const auto& [id, e] : jobs_) {
      const JobState st = e.job.state();
      if (e.job.user() == user && (st == QUEUED || st == PARTITIONING)) ++waiting;
    }
    if (waiting >= options_.max_queued_per_user) {
      return absl::ResourceExhaustedError(absl::StrCat(
          user.empty() ? "you have " : absl::StrCat(user, " has "), waiting,
          " jobs waiting for workers, the coordinator's limit (--max-queued-jobs-per-user raises it); cancel one or "
          "wait for it to start"));
    }
  }
  absl::Status slot = AcquireModelSlot();
  if (!slot.ok()) return slot;
  absl::StatusOr<PreparedJob> prepared = PrepareJob(spec, upload->dir(), {options_.model_checker, options_.model_check_timeout});
  if (!prepared.ok()) {
    ReleaseModelSlot();
    return prepared.status();
  }
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    const int registered = static_cast<int>(workers_.size());
    const int replicas = std::max(1, prepared->spec.replicas());
    const int need = prepared->ranks * replicas;
    // No workers yet: a cluster starting up; the job waits. Some, but too few: refuse.
    absl::Status refused;
    if (registered > 0 && need > registered) {
      refused = absl::InvalidArgumentError(absl::StrCat(
          "split: the job needs ", need, " workers (", prepared->plan.stages_size(), " stages, ",
          prepared->spec.schedule().stages_per_worker(), " per worker",
          replicas > 1 ? absl::StrCat(", ", replicas, " replicas") : "", ") but only ", registered,
          " are registered; use fewer stages, more stages per worker (an interleaved schedule)",
          replicas > 1 ? " or fewer replicas" : ""));
    }
    // GPU workers only: a rank whose stages fit none of them can never be placed.
    bool any_cpu = false;
    int64_t largest_gpu = 0;
    for (const auto& [wid, w] : workers_) {
      if (w.device.is_gpu()) {
        largest_gpu = std::max(largest_gpu, w.info.free_memory());
      } else {
        any_cpu = true;
      }
    }
    for (int r = 0; refused.ok() && registered > 0 && !any_cpu && r < prepared->ranks; ++r) {
      const int64_t bytes = job::RankMemoryBytes(prepared->spec, prepared->plan, prepared->stage_to_rank, r);
      if (bytes > largest_gpu) {
        refused = absl::InvalidArgumentError(absl::StrCat(
            "split: rank ", r, " (stages ", absl::StrJoin(StagesOfRank(prepared->stage_to_rank, r), ","), ") needs ",
            bytes, " bytes of device memory (parameters, gradients and optimizer state) but the largest GPU "
            "worker registered has ", largest_gpu, " bytes free; split into more stages or add larger GPUs"));
      }
    }
    if (refused.ok()) {
      id = absl::StrCat("job-", next_job_++);
      refused = artifacts_->Accept(*upload, id);
    }
    if (!refused.ok()) {
      model_in_memory_ = false;
      return refused;
    }
    JobEntry entry;
    entry.job.set_job_id(id);
    entry.job.set_user(user);
    *entry.job.mutable_spec() = prepared->spec;
    *entry.job.mutable_plan() = prepared->plan;
    entry.job.set_state(PARTITIONING);
    entry.job.set_created_unix_ms(NowMs());
    entry.job.set_model_bytes(upload->model_bytes());
    entry.per_replica = prepared->ranks;
    entry.ranks = need;
    entry.stage_to_rank = prepared->stage_to_rank;
    for (int r : prepared->stage_to_rank) entry.job.add_stage_ranks(r);
    entry.share_bytes = prepared->share_bytes;
    entry.stages = prepared->stages;
    if (prepared->spec.has_serving()) entry.serving = MakeServingQueue(entry.job);
    Touch(entry);
    jobs_[id] = std::move(entry);
    log::Info("job={} accepted: {} stages on {} workers{}, schedule {}", id, prepared->plan.stages_size(), need,
              replicas > 1 ? absl::StrCat(" (", replicas, " replicas)") : "",
              job::ScheduleName(prepared->spec.schedule().kind()));
  }
  prepared->stages.reset();  // the job entry holds them until they are out
  tasks_.Run([this, id] { StageOut(id); });
  return id;
}

void Coordinator::StageOut(const std::string& job_id) {
  std::shared_ptr<const PreparedStages> stages;
  std::vector<RankSend> sends;
  {
    absl::MutexLock lock(&mu_);
    JobEntry& e = jobs_[job_id];
    stages = std::move(e.stages);
    if (!IsTerminal(e.job.state())) {
      std::vector<std::string> chosen = FitWorkers(e, IdleWorkers());
      // Straight from memory when the job can run now and no earlier job waits for
      // these workers; else to files and the queue.
      if (!chosen.empty() && queue_.empty()) sends = Place(e, chosen);
    }
  }
  if (!sends.empty()) {
    // Every rank at once, each stage serialised as it is sent.
    const auto start = absl::Now();
    std::vector<std::map<int, int64_t>> bytes(sends.size());
    std::vector<std::thread> threads;
    StageWriter from_memory = [&stages](int stage, const std::function<absl::Status(absl::string_view)>& sink) {
      return stages->Write(stage, sink);
    };
    for (size_t r = 0; r < sends.size(); ++r) {
      threads.emplace_back([&, r] { SendRank(sends[r], from_memory, &bytes[r]); });
    }
    for (std::thread& t : threads) t.join();
    bool restartable = false;
    {
      absl::MutexLock lock(&mu_);
      JobEntry& e = jobs_[job_id];
      std::vector<int64_t> sizes(e.stage_to_rank.size(), 0);
      for (const auto& per_rank : bytes) {
        for (const auto& [s, n] : per_rank) sizes[s] = n;
      }
      e.job.clear_stage_file_bytes();
      for (int64_t n : sizes) e.job.add_stage_file_bytes(n);
      Touch(e);
      log::Info("job={} stages streamed to {} workers from memory in {}", job_id, sends.size(),
                absl::FormatDuration(absl::Now() - start));
      restartable = !IsTerminal(e.job.state()) && e.job.spec().fault_tolerance().max_restarts() > 0;
    }
    if (restartable) {
      // A restart before the first checkpoint (or after a coordinator restart) places
      // the stages again from these files; the job runs meanwhile.
      const auto write_start = absl::Now();
      absl::StatusOr<std::vector<int64_t>> written = stages->WriteFiles(artifacts_->JobDir(job_id));
      Outbox out;
      {
        absl::MutexLock lock(&mu_);
        JobEntry& e = jobs_[job_id];
        if (!written.ok()) {
          const std::string why = absl::StrCat("writing the stage files for restarts: ", written.status().message());
          log::Warn("job={} {}", job_id, why);
          if (e.job.state() == RECOVERING && e.job.checkpoint_step() == 0) {
            Finish(e, FAILED, absl::StrCat("the job cannot restart: ", why), &out);
          }
        } else if (IsTerminal(e.job.state())) {
          artifacts_->RemoveJobFiles(job_id);  // it ended while the files were written
        } else {
          e.stage_files_ready = true;
          log::Info("job={} stage files written for restarts in {}", job_id,
                    absl::FormatDuration(absl::Now() - write_start));
          Schedule();  // a restart may have been waiting for them
        }
      }
      Deliver(&out);
    }
  } else if (stages != nullptr) {
    const auto start = absl::Now();
    absl::StatusOr<std::vector<int64_t>> sizes = stages->WriteFiles(artifacts_->JobDir(job_id));
    Outbox out;
    {
      absl::MutexLock lock(&mu_);
      JobEntry& e = jobs_[job_id];
      if (IsTerminal(e.job.state())) {
        // Cancelled meanwhile: nothing to queue (Finish removed the files).
      } else if (!sizes.ok()) {
        Finish(e, FAILED, absl::StrCat("writing the stage files: ", sizes.status().message()), &out);
      } else {
        e.job.clear_stage_file_bytes();
        for (int64_t n : *sizes) e.job.add_stage_file_bytes(n);
        e.job.set_state(QUEUED);
        e.stage_files_ready = true;
        queue_.push_back(job_id);
        log::Info("job={} queued; {} stage files written in {}", job_id, sizes->size(),
                  absl::FormatDuration(absl::Now() - start));
        Touch(e);
        Schedule();
      }
    }
    Deliver(&out);
  }
  stages.reset();
  ReleaseModelSlot();
}

std::vector<std::string> Coordinator::IdleWorkers() {
  std::vector<std::string> idle;
  for (const auto& [id, w] : workers_) {
    if (w.info.state() == IDLE) idle.push_back(id);
  }
  return idle;
}

std::vector<std::string> Coordinator::FitWorkers(const JobEntry& e, const std::vector<std::string>& idle) {
  if (static_cast<int>(idle.size()) < e.ranks || e.ranks <= 0) return {};
  std::vector<int64_t> need(static_cast<size_t>(e.ranks));
  for (int g = 0; g < e.ranks; ++g) {
    need[static_cast<size_t>(g)] =
        job::RankMemoryBytes(e.job.spec(), e.job.plan(), e.stage_to_rank, g % std::max(1, e.per_replica));
  }
  std::vector<int> order(need.size());
  for (size_t g = 0; g < order.size(); ++g) order[g] = static_cast<int>(g);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return need[a] > need[b]; });
  std::vector<std::string> free = idle;
  std::vector<std::string> chosen(need.size());
  for (int g : order) {
    int best = -1;
    for (size_t k = 0; k < free.size(); ++k) {
      const WorkerEntry& w = workers_.at(free[k]);
      if (w.device.is_gpu()) {
        if (w.info.free_memory() < need[g]) continue;
        const WorkerEntry& chosen_so_far = workers_.at(free[best < 0 ? k : best]);
        if (best < 0 || !chosen_so_far.device.is_gpu() || w.info.free_memory() < chosen_so_far.info.free_memory()) {
          best = static_cast<int>(k);
        }
      } else if (best < 0) {
        best = static_cast<int>(k);
      }
    }
    if (best < 0) return {};
    chosen[g] = free[best];
    free.erase(free.begin() + best);
  }
  return chosen;
}

absl::StatusOr<Job> Coordinator::GetJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' (pippyctl list shows them)"));
  return View(it->second);
}

Job Coordinator::View(const JobEntry& e) {
  if (e.serving == nullptr) return e.job;
  Job j = e.job;
  *j.mutable_serving() = e.serving->Stats();
  return j;
}

std::shared_ptr<ServingQueue> Coordinator::MakeServingQueue(const Job& job) {
  ServingQueue::Options o;
  o.job_id = job.job_id();
  const ServingSpec& sv = job.spec().serving();
  o.max_batch = sv.max_batch();
  o.max_delay = absl::Milliseconds(sv.max_delay_ms());
  o.stages = job.plan().stages_size();
  o.max_inflight = sv.max_inflight() > 0 ? sv.max_inflight() : o.stages + 1;
  for (const ModelValue& v : job.plan().inputs()) {
    o.input_names.push_back(v.name());
    o.input_dtypes.push_back(v.has_example() ? v.example().dtype() : "");
    o.input_dims.push_back(v.has_example() ? v.example().shape_size() : -1);
  }
  return std::make_shared<ServingQueue>(o);
}

void Coordinator::StartServing(JobEntry& e) {
  absl::StatusOr<schedule::Schedule> sched = job::ScheduleFor(e.job.spec(), e.job.plan());
  if (!sched.ok()) return;  // checked at submission
  std::vector<std::vector<int>> needs;
  std::vector<std::shared_ptr<WorkerChannel>> channels;
  for (int r = 0; r < e.ranks && r < e.job.workers_size(); ++r) {
    needs.push_back(job::DataNeedsOf(e.job.spec(), e.job.plan(), *sched, r).inputs);
    channels.push_back(workers_[e.job.workers(r)].channel);
  }
  const std::string job_id = e.job.job_id();
  const int attempt = e.job.attempt();
  e.serving->Start(attempt, std::move(needs),
                   [job_id, attempt, channels](int64_t step, const std::vector<std::string>& inputs, int64_t rows) {
                     bool ok = true;
                     for (size_t r = 0; r < channels.size(); ++r) {
                       CoordinatorMessage m;
                       ServeBatch* b = m.mutable_serve();
                       b->set_job_id(job_id);
                       b->set_attempt(attempt);
                       b->set_step(step);
                       b->set_rows(rows);
                       if (r < inputs.size()) b->set_inputs(inputs[r]);
                       ok = channels[r]->Send(m) && ok;
                     }
                     return ok;
                   });
}

absl::Status Coordinator::Infer(const std::string& job, std::string input, ServingQueue::Done done,
                               std::shared_ptr<const std::atomic<bool>> cancelled) {
  std::shared_ptr<ServingQueue> queue;
  {
    absl::MutexLock lock(&mu_);
    const JobEntry* found = nullptr;
    auto it = jobs_.find(job);
    if (it != jobs_.end()) {
      found = &it->second;
    } else {
      // By name: the newest serving job so named that has not ended, else the newest.
      for (const auto& [id, e] : jobs_) {
        if (e.job.spec().name() != job || !e.job.spec().has_serving()) continue;
        const bool better = found == nullptr || (IsTerminal(found->job.state()) && !IsTerminal(e.job.state())) ||
                            (IsTerminal(found->job.state()) == IsTerminal(e.job.state()) &&
                             e.job.created_unix_ms() >= found->job.created_unix_ms());
        if (better) found = &e;
      }
    }
    if (found == nullptr) {
      return absl::NotFoundError(absl::StrCat("no serving job '", job,
                                              "' (pippyctl list shows the jobs; pippyctl serve starts one)"));
    }
    if (!found->job.spec().has_serving()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", found->job.job_id(), " is not a serving job (pippyctl "
                                                        "serve starts one; inference jobs read a data file)"));
    }
    if (IsTerminal(found->job.state())) {
      return absl::FailedPreconditionError(absl::StrCat("serving job ", found->job.job_id(), " ended (",
                                                        JobState_Name(found->job.state()), ": ", found->job.reason(),
                                                        "); serve the model again"));
    }
    queue = found->serving;
  }
  return queue->Submit(std::move(input), std::move(done), std::move(cancelled));
}

std::vector<Job> Coordinator::ListJobs() {
  absl::MutexLock lock(&mu_);
  std::vector<Job> out;
  for (const auto& [id, e] : jobs_) out.push_back(View(e));
  std::sort(out.begin(), out.end(), [](const Job& a, const Job& b) { return a.created_unix_ms() < b.created_unix_ms(); });
  return out;
}

absl::StatusOr<Job> Coordinator::WaitForChange(const std::string& job_id, int64_t* version, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = jobs_.find(job_id);
    return it == jobs_.end() || it->second.version != *version || stop_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&changed), timeout);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  *version = it->second.version;
  return View(it->second);
}

absl::StatusOr<Job> Coordinator::CancelJob(const std::string& job_id, const std::string& user) {
  Outbox out;
  Job result;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
    const std::string& owner = it->second.job.user();
    if (!user.empty() && !owner.empty() && user != owner) {
      return absl::PermissionDeniedError(absl::StrCat("job ", job_id, " was submitted by ", owner,
                                                      "; only they can cancel it"));
    }
    if (IsTerminal(it->second.job.state())) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " already ended (",
                                                        JobState_Name(it->second.job.state()), ")"));
    }
    Finish(it->second, CANCELLED, user.empty() ? "cancelled by the user" : absl::StrCat("cancelled by ", user), &out);
    result = it->second.job;
  }
  Deliver(&out);
  return result;
}

absl::StatusOr<std::string> Coordinator::ResultPath(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  if (!it->second.job.model_ready()) {
    return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " has no trained model yet (state ",
                                                      JobState_Name(it->second.job.state()), ")"));
  }
  return artifacts_->FetchPath(job_id);
}

std::vector<WorkerInfo> Coordinator::ListWorkers() {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerInfo> out;
  for (const auto& [id, w] : workers_) out.push_back(w.info);
  return out;
}

absl::StatusOr<StepTrace> Coordinator::GetTrace(const std::string& job_id, int step) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' (pippyctl list shows them)"));
  const JobEntry& e = it->second;
  StepTrace out;
  out.set_job_id(job_id);
  for (const auto& [s, ranks] : e.traces) out.add_available_steps(s);
  if (e.traces.empty()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, " has no traced step ",
                                            IsTerminal(e.job.state()) && e.job.step() == 0
                                                ? "(it ran no step)"
                                                : "yet (a step is traced once every rank reported it)"));
  }
  auto t = step < 0 ? std::prev(e.traces.end()) : e.traces.find(step);
  if (t == e.traces.end()) {
    return absl::NotFoundError(absl::StrCat("job ", job_id, ": step ", step, " is not held; the coordinator keeps "
                                            "the last ", kTracedSteps, " steps: ",
                                            absl::StrJoin(out.available_steps(), ", ")));
  }
  out.set_step(t->first);
  for (const auto& [rank, r] : t->second) {
    RankTrace* rt = out.add_ranks();
    rt->set_rank(rank);
    const std::string& wid = rank < e.job.workers_size() ? e.job.workers(rank) : "";
    auto w = workers_.find(wid);
    rt->set_worker(w != workers_.end() ? w->second.info.name() : wid);
    for (int s : StagesOfRank(e.stage_to_rank, rank % std::max(1, e.per_replica))) rt->add_stages(s);
    rt->set_steady_anchor_us(r.steady_anchor_us());
    rt->set_unix_anchor_us(r.unix_anchor_us());
    *rt->mutable_breakdown() = r.breakdown();
    rt->mutable_breakdown()->set_rank(rank);
    rt->mutable_breakdown()->set_step_seconds(r.step_seconds());
    *rt->mutable_events() = r.events();
  }
  return out;
}

absl::StatusOr<std::string> Coordinator::AddWorker(const RegisterWorker& reg, std::shared_ptr<WorkerChannel> channel) {
  // Unset: a CPU worker.
  absl::StatusOr<Device> device = ParseDevice(reg.device().empty() ? "cpu" : reg.device());
  if (!device.ok() || device->kind == Device::Kind::kAuto) {
    return absl::InvalidArgumentError(absl::StrCat("register.device: '", reg.device(), "' is not a device a worker ",
                                                   "runs on (cpu or cuda:N); is the worker's version ", reg.version(),
                                                   " this coordinator's?"));
  }
  Outbox out;
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    // A worker that reconnects (after a restart of the coordinator or a broken stream)
    // keeps its id unless another worker has it now.
    int64_t n = 0;
    if (!reg.worker_id().empty() && !workers_.count(reg.worker_id()) &&
        sscanf(reg.worker_id().c_str(), "worker-%ld", &n) == 1 && reg.worker_id() == absl::StrCat("worker-", n)) {
      id = reg.worker_id();
      next_worker_ = std::max(next_worker_, n + 1);
    } else {
      id = absl::StrCat("worker-", next_worker_++);
    }
    absl::Status saved = store_->PutCounter("next_worker", next_worker_);
    if (!saved.ok()) log::Warn("the next worker id was not saved: {}", saved.message());
    WorkerEntry w;
    w.info.set_worker_id(id);
    w.info.set_name(reg.name().empty() ? id : reg.name());
    w.info.set_host(reg.host());
    w.info.set_device(reg.device());
    w.info.set_free_memory(reg.free_memory());
    w.info.set_device_name(reg.device_name());
    w.info.set_version(reg.version());
    w.info.set_threads(reg.threads());
    w.info.set_state(IDLE);
    w.info.set_last_heartbeat_unix_ms(NowMs());
    w.device = *device;
    w.channel = channel;
    w.last_heartbeat = absl::Now();
    workers_[id] = w;
    CoordinatorMessage m;
    m.mutable_registered()->set_worker_id(id);
    out.emplace_back(channel, m);
    log::Info("worker {} ({}) {}", id, w.info.name(), id == reg.worker_id() ? "registered again" : "registered");
    Schedule();
  }
  Deliver(&out);
  return id;
}

void Coordinator::RemoveWorker(const std::string& worker_id, const std::string& why) {
  Outbox out;
  {
    absl::MutexLock lock(&mu_);
    auto it = workers_.find(worker_id);
    if (it == workers_.end()) return;
    WorkerInfo info = it->second.info;
    const int attempt = it->second.attempt;
    workers_.erase(it);
    log::Warn("worker {} ({}) removed: {}", worker_id, info.name(), why);
    if (!info.job_id().empty()) {
      auto job = jobs_.find(info.job_id());
      // A worker still finishing an earlier attempt of a recovering job changes nothing.
      if (job != jobs_.end() && !IsTerminal(job->second.job.state()) && job->second.job.state() != RECOVERING &&
          attempt == job->second.job.attempt()) {
        Recover(job->second,
                absl::StrCat("worker ", info.name(), " (", worker_id, ", rank ", info.rank(),
                             job->second.job.spec().replicas() > 1 ? absl::StrCat(" of replica ", info.replica()) : "",
                             ", stages ",
                             absl::StrJoin(StagesOfRank(job->second.stage_to_rank, info.rank()), ","), ") ", why),
                &out);
      }
    }
  }
  Deliver(&out);
}

void Coordinator::Finish(JobEntry& e, JobState state, const std::string& reason, Outbox* out) {
  if (IsTerminal(e.job.state())) return;
  e.job.set_state(state);
  e.job.set_reason(reason);
  e.stop->store(true);
  log::Info("job={} {}{}", e.job.job_id(), JobState_Name(state), reason.empty() ? "" : ": " + reason);
  if (e.serving != nullptr) {
    e.serving->Stop(absl::UnavailableError(absl::StrCat("serving job ", e.job.job_id(), " ended (",
                                                        JobState_Name(state), reason.empty() ? "" : ": " + reason,
                                                        ")")));
  }
  queue_.erase(std::remove(queue_.begin(), queue_.end(), e.job.job_id()), queue_.end());
  for (const std::string& wid : e.job.workers()) {
    auto w = workers_.find(wid);
    if (w == workers_.end() || w->second.info.job_id() != e.job.job_id()) continue;
    if (state != SUCCEEDED) {
      CoordinatorMessage m;
      m.mutable_cancel()->set_job_id(e.job.job_id());
      m.mutable_cancel()->set_reason(reason);
      m.mutable_cancel()->set_attempt(w->second.attempt);
      out->emplace_back(w->second.channel, m);
      // The worker is idle again once it reports its rank finished (it stops at once).
    } else {
      w->second.info.set_state(IDLE);
      w->second.info.clear_job_id();
    }
  }
  artifacts_->RemoveJobFiles(e.job.job_id());
  Touch(e);
}

void Coordinator::Recover(JobEntry& e, const std::string& what, Outbox* out) {
  const FaultToleranceSpec& ft = e.job.spec().fault_tolerance();
  const int from = e.job.checkpoint_step();
  if (e.job.restarts() >= ft.max_restarts()) {
    Finish(e, FAILED,
           absl::StrCat(what, "; no restart left (", e.job.restarts(), " of ", ft.max_restarts(),
                        " used; raise it with --max-restarts)"),
           out);
    return;
  }
  const std::string& id = e.job.job_id();
  // The job's other workers stop; each is idle again once it reports its rank finished.
  for (const std::string& wid : e.job.workers()) {
    auto w = workers_.find(wid);
    if (w == workers_.end() || w->second.info.job_id() != id || w->second.attempt != e.job.attempt()) continue;
    CoordinatorMessage m;
    m.mutable_cancel()->set_job_id(id);
    m.mutable_cancel()->set_reason(absl::StrCat("restarting the job: ", what));
    m.mutable_cancel()->set_attempt(w->second.attempt);
    out->emplace_back(w->second.channel, m);
  }
  if (e.serving != nullptr) {
    // Requests in the pipeline are lost with it; queued ones wait for the restart.
    e.serving->Pause(absl::UnavailableError(absl::StrCat("serving job ", id, " lost its pipeline (", what,
                                                         "); it restarts on other workers: try again")));
  }
  e.job.set_restarts(e.job.restarts() + 1);
  e.job.set_attempt(e.job.attempt() + 1);
  ++counters_.restarts;
  // The stopped attempt's senders stop; the next attempt gets a flag of its own.
  e.stop->store(true);
  e.stop = std::make_shared<std::atomic<bool>>(false);
  e.job.set_state(RECOVERING);
  e.job.set_step(from);
  e.job.mutable_losses()->Truncate(std::min(e.job.losses_size(), from));
  e.job.mutable_step_seconds()->Truncate(std::min(e.job.step_seconds_size(), from));
  e.job.clear_breakdown();
  e.addresses.clear();
  e.gloo_addresses.clear();
  e.reports.clear();
  e.finished.clear();
  e.assembling = false;
  e.checkpoint_pieces.clear();
  e.recover_deadline = absl::Now() + absl::Seconds(ft.recovery_timeout_s());
  // Pieces of later checkpoints and results of this attempt are dropped (small file
  // work under the lock: a later attempt writes the same names).
  artifacts_->RemoveCheckpoints(id, [from](int step) { return step != from; });
  artifacts_->ResetResults(id);
  queue_.erase(std::remove(queue_.begin(), queue_.end(), id), queue_.end());
  queue_.insert(queue_.begin(), id);
  AddEvent(e, absl::StrCat(what, "; restarting from step ", from,
                           from > 0 ? " (the last checkpoint)" : " (no checkpoint yet)", ", restart ",
                           e.job.restarts(), " of ", ft.max_restarts()));
  Touch(e);
}

Coordinator::StageWriter Coordinator::StagesFromFiles(const std::string& job_id, int checkpoint_step) const {
  return [this, job_id, checkpoint_step](int stage, const std::function<absl::Status(absl::string_view)>& sink) {
    const std::string path = checkpoint_step > 0 ? artifacts_->CheckpointStagePath(job_id, checkpoint_step, stage)
                                                 : artifacts_->StagePath(job_id, stage);
    return ArtifactStore::StreamFile(path, options_.chunk_bytes, sink);
  };
}

void Coordinator::Schedule() {
  for (auto it = queue_.begin(); it != queue_.end();) {
    JobEntry& e = jobs_[*it];
    std::vector<std::string> chosen = FitWorkers(e, IdleWorkers());
    // A restart before the first checkpoint waits for the original stage files.
    if (chosen.empty() || (!e.stage_files_ready && e.job.checkpoint_step() == 0)) {
      ++it;  // later jobs that fit may go first on the remaining workers
      continue;
    }
    const std::string job_id = *it;
    it = queue_.erase(it);
    std::vector<RankSend> sends = Place(e, chosen);
    StageWriter from_files = StagesFromFiles(job_id, e.job.checkpoint_step());
    for (RankSend& send : sends) {
      tasks_.Run([this, send = std::move(send), from_files] {
        std::map<int, int64_t> ignored;
        SendRank(send, from_files, &ignored);
      });
    }
  }
}

std::vector<Coordinator::RankSend> Coordinator::Place(JobEntry& e, const std::vector<std::string>& workers) {
  const std::string& job_id = e.job.job_id();
  e.job.set_state(PLACING);
  e.job.clear_workers();
  absl::StatusOr<schedule::Schedule> sched = job::ScheduleFor(e.job.spec(), e.job.plan());
  std::vector<RankSend> sends;
  for (size_t r = 0; r < workers.size(); ++r) {
    const int global = static_cast<int>(r);
    const int rank = global % e.per_replica, replica = global / e.per_replica;
    WorkerEntry& w = workers_[workers[r]];
    w.attempt = e.job.attempt();
    w.info.set_state(BUSY);
    w.info.set_job_id(job_id);
    w.info.set_rank(rank);
    w.info.set_replica(replica);
    w.info.clear_stages();
    w.info.set_bytes_received(0);
    w.info.set_loaded_param_bytes(0);
    e.job.add_workers(workers[r]);
    RankSend send;
    send.channel = w.channel;
    send.share_file = artifacts_->SharePath(job_id, rank);
    send.stop = e.stop;
    Assignment* as = send.assignment.mutable_assignment();
    as->set_job_id(job_id);
    *as->mutable_spec() = e.job.spec();
    as->set_rank(rank);
    as->set_world_size(e.per_replica);
    as->set_replica(replica);
    // The schedule was made and validated at submission; it cannot fail here.
    *as->mutable_plan() = sched.ok() ? job::PlanSliceFor(e.job.plan(), *sched, rank) : e.job.plan();
    send.stages = StagesOfRank(e.stage_to_rank, rank);
    for (int s : send.stages) {
      Assignment::StageFile* f = as->add_stages();
      f->set_stage(s);
      // Known when the stage came from a file; else the worker learns it as it comes.
      if (s < e.job.stage_file_bytes_size()) f->set_bytes(e.job.stage_file_bytes(s));
      w.info.add_stages(s);
    }
    as->set_data_bytes(e.share_bytes[rank]);
    as->set_attempt(e.job.attempt());
    const int from = e.job.checkpoint_step();
    if (from > 0) {
      // A restart from a checkpoint: its stages and the rank's training state.
      as->set_start_step(from);
      send.state_file = artifacts_->CheckpointStatePath(job_id, from, global);
      as->set_state_bytes(std::max<int64_t>(0, ArtifactStore::FileSize(send.state_file)));
      for (Assignment::StageFile& f : *as->mutable_stages()) {
        f.set_bytes(std::max<int64_t>(0, ArtifactStore::FileSize(artifacts_->CheckpointStagePath(job_id, from, f.stage()))));
      }
    }
    sends.push_back(std::move(send));
  }
  // The transport of each edge between ranks, from their workers' hosts and devices
  // (replica 0's; the replicas are placed alike).
  std::vector<job::RankPlace> places;
  for (int r = 0; r < e.per_replica && r < static_cast<int>(workers.size()); ++r) {
    const WorkerEntry& w = workers_[workers[static_cast<size_t>(r)]];
    places.push_back({w.info.host(), w.device});
  }
  e.job.clear_edges();
  if (static_cast<int>(places.size()) == e.per_replica) {
    for (const job::EdgeTransport& t : job::EdgeTransportsFor(e.job.plan(), e.stage_to_rank, places)) {
      StageEdge* edge = e.job.add_edges();
      edge->set_from_stage(t.from_stage);
      edge->set_to_stage(t.to_stage);
      edge->set_from_rank(t.from_rank);
      edge->set_to_rank(t.to_rank);
      edge->set_transport(t.transport);
    }
  }
  log::Info("job={} placing on {}{}", job_id, absl::StrJoin(workers, ", "),
            e.job.attempt() > 0 ? absl::StrCat(" (attempt ", e.job.attempt(), ", from step ", e.job.checkpoint_step(), ")")
                                : "");
  Touch(e);
  return sends;
}

void Coordinator::FailAttempt(const std::string& job_id, int attempt, const std::string& reason) {
  Outbox out;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end() && it->second.job.attempt() == attempt) Finish(it->second, FAILED, reason, &out);
  }
  Deliver(&out);
}

void Coordinator::SendRank(const RankSend& send, const StageWriter& writer, std::map<int, int64_t>* stage_bytes) {
  const std::string& job_id = send.assignment.assignment().job_id();
  const int rank = send.assignment.assignment().rank();
  const int attempt = send.assignment.assignment().attempt();
  if (!send.channel->Send(send.assignment)) return;  // the worker is gone; RemoveWorker fails the job
  const auto start = absl::Now();
  int64_t sent = 0;
  using Sink = std::function<absl::Status(absl::string_view)>;
  // Streams what `source` writes as chunk messages of options_.chunk_bytes (the last,
  // possibly short, says so) that `chunk_of` picks in a message; a failure other than
  // the job ending or the worker going fails the attempt, naming `what`. Returns the
  // bytes sent, or nothing when it stopped.
  auto stream = [&](const auto& chunk_of, const std::function<absl::Status(const Sink&)>& source,
                    const std::string& what) -> std::optional<int64_t> {
    Chunker chunker(options_.chunk_bytes, [&](std::string chunk, bool last) -> absl::Status {
      if (send.stop->load()) return absl::CancelledError("the job ended");
      CoordinatorMessage m;
      auto* c = chunk_of(&m);
      c->set_job_id(job_id);
      c->set_attempt(attempt);
      c->set_chunk(std::move(chunk));
      c->set_last_chunk(last);
      return send.channel->Send(m) ? absl::OkStatus() : absl::UnavailableError("the worker's stream closed");
    });
    absl::Status s = source([&](absl::string_view piece) { return chunker.Append(piece); });
    if (s.ok()) s = chunker.Finish();
    if (!s.ok()) {
      if (!absl::IsCancelled(s) && !absl::IsUnavailable(s)) {
        FailAttempt(job_id, attempt, absl::StrCat("cannot send ", what, ": ", s.message()));
      }
      return std::nullopt;
    }
    return static_cast<int64_t>(chunker.total());
  };
  for (int stage : send.stages) {
    std::optional<int64_t> bytes = stream(
        [stage](CoordinatorMessage* m) {
          m->mutable_stage()->set_stage(stage);
          return m->mutable_stage();
        },
        [&](const Sink& sink) { return writer(stage, sink); }, absl::StrCat("stage ", stage, " to rank ", rank));
    if (!bytes) return;
    (*stage_bytes)[stage] = *bytes;
    sent += *bytes;
  }
  // The data share (a missing file: a rank that needs none, one empty last chunk).
  std::optional<int64_t> data = stream(
      [](CoordinatorMessage* m) { return m->mutable_data(); },
      [&](const Sink& sink) {
        return ArtifactStore::FileSize(send.share_file) > 0
                   ? ArtifactStore::StreamFile(send.share_file, options_.chunk_bytes, sink)
                   : absl::OkStatus();
      },
      absl::StrCat("rank ", rank, " its data"));
  if (!data) return;
  sent += *data;
  if (!send.state_file.empty()) {
    std::optional<int64_t> state = stream(
        [](CoordinatorMessage* m) { return m->mutable_state(); },
        [&](const Sink& sink) { return ArtifactStore::StreamFile(send.state_file, options_.chunk_bytes, sink); },
        absl::StrCat("rank ", rank, " its training state"));
    if (!state) return;
    sent += *state;
  }
  log::Info("job={} rank={} sent {} bytes (stages and data share) in {}", job_id, rank, sent,
            absl::FormatDuration(absl::Now() - start));
}

void Coordinator::OnResultChunk(const std::string& job_id, int attempt, int stage, const std::string& chunk,
                                bool last) {
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end() || it->second.job.attempt() != attempt || IsTerminal(it->second.job.state())) return;
  }
  absl::Status s = artifacts_->AppendResult(job_id, stage, chunk, last);
  if (s.ok()) return;
  Outbox out;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it != jobs_.end()) Finish(it->second, FAILED, std::string(s.message()), &out);
  }
  Deliver(&out);
}

void Coordinator::OnCheckpointChunk(const CheckpointChunk& c) {
  int ranks = 0, stages = 0, per_replica = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(c.job_id());
    if (it == jobs_.end() || it->second.job.attempt() != c.attempt() || it->second.job.state() != RUNNING ||
        c.step() <= it->second.job.checkpoint_step()) {
      return;  // an earlier attempt's, or the job ended
    }
    ranks = it->second.ranks;
    per_replica = it->second.per_replica;
    stages = it->second.job.plan().stages_size();
  }
  // Stages come from replica 0 (the replicas hold the same parameters); every rank's
  // training state (its own random generator) is kept.
  const int global = c.replica() * per_replica + c.rank();
  if (c.rank() < 0 || c.rank() >= per_replica || global >= ranks || c.stage() < -1 || c.stage() >= stages ||
      c.step() <= 0 || (c.stage() >= 0 && c.replica() != 0)) {
    log::Warn("job={} a checkpoint piece names rank {} stage {} step {}: ignored", c.job_id(), c.rank(), c.stage(),
              c.step());
    return;
  }
  absl::StatusOr<bool> done = artifacts_->AppendCheckpoint(c.job_id(), c.step(), global, c.stage(), c.chunk(),
                                                           c.last_chunk());
  if (!done.ok() || !*done) {
    // A checkpoint that cannot be written is not fatal: the job keeps its last one.
    if (!done.ok()) log::Warn("job={} checkpoint after step {}: {}", c.job_id(), c.step(), done.status().message());
    return;
  }
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(c.job_id());
  if (it == jobs_.end() || it->second.job.attempt() != c.attempt() || IsTerminal(it->second.job.state())) return;
  JobEntry& e = it->second;
  auto& pieces = e.checkpoint_pieces[c.step()];
  pieces.insert({c.stage() >= 0 ? 0 : global, c.stage()});
  if (static_cast<int>(pieces.size()) < stages + ranks || c.step() <= e.job.checkpoint_step()) return;
  // Every stage and every rank's state arrived whole: commit (files durable first,
  // then the record names the step), and drop the earlier checkpoints.
  const auto start = absl::Now();
  absl::Status synced = artifacts_->SyncCheckpoint(c.job_id(), c.step());
  if (!synced.ok()) {
    log::Warn("job={} checkpoint after step {} not committed: {}", c.job_id(), c.step(), synced.message());
    return;
  }
  e.job.set_checkpoint_step(c.step());
  e.checkpoint_time = absl::Now();
  ++counters_.checkpoints;
  Touch(e);
  const int kept = c.step();
  artifacts_->RemoveCheckpoints(c.job_id(), [kept](int step) { return step < kept; });
  for (auto p = e.checkpoint_pieces.begin(); p != e.checkpoint_pieces.end();) {
    p = p->first <= kept ? e.checkpoint_pieces.erase(p) : std::next(p);
  }
  log::Info("job={} checkpoint after step {} committed ({} files, synced in {})", c.job_id(), kept, stages + ranks,
            absl::FormatDuration(absl::Now() - start));
}

void Coordinator::OnWorkerMessage(const std::string& worker_id, const WorkerMessage& m) {
  // Results go to disk as they come, outside the lock.
  if (m.has_stage_result()) {
    OnResultChunk(m.stage_result().job_id(), m.stage_result().attempt(), m.stage_result().stage(),
                  m.stage_result().chunk(), m.stage_result().last_chunk());
  } else if (m.has_output()) {
    OnResultChunk(m.output().job_id(), m.output().attempt(), -1, m.output().chunk(), m.output().last_chunk());
  } else if (m.has_checkpoint()) {
    OnCheckpointChunk(m.checkpoint());
  } else if (m.has_serve_result()) {
    std::shared_ptr<ServingQueue> queue;
    {
      absl::MutexLock lock(&mu_);
      auto it = jobs_.find(m.serve_result().job_id());
      if (it != jobs_.end()) queue = it->second.serving;
      auto w = workers_.find(worker_id);
      if (w != workers_.end()) w->second.last_heartbeat = absl::Now();
    }
    if (queue != nullptr) queue->OnResult(m.serve_result());
    return;
  }
  Outbox out;
  std::string assemble_job;
  bool assemble_inference = false;
  int assemble_stages = 0;
  {
    absl::MutexLock lock(&mu_);
    auto w = workers_.find(worker_id);
    if (w == workers_.end()) return;
    w->second.last_heartbeat = absl::Now();
    w->second.info.set_last_heartbeat_unix_ms(NowMs());
    std::string job_id;
    int attempt = 0, replica = 0;
    if (m.has_address()) {
      std::tie(job_id, attempt, replica) = std::make_tuple(m.address().job_id(), m.address().attempt(),
                                                           m.address().replica());
    }
    if (m.has_step()) {
      std::tie(job_id, attempt, replica) = std::make_tuple(m.step().job_id(), m.step().attempt(), m.step().replica());
    }
    if (m.has_finished()) {
      std::tie(job_id, attempt, replica) = std::make_tuple(m.finished().job_id(), m.finished().attempt(),
                                                           m.finished().replica());
    }
    auto jit = job_id.empty() ? jobs_.end() : jobs_.find(job_id);
    if (m.has_finished() && w->second.info.job_id() == job_id && w->second.attempt == attempt) {
      w->second.info.set_state(IDLE);
      w->second.info.clear_job_id();
      Schedule();  // a queued or recovering job may wait for this worker
    }
    // Messages of an earlier attempt of the job (ranks that were stopped) are ignored.
    if (jit != jobs_.end() && !IsTerminal(jit->second.job.state()) && jit->second.job.attempt() == attempt &&
        jit->second.job.state() != RECOVERING) {
      JobEntry& e = jit->second;
      const int P = std::max(1, e.per_replica);
      if (m.has_address()) {
        const int global = replica * P + m.address().rank();
        e.addresses[global] = m.address().ucx_address();
        e.gloo_addresses[global] = m.address().gloo_address();
        w->second.info.set_bytes_received(m.address().bytes_received());
        w->second.info.set_loaded_param_bytes(m.address().loaded_param_bytes());
        if (static_cast<int>(e.addresses.size()) == e.ranks) {
          // Each rank gets its replica's UCX addresses and its replica group's.
          for (int g = 0; g < e.ranks && g < e.job.workers_size(); ++g) {
            const int rr = g / P, pr = g % P;
            CoordinatorMessage p;
            p.mutable_peers()->set_job_id(job_id);
            p.mutable_peers()->set_attempt(e.job.attempt());
            for (int k = 0; k < P; ++k) p.mutable_peers()->add_ucx_addresses(e.addresses[rr * P + k]);
            if (e.ranks > P) {
              for (int k = 0; k * P < e.ranks; ++k) p.mutable_peers()->add_gloo_addresses(e.gloo_addresses[k * P + pr]);
            }
            out.emplace_back(workers_[e.job.workers(g)].channel, p);
          }
          e.job.set_state(e.serving != nullptr ? SERVING : RUNNING);
          if (e.serving != nullptr) StartServing(e);
          log::Info("job={} {}: {} ranks connected{}", job_id, e.serving != nullptr ? "serving" : "running", e.ranks,
                    e.job.attempt() > 0 ? absl::StrCat(" (attempt ", e.job.attempt(), ", from step ",
                                                       e.job.checkpoint_step(), ")")
                                        : "");
          Touch(e);
        }
      } else if (m.has_step()) {
        auto& reports = e.reports[m.step().step()];
        reports[replica * P + m.step().rank()] = m.step();  // a repeated report replaces the earlier one
        if (static_cast<int>(reports.size()) == e.ranks) {
          double busy = 0, step_s = 0, loss = 0;
          int losses = 0;
          e.job.clear_breakdown();
          for (const auto& [rank, r] : reports) {
            busy += r.busy_seconds();
            step_s = std::max(step_s, r.step_seconds());
            if (r.has_loss()) {
              loss += r.loss();  // each replica's mean over its slice; the step's is their mean
              ++losses;
            }
            StepBreakdown* b = e.job.add_breakdown();
            *b = r.breakdown();
            b->set_rank(rank);
            b->set_replica(rank / P);
            b->set_step_seconds(r.step_seconds());
          }
          if (losses > 0) loss /= losses;
          ++counters_.steps;
          counters_.samples += e.job.spec().batch_size();
          step_seconds_.Observe(step_s);
          for (const auto& [rank, r] : reports) {
            for (const TraceEvent& ev : r.events()) {
              if (ev.kind() == TRACE_SEND) counters_.bytes_sent += ev.bytes();
              if (ev.kind() == TRACE_RECV) counters_.bytes_received += ev.bytes();
            }
          }
          e.job.set_step(m.step().step() + 1);
          if (e.job.spec().mode() == MODE_TRAIN) e.job.add_losses(loss);
          e.job.add_step_seconds(step_s);
          e.job.set_samples_per_second(step_s > 0 ? e.job.spec().batch_size() / step_s : 0);
          e.job.set_bubble_fraction(step_s > 0 ? std::max(0.0, 1.0 - busy / (e.ranks * step_s)) : 0);
          // The complete step's trace is kept (the last kTracedSteps of them).
          e.traces[m.step().step()] = std::move(reports);
          e.reports.erase(m.step().step());
          while (static_cast<int>(e.traces.size()) > kTracedSteps) e.traces.erase(e.traces.begin());
          Touch(e);
        }
      } else if (m.has_finished()) {
        const auto code = static_cast<absl::StatusCode>(m.finished().code());
        const std::string what = absl::StrCat("rank ", m.finished().rank(),
                                              e.ranks > P ? absl::StrCat(" of replica ", replica) : "", " on worker ",
                                              w->second.info.name(), ": ", m.finished().error());
        if (!m.finished().ok() &&
            (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded)) {
          // A peer gone or silent: the job restarts (the lost worker, if it is lost,
          // is removed when its stream breaks or its heartbeats stop).
          Recover(e, what, &out);
        } else if (!m.finished().ok()) {
          Finish(e, FAILED, what, &out);
        } else {
          e.finished.insert(replica * P + m.finished().rank());
          if (static_cast<int>(e.finished.size()) == e.ranks && !e.assembling) {
            e.assembling = true;
            assemble_job = job_id;
            assemble_inference = e.job.spec().mode() == MODE_INFERENCE;
            assemble_stages = e.job.plan().stages_size();
          }
        }
      }
    }
  }
  Deliver(&out);
  if (!assemble_job.empty()) {
    tasks_.Run([this, assemble_job, assemble_inference, assemble_stages] {
      Assemble(assemble_job, assemble_inference, assemble_stages);
    });
  }
}

void Coordinator::Assemble(const std::string& job_id, bool inference, int stages) {
  const auto start = absl::Now();
  // Inference: the outputs file as the last rank sent it; training: the merged model.
  const std::string assembled =
      inference ? artifacts_->OutputsPath(job_id) : artifacts_->JobDir(job_id) + "/assembled.pt";
  absl::Status s;
  if (!artifacts_->ResultsComplete(job_id, inference ? -1 : stages)) {
    s = absl::DataLossError(inference ? "the last rank finished without sending all of its outputs; submit the job again"
                                      : "a rank finished without sending all of its trained stages; submit the job "
                                        "again");
  } else if (!inference) {
    std::map<int, std::string> results;
    for (int st = 0; st < stages; ++st) results[st] = artifacts_->ResultPath(job_id, st);
    s = AcquireModelSlot();
    if (s.ok()) {
      s = partition::MergeStagesIntoModel(artifacts_->ModelPath(job_id), results, assembled);
      ReleaseModelSlot();
    }
  }
  Outbox out;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end() || IsTerminal(it->second.job.state())) return;  // cancelled meanwhile
    if (s.ok()) s = artifacts_->Publish(job_id, assembled);
    if (!s.ok()) {
      Finish(it->second, FAILED, absl::StrCat("assembling the result: ", s.message()), &out);
    } else {
      it->second.job.set_model_ready(true);
      log::Info("job={} result assembled in {}", job_id, absl::FormatDuration(absl::Now() - start));
      Finish(it->second, SUCCEEDED, "", &out);
    }
  }
  Deliver(&out);
}

std::string Coordinator::MetricsText() {
  absl::MutexLock lock(&mu_);
  metrics::Exposition x;
  std::map<std::string, int> jobs;
  for (int st = JobState_MIN; st <= JobState_MAX; ++st) {
    if (JobState_IsValid(st) && st != JOB_STATE_UNSPECIFIED) jobs[JobState_Name(static_cast<JobState>(st))] = 0;
  }
  for (const auto& [id, e] : jobs_) ++jobs[JobState_Name(e.job.state())];
  x.Family("pippy_jobs", "gauge", "Jobs known to the coordinator, by state");
  for (const auto& [state, n] : jobs) x.Sample("pippy_jobs", {{"state", state}}, n);
  std::map<std::string, int> workers = {{"IDLE", 0}, {"BUSY", 0}};
  for (const auto& [id, w] : workers_) ++workers[WorkerState_Name(w.info.state())];
  x.Family("pippy_workers", "gauge", "Registered workers, by state");
  for (const auto& [state, n] : workers) x.Sample("pippy_workers", {{"state", state}}, n);
  x.Family("pippy_steps_total", "counter", "Pipeline steps completed by every rank of a job");
  x.Sample("pippy_steps_total", {}, static_cast<double>(counters_.steps));
  x.Family("pippy_samples_total", "counter", "Samples trained on or inferred (batch size per completed step)");
  x.Sample("pippy_samples_total", {}, static_cast<double>(counters_.samples));
  x.Family("pippy_step_seconds", "histogram", "Step time (the slowest rank's) of completed steps");
  x.HistogramSamples("pippy_step_seconds", {}, step_seconds_);
  x.Family("pippy_transport_bytes_total", "counter", "Tensor bytes the ranks moved between each other (UCX), as reported");
  x.Sample("pippy_transport_bytes_total", {{"transport", "ucx"}, {"direction", "sent"}},
           static_cast<double>(counters_.bytes_sent));
  x.Sample("pippy_transport_bytes_total", {{"transport", "ucx"}, {"direction", "received"}},
           static_cast<double>(counters_.bytes_received));
  x.Family("pippy_checkpoints_total", "counter", "Checkpoints committed");
  x.Sample("pippy_checkpoints_total", {}, static_cast<double>(counters_.checkpoints));
  x.Family("pippy_restarts_total", "counter", "Jobs restarted after losing a worker");
  x.Sample("pippy_restarts_total", {}, static_cast<double>(counters_.restarts));
  const absl::Time now = absl::Now();
  x.Family("pippy_worker_heartbeat_age_seconds", "gauge", "Time since each worker was last heard from");
  for (const auto& [id, w] : workers_) {
    x.Sample("pippy_worker_heartbeat_age_seconds", {{"worker", id}, {"name", w.info.name()}},
             absl::ToDoubleSeconds(now - w.last_heartbeat));
  }
  x.Family("pippy_checkpoint_age_seconds", "gauge", "Time since the last checkpoint of each unfinished job");
  for (const auto& [id, e] : jobs_) {
    if (IsTerminal(e.job.state()) || e.checkpoint_time == absl::InfinitePast()) continue;
    x.Sample("pippy_checkpoint_age_seconds", {{"job", id}}, absl::ToDoubleSeconds(now - e.checkpoint_time));
  }
  // Serving jobs (the ones that have not ended).
  std::vector<std::pair<std::string, ServingStats>> serving;
  for (const auto& [id, e] : jobs_) {
    if (e.serving != nullptr && !IsTerminal(e.job.state())) serving.emplace_back(id, e.serving->Stats());
  }
  x.Family("pippy_serving_requests_total", "counter", "Requests a serving job answered, by outcome");
  for (const auto& [id, s] : serving) {
    x.Sample("pippy_serving_requests_total", {{"job", id}, {"outcome", "ok"}},
             static_cast<double>(s.requests() - s.failed()));
    x.Sample("pippy_serving_requests_total", {{"job", id}, {"outcome", "error"}}, static_cast<double>(s.failed()));
  }
  x.Family("pippy_serving_rows_total", "counter", "Rows a serving job answered");
  for (const auto& [id, s] : serving) x.Sample("pippy_serving_rows_total", {{"job", id}}, static_cast<double>(s.rows()));
  x.Family("pippy_serving_microbatches_total", "counter", "Micro-batches a serving job sent through its pipeline");
  for (const auto& [id, s] : serving) {
    x.Sample("pippy_serving_microbatches_total", {{"job", id}}, static_cast<double>(s.microbatches()));
  }
  x.Family("pippy_serving_queued_requests", "gauge", "Requests waiting for a micro-batch");
  for (const auto& [id, s] : serving) x.Sample("pippy_serving_queued_requests", {{"job", id}}, s.queued());
  x.Family("pippy_serving_inflight_microbatches", "gauge", "Micro-batches in a serving job's pipeline");
  for (const auto& [id, s] : serving) x.Sample("pippy_serving_inflight_microbatches", {{"job", id}}, s.inflight());
  x.Family("pippy_serving_request_seconds", "histogram", "Request latency: arrival at the coordinator to answer");
  for (const auto& [id, s] : serving) {
    x.HistogramSamples("pippy_serving_request_seconds", {{"job", id}}, jobs_.at(id).serving->LatencySeconds());
  }
  return x.text();
}

void Coordinator::Loop() {
  while (true) {
    Outbox out;
    std::vector<std::pair<std::string, std::string>> dead;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.tick);
      if (stop_) return;
      const absl::Time now = absl::Now();
      for (const auto& [id, w] : workers_) {
        if (now - w.last_heartbeat > options_.heartbeat_timeout) {
          dead.emplace_back(id, absl::StrCat("stopped sending heartbeats (none for ",
                                             absl::FormatDuration(now - w.last_heartbeat), ")"));
        }
      }
      Schedule();
      for (auto& [id, e] : jobs_) {
        if (e.job.state() != RECOVERING || now < e.recover_deadline) continue;
        const int idle = static_cast<int>(IdleWorkers().size());
        Finish(e, FAILED,
               absl::StrCat("waited ", e.job.spec().fault_tolerance().recovery_timeout_s(),
                            " s (--recovery-timeout-s) for ", e.ranks, " idle workers to restart the job from step ",
                            e.job.checkpoint_step(), "; ", idle, " of ", workers_.size(),
                            " registered workers are idle: start more workers or submit the job again"),
               &out);
      }
    }
    Deliver(&out);
    for (const auto& [id, why] : dead) RemoveWorker(id, why);
  }
}

}  // namespace pippy::coordinator
