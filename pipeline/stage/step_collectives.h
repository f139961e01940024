// The collectives of a training step across a pipeline's ranks, over the stage
// transport (no extra process group): the sum of tied-weight gradients over the stages
// that hold a tied tensor, and the all-reduce of the squared gradient norm for global
// clipping. Both gather at one rank and send the result back, so every rank applies
// the same sum in the same order — what the unsplit model's autograd would compute.
//
// Values from peers are checked before they are used: a malformed message (wrong type
// or structure, a tensor of the wrong shape) is DATA_LOSS naming the peer, never an
// exception. Every wait goes through the caller's `wait` (deadline and cancellation).
#ifndef PIPPY_PIPELINE_STAGE_STEP_COLLECTIVES_H_
#define PIPPY_PIPELINE_STAGE_STEP_COLLECTIVES_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ATen/core/ivalue.h"
#include "absl/status/statusor.h"
#include "pipeline/transport/transport.h"

namespace pippy::stage {

// Where a collective runs and how it waits.
struct CollectiveContext {
  int rank = 0;
  int num_ranks = 1;
  int step = 0;
  transport::Transport* transport = nullptr;
  // Waits for a posted operation (the runtime's deadline and Cancel()).
  std::function<absl::Status(const std::shared_ptr<transport::Work>&, const std::string& where)> wait;
};

// Sum over all ranks of each rank's `local` (rank 0 gathers and sends the total back).
// Errors: those of `wait`; DATA_LOSS when a peer sends something that is not a number.
absl::StatusOr<double> AllReduceSum(const CollectiveContext& ctx, double local, const std::string& what);

// One tie group's gradient: every holder stage's per-micro-batch contributions summed
// in the unsplit model's order (per micro-batch: the uses' gradients as its backward
// meets them, last stage first; then micro-batches in order).
struct TiedGroup {
  int group = 0;                            // index into PipelinePlan.tied
  std::string name;                         // the tensor's canonical name, for messages
  std::vector<int> holders;                 // stages holding it, ascending
  std::map<int, std::vector<int>> stages_of_rank;  // rank -> its holder stages
  std::vector<int64_t> shape;               // the tensor's shape
};

// `local[i][mb]`: this rank's contribution of its i-th holder stage (stages_of_rank
// order) for micro-batch mb; undefined where it made none. Returns the total (undefined
// if no stage contributed). REQUIRES: this rank holds one of the group's stages.
// Errors: those of `wait`; DATA_LOSS when a peer's contributions are malformed.
absl::StatusOr<at::Tensor> SumTiedGradient(const CollectiveContext& ctx, const TiedGroup& group,
                                           const std::vector<std::vector<at::Tensor>>& local, int microbatches);

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_STEP_COLLECTIVES_H_
