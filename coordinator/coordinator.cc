#include "coordinator/coordinator.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/grpc_limits.h"
#include "common/log.h"
#include "common/test_hooks.h"
#include "common/status.h"
#include "coordinator/rank_sender.h"
#include "coordinator/result_assembly.h"
#include "coordinator/resume.h"
#include "pipeline/autoplan/calibration.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/layout.h"
#include "proto/job_state.h"

namespace pippy::coordinator {
namespace {

// N of "job-N" (every id this coordinator gives); 0 for anything else.
int64_t JobNumber(const std::string& job_id) {
  int64_t n = 0;
  return sscanf(job_id.c_str(), "job-%ld", &n) == 1 ? n : 0;
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
    c->workers_ = std::make_unique<WorkerRegistry>(c->store_->GetCounter("next_worker", 1));
    c->RestoreJobs();
  }
  c->loop_ = std::thread([p = c.get()] { p->Loop(); });
  return c;
}

void Coordinator::RestoreJobs() {
  // Uploaded datasets of submissions cut off by the restart, or of jobs that ended as
  // the coordinator stopped (or that could not be restored), are named by no job that
  // will run again.
  std::set<std::string> datasets_in_use;
  for (const Job& record : store_->List()) {
    next_job_ = std::max(next_job_, JobNumber(record.job_id()) + 1);
    JobRun::Restored restored = JobRun::Restored::kEnded;
    std::unique_ptr<JobRun> run = JobRun::Restore({store_.get(), artifacts_.get()}, record,
                                                  IsTerminal(record.state()) ? absl::StatusOr<JobLayout>(JobLayout())
                                                                             : store_->GetLayout(record.job_id()),
                                                  &restored);
    if (restored == JobRun::Restored::kQueued) queue_.push_back(record.job_id());
    if (restored == JobRun::Restored::kRecovering) queue_.insert(queue_.begin(), record.job_id());
    if (restored == JobRun::Restored::kPreparing) {
      tasks_.Run([this, id = record.job_id(), spec = record.spec()] { PrepareDetached(id, spec); });
    }
    const Job& j = run->job();  // as restored: a job that could not be is FAILED
    if (!IsTerminal(j.state()) && j.spec().data().dataset().uploaded()) {
      datasets_in_use.insert(std::filesystem::path(j.spec().data().dataset().path()).lexically_normal().string());
    }
    AddJob(std::move(run));
  }
  artifacts_->RemoveUploadedDatasetsExcept(datasets_in_use);
}

Coordinator::~Coordinator() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    stopping_ = true;
    for (auto& [id, run] : jobs_) run->StopSenders();
  }
  if (loop_.joinable()) loop_.join();
}

JobRun* Coordinator::Find(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second.get();
}

void Coordinator::AddJob(std::unique_ptr<JobRun> run) {
  const std::string id = run->id();
  if (run->serving() != nullptr) {
    run->serving()->SetMaxMessageBytes(std::min<int64_t>(options_.max_message_bytes, kWorkerMaxMessageBytes));
  }
  by_number_[JobNumber(id)] = run.get();
  jobs_[id] = std::move(run);
}

void Coordinator::ForgetJob(const std::string& job_id) {
  by_number_.erase(JobNumber(job_id));
  jobs_.erase(job_id);
  queue_.erase(std::remove(queue_.begin(), queue_.end(), job_id), queue_.end());
  absl::Status s = store_->Delete(job_id);
  if (!s.ok()) log::Warn("job={} record not deleted: {}", job_id, s.message());
}

std::vector<std::string> Coordinator::Retain(absl::Time now) {
  if (options_.job_retention <= absl::ZeroDuration() && options_.max_finished_jobs <= 0) return {};
  std::vector<std::pair<int64_t, std::string>> ended;  // (updated ms, id)
  for (const auto& [id, run] : jobs_) {
    if (run->ended()) ended.emplace_back(run->job().updated_unix_ms(), id);
  }
  std::sort(ended.begin(), ended.end());
  std::vector<std::string> drop;
  const int64_t keep_after =
      options_.job_retention > absl::ZeroDuration() ? absl::ToUnixMillis(now - options_.job_retention) : INT64_MIN;
  const size_t beyond = options_.max_finished_jobs > 0 && ended.size() > static_cast<size_t>(options_.max_finished_jobs)
                            ? ended.size() - static_cast<size_t>(options_.max_finished_jobs)
                            : 0;
  for (size_t i = 0; i < ended.size(); ++i) {
    if (i < beyond || ended[i].first < keep_after) drop.push_back(ended[i].second);
  }
  for (const std::string& id : drop) ForgetJob(id);
  if (!drop.empty()) {
    log::Info("deleted {} ended job(s) by the retention rule (--job-retention-days, --max-finished-jobs): {}",
              drop.size(), absl::StrJoin(drop, ","));
  }
  return drop;
}

absl::Status Coordinator::DeleteJob(const std::string& job_id, const std::string& user) {
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(job_id);
    if (run == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' (pippyctl list shows them)"));
    const std::string& owner = run->job().user();
    if (!user.empty() && !owner.empty() && user != owner) {
      return absl::PermissionDeniedError(absl::StrCat("job ", job_id, " was submitted by ", owner,
                                                      "; only they can delete it"));
    }
    if (!run->ended()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " is ", JobState_Name(run->state()),
                                                        "; cancel it first (pippyctl cancel ", job_id, ")"));
    }
    ForgetJob(job_id);
  }
  artifacts_->RemoveAllOf(job_id);
  log::Info("job={} deleted{}", job_id, user.empty() ? "" : absl::StrCat(" by ", user));
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Upload>> Coordinator::NewUpload() { return artifacts_->NewUpload(); }

absl::Status Coordinator::AcquireModelSlot() {
  absl::MutexLock lock(&mu_);
  auto free_or_stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !model_in_memory_ || stop_; };
  // No deadline needed: whoever holds the slot lets go when its child ends, and every
  // child has deadlines (PrepareOptions, AssembleOptions).
  mu_.Await(absl::Condition(&free_or_stopping));
  if (stop_ || stopping_) return absl::UnavailableError("the coordinator is stopping; submit again once it is back");
  model_in_memory_ = true;
  return absl::OkStatus();
}

void Coordinator::ReleaseModelSlot() {
  absl::MutexLock lock(&mu_);
  model_in_memory_ = false;
}

absl::Status Coordinator::CheckUserQueue(const std::string& user) {
  if (options_.max_queued_per_user <= 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  int waiting = 0;
  for (const auto& [id, run] : jobs_) {
    if (run->job().user() == user && (run->state() == QUEUED || run->state() == PARTITIONING)) ++waiting;
  }
  if (waiting < options_.max_queued_per_user) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(
      user.empty() ? "you have " : absl::StrCat(user, " has "), waiting,
      " jobs waiting for workers, the coordinator's limit (--max-queued-jobs-per-user raises it); cancel one or "
      "wait for it to start"));
}

absl::Status Coordinator::Admit(const PreparedJob& prepared) {
  const int registered = workers_->size();
  const int replicas = std::max(1, prepared.spec.replicas());
  const int tp = std::max(1, prepared.spec.tensor_parallel().size());
  const int need = prepared.layout.ranks_size() * replicas * tp;
  // No workers yet: a cluster starting up; the job waits. Some, but too few: refuse.
  if (registered > 0 && need > registered) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split: the job needs ", need, " workers (", prepared.plan.stages_size(), " stages, ",
        prepared.spec.schedule().stages_per_worker(), " per worker",
        replicas > 1 ? absl::StrCat(", ", replicas, " replicas") : "",
        tp > 1 ? absl::StrCat(", ", tp, " tensor-parallel ranks per stage") : "", ") but only ", registered,
        registered == 1 ? " is" : " are", " registered; use fewer stages, more stages per worker (an interleaved "
        "schedule)", replicas > 1 ? ", fewer replicas" : "", tp > 1 ? ", a smaller --tensor-parallel" : "",
        " or start more workers"));
  }
  // GPU workers only: a rank whose stages fit none of them can never be placed.
  const WorkerRegistry::Capacity capacity = workers_->capacity();
  if (registered == 0 || capacity.any_cpu) return absl::OkStatus();
  for (int r = 0; r < prepared.layout.ranks_size(); ++r) {
    const RankLayout& piece = prepared.layout.ranks(r);
    if (piece.memory_bytes() <= capacity.largest_gpu) continue;
    return absl::InvalidArgumentError(absl::StrCat(
        "split: rank ", r, " (stages ", absl::StrJoin(job::StagesOf(piece, r), ","), ") needs ", piece.memory_bytes(),
        " bytes of device memory (parameters, gradients and optimizer state) but the largest GPU worker "
        "registered has ",
        capacity.largest_gpu, " bytes free; split into more stages or add larger GPUs"));
  }
  return absl::OkStatus();
}

// What a user probably did not mean, though it runs: micro-batch sizes an auto plan
// could not measure (so did not consider), a schedule of several stages per worker
// that leaves registered workers idle (`--schedule zbv --stages 2` on 2 workers), a
// batch larger than the data (steps take samples more than once).
static std::vector<std::string> NoticesFor(const PreparedJob& p, int registered) {
  std::vector<std::string> notices;
  for (const std::string& u : p.plan.choice().profile().unmeasured()) {
    notices.push_back("auto plan: not a candidate: " + u);
  }
  const int per_worker = p.spec.schedule().stages_per_worker();
  const int replicas = std::max(1, p.spec.replicas()) * std::max(1, p.spec.tensor_parallel().size());
  const int used = p.layout.ranks_size() * replicas;
  if (per_worker > 1 && used < registered) {
    notices.push_back(absl::StrCat(
        "schedule ", job::ScheduleName(p.spec.schedule().kind()), " runs ", per_worker, " stages per worker: the ",
        p.plan.stages_size(), " stages use ", used, " of the ", registered, " registered workers; --stages ",
        per_worker * (registered / replicas), " would use ", (registered / replicas) * replicas));
  }
  const int64_t samples = p.layout.data_samples();
  if (p.spec.mode() == MODE_TRAIN && samples > 0 && p.spec.batch_size() > samples) {
    notices.push_back(absl::StrCat("--batch-size ", p.spec.batch_size(), " is more than the data's ", samples,
                                   " samples: every step takes some samples more than once (steps wrap around the "
                                   "data)"));
  }
  return notices;
}

PrepareOptions Coordinator::PrepareOptionsFor(std::shared_ptr<const std::atomic<bool>> ended,
                                              const JobSpec& spec) const {
  PrepareOptions prepare;
  prepare.preparer = options_.child_binary;
  prepare.timeout = options_.prepare_timeout;
  prepare.probe_timeout = options_.probe_timeout;
  prepare.dataset_roots = options_.dataset_roots;
  const DatasetSpec& ds = spec.data().dataset();
  if (ds.uploaded() && ds.path().rfind(artifacts_->DatasetsDir() + "/", 0) == 0) prepare.dataset_roots.push_back(ds.path());
  prepare.cancelled = [this, ended = std::move(ended)] { return stopping_.load() || (ended && ended->load()); };
  return prepare;
}

JobSpec Coordinator::WithWorkers(const JobSpec& spec) {
  if (!job::AutoPlanned(spec.auto_plan())) return spec;
  JobSpec out = spec;
  AutoPlanSpec* plan = out.mutable_auto_plan();
  plan->clear_workers();
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids = workers_->IdleIds();
  if (ids.empty()) {
    for (const auto& [id, w] : workers_->all()) ids.push_back(id);
  }
  for (const std::string& id : ids) {
    const WorkerRegistry::Worker* w = workers_->Find(id);
    if (w == nullptr) continue;
    WorkerCapacity* c = plan->add_workers();
    c->set_host(w->info.host());
    c->set_free_memory(w->info.free_memory());
    c->set_threads(std::max(1, w->info.threads()));
    c->set_host_cpus(w->info.host_cpus());
    c->set_gpu(w->device.is_gpu());
  }
  plan->clear_calibration();
  for (const ActionFactors& f : calibration_) *plan->add_calibration() = f;
  return out;
}

absl::Status Coordinator::Queue(JobRun& run, const PreparedJob& prepared, std::vector<std::string>* notices) {
  const PlanChoice& choice = prepared.plan.choice();
  if (choice.candidates_size() > 0) {
    const PlanCandidate& c = choice.candidates(0);
    run.AddEvent(absl::StrCat(
        "plan chosen (auto ", absl::StrJoin(choice.chosen(), ", "), "): ", job::ScheduleName(c.schedule()), ", ",
        c.microbatches(), " micro-batches, ", c.stages(), " stages on ", c.workers(), " workers",
        choice.fallback().empty() ? absl::StrFormat(", %.1f samples/s predicted among %d candidates",
                                                    c.samples_per_second(), choice.candidates_size())
                                  : absl::StrCat(": the defaults, costs not measured (", choice.fallback(), ")")));
    if (!choice.fallback().empty() && notices != nullptr) {
      notices->push_back(absl::StrCat("auto plan: costs not measured (", choice.fallback(), "); the defaults were used"));
    }
  }
  for (const std::string& n : NoticesFor(prepared, workers_->size())) {
    run.AddEvent(absl::StrCat("note: ", n));
    if (notices != nullptr) notices->push_back(n);
  }
  log::Info("job={} accepted: {} stage(s) on {} worker(s){}, schedule {}", run.id(), prepared.plan.stages_size(),
            run.ranks(), run.layout().replicas() > 1 ? absl::StrCat(" (", run.layout().replicas(), " replicas)") : "",
            job::ScheduleName(prepared.spec.schedule().kind()));
  queue_.push_back(run.id());
  Schedule();  // placed now if enough workers are idle
  return absl::OkStatus();
}

absl::StatusOr<std::string> Coordinator::SubmitJob(const JobSpec& spec, std::unique_ptr<Upload> upload,
                                                   const std::string& user, std::vector<std::string>* notices,
                                                   bool detach) {
  absl::Status closed = upload->Close();
  if (!closed.ok()) return closed;
  absl::Status room = CheckUserQueue(user);
  if (!room.ok()) return room;
  Job job;
  job.set_user(user);
  *job.mutable_spec() = spec;
  job.set_created_unix_ms(absl::ToUnixMillis(absl::Now()));
  job.set_model_bytes(upload->model_bytes());
  if (detach) {
    std::string id;
    {
      absl::MutexLock lock(&mu_);
      if (stop_ || stopping_) return absl::UnavailableError("the coordinator is stopping; submit again once it is back");
      id = absl::StrCat("job-", next_job_++);
      PIPPY_RETURN_IF_ERROR(artifacts_->Accept(*upload, id));
      job.set_job_id(id);
      std::unique_ptr<JobRun> run = JobRun::Preparing({store_.get(), artifacts_.get()}, std::move(job));
      run->AddEvent(absl::StrCat("uploaded (", upload->model_bytes() >> 20, " MiB of model, ",
                                 upload->data_bytes() >> 20, " MiB of data); being prepared"));
      AddJob(std::move(run));
    }
    tasks_.Run([this, id, spec] { PrepareDetached(id, spec); });
    return id;
  }
  absl::Status slot = AcquireModelSlot();
  if (!slot.ok()) return slot;
  absl::StatusOr<PreparedJob> prepared = PrepareJob(WithWorkers(spec), upload->dir(), PrepareOptionsFor(nullptr, spec));
  ReleaseModelSlot();
  if (!prepared.ok()) return prepared.status();
  absl::MutexLock lock(&mu_);
  PIPPY_RETURN_IF_ERROR(Admit(*prepared));
  const JobRun* source = nullptr;
  if (!prepared->spec.resume_from().empty()) {
    PIPPY_ASSIGN_OR_RETURN(source, ResumeSource(*prepared, user));
  }
  const std::string id = absl::StrCat("job-", next_job_++);
  PIPPY_RETURN_IF_ERROR(artifacts_->Accept(*upload, id));
  job.set_job_id(id);
  *job.mutable_spec() = prepared->spec;
  *job.mutable_plan() = prepared->plan;
  auto run = std::make_unique<JobRun>(JobRun::Stores{store_.get(), artifacts_.get()}, std::move(job),
                                      prepared->layout, prepared->share_bytes, prepared->stage_bytes);
  JobRun& added = *run;
  AddJob(std::move(run));
  if (source != nullptr) {
    absl::Status linked = ResumeFrom(*source, added);
    if (!linked.ok()) {
      Outbox out;  // nothing placed yet: nothing to deliver
      EndJob(added, FAILED, std::string(linked.message()), &out);
      return linked;
    }
  }
  PIPPY_RETURN_IF_ERROR(Queue(added, *prepared, notices));
  return id;
}

absl::StatusOr<const JobRun*> Coordinator::ResumeSource(const PreparedJob& prepared, const std::string& user) {
  const std::string& from = prepared.spec.resume_from();
  const JobRun* source = Find(from);
  if (source == nullptr) {
    return absl::NotFoundError(absl::StrCat("resume_from: no job '", from, "' (pippyctl list shows them)"));
  }
  PIPPY_RETURN_IF_ERROR(
      CheckResume(source->job(), source->layout(), user, prepared.spec, prepared.plan, prepared.layout));
  return source;
}

absl::Status Coordinator::ResumeFrom(const JobRun& source, JobRun& run) {
  const int step = source.job().checkpoint_step();
  absl::Status linked =
      artifacts_->LinkCheckpoint(source.id(), step, run.id(), source.job().plan().stages_size(), source.ranks());
  if (!linked.ok()) {
    return absl::UnavailableError(
        absl::StrCat("resume_from: ", source.id(), "'s checkpoint after step ", step, ": ", linked.message()));
  }
  run.Resumed(source.job(), step);
  log::Info("job={} resumes {} from its checkpoint after step {}", run.id(), source.id(), step);
  return absl::OkStatus();
}

void Coordinator::PrepareDetached(const std::string& job_id, const JobSpec& spec) {
  std::shared_ptr<const std::atomic<bool>> ended;
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(job_id);
    if (run == nullptr || run->state() != PARTITIONING) return;
    ended = run->StopFlag();
  }
  if (!AcquireModelSlot().ok()) return;  // stopping: a restart prepares it again
  absl::StatusOr<PreparedJob> prepared =
      ended->load() ? absl::CancelledError("ended") : PrepareJob(WithWorkers(spec), artifacts_->JobDir(job_id), PrepareOptionsFor(ended, spec));
  ReleaseModelSlot();
  Outbox out;
  bool cancelled = false;
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(job_id);
    cancelled = run == nullptr || run->ended();
    // The coordinator stopping stopped the child: the record stays PARTITIONING and a
    // restart prepares it again.
    if (!cancelled && !stop_ && !stopping_) {
      absl::Status s = prepared.status();
      if (s.ok()) s = Admit(*prepared);
      const JobRun* source = nullptr;
      if (s.ok() && !prepared->spec.resume_from().empty()) {
        absl::StatusOr<const JobRun*> found = ResumeSource(*prepared, run->job().user());
        s = found.status();
        if (s.ok()) source = *found;
      }
      if (s.ok()) {
        run->Prepared(prepared->spec, prepared->plan, prepared->layout, prepared->share_bytes, prepared->stage_bytes);
        if (source != nullptr) s = ResumeFrom(*source, *run);
        if (s.ok()) s = Queue(*run, *prepared, nullptr);
      }
      if (!s.ok()) {
        log::Info("job={} refused: {}", job_id, s.message());
        EndJob(*run, FAILED, std::string(s.message()), &out);
      }
    }
  }
  // Cancelled or deleted while its child wrote: what the child left goes too.
  if (cancelled) artifacts_->RemoveJobFiles(job_id);
  Deliver(&out);
}

std::vector<RankSend> Coordinator::PlaceOnIdleWorkers(JobRun& run, NoFit* no_fit) {
  const std::vector<int64_t>& need = run.RankMemory();
  // Within one pass over the queue the idle workers only shrink: a need that did not
  // fit once does not fit later in the pass (10,000 queued jobs cost one Fit per need).
  if (no_fit != nullptr && no_fit->contains(need)) return {};
  std::vector<std::string> chosen = workers_->Fit(need);
  if (chosen.empty()) {
    if (no_fit != nullptr) no_fit->insert(need);
    return {};
  }
  std::map<std::string, std::string> host_of;
  for (const std::string& wid : chosen) host_of[wid] = workers_->Find(wid)->info.host();
  chosen = GroupByHost(chosen, run.ranks_per_replica(), run.tensor_parallel(),
                       [&host_of](const std::string& id) { return host_of.at(id); });
  std::vector<JobRun::PlacedWorker> placed;
  for (const std::string& wid : chosen) {
    const WorkerRegistry::Worker& w = *workers_->Find(wid);
    placed.push_back({wid, w.info.host(), w.device, w.channel});
  }
  std::vector<RankSend> sends = run.Place(placed);
  for (size_t g = 0; g < chosen.size(); ++g) {
    const int rank = static_cast<int>(g) % run.ranks_per_replica();
    const int copy = static_cast<int>(g) / run.ranks_per_replica();
    WorkerRegistry::Worker& w = *workers_->Find(chosen[g]);
    workers_->Assign(w, run.id(), run.attempt(), rank, copy / run.tensor_parallel(), run.StagesOfRank(rank));
    w.info.set_tp_rank(copy % run.tensor_parallel());
  }
  return sends;
}

void Coordinator::Schedule() {
  if (queue_.empty() || workers_->IdleCount() == 0) return;
  NoFit no_fit;
  for (auto it = queue_.begin(); it != queue_.end();) {
    JobRun& run = *jobs_.at(*it);
    // A restart before the first checkpoint waits for the original stage files.
    std::vector<RankSend> sends = run.StagesOnDisk() ? PlaceOnIdleWorkers(run, &no_fit) : std::vector<RankSend>();
    if (sends.empty()) {
      ++it;  // later jobs that fit may go first on the remaining workers
      continue;
    }
    it = queue_.erase(it);
    StageWriter from_files = run.StagesFromFiles(options_.chunk_bytes);
    const std::string job_id = run.id();
    for (RankSend& send : sends) {
      tasks_.Run([this, job_id, send = std::move(send), from_files] {
        std::map<int, int64_t> ignored;
        SendOrFail(job_id, send, from_files, &ignored);
      });
    }
  }
}

void Coordinator::EndJob(JobRun& run, JobState state, const std::string& reason, Outbox* out) {
  if (run.ended()) return;
  if (state == SUCCEEDED) {
    run.Succeed();
  } else {
    run.Finish(state, reason);
  }
  queue_.erase(std::remove(queue_.begin(), queue_.end(), run.id()), queue_.end());
  if (state != SUCCEEDED) {
    CancelWorkers(run, reason, /*attempt=*/-1, out);  // each is idle again once it reports its rank finished
    return;
  }
  for (const std::string& wid : run.job().workers()) {
    WorkerRegistry::Worker* w = workers_->Find(wid);
    if (w != nullptr && w->info.job_id() == run.id()) workers_->Release(*w);
  }
}

void Coordinator::CancelWorkers(const JobRun& run, const std::string& reason, int attempt, Outbox* out) {
  for (const std::string& wid : run.job().workers()) {
    WorkerRegistry::Worker* w = workers_->Find(wid);
    if (w == nullptr || w->info.job_id() != run.id() || (attempt >= 0 && w->attempt != attempt)) continue;
    CoordinatorMessage m;
    m.mutable_cancel()->set_job_id(run.id());
    m.mutable_cancel()->set_reason(reason);
    m.mutable_cancel()->set_attempt(w->attempt);
    out->emplace_back(w->channel, m);
  }
}

void Coordinator::LoseAttempt(JobRun& run, const std::string& what, Outbox* out) {
  if (!run.CanRestart()) {
    const int max = run.job().spec().fault_tolerance().max_restarts();
    EndJob(run, FAILED,
           absl::StrCat(what, "; no restart left (", run.job().restarts(), " of ", max,
                        " used; raise it with --max-restarts)"),
           out);
    return;
  }
  // The job's other workers stop; each is idle again once it reports its rank finished.
  CancelWorkers(run, absl::StrCat("restarting the job: ", what), run.attempt(), out);
  run.Recover(what);
  metrics_.OnRestart();
  queue_.erase(std::remove(queue_.begin(), queue_.end(), run.id()), queue_.end());
  queue_.insert(queue_.begin(), run.id());
}

void Coordinator::SendOrFail(const std::string& job_id, const RankSend& send, const StageWriter& writer,
                             std::map<int, int64_t>* stage_bytes) {
  absl::Status s = SendRank(send, writer, options_.chunk_bytes, stage_bytes);
  // CANCELLED: the attempt ended; UNAVAILABLE: the worker is gone (its removal recovers the job).
  if (!s.ok() && !absl::IsCancelled(s) && !absl::IsUnavailable(s)) {
    FailAttempt(job_id, send.assignment.assignment().attempt(), std::string(s.message()));
  }
}

void Coordinator::FailAttempt(const std::string& job_id, int attempt, const std::string& reason) {
  Outbox out;
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(job_id);
    if (run != nullptr && run->attempt() == attempt) EndJob(*run, FAILED, reason, &out);
  }
  Deliver(&out);
}

absl::StatusOr<Job> Coordinator::CancelJob(const std::string& job_id, const std::string& user) {
  Outbox out;
  Job result;
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(job_id);
    if (run == nullptr) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
    const std::string& owner = run->job().user();
    if (!user.empty() && !owner.empty() && user != owner) {
      return absl::PermissionDeniedError(absl::StrCat("job ", job_id, " was submitted by ", owner,
                                                      "; only they can cancel it"));
    }
    if (run->ended()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " already ended (",
                                                        JobState_Name(run->state()), ")"));
    }
    EndJob(*run, CANCELLED, user.empty() ? "cancelled by the user" : absl::StrCat("cancelled by ", user), &out);
    result = run->job();
  }
  Deliver(&out);
  return result;
}

absl::StatusOr<std::string> Coordinator::AddWorker(const RegisterWorker& reg, std::shared_ptr<WorkerChannel> channel) {
  Outbox out;
  absl::StatusOr<std::string> id;
  {
    absl::MutexLock lock(&mu_);
    id = workers_->Add(reg, channel);
    if (!id.ok()) return id;
    absl::Status saved = store_->PutCounter("next_worker", workers_->next_id());
    if (!saved.ok()) log::Warn("the next worker id was not saved: {}", saved.message());
    CoordinatorMessage m;
    m.mutable_registered()->set_worker_id(*id);
    out.emplace_back(channel, m);
    schedule_soon_ = true;  // the loop places what now fits, once for many registrations
  }
  Deliver(&out);
  return id;
}

void Coordinator::RemoveWorker(const std::string& worker_id, const std::string& why) {
  Outbox out;
  {
    absl::MutexLock lock(&mu_);
    std::optional<WorkerRegistry::Worker> gone = workers_->Remove(worker_id);
    if (!gone.has_value()) return;
    const WorkerInfo& info = gone->info;
    log::Warn("worker {} ({}) removed: {}", worker_id, info.name(), why);
    JobRun* run = info.job_id().empty() ? nullptr : Find(info.job_id());
    // A worker still finishing an earlier attempt of a recovering job changes nothing.
    if (run != nullptr && run->IsCurrent(gone->attempt)) {
      LoseAttempt(*run,
                  absl::StrCat("worker ", info.name(), " (", worker_id, ", rank ", info.rank(),
                               run->layout().replicas() > 1 ? absl::StrCat(" of replica ", info.replica()) : "",
                               ", stages ", absl::StrJoin(run->StagesOfRank(info.rank()), ","), ") ", why),
                  &out);
    }
  }
  Deliver(&out);
}

void Coordinator::OnWorkerMessage(const std::string& worker_id, const WorkerMessage& m) {
  // Results and checkpoints go to disk as they come, outside the lock.
  if (m.has_stage_result()) {
    const StageResult& r = m.stage_result();
    OnResultChunk(r.job_id(), r.attempt(), r.stage(), r.chunk(), r.last_chunk(), r.tp_rank());
  } else if (m.has_output()) {
    OnResultChunk(m.output().job_id(), m.output().attempt(), -1, m.output().chunk(), m.output().last_chunk(), 0);
  } else if (m.has_checkpoint()) {
    OnCheckpointChunk(m.checkpoint());
  } else if (m.has_serve_result()) {
    OnServeResult(worker_id, m.serve_result());
    return;
  }
  Outbox out;
  std::string assemble;
  {
    absl::MutexLock lock(&mu_);
    WorkerRegistry::Worker* w = workers_->Find(worker_id);
    if (w == nullptr) return;
    workers_->Heard(*w);
    if (m.has_address() || m.has_step() || m.has_finished()) OnRankMessage(*w, m, &out, &assemble);
  }
  Deliver(&out);
  if (!assemble.empty()) tasks_.Run([this, assemble] { Assemble(assemble); });
}

void Coordinator::OnRankMessage(WorkerRegistry::Worker& w, const WorkerMessage& m, Outbox* out,
                                std::string* assemble) {
  const std::string& job_id = m.has_address() ? m.address().job_id() : m.has_step() ? m.step().job_id()
                                                                                     : m.finished().job_id();
  const int attempt = m.has_address() ? m.address().attempt() : m.has_step() ? m.step().attempt()
                                                                             : m.finished().attempt();
  if (m.has_finished() && w.info.job_id() == job_id && w.attempt == attempt) {
    workers_->Release(w);
    Schedule();  // a queued or recovering job may wait for this worker
  }
  // Messages of an earlier attempt of the job (ranks that were stopped) are ignored.
  JobRun* run = Find(job_id);
  if (run == nullptr || !run->IsCurrent(attempt)) return;
  if (m.has_address()) {
    w.info.set_bytes_received(m.address().bytes_received());
    w.info.set_loaded_param_bytes(m.address().loaded_param_bytes());
    run->OnAddress(m.address(), out);
  } else if (m.has_step()) {
    std::optional<CompletedStep> done = run->OnStepReport(m.step());
    if (done.has_value()) metrics_.OnStep(*done);
    if (std::optional<ActionFactors> learned = run->TakeCalibration()) {
      autoplan::Merge(*learned, &calibration_);
      log::Info("job={} auto plan calibration, {} rank(s) on a host: measured / predicted {}", job_id,
                learned->ranks_on_host(), autoplan::DescribeFactors(*learned));
    }
  } else {
    JobRun::RankOutcome outcome = run->OnRankFinished(m.finished(), w.info.name());
    if (outcome.kind == JobRun::RankOutcome::kRecover) LoseAttempt(*run, outcome.reason, out);
    if (outcome.kind == JobRun::RankOutcome::kFail) EndJob(*run, FAILED, outcome.reason, out);
    if (outcome.kind == JobRun::RankOutcome::kAssemble) *assemble = job_id;
  }
}

void Coordinator::OnServeResult(const std::string& worker_id, const ServeResult& result) {
  std::shared_ptr<RequestQueue> queue;
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(result.job_id());
    if (run != nullptr) queue = run->serving();
    WorkerRegistry::Worker* w = workers_->Find(worker_id);
    if (w != nullptr) workers_->Heard(*w);
  }
  if (queue != nullptr) queue->OnResult(result);
}

void Coordinator::OnResultChunk(const std::string& job_id, int attempt, int stage, const std::string& chunk,
                                bool last, int tp_rank) {
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(job_id);
    if (run == nullptr || run->attempt() != attempt || run->ended()) return;
    if (stage >= 0) {
      if (tp_rank < 0 || tp_rank >= run->tensor_parallel() || stage >= run->job().plan().stages_size()) return;
      stage = run->FileKey(stage, tp_rank);
    }
  }
  absl::Status s = artifacts_->AppendResult(job_id, stage, chunk, last);
  if (s.ok()) return;
  Outbox out;
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(job_id);
    if (run != nullptr) EndJob(*run, FAILED, std::string(s.message()), &out);
  }
  Deliver(&out);
}

void Coordinator::OnCheckpointChunk(const CheckpointChunk& c) {
  std::optional<int> global;
  int key = -1;  // the stage's file (a shard's, with tensor parallelism); -1: the rank's state
  {
    absl::MutexLock lock(&mu_);
    JobRun* run = Find(c.job_id());
    if (run != nullptr) global = run->CheckpointRank(c);
    if (global.has_value() && c.stage() >= 0) key = run->FileKey(c.stage(), c.tp_rank());
  }
  if (!global.has_value()) return;
  absl::StatusOr<bool> done = artifacts_->AppendCheckpoint(c.job_id(), c.step(), *global, key, c.chunk(),
                                                           c.last_chunk());
  if (!done.ok() || !*done) {
    // A checkpoint that cannot be written is not fatal: the job keeps its last one.
    if (!done.ok()) log::Warn("job={} checkpoint after step {}: {}", c.job_id(), c.step(), done.status().message());
    return;
  }
  absl::MutexLock lock(&mu_);
  JobRun* run = Find(c.job_id());
  if (run != nullptr && run->OnCheckpointPiece(c, *global)) metrics_.OnCheckpoint();
}

void Coordinator::Assemble(const std::string& job_id) {
  const auto start = absl::Now();
  bool inference = false;
  int stages = 0;
  PipelinePlan plan;
  {
    absl::MutexLock lock(&mu_);
    const JobRun& run = *jobs_.at(job_id);
    inference = run.job().spec().mode() == MODE_INFERENCE;
    stages = run.stage_files();
    plan = run.job().plan();
  }
  absl::StatusOr<std::string> assembled = absl::UnavailableError("the coordinator is stopping");
  // Merging trained stages loads the submitted model (in a child): the one slot.
  absl::Status slot = inference ? absl::OkStatus() : AcquireModelSlot();
  if (slot.ok()) {
    AssembleOptions merge;
    merge.merger = options_.child_binary;
    merge.timeout = options_.prepare_timeout;
    merge.cancelled = [this] { return stopping_.load(); };
    merge.plan = plan;
    assembled = AssembleResult(*artifacts_, job_id, inference, stages, merge);
    if (!inference) ReleaseModelSlot();
  }
  Outbox out;
  {
    absl::MutexLock lock(&mu_);
    JobRun& run = *jobs_.at(job_id);
    if (run.ended()) return;  // cancelled meanwhile
    absl::Status s = assembled.status();
    if (s.ok()) s = artifacts_->Publish(job_id, *assembled);
    if (!s.ok()) {
      EndJob(run, FAILED, absl::StrCat("assembling the result: ", s.message()), &out);
    } else {
      log::Info("job={} result assembled in {}", job_id, absl::FormatDuration(absl::Now() - start));
      absl::Status kept = run.CommitFinalCheckpoint();
      if (!kept.ok()) log::Warn("job={} the state after the last step is not kept: {}", job_id, kept.message());
      EndJob(run, SUCCEEDED, "", &out);
    }
  }
  Deliver(&out);
}

void Coordinator::Loop() {
  while (true) {
    Outbox out;
    std::vector<std::pair<std::string, std::string>> silent;
    std::vector<std::string> dropped;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.tick);
      if (stop_) return;
      const absl::Time now = absl::Now();
      if (now - retained_at_ >= absl::Seconds(1)) {
        dropped = Retain(now);
        retained_at_ = now;
      }
      silent = workers_->Silent(now, options_.heartbeat_timeout);
      // A pass over the queue when workers came, and every 2 s whatever happened.
      if (schedule_soon_ || now - scheduled_at_ >= absl::Seconds(2)) {
        schedule_soon_ = false;
        scheduled_at_ = now;
        Schedule();
      }
      if (test_hooks::Enabled()) {
        for (const auto& [id, run] : jobs_) test_hooks::MaybeStallLoop(id, run->job().spec().name());
      }
      for (auto& [id, run] : jobs_) {
        if (!run->RecoveryExpired(now)) continue;
        EndJob(*run, FAILED,
               absl::StrCat("waited ", run->job().spec().fault_tolerance().recovery_timeout_s(),
                            " s (--recovery-timeout-s) for ", run->ranks(), " idle workers to restart the job from step ",
                            run->job().checkpoint_step(), "; ", workers_->IdleIds().size(), " of ", workers_->size(),
                            " registered workers are idle: start more workers or submit the job again"),
               &out);
      }
    }
    Deliver(&out);
    loop_alive_.Beat();
    for (const std::string& id : dropped) artifacts_->RemoveAllOf(id);
    for (const auto& [id, why] : silent) RemoveWorker(id, why);
  }
}

}  // namespace pippy::coordinator
