// The device a worker runs its stages on (pippy-worker --device), apart from LibTorch:
// parsing, resolving `auto`, and the refusal where this build cannot serve it.
#ifndef PIPPY_COMMON_DEVICE_H_
#define PIPPY_COMMON_DEVICE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pippy {

struct Device {
  enum class Kind { kCpu, kCuda, kAuto };
  Kind kind = Kind::kCpu;
  int index = 0;  // cuda: the ordinal among the visible GPUs

  std::string ToString() const;  // "cpu", "cuda:1", "auto"
  bool is_gpu() const { return kind == Kind::kCuda; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
};

// "cpu" | "cuda" (= cuda:0) | "cuda:N" | "auto". Errors: INVALID_ARGUMENT naming the
// flag and the accepted forms.
absl::StatusOr<Device> ParseDevice(absl::string_view text);

// `auto`: the GPU this process is meant to use when there are `cuda_devices` visible
// GPUs (the LOCAL_RANK-th, modulo their number, as torchrun and Kubernetes device
// plugins arrange; CUDA_VISIBLE_DEVICES has already renumbered them from 0), else
// the CPU. Other devices are returned as they are.
Device ResolveDevice(const Device& device, int cuda_devices, const char* local_rank);

// Whether this process can run stages on `device`: `libtorch_has_cuda` (this build's
// LibTorch was compiled with CUDA) and `cuda_devices` (how many GPUs it sees).
// Errors: INVALID_ARGUMENT saying why and what to do (a CPU-only LibTorch; an ordinal
// beyond the visible GPUs).
absl::Status CheckDevice(const Device& device, bool libtorch_has_cuda, int cuda_devices);

}  // namespace pippy

#endif  // PIPPY_COMMON_DEVICE_H_
