// The description of a value that precedes its bytes on the wire (UCX and NCCL).
//
// Header: u32 magic "PPY1" (or "PPYI", below), then the value as a tree (little endian):
//   u8 kind: 0 None | 1 Tensor: u8 dtype (c10::ScalarType), u8 ndim, i64 sizes[ndim]
//          | 2 Int: i64 | 3 Double: f64 | 4 Bool: u8 | 5 Tuple / 6 List: u32 n, n children
//          | 7 String: u32 length, bytes
// Payload: every tensor's bytes (contiguous, in header order), as a separate message
// straight from and into tensor storage. A receiver needs no prior knowledge of
// shapes, and shapes may change from one message to the next.
// Inline: a value with at most kMaxInlinePayload payload bytes may travel as one
// message instead, magic "PPYI", the header immediately followed by the payload: one
// small copy on each side instead of a second message (which costs more on tcp).
#ifndef PIPPY_PIPELINE_TRANSPORT_WIRE_FORMAT_H_
#define PIPPY_PIPELINE_TRANSPORT_WIRE_FORMAT_H_

#include <functional>
#include <string>
#include <vector>

#include "ATen/core/Tensor.h"
#include "ATen/core/ivalue.h"
#include "absl/status/statusor.h"

namespace pippy::transport::wire {

constexpr uint32_t kMagic = 0x50505931;  // "PPY1"
constexpr uint32_t kMagicInline = 0x50505949;  // "PPYI"
constexpr size_t kMaxHeader = 64 * 1024;
constexpr size_t kMaxInlinePayload = 16 * 1024;

// Appends magic and structure of `value` to `header`; appends its tensors (detached,
// contiguous — copied only if they were not) to `tensors` in payload order.
// Errors: INVALID_ARGUMENT for values that cannot be sent (objects, modules, ...).
absl::Status EncodeHeader(const c10::IValue& value, std::string* header, std::vector<at::Tensor>* tensors);

// Makes an uninitialised tensor to receive a payload into.
using Allocator = std::function<at::Tensor(const std::vector<int64_t>& sizes, c10::ScalarType dtype)>;

// Turns a header made by EncodeHeader into an inline message: appends the tensors'
// bytes and switches the magic to "PPYI".
void AppendInlinePayload(const std::vector<at::Tensor>& tensors, std::string* header);

// Rebuilds the value from a header, allocating its tensors with `alloc` (appended to
// `tensors` in payload order). An inline message ("PPYI") is accepted only where
// `inline_payload` is given: the tensors are then filled from the bytes after the
// header and *inline_payload is set (else cleared). The whole header is checked before
// anything is allocated. Errors: DATA_LOSS for a malformed header (unknown kinds or
// dtypes, quantized dtypes, counts beyond the bytes that follow), tensors of more than
// `max_payload_bytes` bytes in all, or inline bytes that do not match the tensors' sizes.
constexpr int64_t kMaxPayloadBytes = int64_t{1} << 36;  // 64 GiB in one message
absl::StatusOr<c10::IValue> DecodeHeader(const char* data, size_t size, const Allocator& alloc,
                                         std::vector<at::Tensor>* tensors, bool* inline_payload = nullptr,
                                         int64_t max_payload_bytes = kMaxPayloadBytes);

}  // namespace pippy::transport::wire

#endif  // PIPPY_PIPELINE_TRANSPORT_WIRE_FORMAT_H_
