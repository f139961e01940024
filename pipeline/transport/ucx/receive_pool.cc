#include "pipeline/transport/ucx/receive_pool.h"

namespace pippy::transport::ucx {

at::Tensor ReceivePool::Allocate(const std::vector<int64_t>& sizes, c10::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype);
  int64_t numel = 1;
  for (int64_t d : sizes) numel *= d;
  const int64_t nbytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  if (nbytes < (64 << 10)) return at::empty(sizes, options);  // small: the allocator is fast
  auto& bucket = buckets_[nbytes];
  for (at::Tensor& buf : bucket) {
    if (buf.storage().use_count() == 1) return buf.view(dtype).view(sizes);
  }
  at::Tensor buf = NewBuffer(nbytes);
  if (bucket.size() < 32 && bytes_ + nbytes <= (int64_t{2} << 30)) {
    bucket.push_back(buf);
    bytes_ += nbytes;
  }
  return buf.view(dtype).view(sizes);
}

at::Tensor ReceivePool::NewBuffer(int64_t nbytes) {
  if (make_) {
    at::Tensor buf;
    try {
      buf = make_(nbytes);
    } catch (const std::exception&) {
      buf = at::Tensor();  // e.g. pinned memory without a usable GPU: pageable instead
    }
    if (buf.defined() && buf.scalar_type() == at::kByte && buf.device().is_cpu() && buf.dim() == 1 &&
        buf.numel() == nbytes && buf.is_contiguous()) {
      return buf;
    }
  }
  return at::empty({nbytes}, at::kByte);
}

void ReceivePool::Clear() {
  buckets_.clear();
  bytes_ = 0;
}

std::unique_ptr<char[]> HeaderPool::Take() {
  if (spare_.empty()) return std::unique_ptr<char[]>(new char[buffer_bytes_]);
  std::unique_ptr<char[]> b = std::move(spare_.back());
  spare_.pop_back();
  return b;
}

void HeaderPool::Give(std::unique_ptr<char[]> buffer) {
  if (buffer != nullptr && spare_.size() < 64) spare_.push_back(std::move(buffer));
}

}  // namespace pippy::transport::ucx
