#include "coordinator/coordinator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "coordinator/job_validation.h"
#include "pipeline/partition/merge.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/stage/synthetic_data.h"

namespace pippy::coordinator {
namespace {

constexpr size_t kChunk = 1 << 20;

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

bool Terminal(JobState s) { return s == SUCCEEDED || s == FAILED || s == CANCELLED; }

std::string StagesOfRank(const Job& job, int rank) {
  auto kind = schedule::ParseScheduleKind(job.spec().schedule().name());  // validated at submission
  const int v = std::max(job.spec().schedule().stages_per_worker(), 1);
  const int stages = job.plan().stages_size();
  std::vector<int> placement = schedule::Placement(kind.ok() ? *kind : schedule::ScheduleKind::kGPipe, stages / v, stages);
  std::vector<std::string> out;
  for (int s = 0; s < stages; ++s) {
    if (placement[s] == rank) out.push_back(absl::StrCat(s));
  }
  return absl::StrJoin(out, ",");
}

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Create(const Options& options) {
  std::unique_ptr<Coordinator> c(new Coordinator(options));
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
        c->store_->Put(job).IgnoreError();
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
  store_->Put(entry.job).IgnoreError();
}

absl::StatusOr<std::string> Coordinator::SubmitJob(const JobSpec& spec, std::string model, std::string data) {
  if (data.empty() && !spec.data().synthetic().empty()) {
    auto made = stage::MakeSyntheticData(spec.data().synthetic());
    if (!made.ok()) return made.status();
    data = std::move(*made);
  }
  auto validated = ValidateJob(spec, model, data);
  if (!validated.ok()) return validated.status();
  {
    absl::MutexLock lock(&mu_);
    const int registered = static_cast<int>(workers_.size());
    // No workers yet: a cluster starting up; the job waits. Some, but too few: refuse.
    if (registered > 0 && validated->ranks > registered) {
      const int v = validated->spec.schedule().stages_per_worker();
      return absl::InvalidArgumentError(absl::StrCat(
          "split: the job needs ", validated->ranks, " workers (", validated->plan.stages_size(), " stages, ", v,
          " per worker) but only ", registered, " are registered; use fewer stages or more stages per worker "
          "(an interleaved schedule)"));
    }
  }
  Outbox out;
  std::string id;
  {
    absl::MutexLock lock(&mu_);
    id = absl::StrCat("job-", next_job_++);
    JobEntry entry;
    entry.job.set_job_id(id);
    *entry.job.mutable_spec() = validated->spec;
    *entry.job.mutable_plan() = validated->plan;
    entry.job.set_state(QUEUED);
    entry.job.set_created_unix_ms(NowMs());
    entry.job.set_model_bytes(static_cast<int64_t>(model.size()));
    entry.model = std::move(model);
    entry.data = std::move(data);
    entry.ranks = validated->ranks;
    Touch(entry);
    jobs_[id] = std::move(entry);
    queue_.push_back(id);
    log::Info("job={} queued: {} stages on {} workers, schedule {}", id, validated->plan.stages_size(),
              validated->ranks, validated->spec.schedule().name());
    Schedule(&out);
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

absl::StatusOr<std::string> Coordinator::TrainedModel(const std::string& job_id) {
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
    if (!it->second.job.model_ready()) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " has no trained model yet (state ",
                                                        JobState_Name(it->second.job.state()), ")"));
    }
  }
  return store_->GetModel(job_id);
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
    w.info.set_state("idle");
    w.info.set_last_heartbeat_unix_ms(NowMs());
    w.channel = channel;
    w.last_heartbeat = absl::Now();
    workers_[id] = w;
    CoordinatorMessage m;
    m.mutable_registered()->set_worker_id(id);
    out.emplace_back(channel, m);
    log::Info("worker {} ({}) registered", id, w.info.name());
    Schedule(&out);
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
                            StagesOfRank(job->second.job, info.rank()), ") ", why),
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
      w->second.info.set_state("idle");
      w->second.info.clear_job_id();
    }
  }
  e.model.clear();
  e.data.clear();
  Touch(e);
}

void Coordinator::Schedule(Outbox* out) {
  for (auto it = queue_.begin(); it != queue_.end();) {
    JobEntry& e = jobs_[*it];
    std::vector<std::string> idle;
    for (const auto& [id, w] : workers_) {
      if (w.info.state() == "idle") idle.push_back(id);
    }
    if (static_cast<int>(idle.size()) < e.ranks) {
      ++it;  // later jobs that fit may go first on the remaining workers
      continue;
    }
    idle.resize(e.ranks);
    it = queue_.erase(it);
    e.job.set_state(PARTITIONING);  // the plan was made at submission; nothing else to do here
    Touch(e);
    Place(e, idle, out);
  }
}

void Coordinator::Place(JobEntry& e, const std::vector<std::string>& workers, Outbox* out) {
  e.job.set_state(PLACING);
  e.job.clear_workers();
  for (size_t r = 0; r < workers.size(); ++r) {
    WorkerEntry& w = workers_[workers[r]];
    w.info.set_state("busy");
    w.info.set_job_id(e.job.job_id());
    w.info.set_rank(static_cast<int>(r));
    e.job.add_workers(workers[r]);
    CoordinatorMessage a;
    Assignment* as = a.mutable_assignment();
    as->set_job_id(e.job.job_id());
    *as->mutable_spec() = e.job.spec();
    as->set_rank(static_cast<int>(r));
    as->set_world_size(static_cast<int>(workers.size()));
    *as->mutable_plan() = e.job.plan();
    as->set_model_bytes(static_cast<int64_t>(e.model.size()));
    as->set_data_bytes(static_cast<int64_t>(e.data.size()));
    out->emplace_back(w.channel, a);
    for (bool model : {true, false}) {
      const std::string& bytes = model ? e.model : e.data;
      for (size_t off = 0; off < bytes.size() || off == 0; off += kChunk) {
        CoordinatorMessage c;
        DataChunk* d = c.mutable_data();
        d->set_job_id(e.job.job_id());
        d->set_model(model);
        d->set_chunk(bytes.substr(off, kChunk));
        d->set_last_chunk(off + kChunk >= bytes.size());
        out->emplace_back(w.channel, c);
        if (bytes.empty()) break;
      }
    }
  }
  log::Info("job={} placing on {}", e.job.job_id(), absl::StrJoin(workers, ", "));
  Touch(e);
}

void Coordinator::OnWorkerMessage(const std::string& worker_id, const WorkerMessage& m) {
  Outbox out;
  {
    absl::MutexLock lock(&mu_);
    auto w = workers_.find(worker_id);
    if (w == workers_.end()) return;
    w->second.last_heartbeat = absl::Now();
    w->second.info.set_last_heartbeat_unix_ms(NowMs());
    std::string job_id;
    if (m.has_address()) job_id = m.address().job_id();
    if (m.has_step()) job_id = m.step().job_id();
    if (m.has_stage_result()) job_id = m.stage_result().job_id();
    if (m.has_finished()) job_id = m.finished().job_id();
    auto jit = job_id.empty() ? jobs_.end() : jobs_.find(job_id);
    if (m.has_finished() && w->second.info.job_id() == job_id) {
      w->second.info.set_state("idle");
      w->second.info.clear_job_id();
    }
    if (jit != jobs_.end() && !Terminal(jit->second.job.state())) {
      JobEntry& e = jit->second;
      if (m.has_address()) {
        e.addresses[m.address().rank()] = m.address().ucx_address();
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
          if (e.job.spec().mode() == "train") e.job.add_losses(loss);
          e.job.set_samples_per_second(step_s > 0 ? e.job.spec().batch_size() / step_s : 0);
          e.job.set_bubble_fraction(step_s > 0 ? std::max(0.0, 1.0 - busy / (e.ranks * step_s)) : 0);
          e.reports.erase(m.step().step());
          Touch(e);
        }
      } else if (m.has_stage_result()) {
        e.stage_bytes[m.stage_result().stage()] += m.stage_result().chunk();
      } else if (m.has_finished()) {
        if (!m.finished().ok()) {
          Finish(e, FAILED, absl::StrCat("rank ", m.finished().rank(), " on worker ", w->second.info.name(), ": ",
                                         m.finished().error()),
                 &out);
        } else {
          e.finished[m.finished().rank()] = true;
          if (static_cast<int>(e.finished.size()) == e.ranks) OnStageDone(e, &out);
        }
      }
    }
  }
  Deliver(&out);
}

void Coordinator::OnStageDone(JobEntry& e, Outbox* out) {
  if (e.job.spec().mode() == "inference") {
    // The last stage's rank sent the outputs as stage -1.
    absl::Status s = store_->PutModel(e.job.job_id(), e.stage_bytes[-1]);
    if (!s.ok()) return Finish(e, FAILED, std::string(s.message()), out);
    e.job.set_model_ready(true);
  } else {
    auto merged = partition::MergeStagesIntoModel(e.model, e.stage_bytes);
    if (!merged.ok()) return Finish(e, FAILED, std::string(merged.status().message()), out);
    absl::Status s = store_->PutModel(e.job.job_id(), *merged);
    if (!s.ok()) return Finish(e, FAILED, std::string(s.message()), out);
    e.job.set_model_ready(true);
  }
  e.stage_bytes.clear();
  Finish(e, SUCCEEDED, "", out);
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
      Schedule(&out);
    }
    Deliver(&out);
    for (const auto& [id, why] : dead) RemoveWorker(id, why);
  }
}

}  // namespace pippy::coordinator
