// Loading TorchScript models and example inputs written by PyTorch.
//
// Errors (absl::Status codes):
//   NOT_FOUND         the file does not exist or cannot be read
//   INVALID_ARGUMENT  the file is not a TorchScript archive (with a hint: a
//                     torch.save() checkpoint, a truncated copy, ...), or an example
//                     input does not match the model's forward() arguments
#ifndef PIPPY_PIPELINE_PARTITION_MODEL_IO_H_
#define PIPPY_PIPELINE_PARTITION_MODEL_IO_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "torch/script.h"

namespace pippy::partition {

// Loads a model saved with torch.jit.script(m).save(path) (or torch.jit.trace).
absl::StatusOr<torch::jit::Module> LoadModel(const std::string& path);

// Same, from the bytes of such a file; `name` is used in messages.
absl::StatusOr<torch::jit::Module> LoadModelFromBytes(const std::string& bytes,
                                                      const std::string& name);

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

// Reads a whole file.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_MODEL_IO_H_
