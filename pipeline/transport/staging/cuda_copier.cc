// The CUDA copier of device_copier.h: pinned host buffers, a non-blocking copy stream,
// events between it and the device's default (compute) stream. Only CUDA's runtime API
// and LibTorch's device-independent API are used, so this compiles against a CPU-only
// LibTorch too (pinned host tensors then fail at run time, where no GPU rank runs).
#include <cuda_runtime.h>

#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status.h"
#include "pipeline/transport/staging/device_copier.h"
#include "pipeline/transport/transport.h"

namespace pippy::transport::staging {
namespace {

absl::Status Cuda(cudaError_t e, int device, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("cuda:", device, ": ", what, ": ", cudaGetErrorString(e)));
}

// Makes `device` current on this thread for the scope, as LibTorch's device guards do.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaGetDevice(&previous_);
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceScope() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

// The tensors a copy reads and writes, kept until the copy's event has completed.
class CudaDone : public CopyDone {
 public:
  CudaDone(int device, cudaEvent_t event, std::vector<at::Tensor> keep)
      : device_(device), event_(event), keep_(std::move(keep)) {}
  ~CudaDone() override {
    // A copy still writing into a pinned buffer must finish before the buffer can go
    // back to LibTorch's host allocator.
    cudaEventSynchronize(event_);
    cudaEventDestroy(event_);
  }

  absl::Status Wait(absl::Duration timeout) override {
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
    while (true) {
      const cudaError_t e = cudaEventQuery(event_);
      if (e == cudaSuccess) return absl::OkStatus();
      if (e != cudaErrorNotReady) return Cuda(e, device_, "copy to host");
      if (std::chrono::steady_clock::now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("cuda:", device_, ": a device-to-host copy did not finish within ",
                                                        absl::FormatDuration(timeout)));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }

 private:
  const int device_;
  cudaEvent_t event_;
  std::vector<at::Tensor> keep_;
};

class CudaCopier : public DeviceCopier {
 public:
  explicit CudaCopier(int device) : index_(device), device_(c10::kCUDA, static_cast<c10::DeviceIndex>(device)) {}
  ~CudaCopier() override {
    if (stream_ == nullptr) return;
    DeviceScope scope(index_);
    cudaStreamSynchronize(stream_);
    {
      absl::MutexLock lock(&mu_);
      for (InFlight& f : in_flight_) cudaEventDestroy(f.event);
      in_flight_.clear();
    }
    cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    int n = 0;
    PIPPY_RETURN_IF_ERROR(Cuda(cudaGetDeviceCount(&n), index_, "cudaGetDeviceCount"));
    if (index_ < 0 || index_ >= n) {
      return absl::UnavailableError(absl::StrCat("cuda:", index_, ": no such device (", n,
                                                    " visible; check --device and CUDA_VISIBLE_DEVICES)"));
    }
    DeviceScope scope(index_);
    return Cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), index_, "cudaStreamCreateWithFlags");
  }

  const c10::Device& device() const override { return device_; }

  absl::StatusOr<Staged> ToHost(const c10::IValue& value) override {
    std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (device source, pinned host destination)
    Staged staged;
    try {
      staged.host = MapTensors(value, [&](const at::Tensor& t) {
        if (!t.defined() || t.device().is_cpu()) return t;
        if (t.device() != device_) return t.to(c10::kCPU);  // another device's tensor: a plain copy
        at::Tensor src = t.contiguous();  // queued on the compute stream, before the event below
        at::Tensor dst = at::empty(src.sizes(), src.options().device(c10::kCPU).pinned_memory(true));
        copies.emplace_back(src, dst);
        return dst;
      });
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat(device_.str(), ": staging a value to the host: ", e.what()));
    }
    if (copies.empty()) return staged;
    DeviceScope scope(index_);
    PIPPY_ASSIGN_OR_RETURN(cudaEvent_t done, CopyAll(copies, cudaMemcpyDeviceToHost));
    std::vector<at::Tensor> keep;
    for (auto& [src, dst] : copies) {
      keep.push_back(std::move(src));
      keep.push_back(std::move(dst));
    }
    staged.done = std::make_unique<CudaDone>(index_, done, std::move(keep));
    return staged;
  }

  absl::StatusOr<c10::IValue> ToDevice(const c10::IValue& value) override {
    Reclaim();
    std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (pinned host source, device destination)
    c10::IValue out;
    try {
      out = MapTensors(value, [&](const at::Tensor& t) {
        if (!t.defined() || t.device() == device_) return t;
        if (!t.device().is_cpu()) return t.to(device_);
        at::Tensor pinned = t;
        if (!t.is_contiguous() || !t.is_pinned()) {  // received into pageable memory: a host memcpy first
          pinned = at::empty(t.sizes(), t.options().pinned_memory(true));
          pinned.copy_(t);
        }
        at::Tensor dst = at::empty(t.sizes(), t.options().device(device_));
        copies.emplace_back(pinned, dst);
        return dst;
      });
    } catch (const std::exception& e) {
      return absl::InternalError(absl::StrCat(device_.str(), ": staging a value onto the device: ", e.what()));
    }
    if (copies.empty()) return out;
    DeviceScope scope(index_);
    PIPPY_ASSIGN_OR_RETURN(cudaEvent_t done, CopyAll(copies, cudaMemcpyHostToDevice));
    // Compute queued from here on runs after the copies.
    const absl::Status s = Cuda(cudaStreamWaitEvent(nullptr, done, 0), index_, "cudaStreamWaitEvent");
    std::vector<at::Tensor> keep;  // the pinned sources, until the copies are done
    for (auto& [pinned, dst] : copies) keep.push_back(std::move(pinned));
    {
      absl::MutexLock lock(&mu_);
      in_flight_.push_back({done, std::move(keep)});
    }
    if (!s.ok()) return s;
    return out;
  }

 private:
  struct InFlight {
    cudaEvent_t event;
    std::vector<at::Tensor> keep;
  };

  // The copy stream waits for the work queued so far on the default stream.
  absl::Status WaitForCompute() {
    cudaEvent_t ready = nullptr;
    PIPPY_RETURN_IF_ERROR(Cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), index_, "cudaEventCreate"));
    absl::Status s = Cuda(cudaEventRecord(ready, nullptr), index_, "cudaEventRecord");
    if (s.ok()) s = Cuda(cudaStreamWaitEvent(stream_, ready, 0), index_, "cudaStreamWaitEvent");
    cudaEventDestroy(ready);  // released once it has completed
    return s;
  }

  // Queues (source, destination) copies on the copy stream after the compute queued so
  // far; returns an event recorded after them. On an error the copies already queued
  // have finished when it returns (the caller then frees their buffers).
  absl::StatusOr<cudaEvent_t> CopyAll(const std::vector<std::pair<at::Tensor, at::Tensor>>& copies, cudaMemcpyKind kind) {
    PIPPY_RETURN_IF_ERROR(WaitForCompute());
    absl::Status s;
    for (size_t i = 0; s.ok() && i < copies.size(); ++i) {
      const at::Tensor& src = copies[i].first;
      const size_t bytes = static_cast<size_t>(src.numel()) * src.element_size();
      if (bytes > 0) {
        s = Cuda(cudaMemcpyAsync(copies[i].second.data_ptr(), src.data_ptr(), bytes, kind, stream_), index_,
                 kind == cudaMemcpyDeviceToHost ? "cudaMemcpyAsync (device to host)" : "cudaMemcpyAsync (host to device)");
      }
    }
    cudaEvent_t done = nullptr;
    if (s.ok()) s = Cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), index_, "cudaEventCreate");
    if (s.ok()) {
      s = Cuda(cudaEventRecord(done, stream_), index_, "cudaEventRecord");
      if (!s.ok()) cudaEventDestroy(done);
    }
    if (!s.ok()) {
      cudaStreamSynchronize(stream_);
      return s;
    }
    return done;
  }

  // Lets go of the pinned sources of host-to-device copies that have finished.
  void Reclaim() {
    std::vector<InFlight> finished;
    {
      absl::MutexLock lock(&mu_);
      auto it = in_flight_.begin();
      while (it != in_flight_.end() && cudaEventQuery(it->event) != cudaErrorNotReady) {
        finished.push_back(std::move(*it));
        ++it;
      }
      in_flight_.erase(in_flight_.begin(), it);
    }
    for (InFlight& f : finished) cudaEventDestroy(f.event);
  }

  const int index_;
  const c10::Device device_;
  cudaStream_t stream_ = nullptr;
  absl::Mutex mu_;
  std::vector<InFlight> in_flight_ ABSL_GUARDED_BY(mu_);  // in stream order
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceCopier>> NewCudaCopier(int device) {
  auto copier = std::make_unique<CudaCopier>(device);
  PIPPY_RETURN_IF_ERROR(copier->Init());
  return std::unique_ptr<DeviceCopier>(std::move(copier));
}

}  // namespace pippy::transport::staging
