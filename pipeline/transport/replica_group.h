// The ranks that hold the same stages in the R replicas of a pipeline (data
// parallelism): after each step their gradients are summed across the group (and
// divided by R by the caller), so every replica takes the same optimizer step.
//
// Implementations: gloo over TCP on CPU (pipeline/transport/gloo/); NCCL on GPU.
//
// Thread safety: one collective at a time per group, called from one thread at a time
// (the runtime runs them in order on its reducer thread).
#ifndef PIPPY_PIPELINE_TRANSPORT_REPLICA_GROUP_H_
#define PIPPY_PIPELINE_TRANSPORT_REPLICA_GROUP_H_

#include "absl/status/status.h"
#include "ATen/core/Tensor.h"

namespace pippy::transport {

class ReplicaGroup {
 public:
  virtual ~ReplicaGroup() = default;
  virtual int size() const = 0;
  virtual int index() const = 0;  // this rank's replica
  // Sums `flat` (a contiguous float32 CPU tensor) element-wise across the group, in
  // place. Every member calls it with the same sizes in the same order.
  // Errors: UNAVAILABLE when a member is gone; DEADLINE_EXCEEDED when one does not
  // take part within the group's timeout; INVALID_ARGUMENT for another kind of tensor.
  virtual absl::Status AllReduceSum(at::Tensor& flat) = 0;
};

}  // namespace pippy::transport

#endif  // PIPPY_PIPELINE_TRANSPORT_REPLICA_GROUP_H_
