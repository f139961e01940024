#include "pipeline/transport/nccl/nccl_transport.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "pipeline/transport/completion.h"
#include "pipeline/transport/nccl/cuda_status.h"
#include "pipeline/transport/wire_format.h"

namespace pippy::transport::nccl {
namespace {

// Headers travel in fixed-size slots: NCCL needs matching sizes on both sides.
constexpr size_t kSlot = 16 * 1024;
constexpr size_t kMaxBatch = 64;

class NcclOp : public CompletionWork {
 public:
  NcclOp(bool is_recv, int self, int peer, const Tag& tag) : CompletionWork(self, peer, tag, is_recv) {}
  // NCCL cannot withdraw a posted operation; a cancelled one completes unseen.
  void Cancel() override { Finish(absl::CancelledError(absl::StrCat(tag().ToString(), " cancelled"))); }

  // NCCL thread state.
  std::string header;  // [u64 packed tag][u64 length][wire header]
  std::vector<at::Tensor> tensors;
  c10::IValue value;
  std::chrono::steady_clock::time_point posted = std::chrono::steady_clock::now();
};

class NcclTransport : public Transport {
 public:
  NcclTransport(int rank, int n, const Options& o) : rank_(rank), n_(n), options_(o) {}
  ~NcclTransport() override {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    if (thread_.joinable()) thread_.join();
    if (comm_ != nullptr) ncclCommAbort(comm_);
    if (slots_ != nullptr) cudaFree(slots_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init(const std::string& unique_id) {
    if (unique_id.size() != sizeof(ncclUniqueId)) {
      return absl::InvalidArgumentError("the NCCL unique id has the wrong size (pass NewUniqueId()'s bytes)");
    }
    ncclUniqueId id;
    std::memcpy(&id, unique_id.data(), sizeof(id));
    absl::Status s = CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice");
    if (s.ok()) s = CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    if (s.ok()) s = CudaStatus(cudaMalloc(&slots_, kSlot * kMaxBatch), "cudaMalloc");
    if (s.ok()) s = NcclStatus(ncclCommInitRank(&comm_, n_, id, rank_), "ncclCommInitRank");
    if (!s.ok()) return s;
    thread_ = std::thread([this] { Loop(); });
    return absl::OkStatus();
  }

  int rank() const override { return rank_; }
  int world_size() const override { return n_; }

  std::shared_ptr<Work> Send(int peer, const Tag& tag, c10::IValue value) override {
    auto op = std::make_shared<NcclOp>(false, rank_, peer, tag);
    std::string wire;
    absl::Status s = wire::EncodeHeader(value, &wire, &op->tensors);
    if (s.ok() && wire.size() + 16 > kSlot) s = absl::InvalidArgumentError("value structure too large for NCCL");
    if (!s.ok()) {
      op->Finish(s);
      return op;
    }
    uint64_t packed = tag.Pack(), len = wire.size();
    op->header.assign(reinterpret_cast<const char*>(&packed), 8);
    op->header.append(reinterpret_cast<const char*>(&len), 8);
    op->header += wire;
    return Post(op);
  }

  std::shared_ptr<Work> Recv(int peer, const Tag& tag) override {
    return Post(std::make_shared<NcclOp>(true, rank_, peer, tag));
  }

 private:
  std::shared_ptr<Work> Post(std::shared_ptr<NcclOp> op) {
    if (op->peer() < 0 || op->peer() >= n_ || op->peer() == rank_) {
      op->Finish(absl::InvalidArgumentError(absl::StrCat("NCCL transport: bad peer rank ", op->peer())));
      return op;
    }
    absl::MutexLock lock(&mu_);
    if (aborted_) {
      op->Finish(absl::UnavailableError("NCCL communicator was aborted after a peer stopped responding"));
      return op;
    }
    queue_.push_back(op);  // the loop's Await wakes on the change
    return op;
  }

  void FailAll(const absl::Status& s, std::vector<std::shared_ptr<NcclOp>>* ops) {
    for (auto& op : *ops) op->Finish(s);
    ops->clear();
  }

  // Waits for the comm stream, or aborts the communicator past the deadline.
  absl::Status SyncStream(const std::vector<std::shared_ptr<NcclOp>>& batch) {
    while (true) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return CudaStatus(e, "NCCL stream");
      for (const auto& op : batch) {
        if (std::chrono::steady_clock::now() - op->posted > absl::ToChronoSeconds(options_.abort_after)) {
          ncclCommAbort(comm_);
          comm_ = nullptr;
          {
            absl::MutexLock lock(&mu_);
            aborted_ = true;
          }
          return absl::UnavailableError(absl::StrCat("rank ", rank_, ": peer rank ", op->peer(), " did not take part in ",
                                                     op->tag().ToString(), " within ",
                                                     absl::FormatDuration(options_.abort_after),
                                                     "; NCCL communicator aborted"));
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

  void RunBatch(std::vector<std::shared_ptr<NcclOp>>& batch) {
    cudaSetDevice(options_.device);
    // Phase 1: headers, all in one group.
    std::vector<char> host(kSlot * batch.size(), 0);
    for (size_t i = 0; i < batch.size(); ++i) {
      if (!batch[i]->is_recv()) std::memcpy(host.data() + i * kSlot, batch[i]->header.data(), batch[i]->header.size());
    }
    char* dev = static_cast<char*>(slots_);
    absl::Status s = CudaStatus(cudaMemcpyAsync(dev, host.data(), host.size(), cudaMemcpyHostToDevice, stream_), "header copy");
    if (s.ok()) s = NcclStatus(ncclGroupStart(), "ncclGroupStart");
    for (size_t i = 0; s.ok() && i < batch.size(); ++i) {
      auto& op = batch[i];
      s = op->is_recv() ? NcclStatus(ncclRecv(dev + i * kSlot, kSlot, ncclUint8, op->peer(), comm_, stream_), "ncclRecv")
                      : NcclStatus(ncclSend(dev + i * kSlot, kSlot, ncclUint8, op->peer(), comm_, stream_), "ncclSend");
    }
    if (s.ok()) s = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
    if (s.ok()) s = CudaStatus(cudaMemcpyAsync(host.data(), dev, host.size(), cudaMemcpyDeviceToHost, stream_), "header copy");
    if (s.ok()) s = SyncStream(batch);
    if (!s.ok()) return FailAll(s, &batch);
    // Phase 2: decode received headers, stage send tensors, then all payloads in one group.
    const at::Device device(at::kCUDA, options_.device);
    for (size_t i = 0; i < batch.size(); ++i) {
      auto& op = batch[i];
      if (op->is_recv()) {
        const char* h = host.data() + i * kSlot;
        uint64_t packed, len;
        std::memcpy(&packed, h, 8);
        std::memcpy(&len, h + 8, 8);
        if (packed != op->tag().Pack()) {
          op->Finish(absl::InternalError(absl::StrCat(
              "rank ", rank_, ": NCCL matches messages by order, and rank ", op->peer(), " sent ",
              Tag::Unpack(packed).ToString(), " where ", op->tag().ToString(), " was expected: the two ranks post their "
              "operations in different orders")));
          continue;
        }
        auto v = wire::DecodeHeader(h + 16, len,
                                    [&](const std::vector<int64_t>& sizes, c10::ScalarType dt) {
                                      return at::empty(sizes, at::TensorOptions().dtype(dt).device(device));
                                    },
                                    &op->tensors);
        if (!v.ok()) {
          op->Finish(v.status());
          continue;
        }
        op->value = *v;
      } else {
        for (at::Tensor& t : op->tensors) {
          if (!t.is_cuda()) t = t.to(device);
        }
      }
    }
    cudaEvent_t ready;
    cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    cudaEventRecord(ready, nullptr);  // the default (compute) stream's work so far
    cudaStreamWaitEvent(stream_, ready, 0);
    cudaEventDestroy(ready);
    s = NcclStatus(ncclGroupStart(), "ncclGroupStart");
    for (auto& op : batch) {
      if (op->IsCompleted()) continue;
      for (const at::Tensor& t : op->tensors) {
        const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
        if (bytes == 0 || !s.ok()) continue;
        s = op->is_recv() ? NcclStatus(ncclRecv(t.data_ptr(), bytes, ncclUint8, op->peer(), comm_, stream_), "ncclRecv")
                        : NcclStatus(ncclSend(t.data_ptr(), bytes, ncclUint8, op->peer(), comm_, stream_), "ncclSend");
      }
    }
    if (s.ok()) s = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
    if (s.ok()) s = SyncStream(batch);
    if (!s.ok()) return FailAll(s, &batch);
    // Compute that uses received tensors is ordered after the transfer.
    cudaEvent_t done;
    cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    cudaEventRecord(done, stream_);
    cudaStreamWaitEvent(nullptr, done, 0);
    cudaEventDestroy(done);
    for (auto& op : batch) op->Finish(absl::OkStatus(), op->value);
  }

  void Loop() {
    cudaSetDevice(options_.device);
    while (true) {
      std::vector<std::shared_ptr<NcclOp>> batch;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
        // Idle until there is work; Stop() ends it (no deadline: nothing is waited for).
        mu_.Await(absl::Condition(&ready));
        if (stop_) break;
        while (!queue_.empty() && batch.size() < kMaxBatch) {
          if (!queue_.front()->IsCompleted()) batch.push_back(queue_.front());
          queue_.pop_front();
        }
        if (aborted_) {
          for (auto& op : batch) op->Finish(absl::UnavailableError("NCCL communicator aborted"));
          continue;
        }
      }
      if (!batch.empty()) RunBatch(batch);
    }
  }

  const int rank_, n_;
  const Options options_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* slots_ = nullptr;
  std::thread thread_;
  absl::Mutex mu_;
  std::deque<std::shared_ptr<NcclOp>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

int VisibleDevices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
  return n;
}

absl::StatusOr<DeviceInfo> GetDeviceInfo(int device) {
  cudaDeviceProp prop;
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cuda:", device, ": cudaGetDeviceProperties: ", cudaGetErrorString(e)));
  }
  int previous = 0;
  cudaGetDevice(&previous);
  size_t free_bytes = 0, total_bytes = 0;
  e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMemGetInfo(&free_bytes, &total_bytes);
  cudaSetDevice(previous);
  if (e != cudaSuccess) {
    return absl::UnavailableError(absl::StrCat("cuda:", device, ": cudaMemGetInfo: ", cudaGetErrorString(e)));
  }
  DeviceInfo info;
  info.name = prop.name;
  info.free_bytes = static_cast<int64_t>(free_bytes);
  info.total_bytes = static_cast<int64_t>(total_bytes);
  return info;
}

absl::StatusOr<std::string> NewUniqueId() {
  ncclUniqueId id;
  absl::Status s = NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId");
  if (!s.ok()) return s;
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

absl::StatusOr<std::unique_ptr<Transport>> Create(int rank, int world_size, const std::string& unique_id,
                                                  const Options& options) {
  if (VisibleDevices() <= options.device) {
    return absl::UnavailableError(absl::StrCat("no CUDA device ", options.device, " (", VisibleDevices(), " visible)"));
  }
  auto t = std::make_unique<NcclTransport>(rank, world_size, options);
  absl::Status s = t->Init(unique_id);
  if (!s.ok()) return s;
  return std::unique_ptr<Transport>(std::move(t));
}

}  // namespace pippy::transport::nccl
