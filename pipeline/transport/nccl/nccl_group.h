// A ReplicaGroup over NCCL (ncclAllReduce) for ranks on GPUs: the data-parallel
// gradient average of `--replicas` jobs whose workers hold their stages on GPUs.
//
// The NCCL unique id is made by one member (NewUniqueId) and handed to the others by
// the control plane, like the pipeline communicator's. Every member calls
// CreateReplicaGroup at once (it is collective).
//
// AllReduceSum takes a contiguous float32 tensor: on this group's device it is summed
// in place on the group's own stream, which first waits for the work queued on the
// device's current stream; a CPU tensor goes through the device (copied there and
// back). NCCL cannot time out by itself: a sum not done within Options::abort_after
// aborts the communicator and returns UNAVAILABLE, so a dead replica never hangs the
// others.
//
// Built only where CUDA and NCCL are found; elsewhere CreateReplicaGroup returns
// UNIMPLEMENTED.
#ifndef PIPPY_PIPELINE_TRANSPORT_NCCL_NCCL_GROUP_H_
#define PIPPY_PIPELINE_TRANSPORT_NCCL_NCCL_GROUP_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "pipeline/transport/nccl/nccl_transport.h"
#include "pipeline/transport/replica_group.h"

namespace pippy::transport::nccl {

// Member `index` of `size` on CUDA device options.device.
// Errors: UNIMPLEMENTED without CUDA; INVALID_ARGUMENT for a bad index or id;
// UNAVAILABLE with CUDA's or NCCL's message.
absl::StatusOr<std::unique_ptr<ReplicaGroup>> CreateReplicaGroup(int index, int size, const std::string& unique_id,
                                                                 const Options& options = {});

}  // namespace pippy::transport::nccl

#endif  // PIPPY_PIPELINE_TRANSPORT_NCCL_NCCL_GROUP_H_
