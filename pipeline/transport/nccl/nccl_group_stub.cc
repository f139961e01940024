// The NCCL replica group where CUDA/NCCL were not found or --define=pippy_cuda=off.
#include "pipeline/transport/nccl/nccl_group.h"

namespace pippy::transport::nccl {

absl::StatusOr<std::unique_ptr<ReplicaGroup>> CreateReplicaGroup(int, int, const std::string&, const Options&) {
  return absl::UnimplementedError("pippy was built without CUDA/NCCL (see //third_party/cuda)");
}

}  // namespace pippy::transport::nccl
