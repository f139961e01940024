// Where a rank's steps take their batches from: a data file's share held in memory
// (data_source.h) or a dataset the rank reads itself (dataset.h).
//
// Thread safety: an implementation's Read is called from the rank's one thread.
#ifndef PIPPY_PIPELINE_STAGE_BATCH_SOURCE_H_
#define PIPPY_PIPELINE_STAGE_BATCH_SOURCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "ATen/core/ivalue.h"

namespace pippy::stage {

// One step's batch as a rank sees it: forward()'s arguments (None for the ones this
// rank does not read) and the targets (None unless it computes the loss).
struct Batch {
  std::vector<c10::IValue> inputs;
  c10::IValue target;
};

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // Step `step`'s batch of `batch` samples, or replica `replica` of `replicas`' slice
  // of it (the replica-th of `replicas` contiguous equal slices; REQUIRES: batch %
  // replicas == 0). Errors: what reading the samples met (a dataset's shard that
  // changed or holds a bad value), INVALID_ARGUMENT or DATA_LOSS naming it.
  virtual absl::StatusOr<Batch> Read(int64_t step, int64_t batch, int replica, int replicas) = 0;
};

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_BATCH_SOURCE_H_
