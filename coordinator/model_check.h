// Loading a submitted model (and its data file) in a child process first.
//
// A submitted TorchScript archive is parsed by LibTorch's deserializer and TorchScript
// compiler, which are not hardened against malicious or corrupt input: fuzz/model_fuzz
// found archives that crash them (a segmentation fault in the type parser on a mutated
// code/ file). The coordinator holds every job, so it loads each submission in a child
// (pippy-coordinator --check-model FILE [DATA]) first, with a deadline: a crash or a hang
// there fails that submission with INVALID_ARGUMENT, and the coordinator loads the model
// itself only once a child has loaded it and walked its graph. The data file (a
// torch.save file) goes through the same unpickler, which makes room for whatever
// length a pickle announces (a 600-byte data file made it touch 4 GiB), so the child
// reads it too, under the same heap cap.
#ifndef PIPPY_COORDINATOR_MODEL_CHECK_H_
#define PIPPY_COORDINATOR_MODEL_CHECK_H_

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace pippy::coordinator {

inline constexpr char kCheckModelFlag[] = "--check-model";

// The child's side: loads the model at `path` and lists its legal cuts, then reads
// `data_path` (if not empty) as the job's data, with its heap (RLIMIT_DATA) capped at
// 2 GiB + 4 x the files' sizes (a pickle can announce a 4 GiB string in a few bytes).
// Exit 0 when both load; 3 (model) or 4 (data) with the error on stdout when one does
// not (a crash is a signal).
int RunModelCheck(const std::string& path, const std::string& data_path);

// What the child found wrong: the model, or the data file.
struct ModelCheckError {
  enum Field { kModel, kData } field = kModel;
  absl::Status status;
};

// Runs `checker` --check-model `path` [`data_path`] and waits up to `timeout`. OK, or
// INVALID_ARGUMENT with the loader's message, or saying that LibTorch crashed (and with
// which signal) or did not finish within the timeout, with the field it concerns;
// UNAVAILABLE when the child cannot be started.
ModelCheckError CheckModelInChild(const std::string& checker, const std::string& path, const std::string& data_path,
                                  absl::Duration timeout);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_MODEL_CHECK_H_
