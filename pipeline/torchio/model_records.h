// A TorchScript archive split stage by stage without ever holding all of its tensors.
//
// A TorchScript file is a zip archive: code, data.pkl (the module tree, and for each
// tensor its storage key, dtype, sizes and strides) and one record per storage
// (data/<key>). ModelRecords loads a *skeleton* of the module: the same archive with
// every storage record replaced by 8 bytes that name its key, so the module, its graph
// and every tensor's dtype, shape and strides are as in the real one while no tensor
// holds its data (about the size of the code and the pickle, whatever the model's
// size). Materialize then gives the tensors of one module (a stage, split from the
// skeleton with its tensors shared) their real storages, each read from its record on
// its own, checked against the size the pickle claims; Dematerialize gives them back,
// so memory holds one stage's tensors at a time.
//
// A skeleton tensor must not be read before it is materialized: its storage claims its
// real size but holds 8 bytes. The split itself reads only shapes and types; forward
// passes run on materialized stages (job_preparation.cc's record-by-record path).
//
// Thread safety: none; one thread uses an instance.
#ifndef PIPPY_PIPELINE_TORCHIO_MODEL_RECORDS_H_
#define PIPPY_PIPELINE_TORCHIO_MODEL_RECORDS_H_

#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "torch/script.h"

namespace caffe2::serialize {
class PyTorchStreamReader;
}

namespace pippy::torchio {

class ModelRecords {
 public:
  // Opens the archive at `path`, checks each storage's record against the size its
  // tensor claims (from the zip's directory, reading no record) and loads its skeleton;
  // `name` is the archive's name in messages ("model"). Errors: INVALID_ARGUMENT naming
  // the file, the tensor and the record (missing, listed twice, shorter than claimed)
  // or as LoadModel's; UNIMPLEMENTED for storage keys that are not numbers, UNKNOWN
  // when the zip does not read (load such archives whole: LoadModel says what is wrong).
  static absl::StatusOr<std::unique_ptr<ModelRecords>> Open(const std::string& path, const std::string& name);
  ~ModelRecords();

  // The skeleton module (see above).
  torch::jit::Module& skeleton() { return skeleton_; }

  // Gives every skeleton tensor of `module` (parameters, buffers, tensor attributes,
  // recursively) its storage read from its record. Errors: INVALID_ARGUMENT naming the
  // tensor when its record is missing or holds fewer bytes than the pickle claims.
  absl::Status Materialize(const torch::jit::Module& module);
  // Gives them their skeleton storages back (their records' memory is freed once no
  // other tensor, e.g. an output that is a view of a parameter, holds it). One module is
  // materialized at a time: every storage lent is given back.
  void Dematerialize(const torch::jit::Module& module);
  // The record key behind a skeleton tensor's storage (-1: none, e.g. empty).
  int64_t KeyOf(const at::Tensor& skeleton_tensor) const;
  // The archive as it was uploaded, to copy records from.
  caffe2::serialize::PyTorchStreamReader& reader() { return *reader_; }

 private:
  ModelRecords() = default;

  std::string name_;
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader_;
  torch::jit::Module skeleton_;
  // Skeleton storages by the key their 8 bytes name; and the real storages now lent.
  std::map<int64_t, c10::Storage> skeleton_storage_;
  std::map<int64_t, c10::Storage> lent_;
  std::map<const c10::StorageImpl*, int64_t> key_of_;  // skeleton and lent storages alike
  std::map<int64_t, std::string> name_of_;             // a tensor that uses the key, for messages
};

// A torch.save file's value with every tensor's data left in the file: where each
// storage's bytes lie, so that a reader can take rows of a tensor with pread (a
// dataset's tensor shard, pipeline/stage/dataset.h). The tensors have their real
// dtype, sizes, strides and storage offset, and storages that claim their real size
// but hold no data: never read them.
struct SavedSkeleton {
  c10::IValue value;
  struct Record {
    int64_t offset = 0;  // of the storage's first byte in the file
    int64_t bytes = 0;   // the record's size (at least what the storage claims)
  };
  std::map<const c10::StorageImpl*, Record> records;
};

// Reads `path`'s zip directory and pickle (checked as an untrusted pickle is:
// pickle_scan.h), no tensor data. Errors: INVALID_ARGUMENT starting with `what`:
// not a torch.save file, a hostile pickle, a storage whose record is missing, shorter
// than its tensor claims, or compressed.
absl::StatusOr<SavedSkeleton> LoadSavedSkeleton(const std::string& path, const std::string& what);

}  // namespace pippy::torchio

#endif  // PIPPY_PIPELINE_TORCHIO_MODEL_RECORDS_H_
