// "ucx+staging": transfers for a rank whose tensors live on a device (a GPU) over a
// transport that moves host memory (UCX), for the edges NCCL cannot serve — two
// workers sharing one GPU, or a GPU rank and a CPU rank (job::EdgeTransportsFor).
//
// A send copies the value's device tensors to host memory, then posts the host copy on
// the inner transport; a receive's value comes back with its tensors copied to the
// rank's device. Values without device tensors pass through unchanged, so a
// StagingTransport on a CPU rank is the inner transport.
//
// The copies run on the caller's thread and stream in this version: a send's
// device-to-host copy waits for the compute that produced the tensor, and the
// host-to-device copy of a received value happens in Value(). (Overlapping them with
// compute on a stream of their own is not done yet.)
//
// Thread safety and ownership: as transport.h; the inner transport must outlive this.
#ifndef PIPPY_PIPELINE_TRANSPORT_STAGING_STAGING_TRANSPORT_H_
#define PIPPY_PIPELINE_TRANSPORT_STAGING_STAGING_TRANSPORT_H_

#include <memory>

#include "c10/core/Device.h"
#include "pipeline/transport/transport.h"

namespace pippy::transport::staging {

// `value` with every tensor in it (through tuples and lists) on `device`; tensors
// already there are the same tensors.
c10::IValue ToDevice(const c10::IValue& value, const c10::Device& device);

// Whether `value` holds a tensor that is not on `device`.
bool HasTensorOffDevice(const c10::IValue& value, const c10::Device& device);

class StagingTransport : public Transport {
 public:
  // `host`: the transport that moves host memory; `device`: where this rank's tensors live.
  StagingTransport(Transport* host, c10::Device device) : host_(host), device_(device) {}

  int rank() const override { return host_->rank(); }
  int world_size() const override { return host_->world_size(); }
  std::shared_ptr<Work> Send(int peer, const Tag& tag, c10::IValue value) override;
  std::shared_ptr<Work> Recv(int peer, const Tag& tag) override;

  const c10::Device& device() const { return device_; }

 private:
  Transport* host_;
  c10::Device device_;
};

}  // namespace pippy::transport::staging

#endif  // PIPPY_PIPELINE_TRANSPORT_STAGING_STAGING_TRANSPORT_H_
