// Training data from a file written by Python's
//   torch.save({"inputs": x_or_tuple_or_dict, "targets": y}, "data.pt")
// Step k trains on samples [k*B, (k+1)*B) along dim 0, wrapping around the end.
#ifndef PIPPY_PIPELINE_STAGE_DATA_SOURCE_H_
#define PIPPY_PIPELINE_STAGE_DATA_SOURCE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "torch/script.h"

namespace pippy::stage {

class DataSource {
 public:
  // Errors: INVALID_ARGUMENT naming what is wrong (not a torch.save file, no "inputs",
  // inputs that do not match forward()'s arguments, sample counts that differ).
  static absl::StatusOr<DataSource> FromBytes(const std::string& bytes, const torch::jit::Module& model);

  int64_t num_samples() const { return num_samples_; }
  bool has_targets() const { return !target_.isNone(); }

  // forward() arguments and target of step `step` with batch size `batch`.
  std::vector<c10::IValue> Inputs(int64_t step, int64_t batch) const;
  c10::IValue Target(int64_t step, int64_t batch) const;

 private:
  std::vector<c10::IValue> inputs_;
  c10::IValue target_;
  int64_t num_samples_ = 0;
};

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_DATA_SOURCE_H_
