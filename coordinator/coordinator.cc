#include "coordinator/coordinator.h"

#include <algorithm>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "coordinator/job_preparation.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/partition/merge.h"

namespace pippy::coordinator {
namespace {

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

bool Terminal(JobState s) { return s == SUCCEEDED || s == FAILED || s == CANCELLED; }

std::string StagesOfRank(const std::vector<int>& stage_to_rank, int rank) {
  std::vector<std::string> out;
  for (size_t s = 0; s < stage_to_rank.size(); ++s) {
    if (stage_to_rank[s] == rank) out.push_back(absl::StrCat(s));
  }
  return absl::StrJoin(out, ",");
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

absl::StatusOr<std::string> Coordinator::SubmitJob(const JobSpec& spec, std::unique_ptr<Upload> upload) {
  absl::Status closed = upload->Close();
  if (!closed.ok()) return closed;
  absl::StatusOr<PreparedJob> prepared;
  {
    absl::MutexLock one_model(&model_mu_);
    prepared = PrepareJob(spec, upload->dir());
  }
  if (!prepared.ok()) return prepared.status();
  Outbox out;
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    const int registered = static_cast<int>(workers_.size());
    // No workers yet: a cluster starting up; the job waits. Some, but too few: refuse.
    if (registered > 0 && prepared->ranks > registered) {
      return absl::InvalidArgumentError(absl::StrCat(
          "split: the job needs ", prepared->ranks, " workers (", prepared->plan.stages_size(), " stages, ",
          prepared->spec.schedule().stages_per_worker(), " per worker) but only ", registered,
          " are registered; use fewer stages or more stages per worker (an interleaved schedule)"));
    }
    id = absl::StrCat("job-", next_job_++);
    absl::Status accepted = artifacts_->Accept(*upload, id);
    if (!accepted.ok()) return accepted;
    JobEntry entry;
    entry.job.set_job_id(id);
    *entry.job.mutable_spec() = prepared->spec;
    *entry.job.mutable_plan() = prepared->plan;
    entry.job.set_state(QUEUED);
    entry.job.set_created_unix_ms(NowMs());
    entry.job.set_model_bytes(upload->model_bytes());
    for (int64_t b : prepared->stage_file_bytes) entry.job.add_stage_file_bytes(b);
    entry.ranks = prepared->ranks;
    entry.stage_to_rank = prepared->stage_to_rank;
    entry.share_bytes = prepared->share_bytes;
    Touch(entry);
    jobs_[id] = std::move(entry);
    queue_.push_back(id);
    log::Info("job={} queued: {} stages on {} workers, schedule {}", id, prepared->plan.stages_size(),
              prepared->ranks, job::ScheduleName(prepared->spec.schedule().kind()));
    Schedule();
  }
  Deliver(&out);
  return id;
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
                            StagesOfRank(job->second.stage_to_rank, info.rank()), ") ", why),
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
    std::vector<std::string> idle;
    for (const auto& [id, w] : workers_) {
      if (w.info.state() == IDLE) idle.push_back(id);
    }
    if (static_cast<int>(idle.size()) < e.ranks) {
      ++it;  // later jobs that fit may go first on the remaining workers
      continue;
    }
    idle.resize(e.ranks);
    it = queue_.erase(it);
    e.job.set_state(PARTITIONING);  // the plan was made at submission; nothing else to do here
    Touch(e);
    Place(e, idle);
  }
}

void Coordinator::Place(JobEntry& e, const std::vector<std::string>& workers) {
  const std::string& job_id = e.job.job_id();
  e.job.set_state(PLACING);
  e.job.clear_workers();
  absl::StatusOr<schedule::Schedule> sched = job::ScheduleFor(e.job.spec(), e.job.plan());
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
    CoordinatorMessage a;
    Assignment* as = a.mutable_assignment();
    as->set_job_id(job_id);
    *as->mutable_spec() = e.job.spec();
    as->set_rank(rank);
    as->set_world_size(static_cast<int>(workers.size()));
    // The schedule was made and validated at submission; it cannot fail here.
    *as->mutable_plan() = sched.ok() ? job::PlanSliceFor(e.job.plan(), *sched, rank) : e.job.plan();
    std::vector<std::pair<int, std::string>> files;
    for (size_t s = 0; s < e.stage_to_rank.size(); ++s) {
      if (e.stage_to_rank[s] != rank) continue;
      Assignment::StageFile* f = as->add_stages();
      f->set_stage(static_cast<int>(s));
      f->set_bytes(e.job.stage_file_bytes(static_cast<int>(s)));
      w.info.add_stages(static_cast<int>(s));
      files.emplace_back(static_cast<int>(s), artifacts_->StagePath(job_id, static_cast<int>(s)));
    }
    as->set_data_bytes(e.share_bytes[r]);
    tasks_.Run([this, channel = w.channel, a = std::move(a), files = std::move(files),
                share = artifacts_->SharePath(job_id, rank), stop = e.stop]() mutable {
      SendAssignment(std::move(channel), std::move(a), std::move(files), std::move(share), std::move(stop));
    });
  }
  log::Info("job={} placing on {}", job_id, absl::StrJoin(workers, ", "));
  Touch(e);
}

void Coordinator::SendAssignment(std::shared_ptr<WorkerChannel> channel, CoordinatorMessage assignment,
                                 std::vector<std::pair<int, std::string>> stage_files, std::string share_file,
                                 std::shared_ptr<std::atomic<bool>> stop) {
  const std::string job_id = assignment.assignment().job_id();
  const int rank = assignment.assignment().rank();
  if (!channel->Send(assignment)) return;  // the worker is gone; RemoveWorker fails the job
  const auto start = absl::Now();
  int64_t sent = 0;
  for (const auto& [stage, path] : stage_files) {
    const int64_t size = ArtifactStore::FileSize(path);
    int64_t offset = 0;
    absl::Status s = ArtifactStore::StreamFile(path, options_.chunk_bytes, [&](absl::string_view piece) {
      if (stop->load()) return false;
      offset += static_cast<int64_t>(piece.size());
      CoordinatorMessage m;
      StageChunk* c = m.mutable_stage();
      c->set_job_id(job_id);
      c->set_stage(stage);
      c->set_chunk(piece.data(), piece.size());
      c->set_last_chunk(offset == size);
      return channel->Send(m);
    });
    if (!s.ok()) {
      if (!absl::IsCancelled(s)) log::Error("job={} rank={} cannot send stage {}: {}", job_id, rank, stage, s.message());
      return;
    }
    sent += size;
  }
  const int64_t share_size = std::max<int64_t>(ArtifactStore::FileSize(share_file), 0);
  int64_t offset = 0;
  auto send_data = [&](absl::string_view piece) {
    if (stop->load()) return false;
    offset += static_cast<int64_t>(piece.size());
    CoordinatorMessage m;
    DataChunk* c = m.mutable_data();
    c->set_job_id(job_id);
    c->set_chunk(piece.data(), piece.size());
    c->set_last_chunk(offset == share_size);
    return channel->Send(m);
  };
  if (share_size == 0) {
    send_data("");
  } else {
    absl::Status s = ArtifactStore::StreamFile(share_file, options_.chunk_bytes, send_data);
    if (!s.ok()) {
      if (!absl::IsCancelled(s)) log::Error("job={} rank={} cannot send its data: {}", job_id, rank, s.message());
      return;
    }
  }
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
        reports.push_back(m.step());
        if (static_cast<int>(reports.size()) == e.ranks) {
          double busy = 0, step_s = 0, loss = 0;
          for (const auto& r : reports) {
            busy += r.busy_seconds();
            step_s = std::max(step_s, r.step_seconds());
            if (r.has_loss()) loss = r.loss();
          }
          e.job.set_step(m.step().step() + 1);
          if (e.job.spec().mode() == MODE_TRAIN) e.job.add_losses(loss);
          e.job.set_samples_per_second(step_s > 0 ? e.job.spec().batch_size() / step_s : 0);
          e.job.set_bubble_fraction(step_s > 0 ? std::max(0.0, 1.0 - busy / (e.ranks * step_s)) : 0);
          e.reports.erase(m.step().step());
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
  const std::string assembled = artifacts_->JobDir(job_id) + "/assembled.pt";
  absl::Status s;
  if (!artifacts_->ResultsComplete(job_id, inference ? -1 : stages)) {
    s = absl::DataLossError(inference ? "the last rank finished without sending all of its outputs"
                                      : "a rank finished without sending all of its trained stages");
  } else if (inference) {
    std::error_code ec;
    std::filesystem::rename(artifacts_->OutputsPath(job_id), assembled, ec);
    if (ec) s = absl::UnavailableError(absl::StrCat("cannot keep the outputs: ", ec.message()));
  } else {
    std::map<int, std::string> results;
    for (int st = 0; st < stages; ++st) results[st] = artifacts_->ResultPath(job_id, st);
    absl::MutexLock one_model(&model_mu_);
    s = partition::MergeStagesIntoModel(artifacts_->ModelPath(job_id), results, assembled);
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
