// The inverse of the split: trained stage modules written back into the original
// model, giving ONE TorchScript file with the original module structure.
#ifndef PIPPY_PIPELINE_PARTITION_MERGE_H_
#define PIPPY_PIPELINE_PARTITION_MERGE_H_

#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ATen/core/Tensor.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pippy::partition {

// A trained stage's parameters and buffers, by their names in the model.
using StageTensors = std::vector<std::pair<std::string, at::Tensor>>;
// Stage `index`'s tensors, asked for one stage at a time (each released before the next):
// read from its TorchScript file (StageFiles), or put together otherwise (tensor
// parallelism gathers a stage's shards).
using StageSource = std::function<absl::StatusOr<StageTensors>(int index)>;

// The source reading stage_paths[index] (its module's parameters and buffers).
StageSource StageFiles(const std::map<int, std::string>& stage_paths);

// As below, the stages (their indices, in order) from `source`.
absl::Status MergeStagesIntoModel(const std::string& model_path, const std::vector<int>& stages,
                                  const StageSource& source, const std::string& out_path);
absl::Status MergeStagesByRecords(const std::string& model_path, const std::vector<int>& stages,
                                  const StageSource& source, const std::string& out_path);

// `model_path`: the submitted model; `stage_paths`: stage index -> TorchScript file of
// the trained stage. Every parameter and buffer of every stage is copied into the
// model under its name (tied weights: the same tensor, written once per name), one
// stage in memory at a time, and the model is saved to `out_path` (atomically).
// Memory: the model plus its largest stage.
// Errors: INVALID_ARGUMENT naming a stage parameter the model does not have or whose
// shape differs; NOT_FOUND / INVALID_ARGUMENT for files that are missing or corrupt.
absl::Status MergeStagesIntoModel(const std::string& model_path, const std::map<int, std::string>& stage_paths,
                                  const std::string& out_path);

// The same result written record by record (torchio/model_records.h): the submitted
// archive's code and pickles copied as they are, each storage record written from the
// trained stage that holds its tensor (one stage loaded at a time) or copied from the
// archive. Memory: the largest stage plus one record. Errors as MergeStagesIntoModel's;
// UNIMPLEMENTED when the model's tensors do not each own a whole storage of their own
// (views, offsets, non-contiguous layouts): merge those with MergeStagesIntoModel.
absl::Status MergeStagesByRecords(const std::string& model_path, const std::map<int, std::string>& stage_paths,
                                  const std::string& out_path);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_MERGE_H_
