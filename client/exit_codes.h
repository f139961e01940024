// pippyctl's exit codes, which scripts may rely on.
#ifndef PIPPY_CLIENT_EXIT_CODES_H_
#define PIPPY_CLIENT_EXIT_CODES_H_

#include <iostream>

#include "absl/status/status.h"

namespace pippy::cli {

constexpr int kExitOk = 0;
constexpr int kExitInternal = 1;   // a bug or an unexpected failure
constexpr int kExitBadInput = 2;   // bad arguments, files or models: the message says what to do
constexpr int kExitUnavailable = 3;  // the coordinator cannot be reached

// Prints "pippyctl: <message>" to stderr and returns the exit code for `status`.
inline int Fail(const absl::Status& status) {
  std::cerr << "pippyctl: " << status.message() << "\n";
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kPermissionDenied:
      return kExitBadInput;
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
      return kExitUnavailable;
    default:
      return kExitInternal;
  }
}

}  // namespace pippy::cli

#endif  // PIPPY_CLIENT_EXIT_CODES_H_
