// Memory the UCX protocol reuses instead of allocating per message.
//
// ReceivePool: tensors that receive payloads. A fresh 64 MiB tensor costs page faults
// (~2 GB/s on these machines), so a buffer goes back to the pool once nothing but the
// pool references its storage, and the next receive of that size takes it (payloads
// under 64 KiB come from the allocator, which is fast at that size). At most 32
// buffers per size and 2 GiB in all are kept.
//
// HeaderPool: the kMaxHeader-byte buffers headers are received into (allocating and
// freeing 64 KiB per message costs glibc a heap consolidation each time).
//
// Thread safety: none; the UCX transport uses both under its worker lock.
#ifndef PIPPY_PIPELINE_TRANSPORT_UCX_RECEIVE_POOL_H_
#define PIPPY_PIPELINE_TRANSPORT_UCX_RECEIVE_POOL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "ATen/ATen.h"

namespace pippy::transport::ucx {

class ReceivePool {
 public:
  // `make` gives new buffers (a contiguous CPU byte tensor of the size asked for);
  // unset, or where it gives something else: at::empty.
  explicit ReceivePool(std::function<at::Tensor(int64_t nbytes)> make = nullptr) : make_(std::move(make)) {}
  // A tensor of `sizes` and `dtype` to receive into (contents undefined).
  at::Tensor Allocate(const std::vector<int64_t>& sizes, c10::ScalarType dtype);
  void Clear();

 private:
  at::Tensor NewBuffer(int64_t nbytes);

  std::function<at::Tensor(int64_t)> make_;
  std::map<int64_t, std::vector<at::Tensor>> buckets_;  // by byte size
  int64_t bytes_ = 0;
};

class HeaderPool {
 public:
  explicit HeaderPool(size_t buffer_bytes) : buffer_bytes_(buffer_bytes) {}
  std::unique_ptr<char[]> Take();
  void Give(std::unique_ptr<char[]> buffer);

 private:
  const size_t buffer_bytes_;
  std::vector<std::unique_ptr<char[]>> spare_;
};

}  // namespace pippy::transport::ucx

#endif  // PIPPY_PIPELINE_TRANSPORT_UCX_RECEIVE_POOL_H_
