#include "coordinator/grpc_service.h"

#include <deque>
#include <filesystem>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "coordinator/artifact_store.h"
#include "proto/job_state.h"

namespace pippy::coordinator {
namespace {

// A worker's stream as seen by the logic; writes stop when the handler returns. Sends
// from several threads (file senders, the logic) are serialised: gRPC allows one
// outstanding write per stream.
class StreamChannel : public WorkerChannel {
 public:
  explicit StreamChannel(grpc::ServerReaderWriter<CoordinatorMessage, WorkerMessage>* s) : stream_(s) {}
  bool Send(const CoordinatorMessage& m) override {
    absl::MutexLock lock(&mu_);
    return stream_ != nullptr && stream_->Write(m);
  }
  void Close() {
    absl::MutexLock lock(&mu_);
    stream_ = nullptr;
  }

 private:
  absl::Mutex mu_;
  grpc::ServerReaderWriter<CoordinatorMessage, WorkerMessage>* stream_ ABSL_GUARDED_BY(mu_);
};

// Cancels a call that has not moved for `limit` (Touch() is the movement): a client
// that opened an upload or a download and went quiet cannot hold its handler thread
// and its stream slot forever. limit 0: never.
class IdleWatch {
 public:
  IdleWatch(grpc::ServerContext* context, absl::Duration limit) : last_(absl::Now()) {
    if (limit <= absl::ZeroDuration()) return;
    thread_ = std::thread([this, context, limit] {
      absl::MutexLock lock(&mu_);
      while (!done_) {
        const absl::Duration left = last_ + limit - absl::Now();
        if (left <= absl::ZeroDuration()) {
          fired_ = true;
          context->TryCancel();
          return;
        }
        mu_.AwaitWithTimeout(absl::Condition(&done_), left);
      }
    });
  }
  ~IdleWatch() {
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
    }
    if (thread_.joinable()) thread_.join();
  }
  void Touch() {
    absl::MutexLock lock(&mu_);
    last_ = absl::Now();
  }
  bool fired() {
    absl::MutexLock lock(&mu_);
    return fired_;
  }

 private:
  absl::Mutex mu_;
  absl::Time last_ ABSL_GUARDED_BY(mu_);
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

grpc::Status IdleError(const char* what, grpc::ServerContext* context, absl::Duration limit) {
  log::Warn("{} from {}: nothing moved for {}; cancelled (--stream-idle-timeout-s)", what, context->peer(),
            absl::FormatDuration(limit));
  return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                      absl::StrCat(what, ": nothing moved for ", absl::FormatDuration(limit),
                                   " (--stream-idle-timeout-s); the stream was cancelled"));
}

ProgressEvent EventOf(const Job& job) {
  ProgressEvent e;
  e.set_job_id(job.job_id());
  e.set_state(job.state());
  e.set_step(job.step());
  e.set_steps(job.spec().steps());
  if (job.losses_size() > 0) e.set_loss(job.losses(job.losses_size() - 1));
  if (job.learning_rates_size() > 0) e.set_lr(job.learning_rates(job.learning_rates_size() - 1));
  if (job.evals_size() > 0) {
    e.set_eval_loss(job.evals(job.evals_size() - 1).loss());
    e.set_eval_step(job.evals(job.evals_size() - 1).step());
  }
  e.set_samples_per_second(job.samples_per_second());
  e.set_bubble_fraction(job.bubble_fraction());
  // Why it ended, or else the latest event (a worker lost, a restart).
  e.set_message(!job.reason().empty() || job.history().empty() ? job.reason()
                                                                : job.history(job.history_size() - 1).message());
  return e;
}

}  // namespace

absl::StatusOr<std::string> CoordinatorGrpc::Authenticate(grpc::ServerContext* context) const {
  if (auth_ == nullptr) return std::string();
  std::string header;
  auto it = context->client_metadata().find("authorization");
  if (it != context->client_metadata().end()) header.assign(it->second.data(), it->second.size());
  auto user = auth_->UserOf(header);
  if (!user.ok()) log::Warn("refused a call from {}: {}", context->peer(), user.status().message());
  return user;
}

absl::StatusOr<std::shared_ptr<void>> CoordinatorGrpc::TakeStream(const char* what) {
  if (limits_.max_concurrent_streams <= 0) return std::shared_ptr<void>();
  if (streams_.fetch_add(1) >= limits_.max_concurrent_streams) {
    streams_.fetch_sub(1);
    return absl::ResourceExhaustedError(absl::StrCat(what, ": ", limits_.max_concurrent_streams,
                                                     " uploads and downloads already run (--max-concurrent-streams); "
                                                     "try again shortly"));
  }
  return std::shared_ptr<void>(nullptr, [this](void*) { streams_.fetch_sub(1); });
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(static_cast<int>(s.code())), std::string(s.message()));
}

grpc::Status CoordinatorGrpc::SubmitJob(grpc::ServerContext* context, grpc::ServerReader<SubmitJobRequest>* reader,
                                        SubmitJobResponse* response) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  SubmitJobRequest req;
  if (!reader->Read(&req) || !req.has_spec()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "spec: the first message of SubmitJob must be the job spec");
  }
  JobSpec spec = req.spec();
  const bool detach = req.detach();
  auto stream = TakeStream("SubmitJob");
  if (!stream.ok()) return ToGrpc(stream.status());
  // The chunks go to disk as they arrive: no copy of the model is held here.
  const absl::Time start = absl::Now();
  auto upload = logic_->NewUpload();
  if (!upload.ok()) return ToGrpc(upload.status());
  bool data_started = false;
  // Watches the upload only: preparing the job afterwards has deadlines of its own.
  auto idle = std::make_unique<IdleWatch>(context, limits_.stream_idle_timeout);
  while (reader->Read(&req)) {
    idle->Touch();
    absl::Status s;
    if (req.has_model_chunk()) {
      if (data_started) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "model: send the model's chunks before the data's");
      }
      s = (*upload)->AppendModel(req.model_chunk());
      if (s.ok() && limits_.max_model_bytes > 0 && (*upload)->model_bytes() > limits_.max_model_bytes) {
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat("model: larger than the coordinator's limit of ", limits_.max_model_bytes >> 20,
                                         " MiB (--max-model-mib raises it)"));
      }
    } else if (req.has_dataset_file()) {
      if (!spec.data().dataset().uploaded()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "data.dataset: shards were sent, but data.dataset.uploaded is not set");
      }
      data_started = true;
      const DatasetFileChunk& f = req.dataset_file();
      s = (*upload)->AppendDatasetFile(f.name(), f.chunk(), f.last_chunk());
      if (s.ok() && limits_.max_dataset_bytes > 0 && (*upload)->dataset_bytes() > limits_.max_dataset_bytes) {
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat("data.dataset: the uploaded dataset is larger than the coordinator's limit of ",
                                         limits_.max_dataset_bytes >> 30,
                                         " GiB (--max-dataset-upload-gib raises it; or put it on a path the workers "
                                         "share, without --dataset-upload)"));
      }
    } else if (req.has_data_chunk()) {
      data_started = true;
      s = (*upload)->AppendData(req.data_chunk());
      if (s.ok() && limits_.max_data_bytes > 0 && (*upload)->data_bytes() > limits_.max_data_bytes) {
        return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat("data: larger than the coordinator's limit of ", limits_.max_data_bytes >> 20,
                                         " MiB (--max-data-mib raises it)"));
      }
    } else {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "spec: sent twice; send it once, first");
    }
    if (!s.ok()) return ToGrpc(s);
  }
  if (idle->fired()) return IdleError("SubmitJob", context, limits_.stream_idle_timeout);
  idle.reset();
  if (spec.data().dataset().uploaded()) {
    if ((*upload)->dataset_files() == 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "data.dataset: data.dataset.uploaded is set but no shard came (DatasetFileChunk)");
    }
    // The coordinator's copy is the dataset the job reads; where the client read it
    // stays for display.
    DatasetSpec* ds = spec.mutable_data()->mutable_dataset();
    if (ds->uploaded_from().empty()) ds->set_uploaded_from(ds->path());
    std::error_code ec;
    ds->set_path(std::filesystem::absolute((*upload)->dataset_dir(), ec).lexically_normal().string());
  }
  // The upload is over: its slot of --max-concurrent-streams is free for the next one
  // while this submission is prepared.
  stream->reset();
  log::Info("received a submission: model {} bytes, data {} bytes in {}", (*upload)->model_bytes(),
            (*upload)->data_bytes(), absl::FormatDuration(absl::Now() - start));
  std::vector<std::string> notices;
  auto id = logic_->SubmitJob(spec, std::move(*upload), *user, &notices, detach);
  if (!id.ok()) return ToGrpc(id.status());
  response->set_job_id(*id);
  for (std::string& n : notices) response->add_notices(std::move(n));
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpc::GetJob(grpc::ServerContext* context, const GetJobRequest* request, Job* response) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  if (request->job_id().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: missing");
  auto job = logic_->GetJob(request->job_id());
  if (!job.ok()) return ToGrpc(job.status());
  *response = *job;
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpc::ListJobs(grpc::ServerContext* context, const ListJobsRequest* request,
                                       ListJobsResponse* response) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  auto page = logic_->ListJobs(*request);
  if (!page.ok()) return ToGrpc(page.status());
  *response = std::move(*page);
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpc::DeleteJob(grpc::ServerContext* context, const DeleteJobRequest* request,
                                        DeleteJobResponse*) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  if (request->job_id().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job_id: missing");
  return ToGrpc(logic_->DeleteJob(request->job_id(), *user));
}

grpc::Status CoordinatorGrpc::WatchJob(grpc::ServerContext* context, const WatchJobRequest* request,
                                       grpc::ServerWriter<ProgressEvent>* writer) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  int64_t version = -1;
  while (!context->IsCancelled()) {
    int64_t before = version;
    auto job = logic_->WaitForChange(request->job_id(), &version, absl::Seconds(1));
    if (!job.ok()) return ToGrpc(job.status());
    if (version != before && !writer->Write(EventOf(*job))) break;
    if (IsTerminal(job->state())) break;
  }
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpc::CancelJob(grpc::ServerContext* context, const CancelJobRequest* request, Job* response) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  auto job = logic_->CancelJob(request->job_id(), *user);
  if (!job.ok()) return ToGrpc(job.status());
  *response = *job;
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpc::FetchModel(grpc::ServerContext* context, const FetchModelRequest* request,
                                         grpc::ServerWriter<ModelChunk>* writer) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  auto stream = TakeStream("FetchModel");
  if (!stream.ok()) return ToGrpc(stream.status());
  auto path = request->checkpoint() ? logic_->CheckpointPath(request->job_id(), *user)
                                    : logic_->ResultPath(request->job_id());
  if (!path.ok()) return ToGrpc(path.status());
  constexpr size_t kChunk = 1 << 20;
  IdleWatch idle(context, limits_.stream_idle_timeout);
  absl::Status sent = ArtifactStore::StreamFile(*path, kChunk, [&](absl::string_view piece) {
    ModelChunk c;
    c.set_data(piece.data(), piece.size());
    if (!writer->Write(c)) return absl::CancelledError("the client stopped reading");
    idle.Touch();
    return absl::OkStatus();
  });
  if (idle.fired()) return IdleError("FetchModel", context, limits_.stream_idle_timeout);
  return ToGrpc(sent);
}

grpc::Status CoordinatorGrpc::ListWorkers(grpc::ServerContext* context, const ListWorkersRequest*,
                                          ListWorkersResponse* response) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  for (WorkerInfo& w : logic_->ListWorkers()) *response->add_workers() = std::move(w);
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpc::GetTrace(grpc::ServerContext* context, const GetTraceRequest* request, StepTrace* response) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  auto trace = logic_->GetTrace(request->job_id(), request->step());
  if (!trace.ok()) return ToGrpc(trace.status());
  *response = std::move(*trace);
  return grpc::Status::OK;
}

namespace {

InferResponse ResponseOf(const std::string& request_id, ServingQueue::Answer a) {
  InferResponse r;
  r.set_request_id(request_id);
  r.set_code(static_cast<int>(a.status.code()));
  r.set_error(std::string(a.status.message()));
  r.set_output(std::move(a.output));
  r.set_rows(a.rows);
  r.set_queue_ms(a.queue_ms);
  r.set_pipeline_ms(a.pipeline_ms);
  r.set_microbatch_rows(a.microbatch_rows);
  return r;
}

}  // namespace

grpc::Status CoordinatorGrpc::Infer(grpc::ServerContext* context, const InferRequest* request,
                                    InferResponse* response) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  if (request->job().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job: missing (an id or a name)");
  struct Wait {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    ServingQueue::Answer answer ABSL_GUARDED_BY(mu);
  };
  auto wait = std::make_shared<Wait>();
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  absl::Status queued = logic_->Infer(
      request->job(), request->input(),
      [wait](ServingQueue::Answer a) {
        absl::MutexLock lock(&wait->mu);
        wait->answer = std::move(a);
        wait->done = true;
      },
      cancelled);
  if (!queued.ok()) return ToGrpc(queued);
  absl::MutexLock lock(&wait->mu);
  // Every request is answered (the job's end fails what is left); the client's cancel
  // or deadline ends the wait sooner, and the request is dropped if it has not left.
  while (!wait->mu.AwaitWithTimeout(absl::Condition(&wait->done), absl::Milliseconds(100))) {
    if (context->IsCancelled()) {
      cancelled->store(true);
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
    }
  }
  if (!wait->answer.status.ok()) return ToGrpc(wait->answer.status);
  *response = ResponseOf(request->request_id(), std::move(wait->answer));
  return grpc::Status::OK;
}

grpc::Status CoordinatorGrpc::InferStream(grpc::ServerContext* context,
                                          grpc::ServerReaderWriter<InferResponse, InferRequest>* stream) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  struct Out {
    absl::Mutex mu;
    std::deque<InferResponse> ready ABSL_GUARDED_BY(mu);
    int outstanding ABSL_GUARDED_BY(mu) = 0;  // queued requests not yet answered
    bool reading ABSL_GUARDED_BY(mu) = true;
  };
  auto out = std::make_shared<Out>();
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  std::thread writer([out, stream, context, cancelled] {
    while (true) {
      InferResponse r;
      {
        absl::MutexLock lock(&out->mu);
        auto ready = [&out]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(out->mu) {
          return !out->ready.empty() || (!out->reading && out->outstanding == 0);
        };
        if (!out->mu.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(100))) {
          if (context->IsCancelled()) {
            cancelled->store(true);  // the stream's requests still waiting are dropped
            return;
          }
          continue;
        }
        if (out->ready.empty()) return;  // all read and answered
        r = std::move(out->ready.front());
        out->ready.pop_front();
      }
      if (!stream->Write(r)) return;
    }
  });
  InferRequest req;
  while (stream->Read(&req)) {
    {
      absl::MutexLock lock(&out->mu);
      ++out->outstanding;
    }
    const std::string id = req.request_id();
    auto answer = [out, id](ServingQueue::Answer a) {
      InferResponse r = ResponseOf(id, std::move(a));
      absl::MutexLock lock(&out->mu);
      out->ready.push_back(std::move(r));
      --out->outstanding;
    };
    absl::Status queued = req.job().empty() ? absl::InvalidArgumentError("job: missing (an id or a name)")
                                            : logic_->Infer(req.job(), std::move(*req.mutable_input()), answer,
                                                            cancelled);
    if (!queued.ok()) answer(ServingQueue::Answer{queued});
  }
  {
    absl::MutexLock lock(&out->mu);
    out->reading = false;
  }
  writer.join();
  return context->IsCancelled() ? grpc::Status(grpc::StatusCode::CANCELLED, "the client went away") : grpc::Status::OK;
}

grpc::Status CoordinatorGrpc::Generate(grpc::ServerContext* context, const GenerateRequest* request,
                                       grpc::ServerWriter<GenerateResponse>* writer) {
  auto user = Authenticate(context);
  if (!user.ok()) return ToGrpc(user.status());
  if (request->job().empty()) return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "job: missing (an id or a name)");
  GenerationQueue::Request r;
  if (!request->prompt().empty()) {
    if (request->tokens_size() > 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "prompt: give tokens or prompt bytes, not both");
    }
    absl::StatusOr<std::vector<int64_t>> prompt = GenerationQueue::ParsePrompt(request->prompt());
    if (!prompt.ok()) return ToGrpc(prompt.status());
    r.prompt = std::move(*prompt);
  } else {
    r.prompt.assign(request->tokens().begin(), request->tokens().end());
  }
  if (request->max_new_tokens() < 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        absl::StrCat("max_new_tokens: must not be negative (0: ", r.max_new_tokens, ")"));
  }
  if (request->max_new_tokens() > 0) r.max_new_tokens = request->max_new_tokens();  // else Request's default
  r.temperature = request->temperature();
  r.top_k = request->top_k();
  r.top_p = request->top_p();
  std::random_device entropy;
  r.seed = request->has_seed() ? request->seed() : (uint64_t{entropy()} << 32) ^ entropy();
  r.stop_tokens.assign(request->stop_tokens().begin(), request->stop_tokens().end());
  const uint64_t seed = r.seed;
  const int prompt_tokens = static_cast<int>(r.prompt.size());
  struct Out {
    absl::Mutex mu;
    std::deque<GenerationQueue::Event> events ABSL_GUARDED_BY(mu);
  };
  auto out = std::make_shared<Out>();
  auto cancelled = std::make_shared<std::atomic<bool>>(false);
  absl::Status queued = logic_->Generate(
      request->job(), std::move(r),
      [out](GenerationQueue::Event e) {
        absl::MutexLock lock(&out->mu);
        out->events.push_back(std::move(e));
      },
      cancelled);
  if (!queued.ok()) return ToGrpc(queued);
  bool first = true;
  // Every sequence ends (the job's end fails what is left); the client's cancel or
  // deadline ends it sooner and frees its slot.
  while (true) {
    std::deque<GenerationQueue::Event> events;
    {
      absl::MutexLock lock(&out->mu);
      auto ready = [&out]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(out->mu) { return !out->events.empty(); };
      if (!out->mu.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(100))) {
        if (context->IsCancelled()) {
          cancelled->store(true);
          return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
        }
        continue;
      }
      events.swap(out->events);
    }
    // Tokens that came together go in one response.
    GenerateResponse resp;
    resp.set_request_id(request->request_id());
    resp.set_prompt_tokens(prompt_tokens);
    if (first) resp.set_seed(seed);
    for (GenerationQueue::Event& e : events) {
      for (int64_t t : e.tokens) resp.add_tokens(t);
      resp.set_generated_tokens(e.generated);
      if (e.ttft_ms >= 0) resp.set_ttft_ms(e.ttft_ms);
      if (!e.status.ok()) {
        if (resp.tokens_size() > 0) writer->Write(resp);
        return ToGrpc(e.status);
      }
      if (e.done) {
        resp.set_done(true);
        resp.set_finish_reason(e.finish_reason);
      }
    }
    first = false;
    if (!writer->Write(resp)) {
      cancelled->store(true);
      return grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
    }
    if (resp.done()) return grpc::Status::OK;
  }
}

grpc::Status WorkerHubGrpc::Connect(grpc::ServerContext* context,
                                    grpc::ServerReaderWriter<CoordinatorMessage, WorkerMessage>* stream) {
  if (require_client_cert_ && !context->auth_context()->IsPeerAuthenticated()) {
    log::Warn("a worker from {} was refused: no client certificate signed by --tls-client-ca", context->peer());
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED,
                        "workers must present a client certificate signed by the coordinator's --tls-client-ca "
                        "(pippy-worker --tls-cert/--tls-key)");
  }
  WorkerMessage m;
  if (!stream->Read(&m) || !m.has_register_()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "register: the first message must register the worker");
  }
  auto channel = std::make_shared<StreamChannel>(stream);
  const absl::StatusOr<std::string> added = logic_->AddWorker(m.register_(), channel);
  if (!added.ok()) {
    channel->Close();
    log::Warn("a worker from {} was refused: {}", context->peer(), added.status().message());
    return ToGrpc(added.status());
  }
  const std::string& id = *added;
  while (stream->Read(&m)) logic_->OnWorkerMessage(id, m);
  channel->Close();
  logic_->RemoveWorker(id, "disconnected (its stream to the coordinator broke)");
  return grpc::Status::OK;
}

}  // namespace pippy::coordinator
