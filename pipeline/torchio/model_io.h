// Loading TorchScript models and example inputs written by PyTorch.
//
// Errors (absl::Status codes):
//   NOT_FOUND         the file does not exist or cannot be read
//   INVALID_ARGUMENT  the file is not a TorchScript archive (with a hint: a
//                     torch.save() checkpoint, a truncated copy, ...), or an example
//                     input does not match the model's forward() arguments
#ifndef PIPPY_PIPELINE_TORCHIO_MODEL_IO_H_
#define PIPPY_PIPELINE_TORCHIO_MODEL_IO_H_

#include <functional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/torchio/pickle_scan.h"
#include "torch/csrc/jit/serialization/storage_context.h"
#include "torch/script.h"

namespace pippy::torchio {

// Loads a model saved with torch.jit.script(m).save(path) (or torch.jit.trace). The
// file is read record by record: loading needs the model's memory, not twice it.
absl::StatusOr<torch::jit::Module> LoadModel(const std::string& path);

// Same, from the bytes of such a file (read in place, not copied); `name` is used in
// messages. `bytes` must outlive the call only.
absl::StatusOr<torch::jit::Module> LoadModelFromBytes(absl::string_view bytes, const std::string& name);

// As LoadModelFromBytes, for a skeleton archive (model_records.h) whose storage records
// are shorter than their tensors on purpose: their allocations are not checked against
// the pickle's claims (ModelRecords checks the real records as it reads them).
absl::StatusOr<torch::jit::Module> LoadSkeletonFromBytes(absl::string_view bytes, const std::string& name);

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

// Reads what torch.save wrote (zip format), as torch::jit::pickle_load does, but with
// every storage sized by the bytes its record holds: LibTorch 1.13 sizes a storage by
// the element count the pickle claims and fills it from the record, however short
// (a mutated data file then made reads run past the allocation: fuzz/data_fuzz). With
// the true sizes, LibTorch's own bounds check (or CheckTensorsInStorage) refuses such
// a tensor. Errors: INVALID_ARGUMENT (with `what`) for anything that does not load.
absl::StatusOr<c10::IValue> PickleLoad(absl::string_view bytes, const std::string& what);

// As PickleLoad, for bytes from an untrusted client that are not first loaded in a
// child process (a serving request): every record must fit in the archive, the pickle
// must pass ScanPickle (pickle_scan.h: no announced length beyond its bytes, only the
// globals torch.save writes for tensors and containers, bounded nesting, no cycles),
// and no type tag reaches LibTorch's type parser. Errors: INVALID_ARGUMENT with `what`.
absl::StatusOr<c10::IValue> PickleLoadUntrusted(absl::string_view bytes, const std::string& what,
                                                const PickleLimits& limits = {});

// The value of a torch.save pickle (as PickleForLibTorch returns it), its storages
// taken by key from `storages`; `untrusted`: no type tag reaches LibTorch's type
// parser. For this library's loaders: it throws as LibTorch does (call it in TorchCall).
c10::IValue UnpickleWithStorages(const std::string& pickle, uint64_t version,
                                 std::shared_ptr<torch::jit::DeserializationStorageContext> storages,
                                 bool untrusted);

// A tensor of samples (data files) or rows (serving requests), as pippy accepts them:
// at least one dimension (rows along dim 0), dense, on the CPU, of a plain dtype (not
// quantized: LibTorch's index_select throws from where no one catches it), and not an
// expanded or overlapping view (a [10^9, 10^9] view of one element is a file of a few
// bytes that every copy would expand). Errors: INVALID_ARGUMENT starting with `what`.
absl::Status CheckRowTensor(const at::Tensor& t, const std::string& what);

// Reads any value written by torch.save (tensor, tuple, list, dict, number).
absl::StatusOr<c10::IValue> LoadTorchSaved(const std::string& path);

// Checks that every tensor in `value` (through tuples, lists and dicts) lies inside its
// storage: non-negative strides, and storage offset plus the farthest element within
// the storage's bytes. LibTorch's loaders take a file's sizes, strides and storage
// sizes as written, so a corrupt file can describe a tensor larger than its storage,
// which any read then overruns (found by fuzz/data_fuzz). LoadModel, LoadModelFromBytes
// (parameters, buffers and tensor attributes), LoadTorchSaved and DataSource check it.
// Errors: INVALID_ARGUMENT naming `what` and the tensor's place in it.
absl::Status CheckTensorsInStorage(const c10::IValue& value, const std::string& what);

// Maps a loaded value to forward()'s arguments (see LoadExampleInputs); `what`
// names the value in messages.
absl::StatusOr<std::vector<c10::IValue>> ToForwardArguments(const c10::IValue& value,
                                                            const torch::jit::Module& model,
                                                            const std::string& what);
// Same, given forward()'s argument names.
absl::StatusOr<std::vector<c10::IValue>> ToForwardArguments(const c10::IValue& value,
                                                            const std::vector<std::string>& names,
                                                            const std::string& what);

// "float32", "int64", ...: a dtype as Python's torch names it.
std::string DtypeName(c10::ScalarType type);

// Reads a whole file.
absl::StatusOr<std::string> ReadFile(const std::string& path);

}  // namespace pippy::torchio

#endif  // PIPPY_PIPELINE_TORCHIO_MODEL_IO_H_
