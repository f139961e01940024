// Protocol Buffers messages as JSON for programs (pippyctl --output json): the proto's
// own field names, every scalar field even when it is zero, empty or false (protobuf's
// printer leaves those out), 64-bit integers as JSON numbers (protobuf's printer
// quotes them), enums by name, bytes as base64, NaN and infinities as null. Message
// fields appear when set; repeated fields always (as arrays); maps as objects.
#ifndef PIPPY_COMMON_PROTO_JSON_H_
#define PIPPY_COMMON_PROTO_JSON_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace pippy {

std::string ProtoToJson(const google::protobuf::Message& m);
// A JSON string literal (quotes included) of `s`.
std::string JsonString(absl::string_view s);
// {"error": {"code": "INVALID_ARGUMENT", "message": "..."}}
std::string JsonError(const absl::Status& s);

}  // namespace pippy

#endif  // PIPPY_COMMON_PROTO_JSON_H_
