// NCCL backend of transport.h for CUDA tensors between GPUs: ncclSend/ncclRecv on one
// communicator per pipeline group (the unique id is handed over by the control plane).
//
// NCCL matches messages by order, not by tag: for each (sender, receiver) pair the
// n-th Send meets the n-th Recv. Pipeline schedules post them in the same order on
// both sides; every message still carries the tag in its header, and a mismatch is an
// INTERNAL error naming both tags rather than silently wrong data.
//
// A message is a header (structure, dtypes, shapes — staged through a small device
// buffer) and then the tensors' bytes, straight between tensor storages. Sends accept
// CPU tensors too (copied to the device first); received tensors live on the device.
//
// Streams: one NCCL thread issues operations in posting order on a dedicated stream;
// operations posted together (1F1B's paired send and receive) go into one
// ncclGroupStart/End. The comm stream waits on an event recorded on the default
// (compute) stream before a send, and the compute stream waits on the receive's event
// before the received tensor is used.
//
// Limit: batches run one after another, each to completion. An operation posted while
// a batch is in flight waits for it, so two ranks whose pending operations each wait
// for one queued behind the other's batch deadlock (until abort_after): e.g. 1F1B,
// where rank 0's "send activation 1" is in flight while its "receive gradient 0" is
// queued, and rank 1's "send gradient 0" is in flight while its "receive activation 1"
// is queued. The shared suite posts in patterns that do not hit this; pipeline jobs
// would (job::kJobsUseNccl is false). A fix must keep an operation from waiting behind
// one it does not depend on — e.g. the runtime handing over each schedule action's
// sends and receives as one group, as PiPPy does with batch_isend_irecv. And order
// matching must be per channel (one kind of message between one pair of stages), not
// per pair of ranks: the runtime posts each channel's messages in one order at both
// ends (runtime_test checks it for every schedule), but with several stages per rank
// a pair of ranks' activations and gradients interleave differently at the two ends
// (25 of runtime_test's 72 training cases).
//
// Failure: NCCL cannot time out a transfer by itself; an operation pending past
// Options::abort_after aborts the communicator (ncclCommAbort) and fails every pending
// operation with UNAVAILABLE — a dead peer never hangs the survivor.
//
// Built only where CUDA and NCCL are found (//third_party/cuda); elsewhere Create()
// returns UNIMPLEMENTED.
#ifndef PIPPY_PIPELINE_TRANSPORT_NCCL_NCCL_TRANSPORT_H_
#define PIPPY_PIPELINE_TRANSPORT_NCCL_NCCL_TRANSPORT_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "pipeline/transport/transport.h"

namespace pippy::transport::nccl {

struct Options {
  int device = 0;                                   // CUDA device of this rank
  absl::Duration abort_after = absl::Seconds(300);  // then ncclCommAbort
};

// Number of CUDA devices visible (0 where there is no GPU or no CUDA build).
int VisibleDevices();

// A CUDA device's name and memory (cudaGetDeviceProperties, cudaMemGetInfo), for a
// worker's registration. Errors: UNIMPLEMENTED without CUDA; UNAVAILABLE with CUDA's
// message.
struct DeviceInfo {
  std::string name;
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
};
absl::StatusOr<DeviceInfo> GetDeviceInfo(int device);

// A new NCCL unique id (bytes) for rank 0 to hand to the others.
absl::StatusOr<std::string> NewUniqueId();

// Joins the communicator `unique_id` as `rank` of `world_size` (collective: every rank
// must call it). Errors: UNIMPLEMENTED without CUDA; UNAVAILABLE with NCCL's message.
absl::StatusOr<std::unique_ptr<Transport>> Create(int rank, int world_size, const std::string& unique_id,
                                                  const Options& options = {});

}  // namespace pippy::transport::nccl

#endif  // PIPPY_PIPELINE_TRANSPORT_NCCL_NCCL_TRANSPORT_H_
