// Splitting a batch into micro-batches and merging outputs back, like
// torch.distributed.pipelining's TensorChunkSpec / split_args_kwargs_into_chunks.
#ifndef PIPPY_PIPELINE_STAGE_MICROBATCH_H_
#define PIPPY_PIPELINE_STAGE_MICROBATCH_H_

#include <string>
#include <vector>

#include "ATen/core/ivalue.h"
#include "absl/status/statusor.h"

namespace pippy::stage {

// How one argument is split: along `dim`, or replicated to every micro-batch.
struct ChunkSpec {
  int dim = 0;
  bool replicate = false;
};

// Splits each argument into `n` equal micro-batches (tensors along their ChunkSpec
// dim; non-tensors replicated). `specs` may be shorter than `args` (missing: dim 0);
// `names` name the arguments in errors. Returns [micro-batch][argument].
// Errors: INVALID_ARGUMENT when a batch is smaller than n or does not divide by n.
absl::StatusOr<std::vector<std::vector<c10::IValue>>> SplitIntoMicrobatches(
    const std::vector<c10::IValue>& args, int n, const std::vector<ChunkSpec>& specs = {},
    const std::vector<std::string>& names = {});

// Concatenates per-micro-batch outputs along dim 0 (tuples element-wise).
absl::StatusOr<c10::IValue> MergeMicrobatches(const std::vector<c10::IValue>& outputs);

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_MICROBATCH_H_
