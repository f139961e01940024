#include "worker/worker_agent.h"

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <chrono>
#include <map>
#include <thread>

#include "ATen/Parallel.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/chunker.h"
#include "common/log.h"
#include "common/memory.h"
#include "common/metrics.h"
#include "common/systemd.h"
#include "common/tls.h"
#include "common/status.h"
#include "grpcpp/grpcpp.h"
#include "proto/health.grpc.pb.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/rank_job.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/stage/microbatch.h"
#include "pipeline/transport/gloo/gloo_group.h"
#include "pipeline/transport/nccl/nccl_transport.h"
#include "pipeline/transport/staging/device_copier.h"
#include "pipeline/transport/staging/staging_transport.h"
#include "pipeline/transport/ucx/ucx_transport.h"
#include "proto/coordinator.grpc.pb.h"
#include "torch/csrc/jit/runtime/graph_executor.h"
#include "torch/csrc/jit/serialization/pickle.h"
#include "worker/process_device.h"
#include "worker/report_builder.h"

namespace pippy::worker {
namespace {

constexpr char kVersion[] = "pippy 0.2";
constexpr size_t kResultChunk = 1 << 20;

// An assignment and its files as their chunks arrive (read-loop thread only).
struct Incoming {
  Assignment assignment;
  std::map<int, std::string> stages;  // stage -> TorchScript bytes
  std::map<int, bool> stage_done;
  std::string data;
  bool data_done = false;
  std::string state;  // a restart's training state (Assignment.state_bytes > 0)
  bool state_done = false;
  int64_t bytes_received = 0;

  bool Complete() const {
    if (!data_done) return false;
    if (assignment.state_bytes() > 0 && !state_done) return false;
    for (const auto& [s, done] : stage_done) {
      if (!done) return false;
    }
    return true;
  }
};

int64_t ParamBytes(const torch::jit::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.named_parameters(true)) n += static_cast<int64_t>(p.value.numel() * p.value.element_size());
  return n;
}

// grpc.health.v1.Health for --health-port: the whole server ("") and pippy.Worker.
class HealthService : public grpc::health::v1::Health::Service {
 public:
  std::atomic<bool> serving{false};

  grpc::Status Check(grpc::ServerContext*, const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override {
    if (!request->service().empty() && request->service() != "pippy.Worker") {
      return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service (ask for \"\" or pippy.Worker)");
    }
    response->set_status(serving ? grpc::health::v1::HealthCheckResponse::SERVING
                                 : grpc::health::v1::HealthCheckResponse::NOT_SERVING);
    return grpc::Status::OK;
  }
};

class Agent {
 public:
  Agent(const AgentOptions& o, Device device) : options_(o), device_(device), torch_device_(TorchDevice(device)) {}

  // Serves the coordinator; when the connection is lost, stops the rank it runs (the
  // coordinator restarts the job from its checkpoint) and dials again with backoff,
  // registering under the id it had, until options_.reconnect_timeout has passed.
  absl::Status Run() {
    if (options_.health_port >= 0) {
      grpc::ServerBuilder builder;
      builder.RegisterService(&health_service_);
      int bound = 0;
      builder.AddListeningPort(absl::StrCat("0.0.0.0:", options_.health_port), grpc::InsecureServerCredentials(),
                               &bound);
      health_ = builder.BuildAndStart();
      if (!health_ || bound == 0) {
        return absl::UnavailableError(absl::StrCat("cannot serve health checks on port ", options_.health_port,
                                                   " (in use? another --health-port)"));
      }
      log::Info("health checks (grpc.health.v1.Health) on port {}", bound);
    }
    absl::Cleanup stop_health = [this] {
      if (health_) health_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
    };
    std::unique_ptr<metrics::Server> metrics_server;
    if (options_.metrics_port >= 0) {
      PIPPY_ASSIGN_OR_RETURN(metrics_server,
                             metrics::Server::Start("0.0.0.0", options_.metrics_port, [this] { return MetricsText(); }));
      log::Info("metrics on http://0.0.0.0:{}/metrics", metrics_server->port());
    }
    systemd::StartWatchdog();
    absl::Status s = Session(options_.connect_timeout);
    while (absl::IsUnavailable(s) && registered_once_ && options_.reconnect_timeout > absl::ZeroDuration()) {
      const absl::Time deadline = absl::Now() + options_.reconnect_timeout;
      log::Warn("lost the coordinator at {} ({}); reconnecting for up to {}", options_.coordinator, s.message(),
                absl::FormatDuration(options_.reconnect_timeout));
      absl::Duration backoff = absl::Milliseconds(200);
      while (true) {
        const absl::Duration left = deadline - absl::Now();
        if (left <= absl::ZeroDuration()) {
          return absl::UnavailableError(absl::StrCat("lost the coordinator at ", options_.coordinator,
                                                     " and could not reconnect within ",
                                                     absl::FormatDuration(options_.reconnect_timeout),
                                                     " (--reconnect-timeout-s): ", s.message()));
        }
        s = Session(std::min(left, absl::Seconds(5)));
        if (registered_ || !absl::IsUnavailable(s)) break;  // served (and lost again), or done
        absl::SleepFor(std::min(backoff, std::max(absl::ZeroDuration(), deadline - absl::Now())));
        backoff = std::min(backoff * 2, absl::Seconds(5));
      }
    }
    return s;
  }

 private:
  // One connection: registers, serves until the stream ends, then stops the rank it
  // ran. Errors: UNAVAILABLE when the coordinator cannot be reached within
  // `connect_timeout` or the stream broke.
  absl::Status Session(absl::Duration connect_timeout) {
    registered_ = false;
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 200);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
    PIPPY_ASSIGN_OR_RETURN(auto credentials,
                           tls::ChannelCredentials({options_.tls_ca, options_.tls_cert, options_.tls_key}));
    auto channel = grpc::CreateCustomChannel(options_.coordinator, credentials, args);
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + absl::ToChronoMilliseconds(connect_timeout))) {
      std::string why;
      if (!options_.tls_ca.empty()) {
        // A refused TLS handshake looks like an unreachable host to WaitForConnected; one
        // call on the channel says which it was.
        grpc::health::v1::HealthCheckRequest req;
        grpc::health::v1::HealthCheckResponse resp;
        grpc::ClientContext probe;
        probe.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
        grpc::Status st = grpc::health::v1::Health::NewStub(channel)->Check(&probe, req, &resp);
        if (!st.ok()) {
          why = absl::StrCat(" (", st.error_message(), "; with TLS, check that --tls-ca signed the coordinator's "
                             "certificate and, for mTLS, that the coordinator's --tls-client-ca signed --tls-cert)");
        }
      }
      return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", options_.coordinator,
                                                 " within ", absl::FormatDuration(connect_timeout), why));
    }
    auto stub = WorkerHub::NewStub(channel);
    grpc::ClientContext ctx;
    {
      absl::MutexLock lock(&write_mu_);
      stream_ = stub->Connect(&ctx);
    }
    WorkerMessage reg;
    RegisterWorker* r = reg.mutable_register_();
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    r->set_name(options_.name.empty() ? absl::StrCat(host, ":", getpid()) : options_.name);
    r->set_host(host);
    r->set_device(device_.ToString());
    r->set_version(kVersion);
    r->set_threads(options_.threads);
    r->set_free_memory(static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE));
    if (device_.is_gpu()) {
      // A GPU worker: placement counts the device's memory, as free now.
      absl::StatusOr<transport::nccl::DeviceInfo> info = transport::nccl::GetDeviceInfo(device_.index);
      if (info.ok()) {
        r->set_free_memory(info->free_bytes);
        r->set_device_name(info->name);
      } else {
        log::Warn("{}: {}; registering without its free memory", device_.ToString(), info.status().message());
        r->set_free_memory(0);
      }
    }
    r->set_worker_id(worker_id_);
    {
      absl::MutexLock lock(&mu_);
      stopping_ = false;
    }
    if (!Write(reg)) {
      grpc::Status fin = stream_->Finish();
      if (fin.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
        return absl::UnauthenticatedError(absl::StrCat("the coordinator refused this worker: ", fin.error_message()));
      }
      return absl::UnavailableError(absl::StrCat("the coordinator closed the stream at registration: ",
                                                 fin.error_message()));
    }
    std::thread heartbeat([this] {
      while (true) {
        {
          absl::MutexLock lock(&mu_);
          if (stopping_) break;
        }
        WorkerMessage hb;
        hb.mutable_heartbeat()->set_unix_ms(absl::ToUnixMillis(absl::Now()));
        if (!Write(hb)) break;
        absl::MutexLock lock(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(&stopping_), options_.heartbeat);
      }
    });
    CoordinatorMessage m;
    while (stream_->Read(&m)) Handle(m);
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    // The coordinator is gone: the rank stops (its job resumes from a checkpoint), and
    // whatever was arriving is dropped.
    SetHealth(false);
    CancelRunningJob();
    receiving_ = false;
    incoming_ = Incoming();
    heartbeat.join();
    if (job_.joinable()) job_.join();
    grpc::Status s = stream_->Finish();
    if (s.error_code() == grpc::StatusCode::UNAUTHENTICATED) {
      return absl::UnauthenticatedError(absl::StrCat("the coordinator refused this worker: ", s.error_message()));
    }
    return absl::UnavailableError(absl::StrCat("stream to the coordinator ended: ",
                                               s.ok() ? "closed by the coordinator" : s.error_message()));
  }

  void SetHealth(bool serving) {
    health_service_.serving = serving;
    registered_now_ = serving;
    // systemd (Type=notify): ready once registered; the status line follows.
    if (serving) {
      systemd::NotifyReady(absl::StrCat("registered as ", worker_id_, " with ", options_.coordinator));
    } else {
      systemd::NotifyStatus(absl::StrCat("reconnecting to the coordinator at ", options_.coordinator));
    }
  }

  // Prometheus text for --metrics-port.
  std::string MetricsText() {
    metrics::Exposition x;
    x.Family("pippy_worker_registered", "gauge", "1 while registered with a coordinator");
    x.Sample("pippy_worker_registered", {}, registered_now_ ? 1 : 0);
    x.Family("pippy_worker_busy", "gauge", "1 while the worker runs a rank");
    x.Sample("pippy_worker_busy", {}, busy_ ? 1 : 0);
    x.Family("pippy_worker_steps_total", "counter", "Steps this worker's ranks completed");
    x.Sample("pippy_worker_steps_total", {}, static_cast<double>(steps_total_.load()));
    x.Family("pippy_worker_checkpoints_total", "counter", "Checkpoints this worker's ranks sent");
    x.Sample("pippy_worker_checkpoints_total", {}, static_cast<double>(checkpoints_total_.load()));
    x.Family("pippy_worker_transport_bytes_total", "counter", "Tensor bytes sent and received to and from peer ranks");
    x.Sample("pippy_worker_transport_bytes_total", {{"transport", "ucx"}, {"direction", "sent"}},
             static_cast<double>(bytes_sent_.load()));
    x.Sample("pippy_worker_transport_bytes_total", {{"transport", "ucx"}, {"direction", "received"}},
             static_cast<double>(bytes_received_.load()));
    x.Family("pippy_worker_allreduce_seconds_total", "counter", "Time spent in data-parallel gradient all-reduces");
    x.Sample("pippy_worker_allreduce_seconds_total", {}, allreduce_us_.load() * 1e-6);
    x.Family("pippy_worker_step_seconds", "histogram", "Step time of this worker's ranks");
    {
      absl::MutexLock lock(&metrics_mu_);
      x.HistogramSamples("pippy_worker_step_seconds", {}, step_seconds_);
    }
    return x.text();
  }

  bool Write(const WorkerMessage& m) {
    absl::MutexLock lock(&write_mu_);
    return stream_->Write(m);
  }

  void Handle(const CoordinatorMessage& m) {
    if (m.has_registered()) {
      if (!worker_id_.empty() && worker_id_ != m.registered().worker_id()) {
        log::Warn("registered again as {} (was {}: that id is taken)", m.registered().worker_id(), worker_id_);
      }
      worker_id_ = m.registered().worker_id();
      registered_ = true;
      SetHealth(true);
      registered_once_ = true;
      log::Info("registered as {} with the coordinator at {}", worker_id_, options_.coordinator);
    } else if (m.has_assignment()) {
      if (job_.joinable()) job_.join();
      incoming_ = Incoming();
      incoming_.assignment = m.assignment();
      for (const auto& f : m.assignment().stages()) {
        incoming_.stages[f.stage()].reserve(static_cast<size_t>(f.bytes()));
        incoming_.stage_done[f.stage()] = false;
      }
      incoming_.data.reserve(static_cast<size_t>(m.assignment().data_bytes()));
      incoming_.state.reserve(static_cast<size_t>(m.assignment().state_bytes()));
      receiving_ = true;
      absl::MutexLock lock(&mu_);
      job_id_ = m.assignment().job_id();
      attempt_ = m.assignment().attempt();
      cancelled_ = false;
      serve_queue_.clear();
      peers_.clear();
      replica_peers_.clear();
      log::Info("job={} rank={}: receiving {} stage(s) and {} bytes of data{}", job_id_, m.assignment().rank(),
                m.assignment().stages_size(), m.assignment().data_bytes(),
                m.assignment().attempt() > 0
                    ? absl::StrCat("; restart ", m.assignment().attempt(), " from step ", m.assignment().start_step())
                    : "");
    } else if (m.has_stage()) {
      if (!Arriving(m.stage())) return;  // a cancelled transfer
      auto it = incoming_.stages.find(m.stage().stage());
      if (it == incoming_.stages.end()) {
        FailTransfer(absl::InternalError(absl::StrCat("the coordinator sent stage ", m.stage().stage(),
                                                      ", which is not this rank's")));
        return;
      }
      Receive(m.stage(), &it->second, &incoming_.stage_done[m.stage().stage()]);
    } else if (m.has_data()) {
      if (Arriving(m.data())) Receive(m.data(), &incoming_.data, &incoming_.data_done);
    } else if (m.has_state()) {
      if (Arriving(m.state())) Receive(m.state(), &incoming_.state, &incoming_.state_done);
    } else if (m.has_peers()) {
      absl::MutexLock lock(&mu_);
      if (m.peers().job_id() != job_id_ || m.peers().attempt() != attempt_) return;
      peers_.assign(m.peers().ucx_addresses().begin(), m.peers().ucx_addresses().end());
      replica_peers_.assign(m.peers().gloo_addresses().begin(), m.peers().gloo_addresses().end());
    } else if (m.has_serve()) {
      absl::MutexLock lock(&mu_);
      if (m.serve().job_id() != job_id_ || m.serve().attempt() != attempt_) return;
      serve_queue_.push_back(m.serve());
    } else if (m.has_cancel()) {
      {
        absl::MutexLock lock(&mu_);
        if (m.cancel().job_id() != job_id_ || m.cancel().attempt() != attempt_) {
          log::Info("job={} cancel ignored: this worker runs job={} (attempt {})", m.cancel().job_id(), job_id_,
                    attempt_);
          return;
        }
      }
      log::Warn("job={} cancelled: {}", m.cancel().job_id(), m.cancel().reason());
      if (receiving_) {
        // Still arriving: drop what came and report, so the coordinator frees this worker.
        FailTransfer(absl::CancelledError("cancelled while its stages were arriving"));
        return;
      }
      CancelRunningJob();
    }
  }

  // Whether a file chunk (StageChunk, DataChunk, StateChunk) belongs to the assignment
  // being received; chunks of a cancelled transfer or an earlier attempt do not.
  template <typename Chunk>
  bool Arriving(const Chunk& c) const {
    return receiving_ && c.job_id() == incoming_.assignment.job_id() && c.attempt() == incoming_.assignment.attempt();
  }
  // Appends the chunk to `into`; its last chunk marks `done`, and the rank starts once
  // everything has arrived.
  template <typename Chunk>
  void Receive(const Chunk& c, std::string* into, bool* done) {
    *into += c.chunk();
    incoming_.bytes_received += static_cast<int64_t>(c.chunk().size());
    if (c.last_chunk()) *done = true;
    StartIfComplete();
  }

  void StartIfComplete() {
    if (!incoming_.Complete()) return;
    receiving_ = false;
    job_ = std::thread([this, in = std::move(incoming_)]() mutable { RunJob(std::move(in)); });
    incoming_ = Incoming();
  }

  void FailTransfer(const absl::Status& s) {
    receiving_ = false;
    const Assignment a = incoming_.assignment;
    incoming_ = Incoming();
    if (!absl::IsCancelled(s)) log::Error("job={} rank={}: {}", a.job_id(), a.rank(), s.message());
    Finished(a, s);
  }

  // Stops the job: a rank waiting for its peers' addresses or mid-step returns
  // CANCELLED at once (a wait in progress is cancelled), so the worker is free again.
  void CancelRunningJob() {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    if (running_ != nullptr) running_->Cancel();
  }

  void Finished(const Assignment& a, const absl::Status& s) {
    WorkerMessage f;
    f.mutable_finished()->set_job_id(a.job_id());
    f.mutable_finished()->set_rank(a.rank());
    f.mutable_finished()->set_ok(s.ok());
    f.mutable_finished()->set_error(std::string(s.message()));
    f.mutable_finished()->set_code(static_cast<int>(s.code()));
    f.mutable_finished()->set_attempt(a.attempt());
    f.mutable_finished()->set_replica(a.replica());
    Write(f);
  }

  void RunJob(Incoming in) {
    const Assignment a = in.assignment;
    busy_ = true;
    absl::Status s = RunRank(std::move(in));
    busy_ = false;
    ReturnFreedMemory();  // idle, the worker does not keep its last job's peak
    if (absl::IsCancelled(s)) {
      log::Info("job={} rank={} stopped: {}", a.job_id(), a.rank(), s.message());
    } else if (!s.ok()) {
      log::Error("job={} rank={} failed: {}", a.job_id(), a.rank(), s.message());
    }
    Finished(a, s);
  }

  using Sink = std::function<absl::Status(absl::string_view)>;

  // Streams what `source` writes to the coordinator in chunk messages of kResultChunk
  // (the last says so) that `chunk_of` picks in a message, for assignment `a`; `what`
  // names them when the stream breaks. Returns the bytes sent.
  template <typename ChunkOf>
  absl::StatusOr<int64_t> Stream(const Assignment& a, const ChunkOf& chunk_of,
                                 const std::function<absl::Status(const Sink&)>& source, const char* what) {
    Chunker chunker(kResultChunk, [&](std::string chunk, bool last) -> absl::Status {
      WorkerMessage m;
      auto* c = chunk_of(&m);
      c->set_job_id(a.job_id());
      c->set_attempt(a.attempt());
      c->set_chunk(std::move(chunk));
      c->set_last_chunk(last);
      if (!Write(m)) return absl::UnavailableError(absl::StrCat("the stream to the coordinator broke while sending ", what));
      return absl::OkStatus();
    });
    PIPPY_RETURN_IF_ERROR(source([&](absl::string_view piece) { return chunker.Append(piece); }));
    PIPPY_RETURN_IF_ERROR(chunker.Finish());
    return static_cast<int64_t>(chunker.total());
  }

  // Streams `module` (a trained stage) to the coordinator in chunks as it is written.
  absl::Status SendStage(const Assignment& a, int stage, const torch::jit::Module& module) {
    auto sent = Stream(
        a,
        [stage](WorkerMessage* m) {
          m->mutable_stage_result()->set_stage(stage);
          return m->mutable_stage_result();
        },
        [&](const Sink& sink) { return torchio::WriteModule(module, sink); }, "results");
    return sent.status();
  }

  // A checkpoint after `step` steps: each stage's TorchScript (its trained parameters
  // and buffers), then the rank's training state. The coordinator commits it once every
  // rank's pieces arrived whole.
  absl::Status SendCheckpoint(const Assignment& a, int step, job::RankJob& rank_job) {
    const auto start = absl::Now();
    int64_t bytes = 0;
    int chunks = 0;
    auto piece = [&](int stage) {
      return [&, stage](WorkerMessage* m) {
        // Called once per chunk, before it is written: the test's fault strikes once the
        // first chunk went (a checkpoint is at least a stage and a state: 2 chunks).
        if (chunks++ == 1) MaybeDieInCheckpoint(step);
        CheckpointChunk* c = m->mutable_checkpoint();
        c->set_step(step);
        c->set_rank(a.rank());
        c->set_replica(a.replica());
        c->set_stage(stage);
        return c;
      };
    };
    // The replicas hold the same parameters: replica 0 sends the stages, every replica
    // its training state (its own random generator).
    for (const auto& stage : rank_job.stages()) {  // not a structured binding: the lambda captures it
      if (a.replica() != 0) break;
      const torch::jit::Module& module = stage.second;
      auto write = [&](const Sink& sink) { return torchio::WriteModule(module, sink); };
      PIPPY_ASSIGN_OR_RETURN(int64_t n, Stream(a, piece(stage.first), write, "a checkpoint"));
      bytes += n;
    }
    PIPPY_ASSIGN_OR_RETURN(std::string state, rank_job.SaveState());
    PIPPY_ASSIGN_OR_RETURN(int64_t n, Stream(a, piece(-1), [&](const Sink& sink) { return sink(state); }, "a checkpoint"));
    bytes += n;
    log::Info("job={} rank={} checkpoint after step {}: {} bytes in {}", a.job_id(), a.rank(), step, bytes,
              absl::FormatDuration(absl::Now() - start));
    return absl::OkStatus();
  }

  // A test's fault: PIPPY_TEST_DIE_IN_CHECKPOINT=N makes this process SIGKILL itself
  // after sending the first chunk of its checkpoint after step N (a worker lost in the
  // middle of a checkpoint).
  static void MaybeDieInCheckpoint(int step) {
    static const int die_at = [] {
      const char* v = std::getenv("PIPPY_TEST_DIE_IN_CHECKPOINT");
      return v != nullptr ? std::atoi(v) : -1;
    }();
    if (step == die_at) {
      log::Warn("PIPPY_TEST_DIE_IN_CHECKPOINT={}: killing this worker in the middle of its checkpoint", step);
      std::fflush(stderr);
      raise(SIGKILL);
    }
  }

  absl::Status SendOutputs(const Assignment& a, const std::vector<c10::IValue>& outputs) {
    PIPPY_ASSIGN_OR_RETURN(c10::IValue merged, stage::MergeMicrobatches(outputs));
    std::vector<char> bytes = torch::jit::pickle_save(merged);
    auto sent = Stream(
        a, [](WorkerMessage* m) { return m->mutable_output(); },
        [&](const Sink& sink) { return sink(absl::string_view(bytes.data(), bytes.size())); }, "outputs");
    return sent.status();
  }

  // A serving job's rank: runs each micro-batch the coordinator sends (ServeBatch, in
  // step order) as soon as it comes, without waiting for later ranks to finish earlier
  // ones; the last stage's rank returns each output (ServeResult). A micro-batch whose
  // inputs do not fit the model is abandoned on every rank (ABORTED) and serving goes
  // on; any other error, or a cancel, ends the rank.
  absl::Status Serve(const Assignment& a, job::RankJob& rank_job) {
    const int inputs = a.plan().inputs_size();
    const bool last = rank_job.schedule().stage_to_rank.back() == a.rank();
    log::Info("job={} rank={}: serving", a.job_id(), a.rank());
    auto report = [&](int64_t step, const absl::StatusOr<stage::StepResult>& res) {
      WorkerMessage m;
      ServeResult* r = m.mutable_serve_result();
      r->set_job_id(a.job_id());
      r->set_attempt(a.attempt());
      r->set_step(step);
      r->set_ok(res.ok());
      if (!res.ok()) {
        r->set_aborted(absl::IsAborted(res.status()));
        r->set_error(std::string(res.status().message()));
      } else {
        r->set_seconds(res->step_seconds);
        std::vector<char> bytes = torch::jit::pickle_save(res->output);
        r->set_output(bytes.data(), bytes.size());
      }
      return Write(m);
    };
    while (true) {
      ServeBatch batch;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !serve_queue_.empty() || cancelled_; };
        // Idle until the next micro-batch; a lost coordinator cancels the rank.
        while (!mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Seconds(1))) {
        }
        if (cancelled_) return absl::CancelledError("serving stopped");
        batch = std::move(serve_queue_.front());
        serve_queue_.pop_front();
      }
      std::vector<c10::IValue> args(static_cast<size_t>(inputs));
      if (!batch.inputs().empty()) {
        absl::StatusOr<c10::IValue> v = torchio::PickleLoad(batch.inputs(), "a serving micro-batch");
        if (!v.ok()) return v.status();
        if (!v->isTuple() || v->toTupleRef().elements().size() != args.size()) {
          return absl::InternalError(absl::StrCat("step ", batch.step(), ": the coordinator sent ", v->tagKind(),
                                                  " instead of a tuple of ", args.size(), " input(s)"));
        }
        args = v->toTupleRef().elements().vec();
      }
      // Steps number the messages between ranks (the tag keeps their low 16 bits).
      absl::StatusOr<stage::StepResult> res =
          rank_job.ServeStep(static_cast<int>(batch.step() & 0x7fffffff), args);
      ++steps_total_;
      if (!res.ok() && !absl::IsAborted(res.status())) {
        if (last && !absl::IsCancelled(res.status())) report(batch.step(), res);
        return res.status();
      }
      if (res.ok()) {
        absl::MutexLock lock(&metrics_mu_);
        step_seconds_.Observe(res->step_seconds);
      }
      if (last && !report(batch.step(), res)) {
        return absl::UnavailableError("the stream to the coordinator broke while sending a serving output");
      }
    }
  }

  absl::Status RunRank(Incoming in) {
    const Assignment& a = in.assignment;
    const JobSpec& spec = a.spec();
    log::Info("job={} rank={} of {}: received {} bytes; loading stage(s)", a.job_id(), a.rank(), a.layout().num_ranks(),
              in.bytes_received);
    if (std::max(1, spec.replicas()) > 1 && device_.is_gpu()) {
      return absl::UnimplementedError(absl::StrCat("data parallelism (replicas ", spec.replicas(), ") runs on CPU "
                                                   "workers only (the replicas' all-reduce is gloo over TCP); this "
                                                   "worker's device is ", device_.ToString(),
                                                   ": submit without --replicas, or to workers started with "
                                                   "--device cpu"));
    }
    at::set_num_threads(options_.threads);
    torch::jit::setGraphExecutorOptimize(false);
    job::SeedProcessForRank(spec, a.rank(), a.replica(), a.layout().num_ranks());
    std::map<int, torch::jit::Module> stages;
    int64_t param_bytes = 0;
    for (auto& [s, bytes] : in.stages) {
      PIPPY_ASSIGN_OR_RETURN(torch::jit::Module module,
                             torchio::LoadModelFromBytes(bytes, absl::StrCat("stage ", s)));
      param_bytes += ParamBytes(module);
      stages.emplace(s, std::move(module));
      std::string().swap(bytes);  // the archive's bytes are not needed once loaded
    }
    std::vector<std::string> input_names;
    for (const ModelValue& v : a.plan().inputs()) input_names.push_back(v.name());
    PIPPY_ASSIGN_OR_RETURN(stage::DataSource data, stage::DataSource::FromShareBytes(in.data, input_names));
    std::string().swap(in.data);

    const c10::Device device = torch_device_;
    transport::ucx::Options uo;
    if (!options_.ucx_tls.empty()) uo.ucx_config = {{"TLS", options_.ucx_tls}};
    uo.receive_buffer = transport::staging::ReceiveBuffersFor(device);  // pinned on a GPU
    PIPPY_ASSIGN_OR_RETURN(auto ucx, transport::ucx::UcxTransport::Create(a.rank(), a.layout().num_ranks(), uo));
    WorkerMessage addr;
    addr.mutable_address()->set_job_id(a.job_id());
    addr.mutable_address()->set_rank(a.rank());
    addr.mutable_address()->set_ucx_address(ucx->address());
    addr.mutable_address()->set_bytes_received(in.bytes_received);
    addr.mutable_address()->set_loaded_param_bytes(param_bytes);
    addr.mutable_address()->set_attempt(a.attempt());
    addr.mutable_address()->set_replica(a.replica());
    // Data parallelism: this rank's endpoints for its replica group (gloo, TCP).
    const int replicas = std::max(1, spec.replicas());
    std::unique_ptr<transport::gloo_group::GlooGroup> group;
    if (replicas > 1) {
      std::string host = options_.replica_host;
      if (host.empty()) {
        char name[256] = {0};
        gethostname(name, sizeof(name) - 1);
        host = name;
      }
      PIPPY_ASSIGN_OR_RETURN(group, transport::gloo_group::GlooGroup::Create(a.replica(), replicas, host,
                                                                             options_.wait_timeout));
      addr.mutable_address()->set_gloo_address(group->address());
    }
    Write(addr);
    std::vector<std::string> peers, replica_peers;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !peers_.empty() || cancelled_; };
      if (!mu_.AwaitWithTimeout(absl::Condition(&ready), options_.wait_timeout)) {
        return absl::DeadlineExceededError(absl::StrCat("the peers' addresses did not arrive within ",
                                                        absl::FormatDuration(options_.wait_timeout)));
      }
      if (cancelled_) return absl::CancelledError("cancelled");
      peers = peers_;
      replica_peers = replica_peers_;
    }
    PIPPY_RETURN_IF_ERROR(ucx->Connect(peers));
    if (group != nullptr) PIPPY_RETURN_IF_ERROR(group->Connect(replica_peers));
    // A GPU rank's tensors cross to other ranks through host memory (ucx+staging).
    PIPPY_ASSIGN_OR_RETURN(auto staged, transport::staging::StagingTransport::ForDevice(ucx.get(), device));
    PIPPY_ASSIGN_OR_RETURN(auto rank_job, job::RankJob::Create(spec, a.plan(), a.layout(), a.rank(), std::move(stages), staged.get(),
                                                               options_.wait_timeout, group.get(), device));
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) return absl::CancelledError("cancelled");
      running_ = rank_job.get();
    }
    // Declared after the rank job: forgets it before it is destroyed.
    absl::Cleanup forget = [this] {
      absl::MutexLock lock(&mu_);
      running_ = nullptr;
    };
    if (a.state_bytes() > 0) {
      // A restart: the optimizer and the random generator as they were at the checkpoint.
      PIPPY_RETURN_IF_ERROR(rank_job->RestoreState(in.state));
      std::string().swap(in.state);
    }
    const bool inference = rank_job->schedule().forward_only;
    KeepFreedMemory();  // the stages are loaded: from here on, buffers are reused step after step
    if (spec.has_serving()) return Serve(a, *rank_job);  // the stages are loaded: from here on, buffers are reused step after step
    std::vector<c10::IValue> outputs;  // inference: the last stage's merged outputs per step
    for (int step = a.start_step(); step < spec.steps(); ++step) {
      PIPPY_ASSIGN_OR_RETURN(stage::StepResult res, rank_job->RunStep(step, data));
      if (inference && !res.output.isNone()) outputs.push_back(res.output);
      WorkerMessage rep;
      // Read together: the trace's steady-clock times become wall-clock times.
      *rep.mutable_step() = BuildStepReport(a, step, res,
                                            std::chrono::duration_cast<std::chrono::microseconds>(
                                                std::chrono::steady_clock::now().time_since_epoch())
                                                .count(),
                                            absl::ToUnixMicros(absl::Now()));
      Write(rep);
      log::Info("job={} rank={} step={}{}", a.job_id(), a.rank(), step,
                res.has_loss ? absl::StrCat(" loss=", res.loss) : "");
      ++steps_total_;
      const TransferBytes moved = TransferBytesOf(res);
      bytes_sent_ += moved.sent;
      bytes_received_ += moved.received;
      allreduce_us_ += static_cast<int64_t>(res.breakdown.allreduce_seconds * 1e6);
      {
        absl::MutexLock lock(&metrics_mu_);
        step_seconds_.Observe(res.step_seconds);
      }
      if (job::CheckpointAfter(spec, step + 1)) {
        PIPPY_RETURN_IF_ERROR(SendCheckpoint(a, step + 1, *rank_job));
        ++checkpoints_total_;
      }
    }
    // Results: inference sends the outputs (a torch.save file); training sends the
    // trained stages.
    if (inference) {
      if (!outputs.empty()) PIPPY_RETURN_IF_ERROR(SendOutputs(a, outputs));
    } else if (a.replica() == 0) {  // the replicas hold the same parameters
      for (const auto& [s, module] : rank_job->stages()) PIPPY_RETURN_IF_ERROR(SendStage(a, s, module));
    }
    return absl::OkStatus();
  }

  const AgentOptions options_;
  const Device device_;             // resolved and checked (ProcessDevice)
  const c10::Device torch_device_;  // the same, as LibTorch names it
  std::unique_ptr<grpc::ClientReaderWriter<WorkerMessage, CoordinatorMessage>> stream_;
  absl::Mutex write_mu_;  // one writer at a time on the stream
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::string job_id_ ABSL_GUARDED_BY(mu_);  // the job assigned last
  int attempt_ ABSL_GUARDED_BY(mu_) = 0;     // and its attempt
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  job::RankJob* running_ ABSL_GUARDED_BY(mu_) = nullptr;  // the job's rank while it runs
  std::vector<std::string> peers_ ABSL_GUARDED_BY(mu_);
  std::deque<ServeBatch> serve_queue_ ABSL_GUARDED_BY(mu_);  // a serving job's micro-batches, in step order
  std::vector<std::string> replica_peers_ ABSL_GUARDED_BY(mu_);  // the replica group's gloo addresses
  // Metrics (--metrics-port), read by the metrics server's thread.
  std::atomic<bool> registered_now_{false}, busy_{false};
  std::atomic<int64_t> steps_total_{0}, checkpoints_total_{0}, bytes_sent_{0}, bytes_received_{0}, allreduce_us_{0};
  absl::Mutex metrics_mu_;
  metrics::Histogram step_seconds_ ABSL_GUARDED_BY(metrics_mu_){
      {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}};
  // Run()'s thread only.
  std::unique_ptr<grpc::Server> health_;  // --health-port
  HealthService health_service_;
  std::string worker_id_;          // the id the coordinator gave; kept across reconnections
  bool registered_ = false;        // in the current session
  bool registered_once_ = false;
  Incoming incoming_;
  bool receiving_ = false;
  std::thread job_;
};

}  // namespace

absl::Status RunAgent(const AgentOptions& options) {
  PIPPY_ASSIGN_OR_RETURN(Device device, ProcessDevice(options.device));
  if (device.is_gpu()) {
    // The stages run there: this build must reach the device (CUDA runtime, NCCL).
    PIPPY_ASSIGN_OR_RETURN(transport::nccl::DeviceInfo info, transport::nccl::GetDeviceInfo(device.index));
    log::Info("device {} ({}, {} MiB free of {} MiB)", device.ToString(), info.name, info.free_bytes >> 20,
              info.total_bytes >> 20);
  } else {
    log::Info("device {}{}", device.ToString(), options.device == "auto" ? " (auto: this LibTorch sees no GPU)" : "");
  }
  Agent agent(options, device);
  return agent.Run();
}

}  // namespace pippy::worker
