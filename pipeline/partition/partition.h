// The partitioner: the C++ counterpart of torch.distributed.pipelining.pipeline().
//
//   auto model = torchio::LoadModel("m.pt");
//   SplitOptions opts; opts.num_stages = 4;               // or opts.split_at = {...}
//   absl::StatusOr<Pipe> pipe = SplitModel(*model, opts);
//   pipe->stages[s].forward(...)                          // run a stage in process
//   WritePipe(*pipe, "out/")                              // pipe_io.h: stage_N.pt + plan.json
//
// Files: partition.cc (this API: which cuts, from split points, markers or a balanced
// split), cost_model (what a balanced split equalises), plan_builder (stages and the
// plan from cuts), forward_probe (forward passes that change nothing), pipe_io (files).
//
// Split points come, in this order of precedence, from `split_at` (module paths),
// from PipeSplit marker modules in the model, or from an automatic balanced split
// into `num_stages` stages. SplitModel does not modify `model`.
#ifndef PIPPY_PIPELINE_PARTITION_PARTITION_H_
#define PIPPY_PIPELINE_PARTITION_PARTITION_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/partition/pipe.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"
#include "torch/script.h"

namespace pippy::partition {

struct SplitOptions {
  std::vector<std::string> split_at;  // explicit split points; see CutsFromSplitAt
  // Or the cuts as op positions of the inlined forward (ascending, each a legal cut):
  // what the automatic plan chose (pipeline/autoplan). Before split_at.
  std::vector<int> cuts;
  bool cuts_chosen = false;           // `cuts` holds the automatic plan's, even when none (one stage)
  int num_stages = 0;                 // automatic split (0: markers, or one stage)
  // What an automatic split equalises: parameter bytes (PARAMS, also UNSPECIFIED),
  // estimated FLOPs from the shapes seen with the example input (FLOPS), or measured
  // forward time on the example input (TIME).
  Balance balance = BALANCE_PARAMS;
  // Stage parameters and buffers alias the model's tensors instead of being copies:
  // for a caller that only writes the stages out (the coordinator), so that a split
  // needs no second copy of the model. Stages that will be trained in the same process
  // as each other must own their tensors (tied weights appear in several stages).
  bool share_tensors = false;
  // forward() arguments of an example batch: fills the plan's shapes and activation
  // bytes; required by kFlops and kTime.
  std::vector<c10::IValue> example_inputs;
  std::string model_name;             // recorded in the plan
};

// With example inputs, the stages run them once (without gradients) to record shapes;
// buffers a forward changes (batch-norm statistics) are restored afterwards, so
// neither the model nor the stages are changed by it.
// Errors: INVALID_ARGUMENT for anything about the model or the options (unknown split
// points, illegal cuts, too many stages, calls that cannot be inlined, an example
// input that does not fit), with a message that says what to do.
absl::StatusOr<Pipe> SplitModel(const torch::jit::Module& model, const SplitOptions& options);

// A legal cut position and how to name it with --split-at.
struct CutPoint {
  int position = 0;        // ops before the cut
  std::string name;        // "blocks.4" / "blocks.3:end"; "" if no module names it
  std::string before;      // module path of the op before the cut
  std::string after;       // module path of the op after it
};

// Every legal cut of the model, in order.
absl::StatusOr<std::vector<CutPoint>> ListLegalCuts(const torch::jit::Module& model);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_PARTITION_H_
