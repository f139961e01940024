#include "worker/process_device.h"

#include <cstdlib>

#include "ATen/Context.h"
#include "common/status.h"
#include "torch/cuda.h"

namespace pippy::worker {

absl::StatusOr<Device> ProcessDevice(absl::string_view flag) {
  PIPPY_ASSIGN_OR_RETURN(Device device, ParseDevice(flag));
  const bool has_cuda = at::hasCUDA();
  const int gpus = has_cuda ? static_cast<int>(torch::cuda::device_count()) : 0;
  device = ResolveDevice(device, gpus, std::getenv("LOCAL_RANK"));
  PIPPY_RETURN_IF_ERROR(CheckDevice(device, has_cuda, gpus));
  return device;
}

c10::Device TorchDevice(const Device& device) {
  return device.is_gpu() ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(device.index))
                         : c10::Device(c10::kCPU);
}

}  // namespace pippy::worker
