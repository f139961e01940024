// The stage runtime: runs one rank's action list for the stages it holds.
//
// Per step it splits the batch into micro-batches, then executes the schedule's
// actions in order: F (forward, keeping autograd state per micro-batch; the last
// stage computes the loss scaled by 1/micro-batches), B (full backward), I (gradient
// for inputs only) and W (gradient for weights only), SEND_F/RECV_F/SEND_B/RECV_B
// over the transport. Values between stages on the same rank are handed over in
// memory. Received activations are detached and require grad; gradients for a value
// with several consumers are summed. After the actions: tied-weight gradients are
// summed across the stages that hold them, gradients are clipped by the global norm
// over ALL stages (if asked) — both collectives in step_collectives.h — and the
// optimizer steps.
//
// A malformed message from a peer (a gradient of the wrong shape or type, a broken
// collective) ends the step with DATA_LOSS naming the peer; received activations are
// only used inside the stage's forward, whose LibTorch errors are a Status too.
//
// Every wait has a deadline; a rank that times out says where it stood: the action's
// position in the list, the action, and the peer and tag it waited for.
//
// Thread safety: one RankRuntime per rank; its methods are called from one thread.
// Several RankRuntimes (ranks as threads over a loopback transport) may run at once.
#ifndef PIPPY_PIPELINE_STAGE_RANK_RUNTIME_H_
#define PIPPY_PIPELINE_STAGE_RANK_RUNTIME_H_

#include <atomic>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/stage/microbatch.h"
#include "pipeline/stage/step_collectives.h"
#include "pipeline/stage/training.h"
#include "pipeline/transport/replica_group.h"
#include "pipeline/transport/transport.h"
#include "proto/plan.pb.h"
#include "torch/csrc/autograd/function.h"
#include "torch/script.h"

namespace pippy::stage {

struct RuntimeOptions {
  LossKind loss = LOSS_MSE;        // ignored for inference
  OptimizerOptions optimizer;
  // The learning rate of each step (lr_schedule.h's LearningRates), set on every
  // parameter group before that step's optimizer step; a step past its end (or an
  // empty table) keeps optimizer.lr.
  std::vector<double> learning_rates;
  double clip_grad_norm = 0;       // 0: no clipping
  absl::Duration timeout = absl::Seconds(60);  // per wait
  std::vector<ChunkSpec> input_chunks;        // per model input (default: dim 0)
  // Data parallelism: the ranks holding this rank's stages in the other replicas.
  // Each stage's gradients are averaged across them in buckets of at most
  // replica_bucket_bytes (parameters in reverse order, as their gradients come), each
  // bucket on a reducer thread as soon as the stage's last backward of the step has
  // accumulated all of its gradients (overlapping the rest of that backward and the
  // rank's remaining actions, like DDP's buckets); tied parameters after their tied
  // sync. nullptr or size 1: no data parallelism. Must outlive the runtime.
  transport::ReplicaGroup* replicas = nullptr;
  size_t replica_bucket_bytes = 25 << 20;
  // Tensor parallelism (PipelinePlan.tensor_parallel): the ranks computing this rank's
  // stages with it, each holding its shard (pipeline/tensor_parallel). The stages'
  // pippy::tp_* ops reduce over it (set as the step thread's group for every step); the
  // global gradient norm sums the sharded parameters' squares across it and counts the
  // replicated ones once. nullptr or size 1: none. Must outlive the runtime.
  transport::ReplicaGroup* tensor_parallel = nullptr;
  // Where the stages' parameters, activations, gradients and optimizer state live: the
  // runtime moves the stage modules there before the optimizer is made, and each step's
  // inputs and targets; received values must arrive there (a GPU rank's transport is
  // NCCL or transport/staging). Inference outputs are handed back on the CPU.
  c10::Device device = c10::Device(c10::kCPU);
  // Mixed precision: each stage's forward runs under autocast to this dtype (bf16) on
  // the device's type (stage::AutocastScope); the loss is computed in fp32. Undefined: off.
  c10::ScalarType autocast = c10::ScalarType::Undefined;
};

// One timed piece of a step, for the trace: an action of the schedule ("1F3",
// "0SEND_F3", ...) or the step's end ("wait for sends", "tied-gradient sync",
// "clip", "optimizer").
struct TraceEvent {
  std::string name;
  int stage = -1;                  // the action's stage; -1 for the rank's own work
  int64_t begin_us = 0;            // steady clock (std::chrono::steady_clock), microseconds
  int64_t duration_us = 0;
  int64_t bytes = 0;               // tensor bytes sent or received
  int64_t wait_us = 0;             // of the duration, blocked waiting for a peer
  // The schedule action's type; none for the rank's own work (the step's end, all-reduces).
  std::optional<schedule::ActionType> action;
};

// Where a rank's step time went. The parts add up to step_seconds.
struct StepBreakdown {
  double compute_seconds = 0;      // F, B, I, W
  double wait_seconds = 0;         // blocked on peers (receives, send completions, collectives)
  double transport_seconds = 0;    // posting sends and receives, decoding (not waiting)
  double optimizer_seconds = 0;    // the optimizer step and gradient clipping (not waiting)
  double other_seconds = 0;        // the rest: micro-batch split, bookkeeping
  // Data parallelism (not part of the sum above): time the replica all-reduces ran on
  // the reducer thread, and how much of it the step waited for at its end (counted in
  // wait_seconds). 1 - waited / ran is the overlap with the rank's other work.
  double allreduce_seconds = 0;
  double allreduce_wait_seconds = 0;
  // Tensor parallelism (part of compute_seconds: the ops run inside F, B, I, W): the time
  // in the group's all-reduces and how many there were.
  double tp_allreduce_seconds = 0;
  int tp_allreduces = 0;
};

struct StepResult {
  double loss = 0;                 // mean loss over the batch (last-stage rank only)
  bool has_loss = false;
  c10::IValue output;              // inference: merged model output (last-stage rank)
  double busy_seconds = 0;         // time in compute actions
  double step_seconds = 0;
  int peak_live_activations = 0;   // micro-batches holding autograd state, all local stages
  double grad_norm = 0;            // global norm before clipping (when clipping)
  double lr = 0;                   // training: the learning rate the optimizer stepped with
  StepBreakdown breakdown;
  std::vector<TraceEvent> trace;   // in the order they ran
  // Data parallelism: buckets all-reduced, and how many of them started while their
  // stage's last backward was still running (the rest: when it ended).
  int allreduce_buckets = 0;
  int allreduce_buckets_in_backward = 0;
};

class RankRuntime {
 public:
  // `stages` maps stage index -> module for the stages this rank holds (as the
  // schedule places them). `plan` describes every stage. The transport must outlive
  // the runtime. Errors: INVALID_ARGUMENT when the stages, plan and schedule disagree.
  static absl::StatusOr<std::unique_ptr<RankRuntime>> Create(int rank, const PipelinePlan& plan,
                                                            std::map<int, torch::jit::Module> stages,
                                                            const schedule::Schedule& schedule,
                                                            transport::Transport* transport,
                                                            const RuntimeOptions& options);

  // One training step on a batch: `inputs` are forward()'s arguments for the whole
  // batch (used by ranks whose stages read model inputs), `target` the batch target
  // (used by the rank holding the last stage). `step` numbers the messages.
  absl::StatusOr<StepResult> TrainStep(int step, const std::vector<c10::IValue>& inputs, const c10::IValue& target);

  // Forward only (the schedule must be forward-only): returns the merged model output
  // on the rank holding the last stage. Steps need no barrier between them: a rank may
  // run step s + 1 while later ranks still run step s (messages carry the step).
  // ABORTED: a stage's forward failed on this step's inputs (on this rank or, carried
  // by an abort marker in place of the activation, on an earlier one; the message says
  // where and why). The step's sends and receives still completed, so every rank of
  // the pipeline ends the step ABORTED and can run the next one (serving goes on).
  // Any other error leaves the rank unable to continue.
  absl::StatusOr<StepResult> InferenceStep(int step, const std::vector<c10::IValue>& inputs);

  // An evaluation batch of a training job: forward only (no autograd state, no
  // gradients, no optimizer step: the parameters stay as they are), and on the rank
  // holding the last stage the loss as TrainStep computes it (the mean over the
  // micro-batches of each one's loss). The rank runs its stages' forwards micro-batch
  // by micro-batch, whatever the training schedule, with their activations under their
  // own message kind (Tag::kEvalActivation), numbered by `eval_step` (consecutive over
  // the job's evaluation batches). ABORTED as InferenceStep's.
  absl::StatusOr<StepResult> EvalStep(int eval_step, const std::vector<c10::IValue>& inputs,
                                      const c10::IValue& target);

  // Ends the step in progress and every later one with CANCELLED: the wait in progress
  // (if any) returns at once, compute already running finishes first. The only method
  // that may be called from another thread while a step runs (a daemon's cancel).
  void Cancel();

  // The stage modules this rank holds (their parameters are trained in place).
  const std::map<int, torch::jit::Module>& stages() const { return stages_; }

  // The optimizer's state (torch.optim's: SGD's momentum buffers, Adam's moments and
  // step counts), for a checkpoint; between steps only. A forward-only runtime has none
  // (nullptr).
  torch::optim::Optimizer* optimizer() { return optimizer_.get(); }

  ~RankRuntime();

 private:
  RankRuntime() = default;
  struct StepState;
  absl::StatusOr<StepResult> RunStep(int step, const std::vector<c10::IValue>& inputs, const c10::IValue& target,
                                     bool training, bool evaluating = false);
  absl::Status Execute(StepState& st, size_t position, const schedule::Action& action);
  absl::Status Forward(StepState& st, int stage, int mb);
  absl::Status Backward(StepState& st, int stage, int mb, bool inputs, bool weights);
  absl::Status SendForward(StepState& st, int stage, int mb);
  absl::Status RecvForward(StepState& st, int stage, int mb, const std::string& where);
  absl::Status SendBackward(StepState& st, int stage, int mb);
  absl::Status RecvBackward(StepState& st, int stage, int mb, const std::string& where);
  // The step's collectives (step_collectives.h) over this runtime's transport, waits
  // and cancellation.
  CollectiveContext Collectives(int step);
  absl::Status SyncTiedGradients(StepState& st);
  absl::StatusOr<double> ClipGradients(int step);
  // Waits (deadline, Cancel()) and counts the time blocked into the step's wait.
  absl::Status WaitFor(const std::shared_ptr<transport::Work>& work, const std::string& where);
  std::vector<at::Tensor> LocalParameters(int stage) const;
  // Averages `params`' gradients across the replicas, in buckets (an undefined
  // gradient counts as zero, and stays undefined if it is undefined in every replica).
  // Runs on the reducer thread (or the step thread for tied parameters).
  absl::Status AverageAcrossReplicas(const std::vector<at::Tensor>& params);

  // Constant after Create().
  int rank_ = 0;
  PipelinePlan plan_;
  std::map<int, torch::jit::Module> stages_;
  schedule::Schedule schedule_;
  schedule::ActionList eval_actions_;  // a training rank's evaluation batches (EvalStep)
  transport::Transport* transport_ = nullptr;
  RuntimeOptions options_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  // Tied parameters of each local stage: (parameter, tie group).
  std::map<int, std::vector<std::pair<at::Tensor, int>>> tied_params_;
  // Data parallelism: per local stage, the position of its last backward action in the
  // rank's action list; the buckets of the stages' untied parameters; for each of those
  // parameters its bucket. The gradient accumulators are kept alive so that the hooks
  // on them (which count a bucket's gradients during its stage's last backward) stay.
  struct Bucket {
    int stage = 0;
    std::vector<at::Tensor> params;
    int ready = 0;          // gradients accumulated in the stage's last backward (this step)
    bool launched = false;  // its all-reduce is queued (this step)
  };
  struct Reduction;
  struct HookState;
  class GradientReadyHook;
  std::map<size_t, int> reduce_after_;
  std::vector<Bucket> buckets_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::shared_ptr<HookState> hook_state_;
  // Step thread only (and the autograd hooks, which run on it for CPU graphs).
  std::vector<std::shared_ptr<Reduction>> reductions_;
  std::shared_future<void> reducer_;
  void LaunchBucket(int bucket, bool in_backward);
  void OnGradientReady(int bucket);
  // consumers_[s][j]: (consumer stage, its input index) for output j of stage s.
  std::vector<std::vector<std::vector<std::pair<int, int>>>> consumers_;
  // Time blocked in WaitFor since the step began (step thread only).
  int64_t waited_us_ = 0;
  // Cancel(): set from any thread; the operation the step thread waits on.
  absl::Mutex cancel_mu_;
  bool cancelled_ ABSL_GUARDED_BY(cancel_mu_) = false;
  std::shared_ptr<transport::Work> waiting_ ABSL_GUARDED_BY(cancel_mu_);
};

}  // namespace pippy::stage

#endif  // PIPPY_PIPELINE_STAGE_RANK_RUNTIME_H_
