#include "worker/worker_agent.h"

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <sstream>
#include <thread>

#include "ATen/Parallel.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "grpcpp/grpcpp.h"
#include "pipeline/partition/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/stage/rank_runtime.h"
#include "pipeline/transport/ucx/ucx_transport.h"
#include "proto/coordinator.grpc.pb.h"
#include "torch/csrc/jit/runtime/graph_executor.h"
#include "torch/csrc/jit/serialization/pickle.h"
#include "torch/serialize.h"

namespace pippy::worker {
namespace {

constexpr char kVersion[] = "pippy 0.1";

class Agent {
 public:
  explicit Agent(const AgentOptions& o) : options_(o) {}

  absl::Status Run() {
    auto channel = grpc::CreateChannel(options_.coordinator, grpc::InsecureChannelCredentials());
    if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(10))) {
      return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", options_.coordinator));
    }
    auto stub = WorkerHub::NewStub(channel);
    grpc::ClientContext ctx;
    stream_ = stub->Connect(&ctx);
    WorkerMessage reg;
    RegisterWorker* r = reg.mutable_register_();
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    r->set_name(options_.name.empty() ? absl::StrCat(host, ":", getpid()) : options_.name);
    r->set_host(host);
    r->set_device(options_.device);
    r->set_version(kVersion);
    r->set_threads(options_.threads);
    r->set_free_memory(static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE));
    if (!Write(reg)) return absl::UnavailableError("the coordinator closed the stream at registration");
    std::thread heartbeat([this] {
      while (!stopping_.load()) {
        WorkerMessage hb;
        hb.mutable_heartbeat()->set_unix_ms(absl::ToUnixMillis(absl::Now()));
        if (!Write(hb)) break;
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, absl::ToChronoMilliseconds(options_.heartbeat), [&] { return stopping_.load(); });
      }
    });
    CoordinatorMessage m;
    while (stream_->Read(&m)) Handle(m);
    stopping_.store(true);
    CancelRunningJob();
    heartbeat.join();
    if (job_.joinable()) job_.join();
    grpc::Status s = stream_->Finish();
    return s.ok() ? absl::OkStatus()
                  : absl::UnavailableError(absl::StrCat("stream to the coordinator ended: ", s.error_message()));
  }

 private:
  bool Write(const WorkerMessage& m) {
    std::lock_guard<std::mutex> lock(write_mu_);
    return stream_->Write(m);
  }

  void Handle(const CoordinatorMessage& m) {
    if (m.has_registered()) {
      log::Info("registered as {} with the coordinator at {}", m.registered().worker_id(), options_.coordinator);
    } else if (m.has_assignment()) {
      if (job_.joinable()) job_.join();
      assignment_ = m.assignment();
      model_.clear();
      data_.clear();
      model_done_ = data_done_ = false;
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = false;
      peers_.clear();
    } else if (m.has_data()) {
      (m.data().model() ? model_ : data_) += m.data().chunk();
      if (m.data().last_chunk()) (m.data().model() ? model_done_ : data_done_) = true;
      if (model_done_ && data_done_) {
        model_done_ = data_done_ = false;
        job_ = std::thread([this, a = assignment_, model = model_, data = data_] { RunJob(a, model, data); });
      }
    } else if (m.has_peers()) {
      std::lock_guard<std::mutex> lock(mu_);
      peers_.assign(m.peers().ucx_addresses().begin(), m.peers().ucx_addresses().end());
      cv_.notify_all();
    } else if (m.has_cancel()) {
      if (m.cancel().job_id() != assignment_.job_id()) {
        log::Info("job={} cancel ignored: this worker runs job={}", m.cancel().job_id(), assignment_.job_id());
        return;
      }
      log::Warn("job={} cancelled: {}", m.cancel().job_id(), m.cancel().reason());
      CancelRunningJob();
    }
  }

  // Stops the job: a rank waiting for its peers' addresses or mid-step returns
  // CANCELLED at once (a wait in progress is cancelled), so the worker is free again.
  void CancelRunningJob() {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    if (running_ != nullptr) running_->Cancel();
    cv_.notify_all();
  }

  void Finished(const Assignment& a, const absl::Status& s) {
    WorkerMessage f;
    f.mutable_finished()->set_job_id(a.job_id());
    f.mutable_finished()->set_rank(a.rank());
    f.mutable_finished()->set_ok(s.ok());
    f.mutable_finished()->set_error(std::string(s.message()));
    Write(f);
  }

  void RunJob(Assignment a, std::string model_bytes, std::string data_bytes) {
    absl::Status s = RunRank(a, model_bytes, data_bytes);
    if (absl::IsCancelled(s)) {
      log::Info("job={} rank={} stopped: {}", a.job_id(), a.rank(), std::string(s.message()));
    } else if (!s.ok()) {
      log::Error("job={} rank={} failed: {}", a.job_id(), a.rank(), std::string(s.message()));
    }
    Finished(a, s);
  }

  absl::Status RunRank(const Assignment& a, const std::string& model_bytes, const std::string& data_bytes) {
    const JobSpec& spec = a.spec();
    log::Info("job={} rank={} of {}: starting", a.job_id(), a.rank(), a.world_size());
    at::set_num_threads(options_.threads);
    torch::jit::setGraphExecutorOptimize(false);
    auto model = partition::LoadModelFromBytes(model_bytes, "model");
    if (!model.ok()) return model.status();
    auto ds = stage::DataSource::FromBytes(data_bytes, *model);
    if (!ds.ok()) return ds.status();
    auto kind = schedule::ParseScheduleKind(spec.schedule().name());
    if (!kind.ok()) return kind.status();
    // Split exactly where the coordinator did (its plan's split points), so every rank
    // holds the same stages whatever the balance mode measured.
    partition::SplitOptions so;
    so.split_at.assign(a.plan().split_points().begin(), a.plan().split_points().end());
    so.num_stages = a.plan().stages_size();
    auto pipe = partition::SplitModel(*model, so);
    if (!pipe.ok()) return pipe.status();
    if (pipe->plan.stages_size() != a.plan().stages_size()) {
      return absl::InternalError("this worker split the model differently from the coordinator (versions differ?)");
    }
    schedule::ScheduleOptions opts;
    opts.num_ranks = a.world_size();
    opts.num_microbatches = spec.schedule().microbatches();
    opts.stages_per_rank = spec.schedule().stages_per_worker();
    opts.graph = stage::StageGraphOf(pipe->plan);
    auto sched = schedule::MakeSchedule(*kind, opts);
    if (!sched.ok()) return sched.status();
    transport::ucx::Options uo;
    if (!options_.ucx_tls.empty()) uo.ucx_config = {{"TLS", options_.ucx_tls}};
    auto ucx = transport::ucx::UcxTransport::Create(a.rank(), a.world_size(), uo);
    if (!ucx.ok()) return ucx.status();
    WorkerMessage addr;
    addr.mutable_address()->set_job_id(a.job_id());
    addr.mutable_address()->set_rank(a.rank());
    addr.mutable_address()->set_ucx_address((*ucx)->address());
    Write(addr);
    std::vector<std::string> peers;
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (!cv_.wait_for(lock, absl::ToChronoSeconds(options_.wait_timeout),
                        [&] { return !peers_.empty() || cancelled_; })) {
        return absl::DeadlineExceededError("the peers' addresses did not arrive");
      }
      if (cancelled_) return absl::CancelledError("cancelled");
      peers = peers_;
    }
    absl::Status c = (*ucx)->Connect(peers);
    if (!c.ok()) return c;
    std::map<int, torch::jit::Module> mine;
    for (int s : sched->StagesOf(a.rank())) mine[s] = pipe->stages[s];
    stage::RuntimeOptions ro;
    ro.loss = spec.loss();
    ro.optimizer.name = spec.optimizer().name();
    ro.optimizer.lr = spec.optimizer().lr();
    ro.optimizer.momentum = spec.optimizer().momentum();
    ro.optimizer.weight_decay = spec.optimizer().weight_decay();
    if (spec.optimizer().beta1() > 0) ro.optimizer.beta1 = spec.optimizer().beta1();
    if (spec.optimizer().beta2() > 0) ro.optimizer.beta2 = spec.optimizer().beta2();
    if (spec.optimizer().eps() > 0) ro.optimizer.eps = spec.optimizer().eps();
    ro.clip_grad_norm = spec.optimizer().clip_grad_norm();
    ro.timeout = options_.wait_timeout;
    auto rt = stage::RankRuntime::Create(a.rank(), pipe->plan, mine, *sched, ucx->get(), ro);
    if (!rt.ok()) return rt.status();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (cancelled_) return absl::CancelledError("cancelled");
      running_ = rt->get();
    }
    // Declared after the runtime: forgets it before it is destroyed.
    absl::Cleanup forget = [this] {
      std::lock_guard<std::mutex> lock(mu_);
      running_ = nullptr;
    };
    std::vector<c10::IValue> outputs;  // inference: the last stage's merged outputs per step
    for (int step = 0; step < spec.steps(); ++step) {
      auto res = sched->forward_only ? (*rt)->InferenceStep(step, ds->Inputs(step, spec.batch_size()))
                                     : (*rt)->TrainStep(step, ds->Inputs(step, spec.batch_size()),
                                                        ds->Target(step, spec.batch_size()));
      if (!res.ok()) return res.status();
      if (sched->forward_only && !res->output.isNone()) outputs.push_back(res->output);
      WorkerMessage rep;
      StepReport* sr = rep.mutable_step();
      sr->set_job_id(a.job_id());
      sr->set_rank(a.rank());
      sr->set_step(step);
      sr->set_has_loss(res->has_loss);
      sr->set_loss(res->loss);
      sr->set_busy_seconds(res->busy_seconds);
      sr->set_step_seconds(res->step_seconds);
      Write(rep);
      log::Info("job={} rank={} step={}{}", a.job_id(), a.rank(), step,
                res->has_loss ? absl::StrCat(" loss=", res->loss) : "");
    }
    // Results: inference sends the outputs (stage -1, a torch.save file); training
    // sends the trained stages.
    std::vector<std::pair<int, std::string>> results;
    if (sched->forward_only) {
      if (!outputs.empty()) {
        auto merged = stage::MergeMicrobatches(outputs);
        if (!merged.ok()) return merged.status();
        std::vector<char> bytes = torch::pickle_save(*merged);
        results.emplace_back(-1, std::string(bytes.begin(), bytes.end()));
      }
    } else {
      for (auto& [s, module] : mine) {
        std::ostringstream out;
        module.save(out);
        results.emplace_back(s, out.str());
      }
    }
    for (auto& [s, bytes] : results) {
      constexpr size_t kChunk = 1 << 20;
      for (size_t off = 0; off < bytes.size(); off += kChunk) {
        WorkerMessage sr;
        sr.mutable_stage_result()->set_job_id(a.job_id());
        sr.mutable_stage_result()->set_stage(s);
        sr.mutable_stage_result()->set_chunk(bytes.substr(off, kChunk));
        sr.mutable_stage_result()->set_last_chunk(off + kChunk >= bytes.size());
        Write(sr);
      }
    }
    return absl::OkStatus();
  }

  const AgentOptions options_;
  std::unique_ptr<grpc::ClientReaderWriter<WorkerMessage, CoordinatorMessage>> stream_;
  std::mutex write_mu_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> stopping_{false};
  bool cancelled_ = false;              // guarded by mu_
  stage::RankRuntime* running_ = nullptr;  // guarded by mu_: the job's runtime while it runs
  std::vector<std::string> peers_;      // guarded by mu_
  // Read-loop thread only.
  Assignment assignment_;
  std::string model_, data_;
  bool model_done_ = false, data_done_ = false;
  std::thread job_;
};

}  // namespace

absl::Status RunAgent(const AgentOptions& options) {
  if (options.device != "cpu") {
    return absl::InvalidArgumentError(absl::StrCat("--device ", options.device,
                                                   ": this build's LibTorch is CPU-only; use --device cpu"));
  }
  Agent agent(options);
  return agent.Run();
}

}  // namespace pippy::worker
