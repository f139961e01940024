// The NCCL backend where CUDA/NCCL were not found or --define=pippy_cuda=off.
#include "pipeline/transport/nccl/nccl_transport.h"

namespace pippy::transport::nccl {

int VisibleDevices() { return 0; }

absl::StatusOr<DeviceInfo> GetDeviceInfo(int) {
  return absl::UnimplementedError("pippy was built without CUDA/NCCL (see //third_party/cuda)");
}

absl::StatusOr<std::string> NewUniqueId() {
  return absl::UnimplementedError("pippy was built without CUDA/NCCL (see //third_party/cuda)");
}

absl::StatusOr<std::unique_ptr<Transport>> Create(int, int, const std::string&, const Options&) {
  return absl::UnimplementedError("pippy was built without CUDA/NCCL (see //third_party/cuda)");
}

}  // namespace pippy::transport::nccl
