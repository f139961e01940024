#include "worker/worker_agent.h"

#include <unistd.h>

#include <filesystem>
#include <thread>

#include "ATen/Parallel.h"
#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/memory.h"
#include "common/metrics.h"
#include "common/status.h"
#include "common/systemd.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/rank_job.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/stage/dataset.h"
#include "pipeline/transport/gloo/gloo_group.h"
#include "pipeline/transport/nccl/nccl_transport.h"
#include "torch/csrc/jit/runtime/graph_executor.h"
#include "worker/process_device.h"
#include "worker/rank_bringup.h"
#include "worker/serving_loop.h"
#include "worker/training_loop.h"

namespace pippy::worker {
namespace {

constexpr char kVersion[] = "pippy 0.2";

std::string HostName() {
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

}  // namespace

Agent::Agent(const AgentOptions& options, Device device)
    : options_(options), device_(device), torch_device_(TorchDevice(device)) {
  receiver_.set_scratch_dir(options_.scratch_dir);
  Session::Options so;
  so.coordinator = options_.coordinator;
  so.tls_ca = options_.tls_ca;
  so.tls_cert = options_.tls_cert;
  so.tls_key = options_.tls_key;
  so.heartbeat = options_.heartbeat;
  so.connect_timeout = options_.connect_timeout;
  so.reconnect_timeout = options_.reconnect_timeout;
  so.health_port = options_.health_port;
  session_ = std::make_unique<Session>(so, [this] { return Registration(); }, this);
}

Agent::~Agent() {
  control_.Cancel();
  if (rank_thread_.joinable()) rank_thread_.join();
}

absl::Status Agent::Run() {
  std::unique_ptr<metrics::Server> metrics_server;
  if (options_.metrics_port >= 0) {
    PIPPY_ASSIGN_OR_RETURN(metrics_server, metrics::Server::Start("0.0.0.0", options_.metrics_port, [this] {
      return metrics_.Text(session_->registered());
    }));
    log::Info("metrics on http://0.0.0.0:{}/metrics", metrics_server->port());
  }
  systemd::StartWatchdog();
  return session_->Run();
}

RegisterWorker Agent::Registration() const {
  RegisterWorker r;
  const std::string host = HostName();
  r.set_name(options_.name.empty() ? absl::StrCat(host, ":", getpid()) : options_.name);
  r.set_host(host);
  r.set_device(device_.ToString());
  r.set_version(kVersion);
  r.set_threads(options_.threads);
  r.set_host_cpus(static_cast<int32_t>(std::thread::hardware_concurrency()));
  r.set_free_memory(static_cast<int64_t>(sysconf(_SC_AVPHYS_PAGES)) * sysconf(_SC_PAGESIZE));
  if (device_.is_gpu()) {
    // A GPU worker: placement counts the device's memory, as free now.
    absl::StatusOr<transport::nccl::DeviceInfo> info = transport::nccl::GetDeviceInfo(device_.index);
    if (info.ok()) {
      r.set_free_memory(info->free_bytes);
      r.set_device_name(info->name);
    } else {
      log::Warn("{}: {}; registering without its free memory", device_.ToString(), info.status().message());
      r.set_free_memory(0);
    }
  }
  return r;
}

void Agent::OnMessage(const CoordinatorMessage& m) {
  if (m.has_assignment()) {
    OnAssignment(m.assignment());
  } else if (m.has_stage()) {
    OnChunk(m.stage());
  } else if (m.has_data()) {
    OnChunk(m.data());
  } else if (m.has_state()) {
    OnChunk(m.state());
  } else if (m.has_dataset()) {
    OnChunk(m.dataset());
  } else if (m.has_peers()) {
    control_.SetPeers(m.peers());
  } else if (m.has_serve()) {
    control_.PushServe(m.serve());
  } else if (m.has_cancel()) {
    OnCancel(m.cancel());
  }
}

void Agent::OnAssignment(const Assignment& a) {
  if (rank_thread_.joinable()) rank_thread_.join();
  receiver_.Start(a);
  control_.Reset(a.job_id(), a.attempt());
  log::Info("job={} rank={}: receiving {} stage(s) and {} bytes of data{}", a.job_id(), a.rank(), a.stages_size(),
            a.data_bytes(),
            a.attempt() > 0 ? absl::StrCat("; restart ", a.attempt(), " from step ", a.start_step()) : "");
}

template <typename Chunk>
void Agent::OnChunk(const Chunk& chunk) {
  absl::StatusOr<std::optional<ReceivedAssignment>> complete = receiver_.Add(chunk);
  if (!complete.ok()) {
    const Assignment a = receiver_.Drop();
    log::Error("job={} rank={}: {}", a.job_id(), a.rank(), complete.status().message());
    Finished(a, complete.status());
  } else if (complete->has_value()) {
    rank_thread_ = std::thread([this, in = std::move(**complete)]() mutable { RunAssignment(std::move(in)); });
  }
}

void Agent::OnCancel(const CancelAssignment& cancel) {
  if (!control_.Matches(cancel.job_id(), cancel.attempt())) {
    log::Info("job={} cancel ignored: it is not the rank this worker runs", cancel.job_id());
    return;
  }
  log::Warn("job={} cancelled: {}", cancel.job_id(), cancel.reason());
  if (receiver_.receiving()) {
    // Still arriving: drop what came and report, so the coordinator frees this worker.
    Finished(receiver_.Drop(), absl::CancelledError("cancelled while its stages were arriving"));
    return;
  }
  control_.Cancel();
}

void Agent::OnDisconnected() {
  // The coordinator is gone: the rank stops (its job resumes from a checkpoint), and
  // whatever was arriving is dropped.
  control_.Cancel();
  if (receiver_.receiving()) receiver_.Drop();
  if (rank_thread_.joinable()) rank_thread_.join();
}

void Agent::Finished(const Assignment& a, const absl::Status& s) {
  WorkerMessage f;
  RankFinished* r = f.mutable_finished();
  r->set_job_id(a.job_id());
  r->set_rank(a.rank());
  r->set_ok(s.ok());
  r->set_error(std::string(s.message()));
  r->set_code(static_cast<int>(s.code()));
  r->set_attempt(a.attempt());
  r->set_replica(a.replica());
  r->set_tp_rank(a.tp_rank());
  session_->Write(f);
}

void Agent::RunAssignment(ReceivedAssignment in) {
  const Assignment a = in.assignment;
  metrics_.SetBusy(true);
  absl::Status s = RunRank(std::move(in));
  metrics_.SetBusy(false);
  ReturnFreedMemory();  // idle, the worker does not keep its last job's peak
  if (absl::IsCancelled(s)) {
    log::Info("job={} rank={} stopped: {}", a.job_id(), a.rank(), s.message());
  } else if (!s.ok()) {
    log::Error("job={} rank={} failed: {}", a.job_id(), a.rank(), s.message());
  }
  Finished(a, s);
}

absl::StatusOr<std::unique_ptr<stage::BatchSource>> Agent::OpenData(const Assignment& a,
                                                                    const std::vector<std::string>& input_names,
                                                                    const std::string& share,
                                                                    const std::vector<std::string>& roots) const {
  const RankLayout& piece = a.layout();
  if (!piece.has_dataset()) {
    PIPPY_ASSIGN_OR_RETURN(stage::DataSource data, stage::DataSource::FromShareBytes(share, input_names));
    return std::make_unique<stage::DataSource>(std::move(data));
  }
  std::vector<int> inputs(piece.model_inputs().begin(), piece.model_inputs().end());
  PIPPY_ASSIGN_OR_RETURN(std::unique_ptr<stage::Dataset> dataset,
                         stage::Dataset::Open(a.spec().data().dataset(), piece.dataset(), input_names, inputs,
                                              piece.targets(), a.spec().batch_size(), a.spec().seed(), roots));
  const DatasetSpec& ds = a.spec().data().dataset();
  log::Info("job={} rank={}: reading the dataset {} ({} shards, {} samples) itself{}", a.job_id(), a.rank(),
            ds.uploaded() ? ds.uploaded_from() : ds.path(), piece.dataset().shards_size(), piece.dataset().samples(),
            ds.uploaded() ? absl::StrCat(", from its uploaded copy in ", roots.front()) : "");
  return std::unique_ptr<stage::BatchSource>(std::move(dataset));
}

std::string Agent::ReplicaHost() const { return options_.replica_host.empty() ? HostName() : options_.replica_host; }

absl::Status Agent::RunRank(ReceivedAssignment in) {
  // An uploaded dataset: this rank reads its copy of the shards, removed when it ends.
  std::vector<std::string> roots = options_.dataset_roots;
  absl::Cleanup remove_dataset = [dir = in.dataset_dir] {
    if (dir.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  };
  if (!in.dataset_dir.empty()) {
    auto* shards = in.assignment.mutable_layout()->mutable_dataset()->mutable_shards();
    if (shards->size() != static_cast<int>(in.dataset_files.size())) {
      return absl::InternalError(absl::StrCat("the coordinator sent ", in.dataset_files.size(), " shards of ",
                                              shards->size()));
    }
    for (int i = 0; i < shards->size(); ++i) (*shards)[i].set_path(in.dataset_files[static_cast<size_t>(i)]);
    roots = {in.dataset_dir};
  }
  const Assignment& a = in.assignment;
  const JobSpec& spec = a.spec();
  const int world = a.layout().num_ranks();
  const int replicas = std::max(1, spec.replicas());
  log::Info("job={} rank={} of {}: received {} bytes; loading stage(s)", a.job_id(), a.rank(), world,
            in.bytes_received);
  const int tp_size = std::max(1, spec.tensor_parallel().size());
  if (tp_size > 1 && device_.is_gpu()) {
    return absl::UnimplementedError(absl::StrCat("tensor parallelism (", tp_size, " ranks per stage) runs on CPU "
                                                 "workers only (its all-reduces are gloo over TCP); this worker's "
                                                 "device is ", device_.ToString(), ": submit without "
                                                 "--tensor-parallel, or to workers started with --device cpu"));
  }
  if (replicas > 1 && device_.is_gpu()) {
    return absl::UnimplementedError(absl::StrCat("data parallelism (replicas ", spec.replicas(), ") runs on CPU "
                                                 "workers only (the replicas' all-reduce is gloo over TCP); this "
                                                 "worker's device is ", device_.ToString(),
                                                 ": submit without --replicas, or to workers started with "
                                                 "--device cpu"));
  }
  at::set_num_threads(options_.threads);
  torch::jit::setGraphExecutorOptimize(false);
  job::SeedProcessForRank(spec, a.rank(), a.replica(), world);
  PIPPY_ASSIGN_OR_RETURN(LoadedStages stages, LoadStages(std::move(in.stages)));
  std::vector<std::string> input_names;
  for (const ModelValue& v : a.plan().inputs()) input_names.push_back(v.name());
  PIPPY_ASSIGN_OR_RETURN(std::unique_ptr<stage::BatchSource> data, OpenData(a, input_names, in.data, roots));
  std::string().swap(in.data);
  std::unique_ptr<stage::BatchSource> eval_data;  // the validation dataset (spec.eval), on the ranks reading it
  if (a.layout().has_eval_dataset()) {
    std::vector<int> inputs(a.layout().model_inputs().begin(), a.layout().model_inputs().end());
    PIPPY_ASSIGN_OR_RETURN(eval_data, stage::Dataset::Open(spec.eval().dataset(), a.layout().eval_dataset(),
                                                           input_names, inputs, a.layout().targets(),
                                                           spec.batch_size(), spec.seed(), options_.dataset_roots));
  }
  std::vector<std::pair<std::string, std::string>> ucx_config;
  if (!options_.ucx_tls.empty()) ucx_config = {{"TLS", options_.ucx_tls}};
  PIPPY_ASSIGN_OR_RETURN(auto transports, RankTransports::Create(a.rank(), world, torch_device_, ucx_config));
  WorkerMessage addr;
  RankAddress* ra = addr.mutable_address();
  ra->set_job_id(a.job_id());
  ra->set_rank(a.rank());
  ra->set_ucx_address(transports->address());
  ra->set_bytes_received(in.bytes_received);
  ra->set_loaded_param_bytes(stages.param_bytes);
  ra->set_attempt(a.attempt());
  ra->set_replica(a.replica());
  ra->set_tp_rank(a.tp_rank());
  // Tensor parallelism: this rank's endpoints for its group (the same stages' other shards).
  std::unique_ptr<transport::gloo_group::GlooGroup> tp_group;
  if (tp_size > 1) {
    PIPPY_ASSIGN_OR_RETURN(tp_group, transport::gloo_group::GlooGroup::Create(a.tp_rank(), tp_size, ReplicaHost(),
                                                                              options_.wait_timeout));
    ra->set_tp_gloo_address(tp_group->address());
  }
  // Data parallelism: this rank's endpoints for its replica group (gloo, TCP).
  std::unique_ptr<transport::gloo_group::GlooGroup> group;
  if (replicas > 1) {
    PIPPY_ASSIGN_OR_RETURN(group, transport::gloo_group::GlooGroup::Create(a.replica(), replicas, ReplicaHost(),
                                                                           options_.wait_timeout));
    ra->set_gloo_address(group->address());
  }
  session_->Write(addr);
  PIPPY_ASSIGN_OR_RETURN(RankControl::Peers peers, control_.WaitForPeers(options_.wait_timeout));
  PIPPY_RETURN_IF_ERROR(transports->Connect(peers.ucx));
  if (group != nullptr) PIPPY_RETURN_IF_ERROR(group->Connect(peers.replicas));
  if (tp_group != nullptr) PIPPY_RETURN_IF_ERROR(tp_group->Connect(peers.tensor_parallel));
  PIPPY_ASSIGN_OR_RETURN(auto rank_job,
                         job::RankJob::Create(spec, a.plan(), a.layout(), a.rank(), std::move(stages.modules),
                                              transports->transport(), options_.wait_timeout, group.get(),
                                              torch_device_, tp_group.get()));
  PIPPY_RETURN_IF_ERROR(control_.Attach(rank_job.get()));
  absl::Cleanup detach = [this] { control_.Detach(); };  // before the rank job goes
  if (a.state_bytes() > 0) {
    // A restart: the optimizer and the random generator as they were at the checkpoint.
    PIPPY_RETURN_IF_ERROR(rank_job->RestoreState(in.state));
    std::string().swap(in.state);
  }
  KeepFreedMemory();  // the stages are loaded: from here on, buffers are reused step after step
  const Writer write = [this](const WorkerMessage& m) { return session_->Write(m); };
  if (spec.has_serving()) return RunServing(a, *rank_job, control_, write, metrics_);
  return RunTrainingSteps(a, *rank_job, *data, eval_data.get(), write, metrics_);
}

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
