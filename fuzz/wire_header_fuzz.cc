// Fuzz target: the message header decoder of the UCX and NCCL transports (what a peer
// sends before a value's tensors). Any bytes are refused with DATA_LOSS or decode to a
// value; only sizes the header can justify are ever allocated.
#include <cstdint>
#include <vector>

#include "ATen/ATen.h"
#include "pipeline/transport/wire_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pippy::transport::wire;
  // As the transports allocate: at::empty of the header's shape and dtype.
  const Allocator alloc = [](const std::vector<int64_t>& sizes, c10::ScalarType dtype) {
    return at::empty(sizes, at::TensorOptions().dtype(dtype));
  };
  const char* p = reinterpret_cast<const char*>(data);
  constexpr int64_t kLimit = int64_t{1} << 24;  // bytes the fuzzer lets a message announce
  std::vector<at::Tensor> tensors;
  auto v = DecodeHeader(p, size, alloc, &tensors, nullptr, kLimit);
  tensors.clear();
  bool inline_payload = false;
  auto w = DecodeHeader(p, size, alloc, &tensors, &inline_payload, kLimit);
  if (w.ok() && !inline_payload) {
    std::string again;
    std::vector<at::Tensor> ts;
    if (!EncodeHeader(*w, &again, &ts).ok()) __builtin_trap();  // what it decodes, it can send
  }
  return 0;
}
