// Copies between a device's memory and host memory for ucx+staging (staging_transport.h).
//
// A DeviceCopier moves the tensors of a value (through tuples and lists) between its
// device and the host. SyncCopier does it on the caller's thread and stream: the call
// returns when the copy is done. The CUDA copier (NewCudaCopier) copies through pinned
// host buffers on a non-blocking stream of its own, so the calling thread goes on
// queueing compute while the copies run:
//   - ToHost: the copies start once the compute already queued on the device's default
//     stream has produced the tensors; the call returns at once with host tensors that
//     are filled when `done` says so. The device tensors are kept alive until then.
//   - ToDevice: the host tensors are copied into pinned buffers, then onto the device
//     on the copy stream; the default stream waits for those copies, so compute queued
//     after the call may use the result at once. (The copies wait for the compute
//     queued before the call: the new device tensors come from LibTorch's caching
//     allocator, whose reuse of freed memory is ordered on the default stream.)
// The compute stream is the device's default (legacy) stream, which the runtime
// computes on (it sets no stream of its own), as the NCCL backend also assumes.
//
// Thread safety: every method may be called from any thread. A copier outlives the
// CopyDone handles it returned.
#ifndef PIPPY_PIPELINE_TRANSPORT_STAGING_DEVICE_COPIER_H_
#define PIPPY_PIPELINE_TRANSPORT_STAGING_DEVICE_COPIER_H_

#include <functional>
#include <memory>

#include "ATen/core/ivalue.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "c10/core/Device.h"

namespace pippy::transport::staging {

// Whether `value` holds a tensor that is not on `device`.
bool HasTensorOffDevice(const c10::IValue& value, const c10::Device& device);

// Copies in flight: what they produce must not be read before Wait() returned OK.
// Destroying a handle whose copies are still running waits for them (they finish on
// their own; their buffers must not be reused under them).
class CopyDone {
 public:
  virtual ~CopyDone() = default;
  // OK once the copies have finished; DEADLINE_EXCEEDED when `timeout` passes first
  // (they stay in flight: wait again); UNAVAILABLE with the device's error.
  virtual absl::Status Wait(absl::Duration timeout) = 0;
};

class DeviceCopier {
 public:
  virtual ~DeviceCopier() = default;
  virtual const c10::Device& device() const = 0;

  struct Staged {
    c10::IValue host;               // the value, its tensors in host memory
    std::unique_ptr<CopyDone> done;  // null: the copies are done already
  };
  // The value with every tensor not on the host copied to host memory (tensors on
  // another device than this copier's are copied synchronously).
  virtual absl::StatusOr<Staged> ToHost(const c10::IValue& value) = 0;
  // The value with every host tensor copied onto this copier's device; compute queued
  // after the call on the device's default stream may use it at once.
  virtual absl::StatusOr<c10::IValue> ToDevice(const c10::IValue& value) = 0;
};

// Copies with LibTorch's Tensor::to on the caller's thread and stream, for any device
// LibTorch knows (a GPU, or `meta` in tests). Errors: LibTorch's message as INTERNAL.
class SyncCopier : public DeviceCopier {
 public:
  explicit SyncCopier(c10::Device device) : device_(device) {}
  const c10::Device& device() const override { return device_; }
  absl::StatusOr<Staged> ToHost(const c10::IValue& value) override;
  absl::StatusOr<c10::IValue> ToDevice(const c10::IValue& value) override;

 private:
  const c10::Device device_;
};

// The CUDA copier for device `device` (see above). Errors: UNIMPLEMENTED where pippy
// was built without CUDA; UNAVAILABLE with CUDA's message (no such device, no driver).
absl::StatusOr<std::unique_ptr<DeviceCopier>> NewCudaCopier(int device);

// What a rank on `device` receives large payloads into (ucx::Options::receive_buffer):
// on a CUDA device, pinned host memory, which the CUDA copier copies onto the device
// straight away (pageable memory is first copied into a pinned buffer); elsewhere,
// unset (LibTorch's allocator).
std::function<at::Tensor(int64_t nbytes)> ReceiveBuffersFor(const c10::Device& device);

}  // namespace pippy::transport::staging

#endif  // PIPPY_PIPELINE_TRANSPORT_STAGING_DEVICE_COPIER_H_
