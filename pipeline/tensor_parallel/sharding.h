// Tensor parallelism inside each stage: rewrites every stage of a split model into T
// shard modules, one per rank of the stage's tensor-parallel group (Megatron-LM's
// scheme; torch's ColwiseParallel / RowwiseParallel / vocab-parallel Embedding):
//
//   colwise  Linear:    weight rows and bias sharded; its input goes through
//                       pippy::tp_copy (its gradient is summed across the group); its
//                       output stays sharded along the last dimension
//   rowwise  Linear:    weight columns sharded; linear without bias, pippy::tp_reduce,
//                       then the (replicated) bias added once
//   vocab    Embedding: rows sharded; pippy::tp_vocab_embedding (masked lookup, reduced)
//
// Everything else is replicated: every rank of the group computes it on the same values,
// so replicated parameters get the same gradients on every rank (nothing to average).
//
// Before anything is written the plan is checked: every pattern matches a module; each
// matched module is a Linear (colwise, rowwise) or an Embedding (vocab) read only by
// that op, untied, with the sharded size divisible by T; values between a colwise and a
// rowwise Linear ("sharded values") are not reshaped to a fixed size (view/reshape need
// a -1 or a size taken from a sharded value: the head count must follow the sharding),
// not split or chunked (a fused projection, e.g. qkv, would mix its parts across ranks),
// not read by another colwise Linear; a rowwise Linear reads a sharded value; the
// model's output is not sharded. Sharded values may cross stage cuts (rank r sends to
// rank r). Then the shards are run on the example batch with the collectives emulated in
// process (tp_ops.h's LocalGroup, one thread per shard) and compared with the unsplit
// stages: every sharded module's output and every replicated stage output must equal
// the unsplit one within `tolerance` (max relative difference), else the check names
// the first module that differs.
//
// Limits: the check covers forward values (gradients are covered by the runtime's
// equality tests); dropout is off during the check (the stages run in eval mode);
// Linear/Embedding calls inside control flow (prim::If, prim::Loop) cannot be sharded.
#ifndef PIPPY_PIPELINE_TENSOR_PARALLEL_SHARDING_H_
#define PIPPY_PIPELINE_TENSOR_PARALLEL_SHARDING_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/partition/pipe.h"
#include "proto/job.pb.h"
#include "torch/script.h"

namespace pippy::tp {

struct ShardOptions {
  TensorParallelSpec spec;                  // size >= 2, checked (tp_plan.h's CheckSpec)
  std::vector<c10::IValue> example_inputs;  // forward()'s arguments: required for the check
  double tolerance = 1e-5;
};

// shards[s][r]: rank r's module of stage s. Fills pipe->plan's tensor_parallel and each
// sharded parameter's tp_dim; pipe->stages stay the unsplit stages.
// Errors: INVALID_ARGUMENT naming the pattern, module or op and what to change.
absl::StatusOr<std::vector<std::vector<torch::jit::Module>>> ShardPipe(partition::Pipe* pipe,
                                                                        const ShardOptions& options);

// The whole parameters and buffers of stage `sp` from its T trained shards (`shards[r]`:
// rank r's module): sharded tensors concatenated along their tp_dim, replicated ones
// taken from rank 0 after checking every rank holds the same bits. What fetch and
// checkpoints write back into the unsplit model.
// Errors: DATA_LOSS naming a tensor a shard lacks, whose shard has the wrong shape, or
// (replicated) that differs between ranks.
absl::StatusOr<std::map<std::string, at::Tensor>> GatherShards(const StagePlan& sp,
                                                              const std::vector<torch::jit::Module>& shards);

// Shard `rank` of `full` (the whole tensor) as the plan's tp_dim says (a contiguous copy).
at::Tensor ShardOf(const at::Tensor& full, int dim, int rank, int size);

}  // namespace pippy::tp

#endif  // PIPPY_PIPELINE_TENSOR_PARALLEL_SHARDING_H_
