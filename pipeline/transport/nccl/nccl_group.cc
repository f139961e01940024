#include "pipeline/transport/nccl/nccl_group.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status.h"
#include "pipeline/transport/nccl/cuda_status.h"

namespace pippy::transport::nccl {
namespace {

class NcclGroup : public ReplicaGroup {
 public:
  NcclGroup(int index, int size, const Options& o) : index_(index), size_(size), options_(o) {}
  ~NcclGroup() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
    if (ready_ != nullptr) cudaEventDestroy(ready_);
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
    if (s.ok()) s = CudaStatus(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    if (s.ok()) s = NcclStatus(ncclCommInitRank(&comm_, size_, id, index_), "ncclCommInitRank");
    return s;
  }

  int size() const override { return size_; }
  int index() const override { return index_; }

  absl::Status AllReduceSum(at::Tensor& flat) override {
    if (flat.scalar_type() != at::kFloat || !flat.is_contiguous()) {
      return absl::InvalidArgumentError("the replica all-reduce takes contiguous float32 tensors");
    }
    if (comm_ == nullptr) return absl::UnavailableError("the NCCL replica group was aborted");
    if (size_ == 1 || flat.numel() == 0) return absl::OkStatus();
    const bool on_cpu = flat.device().is_cpu();
    if (!on_cpu && flat.device().index() != options_.device) {
      return absl::InvalidArgumentError(absl::StrCat("the tensor is on cuda:", flat.device().index(),
                                                     ", the replica group on cuda:", options_.device));
    }
    PIPPY_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(options_.device), "cudaSetDevice"));
    at::Tensor work = on_cpu ? flat.to(at::Device(at::kCUDA, options_.device)) : flat;
    // The group's stream starts after what the device's current (compute) stream queued.
    PIPPY_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(ready_, nullptr), "cudaEventRecord"));
    PIPPY_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent"));
    float* p = work.data_ptr<float>();
    PIPPY_RETURN_IF_ERROR(NcclStatus(ncclAllReduce(p, p, static_cast<size_t>(work.numel()), ncclFloat, ncclSum, comm_,
                                               stream_),
                                 "ncclAllReduce"));
    // Wait with a deadline: NCCL never gives up on a dead peer by itself.
    const absl::Time deadline = absl::Now() + options_.abort_after;
    while (true) {
      cudaError_t e = cudaStreamQuery(stream_);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) return CudaStatus(e, "the replica all-reduce");
      if (absl::Now() > deadline) {
        ncclCommAbort(comm_);
        comm_ = nullptr;
        return absl::UnavailableError(absl::StrCat("replica ", index_, ": the gradient all-reduce did not finish within ",
                                                   absl::FormatDuration(options_.abort_after),
                                                   " (a replica is gone?); the group was aborted"));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (on_cpu) flat.copy_(work);
    return absl::OkStatus();
  }

 private:
  const int index_, size_;
  const Options options_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ReplicaGroup>> CreateReplicaGroup(int index, int size, const std::string& unique_id,
                                                                 const Options& options) {
  if (size < 1 || index < 0 || index >= size) {
    return absl::InvalidArgumentError(absl::StrCat("replica ", index, " of ", size, " does not exist"));
  }
  if (VisibleDevices() <= options.device) {
    return absl::UnavailableError(absl::StrCat("no CUDA device ", options.device, " (", VisibleDevices(), " visible)"));
  }
  auto g = std::make_unique<NcclGroup>(index, size, options);
  absl::Status s = g->Init(unique_id);
  if (!s.ok()) return s;
  return std::unique_ptr<ReplicaGroup>(std::move(g));
}

}  // namespace pippy::transport::nccl
