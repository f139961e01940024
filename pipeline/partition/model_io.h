// Loading TorchScript models and example inputs written by PyTorch.
//
// Errors (absl::Status codes):
//   NOT_FOUND         the file does not exist or cannot be read
//   INVALID_ARGUMENT  the file is not a TorchScript archive (with a hint: a
//                     torch.save() checkpoint, a truncated copy, ...), or an example
//                     input does not match the model's forward() arguments
#ifndef PIPPY_PIPELINE_PARTITION_MODEL_IO_H_
#define PIPPY_PIPELINE_PARTITION_MODEL_IO_H_

#include <functional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "torch/script.h"

namespace pippy::partition {

// Loads a model saved with torch.jit.script(m).save(path) (or torch.jit.trace). The
// file is read record by record: loading needs the model's memory, not twice it.
absl::StatusOr<torch::jit::Module> LoadModel(const std::string& path);

// Same, from the bytes of such a file (read in place, not copied); `name` is used in
// messages. `bytes` must outlive the call only.
absl::StatusOr<torch::jit::Module> LoadModelFromBytes(absl::string_view bytes, const std::string& name);

// Writes `module` as a TorchScript archive (what module.save writes) through `sink`,
// piece by piece, without holding the archive in memory. A sink error stops the
// write and is returned. Errors: INTERNAL from LibTorch's serializer.
absl::Status WriteModule(const torch::jit::Module& module,
                         const std::function<absl::Status(absl::string_view)>& sink);

// WriteModule to a file, atomically (a temporary file renamed into place).
// Errors: PERMISSION_DENIED or UNAVAILABLE naming the path.
absl::Status SaveModule(const torch::jit::Module& module, const std::string& path);

// Names of forward()'s arguments after self.
std::vector<std::string> ForwardArgumentNames(const torch::jit::Module& model);

// Reads a file written by Python's torch.save holding a tensor, a tuple/list of
// values (positional arguments) or a dict {argument name: value}, and returns
// forward()'s arguments in order.
absl::StatusOr<std::vector<c10::IValue>> LoadExampleInputs(const std::string& path,
                                                           const torch::jit::Module& model);

// Reads any value written by torch.save (tensor, tuple, list, dict, number).
absl::StatusOr<c10::IValue> LoadTorchSaved(const std::string& path);

// Maps a loaded value to forward()'s arguments (see LoadExampleInputs); `what`
// names the value in messages.
absl::StatusOr<std::vector<c10::IValue>> ToForwardArguments(const c10::IValue& value,
                                                            const torch::jit::Module& model,
                                                            const std::string& what);
// Same, given forward()'s argument names.
absl::StatusOr<std::vector<c10::IValue>> ToForwardArguments(const c10::IValue& value,
                                                            const std::vector<std::string>& names,
                                                            const std::string& what);

// Reads a whole file.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_MODEL_IO_H_
