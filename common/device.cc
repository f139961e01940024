#include "common/device.h"

#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace pippy {

std::string Device::ToString() const {
  switch (kind) {
    case Kind::kCpu: return "cpu";
    case Kind::kAuto: return "auto";
    case Kind::kCuda: return absl::StrCat("cuda:", index);
  }
  return "?";
}

absl::StatusOr<Device> ParseDevice(absl::string_view text) {
  Device d;
  if (text == "cpu") return d;
  if (text == "auto") {
    d.kind = Device::Kind::kAuto;
    return d;
  }
  if (text == "cuda") {
    d.kind = Device::Kind::kCuda;
    return d;
  }
  int index = -1;
  if (absl::StartsWith(text, "cuda:") && absl::SimpleAtoi(text.substr(5), &index) && index >= 0 && index < 1024 &&
      text.substr(5).find_first_not_of("0123456789") == absl::string_view::npos) {
    d.kind = Device::Kind::kCuda;
    d.index = index;
    return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device '", text, "': use cpu, cuda, cuda:N (N: the GPU's ordinal) or auto"));
}

Device ResolveDevice(const Device& device, int cuda_devices, const char* local_rank) {
  if (device.kind != Device::Kind::kAuto) return device;
  Device d;
  if (cuda_devices <= 0) return d;  // cpu
  int rank = 0;
  if (local_rank == nullptr || !absl::SimpleAtoi(local_rank, &rank) || rank < 0) rank = 0;
  d.kind = Device::Kind::kCuda;
  d.index = rank % cuda_devices;
  return d;
}

absl::Status CheckDevice(const Device& device, bool libtorch_has_cuda, int cuda_devices) {
  if (device.kind != Device::Kind::kCuda) return absl::OkStatus();
  if (!libtorch_has_cuda) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--device ", device.ToString(),
        ": this build's LibTorch has no CUDA (Debian's libtorch is CPU-only). GPU workers need pippy built against "
        "a LibTorch with CUDA: build with PIPPY_LIBTORCH=DIR bazel build //... (DIR: PyTorch's torch package "
        "folder, with include/ and lib/) or scripts/build-nobazel --torch DIR; or use --device cpu"));
  }
  if (device.index >= cuda_devices) {
    return absl::InvalidArgumentError(absl::StrCat("--device ", device.ToString(), ": this process sees ",
                                                   cuda_devices, " GPU(s) (ordinals 0..", cuda_devices - 1,
                                                   "; CUDA_VISIBLE_DEVICES renumbers them)"));
  }
  return absl::OkStatus();
}

}  // namespace pippy
