// Training data from a file written by Python's
//   torch.save({"inputs": x_or_tuple_or_dict, "targets": y}, "data.pt")
// Step k trains on samples [k*B, (k+1)*B) along dim 0, wrapping around the end (split
// into R contiguous parts between R replicas of the pipeline).
//
// A rank needs only part of it: the model inputs its stages read and, if it computes
// the loss, the targets. The coordinator cuts each rank's share with ShareBytes; the
// rank reads it with FromShareBytes (the model inputs it lacks are None).
#ifndef PIPPY_PIPELINE_STAGE_DATA_SOURCE_H_
#define PIPPY_PIPELINE_STAGE_DATA_SOURCE_H_

#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/stage/batch_source.h"
#include "torch/script.h"

namespace pippy::stage {

class DataSource : public BatchSource {
 public:
  // A data file as users write it; `argument_names` are forward()'s arguments.
  // Errors: INVALID_ARGUMENT naming what is wrong (not a torch.save file, no "inputs",
  // inputs that do not match forward()'s arguments, sample counts that differ).
  static absl::StatusOr<DataSource> FromBytes(absl::string_view bytes, const std::vector<std::string>& argument_names);

  // As FromBytes, but the file may also hold just forward()'s arguments, as a serving
  // request's input does (torch.save of a tensor, a tuple or list, or a dict by
  // argument name): a serving job's example input. Errors: FromBytes's.
  static absl::StatusOr<DataSource> FromExampleBytes(absl::string_view bytes,
                                                     const std::vector<std::string>& argument_names);

  // Data already in memory: forward()'s arguments over all samples (dim 0) and the
  // targets (None for none). Errors: as FromBytes.
  static absl::StatusOr<DataSource> FromValues(std::vector<c10::IValue> inputs, c10::IValue targets,
                                               const std::vector<std::string>& argument_names);

  // A share written by ShareBytes; `argument_names` only count and name the model's
  // inputs. Empty bytes: a rank that needs no data.
  // Errors: INVALID_ARGUMENT when the bytes are not such a share.
  static absl::StatusOr<DataSource> FromShareBytes(absl::string_view bytes,
                                                   const std::vector<std::string>& argument_names);

  // The share of a rank that reads the model inputs at `input_indices` and, with
  // `with_targets`, the targets: a torch.save dict {"inputs": {position: value},
  // "targets": y, "num_samples": n}. Empty when it needs nothing.
  absl::StatusOr<std::string> ShareBytes(const std::vector<int>& input_indices, bool with_targets) const;

  int64_t num_samples() const { return num_samples_; }
  bool has_targets() const { return !target_.isNone(); }

  // forward() arguments (None where this source lacks one) and target of step `step`
  // with batch size `batch`: samples [step*batch, (step+1)*batch), wrapping. With
  // data parallelism, replica r of R takes the r-th of R contiguous equal slices of
  // them (REQUIRES: batch % replicas == 0).
  std::vector<c10::IValue> Inputs(int64_t step, int64_t batch, int replica = 0, int replicas = 1) const;
  c10::IValue Target(int64_t step, int64_t batch, int replica = 0, int replicas = 1) const;

  // Inputs and Target as a BatchSource (never an error).
  absl::StatusOr<Batch> Read(int64_t step, int64_t batch, int replica, int replicas) override {
    return Batch{Inputs(step, batch, replica, replicas), Target(step, batch, replica, replicas)};
  }

 private:
  std::vector<std::string> names_;
  std::vector<c10::IValue> inputs_;
  c10::IValue target_;
  int64_t num_samples_ = 0;
};

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_DATA_SOURCE_H_
