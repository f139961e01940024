#include "coordinator/coordinator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/chunker.h"
#include "common/log.h"
#include "common/status.h"
#include "coordinator/job_preparation.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/partition/merge.h"

namespace pippy::coordinator {
namespace {

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

bool Terminal(JobState s) { return s == SUCCEEDED || s == FAILED || s == CANCELLED; }

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
    for (Job job : c->store_->List()) {
      if (!Terminal(job.state())) {
        job.set_reason(absl::StrCat("the coordinator restarted while the job was ", JobState_Name(job.state()),
                                    "; submit it again"));
        job.set_state(FAILED);
        job.set_updated_unix_ms(NowMs());
        absl::Status saved = c->store_->Put(job);
        if (!saved.ok()) log::Warn("job={} could not record that it failed: {}", job.job_id(), saved.message());
        c->artifacts_->RemoveJobFiles(job.job_id());
      }
      JobEntry entry;
      entry.job = job;
      c->jobs_[job.job_id()] = entry;
      int64_t n = 0;
      if (sscanf(job.job_id().c_str(), "job-%ld", &n) == 1) c->next_job_ = std::max(c->next_job_, n + 1);
    }
  }
  c->loop_ = std::thread([p = c.get()] { p->Loop(); });
  return c;
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

absl::StatusOr<std::string> Coordinator::SubmitJob(const JobSpec& spec, std::unique_ptr<Upload> upload) {
  absl::Status closed = upload->Close();
  if (!closed.ok()) return closed;
  absl::Status slot = AcquireModelSlot();
  if (!slot.ok()) return slot;
  absl::StatusOr<PreparedJob> prepared = PrepareJob(spec, upload->dir());
  if (!prepared.ok()) {
    ReleaseModelSlot();
    return prepared.status();
  }
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    const int registered = static_cast<int>(workers_.size());
    // No workers yet: a cluster starting up; the job waits. Some, but too few: refuse.
    absl::Status refused;
    if (registered > 0 && prepared->ranks > registered) {
      refused = absl::InvalidArgumentError(absl::StrCat(
          "split: the job needs ", prepared->ranks, " workers (", prepared->plan.stages_size(), " stages, ",
          prepared->spec.schedule().stages_per_worker(), " per worker) but only ", registered,
          " are registered; use fewer stages or more stages per worker (an interleaved schedule)"));
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
    *entry.job.mutable_spec() = prepared->spec;
    *entry.job.mutable_plan() = prepared->plan;
    entry.job.set_state(PARTITIONING);
    entry.job.set_created_unix_ms(NowMs());
    entry.job.set_model_bytes(upload->model_bytes());
    entry.ranks = prepared->ranks;
    entry.stage_to_rank = prepared->stage_to_rank;
    entry.share_bytes = prepared->share_bytes;
    entry.stages = prepared->stages;
    Touch(entry);
    jobs_[id] = std::move(entry);
    log::Info("job={} accepted: {} stages on {} workers, schedule {}", id, prepared->plan.stages_size(),
              prepared->ranks, job::ScheduleName(prepared->spec.schedule().kind()));
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
    if (!Terminal(e.job.state())) {
      std::vector<std::string> idle = IdleWorkers();
      // Straight from memory when the job can run now and no earlier job waits for
      // these workers; else to files and the queue.
      if (static_cast<int>(idle.size()) >= e.ranks && queue_.empty()) {
        idle.resize(e.ranks);
        sends = Place(e, idle);
      }
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
  } else if (stages != nullptr) {
    const auto start = absl::Now();
    absl::StatusOr<std::vector<int64_t>> sizes = stages->WriteFiles(artifacts_->JobDir(job_id));
    Outbox out;
    {
      absl::MutexLock lock(&mu_);
      JobEntry& e = jobs_[job_id];
      if (Terminal(e.job.state())) {
        // Cancelled meanwhile: nothing to queue (Finish removed the files).
      } else if (!sizes.ok()) {
        Finish(e, FAILED, absl::StrCat("writing the stage files: ", sizes.status().message()), &out);
      } else {
        e.job.clear_stage_file_bytes();
        for (int64_t n : *sizes) e.job.add_stage_file_bytes(n);
        e.job.set_state(QUEUED);
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

absl::StatusOr<Job> Coordinator::GetJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "' (pippyctl list shows them)"));
  return it->second.job;
}

std::vector<Job> Coordinator::ListJobs() {
  absl::MutexLock lock(&mu_);
  std::vector<Job> out;
  for (const auto& [id, e] : jobs_) out.push_back(e.job);
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
  return it->second.job;
}

absl::StatusOr<Job> Coordinator::CancelJob(const std::string& job_id) {
  Outbox out;
  Job result;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
    if (Terminal(it->second.job.state())) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " already ended (",
                                                        JobState_Name(it->second.job.state()), ")"));
    }
    Finish(it->second, CANCELLED, "cancelled by the user", &out);
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
                                            Terminal(e.job.state()) && e.job.step() == 0
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
    for (int s : StagesOfRank(e.stage_to_rank, rank)) rt->add_stages(s);
    rt->set_steady_anchor_us(r.steady_anchor_us());
    rt->set_unix_anchor_us(r.unix_anchor_us());
    *rt->mutable_breakdown() = r.breakdown();
    rt->mutable_breakdown()->set_rank(rank);
    rt->mutable_breakdown()->set_step_seconds(r.step_seconds());
    *rt->mutable_events() = r.events();
  }
  return out;
}

std::string Coordinator::AddWorker(const RegisterWorker& reg, std::shared_ptr<WorkerChannel> channel) {
  Outbox out;
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    id = absl::StrCat("worker-", next_worker_++);
    WorkerEntry w;
    w.info.set_worker_id(id);
    w.info.set_name(reg.name().empty() ? id : reg.name());
    w.info.set_host(reg.host());
    w.info.set_device(reg.device());
    w.info.set_free_memory(reg.free_memory());
    w.info.set_version(reg.version());
    w.info.set_threads(reg.threads());
    w.info.set_state(IDLE);
    w.info.set_last_heartbeat_unix_ms(NowMs());
    w.channel = channel;
    w.last_heartbeat = absl::Now();
    workers_[id] = w;
    CoordinatorMessage m;
    m.mutable_registered()->set_worker_id(id);
    out.emplace_back(channel, m);
    log::Info("worker {} ({}) registered", id, w.info.name());
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
    workers_.erase(it);
    log::Warn("worker {} ({}) removed: {}", worker_id, info.name(), why);
    if (!info.job_id().empty()) {
      auto job = jobs_.find(info.job_id());
      if (job != jobs_.end() && !Terminal(job->second.job.state())) {
        Finish(job->second, FAILED,
               absl::StrCat("worker ", info.name(), " (", worker_id, ", rank ", info.rank(), ", stages ",
                            absl::StrJoin(StagesOfRank(job->second.stage_to_rank, info.rank()), ","), ") ",
                            why),
               &out);
      }
    }
  }
  Deliver(&out);
}

void Coordinator::Finish(JobEntry& e, JobState state, const std::string& reason, Outbox* out) {
  if (Terminal(e.job.state())) return;
  e.job.set_state(state);
  e.job.set_reason(reason);
  e.stop->store(true);
  log::Info("job={} {}{}", e.job.job_id(), JobState_Name(state), reason.empty() ? "" : ": " + reason);
  queue_.erase(std::remove(queue_.begin(), queue_.end(), e.job.job_id()), queue_.end());
  for (const std::string& wid : e.job.workers()) {
    auto w = workers_.find(wid);
    if (w == workers_.end() || w->second.info.job_id() != e.job.job_id()) continue;
    if (state != SUCCEEDED) {
      CoordinatorMessage m;
      m.mutable_cancel()->set_job_id(e.job.job_id());
      m.mutable_cancel()->set_reason(reason);
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

void Coordinator::Schedule() {
  for (auto it = queue_.begin(); it != queue_.end();) {
    JobEntry& e = jobs_[*it];
    std::vector<std::string> idle = IdleWorkers();
    if (static_cast<int>(idle.size()) < e.ranks) {
      ++it;  // later jobs that fit may go first on the remaining workers
      continue;
    }
    idle.resize(e.ranks);
    const std::string job_id = *it;
    it = queue_.erase(it);
    std::vector<RankSend> sends = Place(e, idle);
    StageWriter from_files = [this, job_id](int stage, const std::function<absl::Status(absl::string_view)>& sink) {
      return ArtifactStore::StreamFile(artifacts_->StagePath(job_id, stage), options_.chunk_bytes, sink);
    };
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
    const int rank = static_cast<int>(r);
    WorkerEntry& w = workers_[workers[r]];
    w.info.set_state(BUSY);
    w.info.set_job_id(job_id);
    w.info.set_rank(rank);
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
    as->set_world_size(static_cast<int>(workers.size()));
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
    as->set_data_bytes(e.share_bytes[r]);
    sends.push_back(std::move(send));
  }
  log::Info("job={} placing on {}", job_id, absl::StrJoin(workers, ", "));
  Touch(e);
  return sends;
}

void Coordinator::SendRank(const RankSend& send, const StageWriter& writer, std::map<int, int64_t>* stage_bytes) {
  const std::string& job_id = send.assignment.assignment().job_id();
  const int rank = send.assignment.assignment().rank();
  if (!send.channel->Send(send.assignment)) return;  // the worker is gone; RemoveWorker fails the job
  const auto start = absl::Now();
  int64_t sent = 0;
  const absl::Status gone = absl::UnavailableError("the worker's stream closed");
  const absl::Status stopped = absl::CancelledError("the job ended");
  for (int stage : send.stages) {
    // Chunks of options_.chunk_bytes; the last one (possibly short) says so.
    Chunker chunker(options_.chunk_bytes, [&](std::string chunk, bool last) -> absl::Status {
      if (send.stop->load()) return stopped;
      CoordinatorMessage m;
      StageChunk* c = m.mutable_stage();
      c->set_job_id(job_id);
      c->set_stage(stage);
      c->set_chunk(std::move(chunk));
      c->set_last_chunk(last);
      return send.channel->Send(m) ? absl::OkStatus() : gone;
    });
    absl::Status s = writer(stage, [&](absl::string_view piece) { return chunker.Append(piece); });
    if (s.ok()) s = chunker.Finish();
    if (!s.ok()) {
      if (!absl::IsCancelled(s) && !absl::IsUnavailable(s)) {
        log::Error("job={} rank={} cannot send stage {}: {}", job_id, rank, stage, s.message());
      }
      return;
    }
    const int64_t bytes = static_cast<int64_t>(chunker.total());
    (*stage_bytes)[stage] = bytes;
    sent += bytes;
  }
  // The data share (a missing file: a rank that needs none, one empty last chunk).
  Chunker data(options_.chunk_bytes, [&](std::string chunk, bool last) -> absl::Status {
    if (send.stop->load()) return stopped;
    CoordinatorMessage m;
    DataChunk* c = m.mutable_data();
    c->set_job_id(job_id);
    c->set_chunk(std::move(chunk));
    c->set_last_chunk(last);
    return send.channel->Send(m) ? absl::OkStatus() : gone;
  });
  absl::Status s;
  if (ArtifactStore::FileSize(send.share_file) > 0) {
    s = ArtifactStore::StreamFile(send.share_file, options_.chunk_bytes,
                                  [&](absl::string_view piece) { return data.Append(piece); });
  }
  if (s.ok()) s = data.Finish();
  if (!s.ok()) {
    if (!absl::IsCancelled(s) && !absl::IsUnavailable(s)) {
      log::Error("job={} rank={} cannot send its data: {}", job_id, rank, s.message());
    }
    return;
  }
  const int64_t share_size = static_cast<int64_t>(data.total());
  sent += share_size;
  log::Info("job={} rank={} sent {} bytes (stages and data share) in {}", job_id, rank, sent,
            absl::FormatDuration(absl::Now() - start));
}

void Coordinator::OnResultChunk(const std::string& job_id, int stage, const std::string& chunk, bool last) {
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

void Coordinator::OnWorkerMessage(const std::string& worker_id, const WorkerMessage& m) {
  // Results go to disk as they come, outside the lock.
  if (m.has_stage_result()) {
    OnResultChunk(m.stage_result().job_id(), m.stage_result().stage(), m.stage_result().chunk(),
                  m.stage_result().last_chunk());
  } else if (m.has_output()) {
    OnResultChunk(m.output().job_id(), -1, m.output().chunk(), m.output().last_chunk());
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
    if (m.has_address()) job_id = m.address().job_id();
    if (m.has_step()) job_id = m.step().job_id();
    if (m.has_finished()) job_id = m.finished().job_id();
    auto jit = job_id.empty() ? jobs_.end() : jobs_.find(job_id);
    if (m.has_finished() && w->second.info.job_id() == job_id) {
      w->second.info.set_state(IDLE);
      w->second.info.clear_job_id();
    }
    if (jit != jobs_.end() && !Terminal(jit->second.job.state())) {
      JobEntry& e = jit->second;
      if (m.has_address()) {
        e.addresses[m.address().rank()] = m.address().ucx_address();
        w->second.info.set_bytes_received(m.address().bytes_received());
        w->second.info.set_loaded_param_bytes(m.address().loaded_param_bytes());
        if (static_cast<int>(e.addresses.size()) == e.ranks) {
          CoordinatorMessage p;
          p.mutable_peers()->set_job_id(job_id);
          for (const auto& [r, a] : e.addresses) p.mutable_peers()->add_ucx_addresses(a);
          for (const std::string& wid : e.job.workers()) out.emplace_back(workers_[wid].channel, p);
          e.job.set_state(RUNNING);
          Touch(e);
        }
      } else if (m.has_step()) {
        auto& reports = e.reports[m.step().step()];
        reports[m.step().rank()] = m.step();  // a repeated report replaces the earlier one
        if (static_cast<int>(reports.size()) == e.ranks) {
          double busy = 0, step_s = 0, loss = 0;
          e.job.clear_breakdown();
          for (const auto& [rank, r] : reports) {
            busy += r.busy_seconds();
            step_s = std::max(step_s, r.step_seconds());
            if (r.has_loss()) loss = r.loss();
            StepBreakdown* b = e.job.add_breakdown();
            *b = r.breakdown();
            b->set_rank(rank);
            b->set_step_seconds(r.step_seconds());
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
        if (!m.finished().ok()) {
          Finish(e, FAILED, absl::StrCat("rank ", m.finished().rank(), " on worker ", w->second.info.name(), ": ",
                                         m.finished().error()),
                 &out);
        } else {
          e.finished.insert(m.finished().rank());
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
    if (it == jobs_.end() || Terminal(it->second.job.state())) return;  // cancelled meanwhile
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
    }
    Deliver(&out);
    for (const auto& [id, why] : dead) RemoveWorker(id, why);
  }
}

}  // namespace pippy::coordinator
