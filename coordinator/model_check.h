// Loading a submitted model in a child process first.
//
// A submitted TorchScript archive is parsed by LibTorch's deserializer and TorchScript
// compiler, which are not hardened against malicious or corrupt input: fuzz/model_fuzz
// found archives that crash them (a segmentation fault in the type parser on a mutated
// code/ file). The coordinator holds every job, so it loads each submission in a child
// (pippy-coordinator --check-model FILE) first, with a deadline: a crash or a hang there
// fails that submission with INVALID_ARGUMENT, and the coordinator loads the model
// itself only once a child has loaded it and walked its graph.
#ifndef PIPPY_COORDINATOR_MODEL_CHECK_H_
#define PIPPY_COORDINATOR_MODEL_CHECK_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace pippy::coordinator {

inline constexpr char kCheckModelFlag[] = "--check-model";

// The child's side: loads `path` and lists its legal cuts, with its heap (RLIMIT_DATA)
// capped at 2 GiB + 4 x the file's size (a pickle can announce a 4 GiB string in a few
// bytes). Exit 0 when it loads, 3 with the error on stdout when it does not (a crash is
// a signal).
int RunModelCheck(const std::string& path);

// Runs `checker` --check-model `path` and waits up to `timeout`.
// Errors: INVALID_ARGUMENT with the loader's message, or saying that LibTorch crashed
// (and with which signal) or did not finish within the timeout; UNAVAILABLE when the
// child cannot be started.
absl::Status CheckModelInChild(const std::string& checker, const std::string& path, absl::Duration timeout);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_MODEL_CHECK_H_
