// The device a worker process (pippy-worker, pippy-rank) runs its stages on: the
// --device flag parsed, `auto` resolved (LOCAL_RANK among the visible GPUs), and
// checked against this build's LibTorch and the GPUs it sees (common/device.h).
#ifndef PIPPY_WORKER_PROCESS_DEVICE_H_
#define PIPPY_WORKER_PROCESS_DEVICE_H_

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "c10/core/Device.h"
#include "common/device.h"

namespace pippy::worker {

// Errors: INVALID_ARGUMENT as ParseDevice and CheckDevice say (the flag's forms; a
// LibTorch without CUDA, naming how to build with one; an ordinal beyond the GPUs).
absl::StatusOr<Device> ProcessDevice(absl::string_view flag);

// LibTorch's name for `device`. REQUIRES: not Kind::kAuto (ProcessDevice resolved it).
c10::Device TorchDevice(const Device& device);

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_PROCESS_DEVICE_H_
