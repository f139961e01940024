// Point-to-point transfer of values between pipeline ranks: the interface every
// backend implements (loopback/ for in-process tests, ucx/ and nccl/ for processes).
//
// Values are what stages exchange: a tensor, None, a number, or a tuple/list of
// those. A message carries its own structure, dtype and shape, so receivers need no
// prior knowledge and shapes may change from one step to the next.
//
// Ordering: messages between one (sender, receiver) pair with the same Tag match in
// the order they were posted; different tags match independently of posting order.
//
// Thread safety: every method of Transport and Work may be called from any thread.
// Ownership: the caller keeps the returned Work alive until it has waited on it or
// cancelled it; a sent tensor must not be modified until its send completes.
//
// Errors from Work::Wait():
//   DEADLINE_EXCEEDED  the timeout passed; the message names the peer and the tag.
//                      The operation stays pending: wait again or Cancel() it.
//   CANCELLED          Cancel() was called.
//   UNAVAILABLE        the peer is gone (process died, transport shut down).
//   INVALID_ARGUMENT   the peer rank is out of range.
#ifndef PIPPY_PIPELINE_TRANSPORT_TRANSPORT_H_
#define PIPPY_PIPELINE_TRANSPORT_TRANSPORT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "ATen/core/ivalue.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

namespace pippy::transport {

// Identifies a message between two ranks within one job. Packs into 64 bits:
// kind 4, step 16, micro-batch 12, source stage 8, destination stage 8, index 16.
struct Tag {
  enum class Kind : uint8_t {
    kActivation = 1,    // forward output of src_stage for dst_stage
    kGradient = 2,      // gradient for src_stage's input that dst_stage produced
    kTiedGradient = 3,  // tied-weight gradient sync (index = tie group)
    kGradNorm = 4,      // global gradient-norm exchange
    kControl = 5,
    kEvalActivation = 6,  // as kActivation, for an evaluation batch of a training job
  };
  Kind kind = Kind::kActivation;
  uint32_t step = 0;
  uint32_t microbatch = 0;
  uint32_t src_stage = 0;
  uint32_t dst_stage = 0;
  uint32_t index = 0;

  uint64_t Pack() const;
  static Tag Unpack(uint64_t packed);
  std::string ToString() const;  // "activation step=3 mb=1 stage 0->1 #0"
  bool operator==(const Tag& o) const { return Pack() == o.Pack(); }
};

// One posted send or receive.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completes, fails, or `timeout` passes.
  virtual absl::Status Wait(absl::Duration timeout) = 0;
  // Non-blocking: whether Wait() would return immediately.
  virtual bool IsCompleted() = 0;
  // Stops a pending operation; Wait() then returns CANCELLED. No effect when done.
  virtual void Cancel() = 0;
  // The received value. REQUIRES: a receive whose Wait() returned OK.
  virtual c10::IValue Value() = 0;
};

// `value` with `fn` applied to every tensor in it, through tuples and lists (which
// keep their element type); other values as they are.
c10::IValue MapTensors(const c10::IValue& value, const std::function<at::Tensor(const at::Tensor&)>& fn);

// `value` with every tensor in it (through tuples and lists) on `device`; tensors
// already there are the same tensors. Synchronous (Tensor::to).
c10::IValue ToDevice(const c10::IValue& value, const c10::Device& device);

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // Posts a send of `value` to rank `peer`. Never blocks on the receiver.
  virtual std::shared_ptr<Work> Send(int peer, const Tag& tag, c10::IValue value) = 0;
  // Posts a receive from rank `peer` for `tag`.
  virtual std::shared_ptr<Work> Recv(int peer, const Tag& tag) = 0;
};

}  // namespace pippy::transport

#endif  // PIPPY_PIPELINE_TRANSPORT_TRANSPORT_H_
