#include "coordinator/job_run.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status.h"
#include "pipeline/job/job_plan.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/layout.h"
#include "proto/job_state.h"

namespace pippy::coordinator {
namespace {

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

std::shared_ptr<RequestQueue> MakeServingQueue(const Job& job) {
  const ServingSpec& sv = job.spec().serving();
  if (sv.has_generation()) {
    GenerationQueue::Options o;
    o.job_id = job.job_id();
    o.max_inflight = sv.max_inflight() > 0 ? sv.max_inflight() : std::max(1, job.plan().stages_size());
    o.max_batch = std::max(1, sv.max_batch());
    o.max_slots = std::max(1, sv.generation().max_slots());
    o.max_seq = std::max(1, sv.generation().max_seq());
    o.prefill_chunk = std::max(1, sv.generation().prefill_chunk());
    o.vocab = job::VocabularyOf(job.plan());
    if (sv.max_queued() > 0) o.max_queued = sv.max_queued();
    return std::make_shared<GenerationQueue>(o);
  }
  ServingQueue::Options o;
  o.job_id = job.job_id();
  if (sv.max_queued() > 0) o.max_queued = sv.max_queued();
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

}  // namespace

JobRun::JobRun(Stores stores, Job job, JobLayout layout) : stores_(stores), job_(std::move(job)) {
  SetLayout(std::move(layout));
  if (job_.losses_size() > 0) job_.set_last_loss(job_.losses(job_.losses_size() - 1));
  // A job being prepared has no plan yet: its queue comes with it (Prepared).
  if (job_.spec().has_serving() && !IsTerminal(job_.state()) && job_.plan().stages_size() > 0) {
    serving_ = MakeServingQueue(job_);
  }
}

void JobRun::SetLayout(JobLayout layout) {
  layout_ = std::move(layout);
  rank_memory_.clear();
  for (int g = 0; g < ranks(); ++g) rank_memory_.push_back(layout_.ranks(g % ranks_per_replica()).memory_bytes());
  job_.set_num_stages(job_.plan().stages_size());  // records of older coordinators lack it
  if (layout_.has_dataset()) {
    const DatasetLayout& d = layout_.dataset();
    DatasetSummary* summary = job_.mutable_dataset();
    summary->set_samples(d.samples());
    summary->set_steps_per_epoch(d.steps_per_epoch());
    summary->set_epochs(d.epochs());
    summary->set_shards(d.shards_size());
    summary->set_tokens(d.tokens());
  }
}

JobRun::JobRun(Stores stores, Job job, JobLayout layout, std::vector<int64_t> share_bytes,
               std::vector<int64_t> stage_bytes)
    : JobRun(stores, std::move(job), JobLayout()) {
  Prepared(job_.spec(), job_.plan(), std::move(layout), std::move(share_bytes), std::move(stage_bytes));
}

std::unique_ptr<JobRun> JobRun::Preparing(Stores stores, Job job) {
  job.set_state(PARTITIONING);
  std::unique_ptr<JobRun> run(new JobRun(stores, std::move(job), JobLayout()));
  run->Touch();
  return run;
}

void JobRun::Prepared(JobSpec spec, PipelinePlan plan, JobLayout layout, std::vector<int64_t> share_bytes,
                      std::vector<int64_t> stage_bytes) {
  *job_.mutable_spec() = std::move(spec);
  *job_.mutable_plan() = std::move(plan);
  SetLayout(std::move(layout));
  if (job_.spec().has_serving() && serving_ == nullptr) serving_ = MakeServingQueue(job_);
  share_bytes_ = std::move(share_bytes);
  stage_files_ready_ = true;
  job_.set_state(QUEUED);
  job_.clear_stage_file_bytes();
  for (int64_t n : stage_bytes) job_.add_stage_file_bytes(n);
  job_.clear_stage_ranks();
  if (layout_.ranks_size() > 0) {
    for (int r : layout_.ranks(0).stage_to_rank()) job_.add_stage_ranks(r);
  }
  absl::Status saved = stores_.records->PutLayout(id(), layout_);
  if (!saved.ok()) log::Warn("job={} layout not saved (a restart cannot resume it): {}", id(), saved.message());
  Touch();
}

std::unique_ptr<JobRun> JobRun::Restore(Stores stores, const Job& record, absl::StatusOr<JobLayout> layout,
                                        Restored* restored) {
  std::unique_ptr<JobRun> run(new JobRun(stores, record, layout.ok() ? *layout : JobLayout()));
  *restored = Restored::kEnded;
  if (IsTerminal(record.state())) return run;
  const std::string& id = record.job_id();
  ArtifactStore& files = *stores.artifacts;
  for (int r = 0; r < run->ranks_per_replica(); ++r) {
    run->share_bytes_.push_back(std::max<int64_t>(0, ArtifactStore::FileSize(files.SharePath(id, r))));
  }
  const int stages = run->stage_files();
  bool stage_files = run->ranks() > 0;
  for (int st = 0; stage_files && st < stages; ++st) stage_files = ArtifactStore::FileSize(files.StagePath(id, st)) > 0;
  const int ckpt = record.checkpoint_step();
  bool checkpoint = ckpt > 0;
  for (int st = 0; checkpoint && st < stages; ++st) {
    checkpoint = ArtifactStore::FileSize(files.CheckpointStagePath(id, ckpt, st)) > 0;
  }
  for (int r = 0; checkpoint && r < run->ranks(); ++r) {
    checkpoint = ArtifactStore::FileSize(files.CheckpointStatePath(id, ckpt, r)) > 0;
  }
  // Pieces of checkpoints that were never committed go; the committed one stays.
  files.RemoveCheckpoints(id, [ckpt](int step) { return step != ckpt; });
  run->stage_files_ready_ = stage_files;
  const std::string was = JobState_Name(record.state());
  std::string failed;
  if (record.state() == PARTITIONING && ArtifactStore::FileSize(files.JobDir(id) + "/model.pt") > 0) {
    // A detached submission the coordinator stopped preparing: its upload is whole (it
    // was moved to the job's folder only once complete); prepared again.
    *restored = Restored::kPreparing;
    run->AddEvent("the coordinator restarted while preparing the job; preparing it again");
  } else if (!layout.ok()) {
    failed = absl::StrCat("the coordinator restarted and the job's layout is not in its records (",
                          layout.status().message(), ")");
  } else if (record.state() == QUEUED) {
    if (stage_files) {
      *restored = Restored::kQueued;
      run->AddEvent("the coordinator restarted; the job is queued again");
    } else {
      failed = "the coordinator restarted while the job was QUEUED and its stage files are missing";
    }
  } else if (record.state() == PARTITIONING) {
    failed = "the coordinator restarted while the job's stages were being sent (they were only in memory)";
  } else if (ckpt > 0 && !checkpoint) {
    failed = absl::StrCat("the coordinator restarted while the job was ", was, " and its checkpoint after step ", ckpt,
                          " is incomplete on disk");
  } else if (!stage_files && ckpt == 0) {
    failed = absl::StrCat("the coordinator restarted while the job was ", was, " before its stage files were written");
  } else {
    // Placed, running or recovering: resume from the checkpoint once workers are back.
    Job& j = run->job_;
    j.set_state(RECOVERING);
    j.set_attempt(record.attempt() + 1);
    j.set_step(ckpt);
    j.mutable_losses()->Truncate(std::min(j.losses_size(), ckpt));
    j.mutable_learning_rates()->Truncate(std::min(j.learning_rates_size(), ckpt));
    j.mutable_step_seconds()->Truncate(std::min(j.step_seconds_size(), ckpt));
    j.clear_breakdown();
    run->recover_deadline_ = absl::Now() + absl::Seconds(record.spec().fault_tolerance().recovery_timeout_s());
    *restored = Restored::kRecovering;
    run->AddEvent(absl::StrCat("the coordinator restarted while the job was ", was, "; resuming from step ", ckpt,
                               " once ", run->ranks(), " workers are idle"));
  }
  if (!failed.empty()) {
    run->job_.set_state(FAILED);
    run->job_.set_reason(absl::StrCat(failed, "; submit it again"));
    run->serving_.reset();
    files.RemoveJobFiles(id);
  }
  run->Touch();
  return run;
}

Job JobRun::View() const {
  if (serving_ == nullptr) return job_;
  Job j = job_;
  *j.mutable_serving() = serving_->Stats();
  return j;
}

Job JobRun::Summary() const {
  Job j = View();
  j.clear_plan();
  j.clear_losses();
  if (j.learning_rates_size() > 1) {  // the last one only
    const double last = j.learning_rates(j.learning_rates_size() - 1);
    j.clear_learning_rates();
    j.add_learning_rates(last);
  }
  j.clear_step_seconds();
  if (j.evals_size() > 1) {  // the last one only
    const EvalPoint last = j.evals(j.evals_size() - 1);
    j.clear_evals();
    *j.add_evals() = last;
  }
  j.clear_history();
  j.clear_breakdown();
  j.clear_edges();
  return j;
}

bool JobRun::ended() const { return IsTerminal(job_.state()); }

std::vector<int> JobRun::StagesOfRank(int rank) const {
  return layout_.ranks_size() > 0 ? job::StagesOf(layout_.ranks(0), rank) : std::vector<int>();
}

void JobRun::AddEvent(const std::string& message) {
  JobEvent* ev = job_.add_history();
  ev->set_unix_ms(NowMs());
  ev->set_message(message);
  log::Info("job={} {}", id(), message);
}

void JobRun::Touch() {
  job_.set_updated_unix_ms(NowMs());
  job_.set_num_stages(job_.plan().stages_size());
  if (job_.losses_size() > 0) job_.set_last_loss(job_.losses(job_.losses_size() - 1));
  ++version_;
  absl::Status saved = stores_.records->Put(job_);
  // The in-memory record stays authoritative; a lost write only costs the record's
  // freshness after a restart, so it is logged, not fatal.
  if (!saved.ok()) log::Warn("job={} record not saved: {}", id(), saved.message());
}

StageWriter JobRun::StagesFromFiles(size_t chunk_bytes) const {
  ArtifactStore* files = stores_.artifacts;
  const std::string job_id = id();
  const int from = job_.checkpoint_step();
  return [files, job_id, from, chunk_bytes](int stage, const std::function<absl::Status(absl::string_view)>& sink) {
    const std::string path = from > 0 ? files->CheckpointStagePath(job_id, from, stage) : files->StagePath(job_id, stage);
    return ArtifactStore::StreamFile(path, chunk_bytes, sink);
  };
}

CoordinatorMessage JobRun::AssignmentFor(int global) const {
  const int rank = global % ranks_per_replica(), copy = global / ranks_per_replica();
  const int replica = copy / tensor_parallel(), tp_rank = copy % tensor_parallel();
  const RankLayout& piece = layout_.ranks(rank);
  CoordinatorMessage m;
  Assignment* as = m.mutable_assignment();
  as->set_job_id(id());
  *as->mutable_spec() = job_.spec();
  as->set_rank(rank);
  as->set_replica(replica);
  as->set_tp_rank(tp_rank);
  *as->mutable_layout() = piece;
  *as->mutable_plan() = job::PlanSlice(job_.plan(), piece, rank);
  const int from = job_.checkpoint_step();
  for (int s : job::StagesOf(piece, rank)) {
    Assignment::StageFile* f = as->add_stages();
    f->set_stage(s);
    // Known when the stage comes from a file; else the worker learns it as it comes.
    const int key = FileKey(s, tp_rank);
    if (from > 0) {
      f->set_bytes(std::max<int64_t>(0, ArtifactStore::FileSize(stores_.artifacts->CheckpointStagePath(id(), from, key))));
    } else if (key < job_.stage_file_bytes_size()) {
      f->set_bytes(job_.stage_file_bytes(key));
    }
  }
  as->set_data_bytes(share_bytes_[static_cast<size_t>(rank)]);
  as->set_attempt(job_.attempt());
  if (job_.spec().data().dataset().uploaded()) {
    for (const DatasetShard& shard : piece.dataset().shards()) as->add_dataset_file_bytes(shard.bytes());
  }
  if (from > 0) {
    // A restart from a checkpoint: its stages and the rank's training state.
    as->set_start_step(from);
    as->set_state_bytes(std::max<int64_t>(0, ArtifactStore::FileSize(stores_.artifacts->CheckpointStatePath(id(), from, global))));
  }
  return m;
}

std::vector<RankSend> JobRun::Place(const std::vector<PlacedWorker>& workers) {
  job_.set_state(PLACING);
  job_.clear_workers();
  channels_.clear();
  std::vector<RankSend> sends;
  const int from = job_.checkpoint_step();
  for (size_t g = 0; g < workers.size(); ++g) {
    const int global = static_cast<int>(g);
    const int rank = global % ranks_per_replica();
    job_.add_workers(workers[g].id);
    channels_.push_back(workers[g].channel);
    RankSend send;
    send.channel = workers[g].channel;
    send.assignment = AssignmentFor(global);
    send.stages = StagesOfRank(rank);
    const int tp_rank = (global / ranks_per_replica()) % tensor_parallel();
    for (int s : send.stages) send.stage_files.push_back(FileKey(s, tp_rank));
    send.share_file = stores_.artifacts->SharePath(id(), rank);
    if (from > 0) send.state_file = stores_.artifacts->CheckpointStatePath(id(), from, global);
    if (job_.spec().data().dataset().uploaded()) {
      for (const DatasetShard& shard : layout_.ranks(rank).dataset().shards()) send.dataset_files.push_back(shard.path());
    }
    send.stop = stop_;
    sends.push_back(std::move(send));
  }
  std::map<std::string, int> on_host;
  ranks_on_host_ = 1;
  for (const PlacedWorker& w : workers) ranks_on_host_ = std::max(ranks_on_host_, ++on_host[w.host]);
  calibration_.reset();
  calibration_steps_ = 0;
  if (const PlanChoice& c = job_.plan().choice();
      c.fallback().empty() && c.candidates_size() > 0 && c.candidates(0).stage_forward_us_size() > 0 &&
      job_.spec().mode() == MODE_TRAIN) {
    calibration_.emplace(c.candidates(0));
  }
  // The transport of each edge between ranks, from their workers' hosts and devices
  // (replica 0's; the replicas are placed alike).
  std::vector<job::RankPlace> places;
  for (int r = 0; r < ranks_per_replica() && r < static_cast<int>(workers.size()); ++r) {
    places.push_back({workers[static_cast<size_t>(r)].host, workers[static_cast<size_t>(r)].device});
  }
  job_.clear_edges();
  if (static_cast<int>(places.size()) == ranks_per_replica()) {
    for (StageEdge& e : job::WithTransports(layout_, places)) *job_.add_edges() = std::move(e);
  }
  std::vector<std::string> ids(job_.workers().begin(), job_.workers().end());
  log::Info("job={} placing on {}{}", id(), absl::StrJoin(ids, ", "),
            job_.attempt() > 0 ? absl::StrCat(" (attempt ", job_.attempt(), ", from step ", from, ")") : "");
  Touch();
  return sends;
}

bool JobRun::IsCurrent(int attempt) const {
  return !ended() && attempt == job_.attempt() && state() != RECOVERING;
}

void JobRun::OnAddress(const RankAddress& a, Outbox* out) {
  const int P = std::max(1, ranks_per_replica()), T = tensor_parallel();
  const int global = GlobalRank(a.replica(), a.tp_rank(), a.rank());
  addresses_[global] = a.ucx_address();
  gloo_addresses_[global] = a.gloo_address();
  tp_gloo_addresses_[global] = a.tp_gloo_address();
  if (static_cast<int>(addresses_.size()) != ranks()) return;
  // Each rank gets its pipeline's UCX addresses (its replica's, its shard's), its replica
  // group's (the same rank and shard in every replica) and its tensor-parallel group's
  // (the same rank and replica in every shard).
  for (int g = 0; g < ranks() && g < static_cast<int>(channels_.size()); ++g) {
    const int copy = g / P, rank = g % P, replica = copy / T, tp_rank = copy % T;
    CoordinatorMessage p;
    p.mutable_peers()->set_job_id(id());
    p.mutable_peers()->set_attempt(attempt());
    for (int k = 0; k < P; ++k) p.mutable_peers()->add_ucx_addresses(addresses_[copy * P + k]);
    if (layout_.replicas() > 1) {
      for (int k = 0; k < layout_.replicas(); ++k) {
        p.mutable_peers()->add_gloo_addresses(gloo_addresses_[GlobalRank(k, tp_rank, rank)]);
      }
    }
    if (T > 1) {
      for (int t = 0; t < T; ++t) p.mutable_peers()->add_tp_gloo_addresses(tp_gloo_addresses_[GlobalRank(replica, t, rank)]);
    }
    out->emplace_back(channels_[static_cast<size_t>(g)], p);
  }
  job_.set_state(serving_ != nullptr ? SERVING : RUNNING);
  if (serving_ != nullptr) StartServing();
  log::Info("job={} {}: {} ranks connected{}", id(), serving_ != nullptr ? "serving" : "running", ranks(),
            attempt() > 0 ? absl::StrCat(" (attempt ", attempt(), ", from step ", job_.checkpoint_step(), ")") : "");
  Touch();
}

void JobRun::StartServing() {
  std::vector<std::vector<int>> needs;
  for (const RankLayout& piece : layout_.ranks()) needs.emplace_back(piece.model_inputs().begin(), piece.model_inputs().end());
  const std::string job_id = id();
  const int attempt = job_.attempt();
  std::vector<std::shared_ptr<WorkerChannel>> channels = channels_;
  const int64_t max_output = serving_->MessageBudget();
  const size_t P = static_cast<size_t>(std::max(1, ranks_per_replica()));  // channels: T copies with tensor parallelism
  serving_->Start(attempt, std::move(needs),
                  [job_id, attempt, channels, max_output, P](const ServeBatch& batch,
                                                             const std::vector<std::string>& inputs) {
                    bool ok = true;
                    for (size_t r = 0; r < channels.size(); ++r) {
                      CoordinatorMessage m;
                      ServeBatch* b = m.mutable_serve();
                      *b = batch;
                      b->set_job_id(job_id);
                      b->set_attempt(attempt);
                      b->set_max_output_bytes(max_output);
                      if (r % P < inputs.size()) b->set_inputs(inputs[r % P]);
                      ok = channels[r]->Send(m) && ok;
                    }
                    return ok;
                  });
}

std::optional<CompletedStep> JobRun::OnStepReport(const StepReport& report) {
  const int P = std::max(1, ranks_per_replica());
  auto& reports = reports_[report.step()];
  reports[GlobalRank(report.replica(), report.tp_rank(), report.rank())] = report;  // a repeat replaces the earlier one
  if (static_cast<int>(reports.size()) != ranks()) return std::nullopt;
  CompletedStep done;
  done.samples = job_.spec().batch_size();
  double busy = 0, loss = 0;
  int losses = 0;
  double eval_sum = 0;
  int evals = 0;
  job_.clear_breakdown();
  const bool calibrating = calibration_.has_value() && report.step() >= 1 && report.step() <= kCalibrationSteps;
  for (const auto& [rank, r] : reports) {
    if (calibrating) {
      std::vector<autoplan::TimedCompute> actions;
      for (const TraceEvent& ev : r.events()) {
        if (ev.kind() == TRACE_COMPUTE) actions.push_back({ev.name(), static_cast<double>(ev.duration_us())});
      }
      calibration_->Add(actions);
    }
    busy += r.busy_seconds();
    done.seconds = std::max(done.seconds, r.step_seconds());
    if (r.has_loss()) {
      loss += r.loss();  // each replica's mean over its slice (its shards' alike); the step's is their mean
      ++losses;
    }
    if (r.has_eval_loss()) {  // each replica's last stage, on its slice: the mean of theirs
      eval_sum += r.eval_loss();
      ++evals;
    }
    StepBreakdown* b = job_.add_breakdown();
    *b = r.breakdown();
    b->set_rank(rank);
    b->set_replica(rank / P / tensor_parallel());
    b->set_tp_rank(rank / P % tensor_parallel());
    b->set_step_seconds(r.step_seconds());
    while (job_.peak_memory_bytes_size() <= rank) job_.add_peak_memory_bytes(0);
    job_.set_peak_memory_bytes(rank, std::max(job_.peak_memory_bytes(rank), r.breakdown().peak_memory_bytes()));
    for (const TraceEvent& ev : r.events()) {
      if (ev.kind() == TRACE_SEND) done.bytes_sent += ev.bytes();
      if (ev.kind() == TRACE_RECV) done.bytes_received += ev.bytes();
    }
  }
  if (calibrating) ++calibration_steps_;
  if (losses > 0) loss /= losses;
  job_.set_step(report.step() + 1);
  if (job_.spec().mode() == MODE_TRAIN) {
    job_.add_losses(loss);
    job_.add_learning_rates(report.lr());  // every rank's optimizer stepped with the same
    if (evals > 0) {
      EvalPoint* e = job_.add_evals();
      e->set_step(report.step() + 1);
      e->set_loss(eval_sum / evals);
    }
  }
  job_.add_step_seconds(done.seconds);
  job_.set_samples_per_second(done.seconds > 0 ? job_.spec().batch_size() / done.seconds : 0);
  job_.set_bubble_fraction(done.seconds > 0 ? std::max(0.0, 1.0 - busy / (ranks() * done.seconds)) : 0);
  traces_.Add(report.step(), std::move(reports));
  reports_.erase(report.step());
  Touch();
  return done;
}

std::optional<ActionFactors> JobRun::TakeCalibration() {
  if (!calibration_.has_value() || calibration_steps_ < kCalibrationSteps) return std::nullopt;
  std::optional<ActionFactors> f = calibration_->Factors(ranks_on_host_);
  calibration_.reset();
  return f;
}

JobRun::RankOutcome JobRun::OnRankFinished(const RankFinished& f, const std::string& worker_name) {
  const auto code = static_cast<absl::StatusCode>(f.code());
  const std::string what = absl::StrCat("rank ", f.rank(), layout_.replicas() > 1 ? absl::StrCat(" of replica ", f.replica()) : "",
                                        tensor_parallel() > 1 ? absl::StrCat(" (shard ", f.tp_rank(), ")") : "",
                                        " on worker ", worker_name, ": ", f.error());
  // A peer gone or silent: the job restarts (the lost worker, if it is lost, is
  // removed when its stream breaks or its heartbeats stop).
  if (!f.ok() && (code == absl::StatusCode::kUnavailable || code == absl::StatusCode::kDeadlineExceeded)) {
    return {RankOutcome::kRecover, what};
  }
  if (!f.ok()) return {RankOutcome::kFail, what};
  finished_.insert(GlobalRank(f.replica(), f.tp_rank(), f.rank()));
  if (static_cast<int>(finished_.size()) < ranks() || assembling_) return {};
  assembling_ = true;
  return {RankOutcome::kAssemble, ""};
}

std::optional<int> JobRun::CheckpointRank(const CheckpointChunk& c) const {
  if (c.attempt() != attempt() || state() != RUNNING || c.step() <= job_.checkpoint_step()) {
    return std::nullopt;  // an earlier attempt's, or the job ended
  }
  // Stages come from replica 0 (the replicas hold the same parameters); every rank's
  // training state (its own random generator) is kept.
  const int P = ranks_per_replica();
  const int global = GlobalRank(c.replica(), c.tp_rank(), c.rank());
  if (c.rank() < 0 || c.rank() >= P || c.replica() < 0 || c.tp_rank() < 0 || c.tp_rank() >= tensor_parallel() ||
      global >= ranks() || c.stage() < -1 ||
      c.stage() >= job_.plan().stages_size() || c.step() <= 0 || (c.stage() >= 0 && c.replica() != 0) ||
      c.step() > job_.spec().steps() || (c.step() == job_.spec().steps() && c.stage() >= 0)) {
    // (After the last step only the ranks' states come: the results are the stages.)
    log::Warn("job={} a checkpoint piece names rank {} stage {} step {}: ignored", id(), c.rank(), c.stage(), c.step());
    return std::nullopt;
  }
  return global;
}

bool JobRun::OnCheckpointPiece(const CheckpointChunk& c, int global) {
  if (!IsCurrent(c.attempt())) return false;
  auto& pieces = checkpoint_pieces_[c.step()];
  pieces.insert({c.stage() >= 0 ? 0 : global, c.stage() >= 0 ? FileKey(c.stage(), c.tp_rank()) : -1});
  const int stages = stage_files();
  if (c.step() == job_.spec().steps()) {
    // The state after the last step: committed with the results (CommitFinalCheckpoint).
    final_states_ready_ = static_cast<int>(pieces.size()) == ranks();
    return false;
  }
  if (static_cast<int>(pieces.size()) < stages + ranks() || c.step() <= job_.checkpoint_step()) return false;
  // Every stage and every rank's state arrived whole: commit (files durable first,
  // then the record names the step), and drop the earlier checkpoints.
  const auto start = absl::Now();
  absl::Status synced = stores_.artifacts->SyncCheckpoint(id(), c.step());
  if (!synced.ok()) {
    log::Warn("job={} checkpoint after step {} not committed: {}", id(), c.step(), synced.message());
    return false;
  }
  job_.set_checkpoint_step(c.step());
  checkpoint_time_ = absl::Now();
  Touch();
  const int kept = c.step();
  stores_.artifacts->RemoveCheckpoints(id(), [kept](int step) { return step < kept; });
  for (auto p = checkpoint_pieces_.begin(); p != checkpoint_pieces_.end();) {
    p = p->first <= kept ? checkpoint_pieces_.erase(p) : std::next(p);
  }
  log::Info("job={} checkpoint after step {} committed ({} files, synced in {})", id(), kept, stages + ranks(),
            absl::FormatDuration(absl::Now() - start));
  return true;
}

absl::Status JobRun::CommitFinalCheckpoint() {
  const int last = job_.spec().steps();
  if (!final_states_ready_ || job_.checkpoint_step() >= last) return absl::OkStatus();
  PIPPY_RETURN_IF_ERROR(stores_.artifacts->CheckpointFromResults(id(), last, stage_files()));
  job_.set_checkpoint_step(last);
  checkpoint_time_ = absl::Now();
  Touch();
  stores_.artifacts->RemoveCheckpoints(id(), [last](int step) { return step < last; });
  log::Info("job={} the state after its last step {} is kept as its checkpoint", id(), last);
  return absl::OkStatus();
}

void JobRun::Resumed(const Job& source, int step) {
  job_.set_checkpoint_step(step);
  job_.set_resumed_step(step);
  job_.set_step(step);
  auto copy = [step](const auto& from, auto* to) {
    to->Clear();
    for (int i = 0; i < step && i < from.size(); ++i) to->Add(from.Get(i));
  };
  copy(source.losses(), job_.mutable_losses());
  copy(source.learning_rates(), job_.mutable_learning_rates());
  copy(source.step_seconds(), job_.mutable_step_seconds());
  job_.clear_evals();
  for (const EvalPoint& e : source.evals()) {
    if (e.step() <= step) *job_.add_evals() = e;
  }
  AddEvent(absl::StrCat("resumed from ", source.job_id(), "'s checkpoint after step ", step, ": its parameters, "
                        "optimizer state and random generators; steps ", step, " to ", job_.spec().steps(), " to run"));
  Touch();
}

void JobRun::Finish(JobState state, const std::string& reason) {
  if (ended()) return;
  job_.set_state(state);
  job_.set_reason(reason);
  stop_->store(true);
  log::Info("job={} {}{}", id(), JobState_Name(state), reason.empty() ? "" : ": " + reason);
  if (serving_ != nullptr) {
    serving_->Stop(absl::UnavailableError(absl::StrCat("serving job ", id(), " ended (", JobState_Name(state),
                                                      reason.empty() ? "" : ": " + reason, ")")));
    // The final counts, the queued requests Stop failed included, go in the record:
    // what cancel answers is what status says later (and after a restart).
    *job_.mutable_serving() = serving_->Stats();
  }
  // A training job keeps its last checkpoint (and the model it merges into) until it is
  // deleted: pippyctl fetch --checkpoint, submit --resume-from.
  const bool keep = job_.spec().mode() == MODE_TRAIN && !job_.spec().has_serving() && job_.checkpoint_step() > 0;
  stores_.artifacts->RemoveJobFiles(id(), keep ? job_.checkpoint_step() : 0);
  if (job_.spec().data().dataset().uploaded()) stores_.artifacts->RemoveUploadedDataset(job_.spec().data().dataset().path());
  Touch();
}

void JobRun::Succeed() {
  job_.set_model_ready(true);
  Finish(SUCCEEDED, "");
}

bool JobRun::CanRestart() const { return job_.restarts() < job_.spec().fault_tolerance().max_restarts(); }

void JobRun::Recover(const std::string& what) {
  const FaultToleranceSpec& ft = job_.spec().fault_tolerance();
  const int from = job_.checkpoint_step();
  if (serving_ != nullptr) {
    // Requests in the pipeline are lost with it; queued ones wait for the restart.
    serving_->Pause(absl::UnavailableError(absl::StrCat("serving job ", id(), " lost its pipeline (", what,
                                                        "); it restarts on other workers: try again")));
  }
  job_.set_restarts(job_.restarts() + 1);
  job_.set_attempt(job_.attempt() + 1);
  // The stopped attempt's senders stop; the next attempt gets a flag of its own.
  stop_->store(true);
  stop_ = std::make_shared<std::atomic<bool>>(false);
  job_.set_state(RECOVERING);
  job_.set_step(from);
  job_.mutable_losses()->Truncate(std::min(job_.losses_size(), from));
  job_.mutable_learning_rates()->Truncate(std::min(job_.learning_rates_size(), from));
  job_.mutable_step_seconds()->Truncate(std::min(job_.step_seconds_size(), from));
  while (job_.evals_size() > 0 && job_.evals(job_.evals_size() - 1).step() > from) job_.mutable_evals()->RemoveLast();
  job_.clear_breakdown();
  channels_.clear();
  addresses_.clear();
  gloo_addresses_.clear();
  reports_.clear();
  finished_.clear();
  assembling_ = false;
  checkpoint_pieces_.clear();
  final_states_ready_ = false;
  recover_deadline_ = absl::Now() + absl::Seconds(ft.recovery_timeout_s());
  // Pieces of later checkpoints and results of this attempt are dropped (small file
  // work under the lock: a later attempt writes the same names).
  stores_.artifacts->RemoveCheckpoints(id(), [from](int step) { return step != from; });
  stores_.artifacts->ResetResults(id());
  AddEvent(absl::StrCat(what, "; restarting from step ", from, from > 0 ? " (the last checkpoint)" : " (no checkpoint yet)",
                        ", restart ", job_.restarts(), " of ", ft.max_restarts()));
  Touch();
}

absl::StatusOr<StepTrace> JobRun::Trace(int step, const std::function<std::string(int global_rank)>& worker_name) const {
  if (auto generation = std::dynamic_pointer_cast<GenerationQueue>(serving_)) return generation->Trace(id());
  StepTraces::Names names;
  names.worker = worker_name;
  names.stages = [this](int global) { return StagesOfRank(global % std::max(1, ranks_per_replica())); };
  return traces_.Get(id(), step, ended() && job_.step() == 0, names);
}

}  // namespace pippy::coordinator
