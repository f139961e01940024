// The names users type for the job spec's enums (schedules, losses, optimizers,
// precisions, balances, modes) and their help: one table, kept on the enum values of
// the .proto files themselves (cli_name, cli_alias, cli_help in options.proto).
// pippyctl, the daemons, pippy-rank, the benches and the tests read it here; the
// Python client reads the same options from its generated descriptors.
//
// Thread safety: every function may be called from any thread (the descriptors are
// immutable).
#ifndef PIPPY_PROTO_NAMES_H_
#define PIPPY_PROTO_NAMES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/generated_enum_reflection.h"
#include "proto/job.pb.h"
#include "proto/options.pb.h"

namespace pippy::names {

// One named value of an enum.
struct Choice {
  int value = 0;
  std::string name;                  // as users type it: "1f1b"
  std::vector<std::string> aliases;  // also accepted: torch's class names ("ZBVZeroBubble")
  std::string help;                  // one line for --help
};

// The values of `e` that have a cli_name, in declaration order.
std::vector<Choice> ChoicesOf(const google::protobuf::EnumDescriptor* e);
template <typename E>
std::vector<Choice> Choices() {
  return ChoicesOf(google::protobuf::GetEnumDescriptor<E>());
}

// "gpipe, 1f1b, ..." : the names of `e`, for messages.
std::string NameList(const google::protobuf::EnumDescriptor* e);

// The name of `value` ("1f1b"), or "unspecified" for a value without one.
std::string NameOf(const google::protobuf::EnumDescriptor* e, int value);
template <typename E>
std::string Name(E value) {
  return NameOf(google::protobuf::GetEnumDescriptor<E>(), static_cast<int>(value));
}

// The value named `text`: a name or an alias, ignoring case, '-' and '_'.
// Errors: INVALID_ARGUMENT "unknown <what> '<text>': use <names>".
absl::StatusOr<int> ParseIn(const google::protobuf::EnumDescriptor* e, absl::string_view what,
                            absl::string_view text);
template <typename E>
absl::StatusOr<E> Parse(absl::string_view what, absl::string_view text) {
  absl::StatusOr<int> v = ParseIn(google::protobuf::GetEnumDescriptor<E>(), what, text);
  if (!v.ok()) return v.status();
  return static_cast<E>(*v);
}

}  // namespace pippy::names

#endif  // PIPPY_PROTO_NAMES_H_
