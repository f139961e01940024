#include "pipeline/stage/rank_runtime.h"

#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <optional>
#include <set>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/schedule/simulator.h"
#include "pipeline/tensor_parallel/tp_ops.h"
#include "torch/csrc/autograd/autograd.h"
#include "torch/csrc/autograd/function_hook.h"
#include "torch/csrc/autograd/variable.h"

namespace pippy::stage {
namespace {

using schedule::Action;
using schedule::ActionType;
using transport::Tag;
using Key = std::pair<int, int>;  // (stage, micro-batch)

Tag MakeTag(Tag::Kind kind, int step, int mb, int src, int dst, int index) {
  Tag t;
  t.kind = kind;
  t.step = static_cast<uint32_t>(step);
  t.microbatch = static_cast<uint32_t>(mb);
  t.src_stage = static_cast<uint32_t>(src);
  t.dst_stage = static_cast<uint32_t>(dst);
  t.index = static_cast<uint32_t>(index);
  return t;
}

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

int64_t Micros(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

int64_t TensorBytes(const c10::IValue& v) {
  if (v.isTensor()) return static_cast<int64_t>(v.toTensor().numel() * v.toTensor().element_size());
  int64_t n = 0;
  if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) n += TensorBytes(e);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) n += TensorBytes(e);
  }
  return n;
}

}  // namespace

// Data parallelism's hooks reach the runtime through this (the runtime clears it when
// it goes; a hook may outlive it on a parameter someone else keeps).
struct RankRuntime::HookState {
  std::atomic<RankRuntime*> runtime{nullptr};
  std::atomic<int> final_stage{-1};  // the stage whose last backward of the step runs now
};

struct RankRuntime::Reduction {
  int stage = 0;
  int bucket = 0;
  bool in_backward = false;
  int64_t begin_us = 0, duration_us = 0;
  absl::Status status;
};

// Runs after a parameter's gradient accumulator: during its stage's last backward of
// the step, the gradient is final, and its bucket may go. Autograd runs CPU graphs on
// the thread that called backward: the step thread.
class RankRuntime::GradientReadyHook : public torch::autograd::FunctionPostHook {
 public:
  GradientReadyHook(std::shared_ptr<HookState> state, int stage, int bucket)
      : state_(std::move(state)), stage_(stage), bucket_(bucket) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    RankRuntime* rt = state_->runtime.load();
    if (rt != nullptr && state_->final_stage.load() == stage_) rt->OnGradientReady(bucket_);
    return outputs;
  }

 private:
  std::shared_ptr<HookState> state_;
  int stage_, bucket_;
};

struct RankRuntime::StepState {
  struct Saved {
    std::vector<c10::IValue> inputs;   // as given to forward (leaves for received values)
    std::vector<at::Tensor> roots;     // what backward starts from
    std::vector<at::Tensor> root_grads;
    bool roots_ready = false;
    at::Tensor loss;                   // last stage: unscaled micro-batch loss
    std::vector<c10::IValue> outputs;  // non-final stages: the stage's outputs
  };
  int step = 0;
  bool training = true;
  // An evaluation batch of a training job: forward only (training false), the loss on
  // the last stage, activations under their own message kind.
  bool evaluating = false;
  Tag::Kind activation = Tag::Kind::kActivation;
  int m = 1;
  std::vector<std::vector<c10::IValue>> mb_inputs;
  std::vector<c10::IValue> mb_targets;
  std::map<Key, std::vector<c10::IValue>> fwd_inbox;
  std::map<Key, std::vector<at::Tensor>> bwd_inbox;
  std::map<Key, Saved> saved;
  std::map<Key, std::vector<c10::IValue>> to_send;      // outputs awaiting SEND_F
  std::map<Key, std::vector<at::Tensor>> grads_to_send; // input grads awaiting SEND_B
  std::vector<c10::IValue> final_outputs;
  // Tied parameters: gradient contribution per (group, stage, micro-batch), summed at
  // the end in the order the unsplit model's autograd would sum them.
  std::map<std::tuple<int, int, int>, at::Tensor> tied_contrib;
  double loss_sum = 0;
  int live = 0;
  int peak = 0;
  double busy = 0;
  double transport = 0;  // SEND/RECV actions, their waits excluded
  int64_t bytes = 0;  // tensor bytes the action in progress sent or received
  std::vector<TraceEvent> trace;
  std::vector<std::pair<std::shared_ptr<transport::Work>, std::string>> pending_sends;
  // Forward-only steps: why the step was abandoned (a stage's forward failed here or on
  // an earlier rank). The rank still sends an abort marker wherever it would have sent
  // an activation, so that every rank ends the step in step (see InferenceStep).
  std::string abort;
};

namespace {

// What a forward-only step sends instead of an activation once it was abandoned: a
// tuple (marker, why). No stage output looks like it (a tuple whose first element is
// this string).
constexpr char kAbortMarker[] = "\x01pippy: step abandoned upstream";

c10::IValue AbortValue(const std::string& why) {
  return c10::ivalue::Tuple::create({c10::IValue(std::string(kAbortMarker)), c10::IValue(why)});
}

// The reason carried by an abort marker, or nullopt for an ordinary value.
std::optional<std::string> AbortReason(const c10::IValue& v) {
  if (!v.isTuple()) return std::nullopt;
  const auto& e = v.toTupleRef().elements();
  if (e.size() != 2 || !e[0].isString() || !e[1].isString() || e[0].toStringRef() != kAbortMarker) return std::nullopt;
  return e[1].toStringRef();
}

}  // namespace

RankRuntime::~RankRuntime() {
  if (reducer_.valid()) reducer_.wait();
  if (hook_state_ != nullptr) hook_state_->runtime = nullptr;  // hooks may outlive the runtime
}

absl::StatusOr<std::unique_ptr<RankRuntime>> RankRuntime::Create(int rank, const PipelinePlan& plan,
                                                                std::map<int, torch::jit::Module> stages,
                                                                const schedule::Schedule& schedule,
                                                                transport::Transport* transport,
                                                                const RuntimeOptions& options) {
  if (schedule.num_stages != plan.stages_size()) {
    return absl::InvalidArgumentError(absl::StrCat("the schedule runs ", schedule.num_stages,
                                                   " stages but the model was split into ", plan.stages_size()));
  }
  if (rank < 0 || rank >= schedule.num_ranks) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is not in the schedule (", schedule.num_ranks,
                                                   " ranks)"));
  }
  for (int s : schedule.StagesOf(rank)) {
    if (!stages.count(s)) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " runs stage ", s, " but was not given it"));
    }
  }
  for (const auto& [s, m] : stages) {
    if (s < 0 || s >= schedule.num_stages || schedule.stage_to_rank[s] != rank) {
      return absl::InvalidArgumentError(absl::StrCat("stage ", s, " does not belong on rank ", rank));
    }
  }
  // An action list that cannot run is refused before anything runs (with the grid).
  // Only this rank's: a rank is sent its own list (the whole schedule was validated
  // when the job's layout was made, job::MakeLayout).
  PIPPY_RETURN_IF_ERROR(schedule::ValidateRank(schedule, rank));
  std::unique_ptr<RankRuntime> rt(new RankRuntime());
  rt->rank_ = rank;
  rt->plan_ = plan;
  rt->stages_ = std::move(stages);
  if (!options.device.is_cpu()) {
    for (auto& stage : rt->stages_) {  // not a structured binding: the lambda uses it
      torch::jit::Module& module = stage.second;
      PIPPY_RETURN_IF_ERROR(TorchCall(absl::StrCat("moving stage ", stage.first, " to ", options.device.str()), [&] {
        module.to(options.device);
      }, absl::StatusCode::kResourceExhausted));
    }
  }
  rt->schedule_ = schedule;
  rt->transport_ = transport;
  rt->options_ = options;
  rt->consumers_.resize(plan.stages_size());
  for (int s = 0; s < plan.stages_size(); ++s) rt->consumers_[s].resize(plan.stages(s).outputs_size());
  for (int c = 0; c < plan.stages_size(); ++c) {
    const StagePlan& cp = plan.stages(c);
    for (int k = 0; k < cp.inputs_size(); ++k) {
      const StageInput& si = cp.inputs(k);
      if (si.source_case() != StageInput::kSourceStage) continue;
      rt->consumers_[si.source_stage()][si.source_output()].push_back({c, k});
      const auto& sched_consumers = schedule.graph.consumers[si.source_stage()];
      if (std::find(sched_consumers.begin(), sched_consumers.end(), c) == sched_consumers.end()) {
        return absl::InvalidArgumentError(absl::StrCat("the schedule's stage graph lacks the edge ", si.source_stage(),
                                                       " -> ", c, " that the plan has; make the schedule with the "
                                                       "plan's stage graph"));
      }
    }
  }
  for (const auto& [s, module] : rt->stages_) {
    for (const ParameterInfo& pi : plan.stages(s).parameters()) {
      if (pi.tie_group() < 0) continue;
      for (const auto& p : module.named_parameters(true)) {
        if (p.name == pi.name()) rt->tied_params_[s].emplace_back(p.value, pi.tie_group());
      }
    }
  }
  if (!schedule.forward_only) {
    // Evaluation batches: this rank's forwards, micro-batch by micro-batch and stage by
    // stage (the stages are numbered in graph order, so each receive waits for a forward
    // earlier in that order on another rank: no cycle), with their sends and receives.
    schedule::Schedule eval = schedule;
    eval.forward_only = true;
    for (schedule::ActionList& l : eval.ranks) l.clear();
    for (int mb = 0; mb < schedule.num_microbatches; ++mb) {
      for (int st : schedule.StagesOf(rank)) eval.ranks[rank].push_back({st, ActionType::kForward, mb});
    }
    schedule::InsertCommunication(&eval);
    rt->eval_actions_ = std::move(eval.ranks[rank]);
    std::vector<at::Tensor> params;
    for (const auto& [s, m] : rt->stages_) {
      for (const at::Tensor& p : rt->LocalParameters(s)) params.push_back(p);
    }
    PIPPY_ASSIGN_OR_RETURN(rt->optimizer_, MakeOptimizer(options.optimizer, params));
    if (options.replicas != nullptr && options.replicas->size() > 1) {
      const auto& actions = schedule.ranks[rank];
      for (size_t pos = 0; pos < actions.size(); ++pos) {
        const ActionType t = actions[pos].type;
        if (t == ActionType::kBackward || t == ActionType::kBackwardWeight) {
          for (auto it = rt->reduce_after_.begin(); it != rt->reduce_after_.end();) {
            it = it->second == actions[pos].stage ? rt->reduce_after_.erase(it) : std::next(it);
          }
          rt->reduce_after_[pos] = actions[pos].stage;
        }
      }
      rt->hook_state_ = std::make_shared<HookState>();
      rt->hook_state_->runtime = rt.get();
      for (const auto& [s, module] : rt->stages_) {
        std::set<const void*> tied;
        for (const auto& [p, g] : rt->tied_params_[s]) tied.insert(p.unsafeGetTensorImpl());
        std::vector<at::Tensor> untied;
        for (const at::Tensor& p : rt->LocalParameters(s)) {
          if (!tied.count(p.unsafeGetTensorImpl())) untied.push_back(p);
        }
        // Reverse order: backward produces the last layers' gradients first.
        size_t bytes = 0;
        for (auto p = untied.rbegin(); p != untied.rend(); ++p) {
          const size_t n = static_cast<size_t>(p->numel()) * sizeof(float);
          if (rt->buckets_.empty() || rt->buckets_.back().stage != s ||
              (bytes + n > options.replica_bucket_bytes && !rt->buckets_.back().params.empty())) {
            rt->buckets_.push_back(Bucket());
            rt->buckets_.back().stage = s;
            bytes = 0;
          }
          rt->buckets_.back().params.push_back(*p);
          bytes += n;
          const int b = static_cast<int>(rt->buckets_.size()) - 1;
          std::shared_ptr<torch::autograd::Node> acc = torch::autograd::impl::grad_accumulator(*p);
          if (acc == nullptr) continue;  // not a leaf that accumulates: counted when its stage's last backward ends
          acc->add_post_hook(std::make_unique<GradientReadyHook>(rt->hook_state_, s, b));
          rt->accumulators_.push_back(std::move(acc));
        }
      }
    }
  }
  return rt;
}

void RankRuntime::OnGradientReady(int bucket) {
  Bucket& b = buckets_[static_cast<size_t>(bucket)];
  if (++b.ready == static_cast<int>(b.params.size()) && !b.launched) LaunchBucket(bucket, /*in_backward=*/true);
}

void RankRuntime::LaunchBucket(int bucket, bool in_backward) {
  Bucket& b = buckets_[static_cast<size_t>(bucket)];
  b.launched = true;
  auto r = std::make_shared<Reduction>();
  r->stage = b.stage;
  r->bucket = bucket;
  r->in_backward = in_backward;
  reductions_.push_back(r);
  // One collective at a time per group: each task waits for the one before.
  reducer_ = std::async(std::launch::async, [this, r, before = reducer_] {
               if (before.valid()) before.wait();
               const auto begin = std::chrono::steady_clock::now();
               r->status = AverageAcrossReplicas(buckets_[static_cast<size_t>(r->bucket)].params);
               r->begin_us = Micros(begin);
               r->duration_us = Micros(std::chrono::steady_clock::now()) - r->begin_us;
             }).share();
}

absl::Status RankRuntime::AverageAcrossReplicas(const std::vector<at::Tensor>& params) {
  transport::ReplicaGroup* group = options_.replicas;
  const double scale = 1.0 / group->size();
  torch::NoGradGuard no_grad;
  // Buckets of whole tensors, at most replica_bucket_bytes each (a bigger tensor is a
  // bucket of its own); one flag per tensor says whether its gradient is defined.
  size_t first = 0;
  while (first < params.size()) {
    size_t last = first, bytes = 0;
    while (last < params.size() &&
           (last == first || bytes + params[last].numel() * sizeof(float) <= options_.replica_bucket_bytes)) {
      bytes += params[last].numel() * sizeof(float);
      ++last;
    }
    PIPPY_RETURN_IF_ERROR(TorchCall("replica all-reduce", [&]() -> absl::Status {
      std::vector<at::Tensor> pieces;
      at::Tensor flags = torch::zeros({static_cast<int64_t>(last - first)}, at::kFloat);
      for (size_t i = first; i < last; ++i) {
        const at::Tensor& g = params[i].grad();
        if (g.defined()) flags[static_cast<int64_t>(i - first)].fill_(1);
        pieces.push_back(g.defined() ? g.reshape(-1).to(at::kFloat) : torch::zeros({params[i].numel()}, at::kFloat));
      }
      pieces.push_back(flags);
      at::Tensor flat = torch::cat(pieces);
      PIPPY_RETURN_IF_ERROR(group->AllReduceSum(flat));
      flat.mul_(scale);
      int64_t off = 0;
      for (size_t i = first; i < last; ++i) {
        at::Tensor p = params[i];
        const int64_t n = p.numel();
        const bool any = flat[flat.numel() - static_cast<int64_t>(last - first) + static_cast<int64_t>(i - first)]
                             .item<float>() > 0;
        if (any) {
          at::Tensor avg = flat.narrow(0, off, n).view(p.sizes()).to(p.scalar_type());
          if (p.grad().defined()) {
            p.mutable_grad().copy_(avg);
          } else {
            p.mutable_grad() = avg.clone();
          }
        }
        off += n;
      }
      return absl::OkStatus();
    }, absl::StatusCode::kInternal));
    first = last;
  }
  return absl::OkStatus();
}

std::vector<at::Tensor> RankRuntime::LocalParameters(int stage) const {
  std::vector<at::Tensor> out;
  for (const auto& p : stages_.at(stage).named_parameters(true)) {
    if (p.value.requires_grad()) out.push_back(p.value);
  }
  return out;
}

void RankRuntime::Cancel() {
  std::shared_ptr<transport::Work> waiting;
  {
    absl::MutexLock lock(&cancel_mu_);
    cancelled_ = true;
    waiting = waiting_;
  }
  if (waiting) waiting->Cancel();
}

absl::Status RankRuntime::WaitFor(const std::shared_ptr<transport::Work>& work, const std::string& where) {
  {
    absl::MutexLock lock(&cancel_mu_);
    if (cancelled_) {
      work->Cancel();
      return absl::CancelledError(absl::StrCat(where, ": the step was cancelled"));
    }
    waiting_ = work;
  }
  const auto wait_start = std::chrono::steady_clock::now();
  absl::Status s = work->Wait(options_.timeout);
  waited_us_ += Micros(std::chrono::steady_clock::now()) - Micros(wait_start);
  {
    absl::MutexLock lock(&cancel_mu_);
    waiting_.reset();
    if (!s.ok() && cancelled_) return absl::CancelledError(absl::StrCat(where, ": the step was cancelled"));
  }
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
}

absl::StatusOr<StepResult> RankRuntime::TrainStep(int step, const std::vector<c10::IValue>& inputs,
                                                  const c10::IValue& target) {
  if (schedule_.forward_only) {
    return absl::FailedPreconditionError("TrainStep needs a training schedule; this one is forward-only");
  }
  return RunStep(step, inputs, target, /*training=*/true);
}

absl::StatusOr<StepResult> RankRuntime::InferenceStep(int step, const std::vector<c10::IValue>& inputs) {
  if (!schedule_.forward_only) {
    return absl::FailedPreconditionError("InferenceStep needs a forward-only schedule");
  }
  return RunStep(step, inputs, c10::IValue(), /*training=*/false);
}

absl::StatusOr<StepResult> RankRuntime::EvalStep(int eval_step, const std::vector<c10::IValue>& inputs,
                                                 const c10::IValue& target) {
  if (schedule_.forward_only) return absl::FailedPreconditionError("EvalStep needs a training job's runtime");
  // As model.eval(): dropout off, batch norm on its running statistics (and no random
  // numbers drawn, so that training goes on as it would have without the evaluation).
  std::map<int, bool> was_training;
  PIPPY_RETURN_IF_ERROR(TorchCall("switching the stages to eval mode", [&] {
    for (auto& [s, m] : stages_) {
      was_training[s] = m.is_training();
      m.eval();
    }
  }));
  absl::StatusOr<StepResult> r = RunStep(eval_step, inputs, target, /*training=*/false, /*evaluating=*/true);
  PIPPY_RETURN_IF_ERROR(TorchCall("switching the stages back to their mode", [&] {
    for (auto& [s, m] : stages_) m.train(was_training[s]);
  }));
  return r;
}

absl::StatusOr<StepResult> RankRuntime::RunStep(int step, const std::vector<c10::IValue>& inputs,
                                                const c10::IValue& target, bool training, bool evaluating) {
  {
    absl::MutexLock lock(&cancel_mu_);
    if (cancelled_) return absl::CancelledError(absl::StrCat("rank ", rank_, ": step ", step, " was cancelled"));
  }
  auto start = std::chrono::steady_clock::now();
  waited_us_ = 0;
  tp::ScopedGroup tp_group(options_.tensor_parallel);
  tp::TakeCollectiveSlices();  // not this step's
  StepState st;
  st.step = step;
  st.training = training;
  st.evaluating = evaluating;
  if (evaluating) st.activation = Tag::Kind::kEvalActivation;
  st.m = schedule_.num_microbatches;
  bool needs_inputs = false, holds_last = false;
  for (const auto& [s, m] : stages_) {
    const StagePlan& sp = plan_.stages(s);
    holds_last |= sp.is_last();
    for (const StageInput& si : sp.inputs()) needs_inputs |= si.source_case() == StageInput::kModelInput;
  }
  if (needs_inputs) {
    if (static_cast<int>(inputs.size()) != plan_.inputs_size()) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " needs the model's ", plan_.inputs_size(),
                                                     " input(s), got ", inputs.size()));
    }
    std::vector<std::string> names;
    for (const auto& in : plan_.inputs()) names.push_back(in.name());
    PIPPY_ASSIGN_OR_RETURN(st.mb_inputs, SplitIntoMicrobatches(inputs, st.m, options_.input_chunks, names));
  }
  if ((training || evaluating) && holds_last) {
    PIPPY_ASSIGN_OR_RETURN(auto t, SplitIntoMicrobatches({target}, st.m, {}, {"target"}));
    for (auto& mb : t) st.mb_targets.push_back(mb[0]);
  }
  if (!options_.device.is_cpu()) {
    PIPPY_RETURN_IF_ERROR(TorchCall(absl::StrCat("copying step ", step, "'s batch to ", options_.device.str()), [&] {
      for (auto& mb : st.mb_inputs) {
        for (c10::IValue& v : mb) v = transport::ToDevice(v, options_.device);
      }
      for (c10::IValue& v : st.mb_targets) v = transport::ToDevice(v, options_.device);
    }));
  }
  st.final_outputs.resize(st.m);
  const auto& actions = evaluating ? eval_actions_ : schedule_.ranks[rank_];
  // Data parallelism: each bucket of gradients is averaged across the replicas on the
  // reducer thread, one after the other, as its stage's last backward completes it.
  reductions_.clear();
  reducer_ = std::shared_future<void>();
  for (Bucket& b : buckets_) {
    b.ready = 0;
    b.launched = false;
  }
  auto join_reducer = [this] {
    if (reducer_.valid()) reducer_.wait();
  };
  absl::Cleanup joined = join_reducer;  // every return waits: the tasks use this runtime
  for (size_t pos = 0; pos < actions.size(); ++pos) {
    auto last = training && hook_state_ != nullptr ? reduce_after_.find(pos) : reduce_after_.end();
    if (last != reduce_after_.end()) hook_state_->final_stage = last->second;
    absl::Status s = Execute(st, pos, actions[pos]);
    if (last != reduce_after_.end()) {
      hook_state_->final_stage = -1;
      // Buckets whose gradients did not all come (unused parameters) go now.
      for (size_t b = 0; s.ok() && b < buckets_.size(); ++b) {
        if (buckets_[b].stage == last->second && !buckets_[b].launched) {
          LaunchBucket(static_cast<int>(b), /*in_backward=*/false);
        }
      }
    }
    if (!s.ok()) {
      if (!absl::IsCancelled(s)) {
        log::Error("rank={} step={} action #{} ({}) failed: {}", rank_, step, pos, actions[pos].ToString(),
                   std::string(s.message()));
      }
      for (auto& [w, d] : st.pending_sends) w->Cancel();
      return s;
    }
  }
  StepResult result;
  // The step's end, each piece timed like an action (wait excluded from its own kind).
  auto timed = [&](const char* name, double* kind, const std::function<absl::Status()>& fn) -> absl::Status {
    const auto begin = std::chrono::steady_clock::now();
    const int64_t waited_before = waited_us_;
    absl::Status s = fn();
    const int64_t dur = Micros(std::chrono::steady_clock::now()) - Micros(begin);
    const int64_t waited = waited_us_ - waited_before;
    st.trace.push_back({name, -1, Micros(begin), dur, 0, waited});
    *kind += static_cast<double>(dur - waited) * 1e-6;
    return s;
  };
  StepBreakdown& bd = result.breakdown;
  PIPPY_RETURN_IF_ERROR(timed("wait for sends", &bd.transport_seconds, [&]() -> absl::Status {
    for (auto& [work, where] : st.pending_sends) PIPPY_RETURN_IF_ERROR(WaitFor(work, where));
    return absl::OkStatus();
  }));
  // Every send and receive of the abandoned step is done: the ranks are in step.
  if (!st.abort.empty()) return absl::AbortedError(st.abort);
  if (training) {
    const auto& reductions = reductions_;
    if (!reductions.empty()) {
      double unused = 0;
      const auto wait_begin = std::chrono::steady_clock::now();
      PIPPY_RETURN_IF_ERROR(timed("replica all-reduce (wait)", &unused, [&]() -> absl::Status {
        join_reducer();
        for (const auto& r : reductions) {
          if (!r->status.ok()) {
            return absl::Status(r->status.code(), absl::StrCat("rank ", rank_, " step ", step, " stage ", r->stage,
                                                               " bucket ", r->bucket, ": ", r->status.message()));
          }
        }
        return absl::OkStatus();
      }));
      const int64_t blocked = Micros(std::chrono::steady_clock::now()) - Micros(wait_begin);
      waited_us_ += blocked;  // blocked on the other replicas
      st.trace.back().wait_us = blocked;
      bd.allreduce_wait_seconds = static_cast<double>(blocked) * 1e-6;
      for (const auto& r : reductions) {
        st.trace.push_back(
            {absl::StrCat("all-reduce ", r->stage, ".", r->bucket), r->stage, r->begin_us, r->duration_us, 0, 0});
        bd.allreduce_seconds += static_cast<double>(r->duration_us) * 1e-6;
        ++result.allreduce_buckets;
        if (r->in_backward) ++result.allreduce_buckets_in_backward;
      }
    }
    if (plan_.tied_size() > 0) {
      PIPPY_RETURN_IF_ERROR(timed("tied-gradient sync", &bd.transport_seconds, [&] { return SyncTiedGradients(st); }));
    }
    if (!reductions.empty() && plan_.tied_size() > 0) {
      PIPPY_RETURN_IF_ERROR(timed("replica all-reduce (tied)", &bd.transport_seconds, [&]() -> absl::Status {
        std::vector<at::Tensor> tied;
        for (const auto& [s, ps] : tied_params_) {
          for (const auto& [p, g] : ps) tied.push_back(p);
        }
        return AverageAcrossReplicas(tied);
      }));
    }
    if (options_.clip_grad_norm > 0) {
      PIPPY_RETURN_IF_ERROR(timed("clip gradients", &bd.optimizer_seconds, [&]() -> absl::Status {
        PIPPY_ASSIGN_OR_RETURN(result.grad_norm, ClipGradients(step));
        return absl::OkStatus();
      }));
    }
    PIPPY_RETURN_IF_ERROR(timed("optimizer step", &bd.optimizer_seconds, [&] {
      return TorchCall("optimizer step", [&] {
        const double lr = step >= 0 && step < static_cast<int>(options_.learning_rates.size())
                              ? options_.learning_rates[step]
                              : options_.optimizer.lr;
        for (auto& group : optimizer_->param_groups()) group.options().set_lr(lr);
        result.lr = lr;
        optimizer_->step();
        for (auto& group : optimizer_->param_groups()) {
          for (auto& p : group.params()) p.mutable_grad() = at::Tensor();
        }
      }, absl::StatusCode::kInternal);
    }));
    if (holds_last) {
      result.loss = st.loss_sum / st.m;
      result.has_loss = true;
    }
  } else if (holds_last && evaluating) {
    result.loss = st.loss_sum / st.m;
    result.has_loss = true;
  } else if (holds_last) {
    PIPPY_ASSIGN_OR_RETURN(result.output, MergeMicrobatches(st.final_outputs));
    if (!options_.device.is_cpu()) {
      PIPPY_RETURN_IF_ERROR(TorchCall("copying the output to the host", [&] {
        result.output = transport::ToDevice(result.output, c10::Device(c10::kCPU));
      }));
    }
  }
  result.busy_seconds = st.busy;
  result.peak_live_activations = st.peak;
  result.step_seconds = Seconds(start);
  bd.wait_seconds = static_cast<double>(waited_us_) * 1e-6;
  bd.compute_seconds = st.busy;
  bd.transport_seconds += st.transport;
  bd.other_seconds = std::max(0.0, result.step_seconds - bd.compute_seconds - bd.wait_seconds -
                                       bd.transport_seconds - bd.optimizer_seconds);
  result.trace = std::move(st.trace);
  for (const tp::CollectiveSlice& c : tp::TakeCollectiveSlices()) {
    result.trace.push_back({c.backward ? "tp all-reduce (backward)" : "tp all-reduce", -1, c.begin_us, c.duration_us,
                            c.bytes, 0});
    bd.tp_allreduce_seconds += static_cast<double>(c.duration_us) * 1e-6;
    ++bd.tp_allreduces;
  }
  return result;
}

absl::Status RankRuntime::Execute(StepState& st, size_t pos, const Action& a) {
  std::string name = a.ToString();
  const std::string where = absl::StrCat("rank ", rank_, " step ", st.step, " action #", pos, " (", name, ")");
  const auto start = std::chrono::steady_clock::now();
  const int64_t waited_before = waited_us_;
  st.bytes = 0;
  absl::Status s;
  bool compute = true;
  switch (a.type) {
    case ActionType::kForward:
      if (!st.training && !st.abort.empty()) break;  // abandoned: nothing to compute
      s = Forward(st, a.stage, a.microbatch);
      if (!st.training && !s.ok() && !absl::IsCancelled(s)) {
        // Forward only: the step is abandoned, but its sends and receives still happen
        // (as abort markers), so that this rank and its peers can run the next step.
        st.abort = absl::StrCat(where, ": ", s.message());
        log::Warn("rank={} step={}: abandoning the step: {}", rank_, st.step, st.abort);
        s = absl::OkStatus();
      }
      break;
    case ActionType::kBackward: s = Backward(st, a.stage, a.microbatch, true, true); break;
    case ActionType::kBackwardInput: s = Backward(st, a.stage, a.microbatch, true, false); break;
    case ActionType::kBackwardWeight: s = Backward(st, a.stage, a.microbatch, false, true); break;
    case ActionType::kSendForward: s = SendForward(st, a.stage, a.microbatch); compute = false; break;
    case ActionType::kRecvForward: s = RecvForward(st, a.stage, a.microbatch, where); compute = false; break;
    case ActionType::kSendBackward: s = SendBackward(st, a.stage, a.microbatch); compute = false; break;
    case ActionType::kRecvBackward: s = RecvBackward(st, a.stage, a.microbatch, where); compute = false; break;
  }
  const int64_t duration = Micros(std::chrono::steady_clock::now()) - Micros(start);
  const int64_t waited = waited_us_ - waited_before;
  st.trace.push_back({std::move(name), a.stage, Micros(start), duration, st.bytes, waited, a.type});
  if (!compute) {
    st.transport += static_cast<double>(duration - waited) * 1e-6;
    return s;
  }
  st.busy += static_cast<double>(duration) * 1e-6;
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat(where, ": ", s.message()));
  return s;
}

absl::Status RankRuntime::Forward(StepState& st, int s, int mb) {
  const StagePlan& sp = plan_.stages(s);
  std::vector<c10::IValue> args;
  auto inbox_it = st.fwd_inbox.find({s, mb});
  for (int k = 0; k < sp.inputs_size(); ++k) {
    const StageInput& si = sp.inputs(k);
    c10::IValue v;
    if (si.source_case() == StageInput::kModelInput) {
      v = st.mb_inputs[mb][si.model_input()];
    } else {
      if (inbox_it == st.fwd_inbox.end() || inbox_it->second[k].isNone()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "input '", si.name(), "' from stage ", si.source_stage(),
            " has not arrived: the schedule runs this forward before the RECV_F or the producing forward"));
      }
      v = inbox_it->second[k];
      if (st.training && v.isTensor() && at::isFloatingType(v.toTensor().scalar_type())) {
        v = v.toTensor().detach().requires_grad_(true);
      }
    }
    args.push_back(std::move(v));
  }
  if (inbox_it != st.fwd_inbox.end()) st.fwd_inbox.erase(inbox_it);
  torch::jit::Module module = stages_.at(s);
  PIPPY_ASSIGN_OR_RETURN(c10::IValue out, TorchCall(absl::StrCat("stage ", s, " forward of micro-batch ", mb), [&] {
    AutocastScope autocast(options_.device.type(), options_.autocast);
    if (st.training) return module.forward(args);
    torch::NoGradGuard no_grad;
    return module.forward(args);
  }));
  StepState::Saved saved;
  if (sp.is_last()) {
    if (st.training) {
      // Mixed precision: the loss in fp32, on the output cast to fp32 (its backward
      // hands the reduced-precision gradient back to the forward).
      if (options_.autocast != c10::ScalarType::Undefined) out = ToFloat32(out);
      PIPPY_ASSIGN_OR_RETURN(saved.loss, ComputeLoss(options_.loss, module, out, st.mb_targets[mb]));
      st.loss_sum += saved.loss.item<double>();
    } else if (st.evaluating) {
      // The loss as training computes it (fp32), without gradients.
      torch::NoGradGuard no_grad;
      if (options_.autocast != c10::ScalarType::Undefined) out = ToFloat32(out);
      PIPPY_ASSIGN_OR_RETURN(at::Tensor loss, ComputeLoss(options_.loss, module, out, st.mb_targets[mb]));
      st.loss_sum += loss.item<double>();
    } else {
      st.final_outputs[mb] = out;
    }
  } else {
    if (!out.isTuple()) return absl::InternalError("a non-final stage must return a tuple (partitioner bug)");
    std::vector<c10::IValue> values = out.toTupleRef().elements().vec();
    for (size_t j = 0; j < values.size(); ++j) {
      for (const auto& [c, k] : consumers_[s][j]) {
        if (schedule_.stage_to_rank[c] != rank_) continue;
        auto& inbox = st.fwd_inbox[{c, mb}];
        inbox.resize(plan_.stages(c).inputs_size());
        inbox[k] = values[j];
      }
    }
    st.to_send[{s, mb}] = values;
    if (st.training) saved.outputs = values;
  }
  if (st.training) {
    saved.inputs = std::move(args);
    st.saved[{s, mb}] = std::move(saved);
    st.peak = std::max(st.peak, ++st.live);
  }
  return absl::OkStatus();
}

absl::Status RankRuntime::SendForward(StepState& st, int s, int mb) {
  if (!st.training && !st.abort.empty()) {
    st.to_send.erase({s, mb});
    for (size_t j = 0; j < consumers_[s].size(); ++j) {
      for (const auto& [c, k] : consumers_[s][j]) {
        const int peer = schedule_.stage_to_rank[c];
        if (peer == rank_) continue;
        Tag tag = MakeTag(st.activation, st.step, mb, s, c, static_cast<int>(j));
        st.pending_sends.emplace_back(transport_->Send(peer, tag, AbortValue(st.abort)),
                                      absl::StrCat("rank ", rank_, " sending ", tag.ToString(), " (abandoned) to rank ",
                                                   peer));
      }
    }
    return absl::OkStatus();
  }
  auto it = st.to_send.find({s, mb});
  if (it == st.to_send.end()) {
    return absl::FailedPreconditionError(absl::StrCat("rank ", rank_, ": SEND_F of stage ", s, " micro-batch ", mb,
                                                      " before its forward"));
  }
  for (size_t j = 0; j < it->second.size(); ++j) {
    for (const auto& [c, k] : consumers_[s][j]) {
      int peer = schedule_.stage_to_rank[c];
      if (peer == rank_) continue;
      Tag tag = MakeTag(st.activation, st.step, mb, s, c, static_cast<int>(j));
      c10::IValue v = it->second[j].isTensor() ? c10::IValue(it->second[j].toTensor().detach()) : it->second[j];
      st.bytes += TensorBytes(v);
      st.pending_sends.emplace_back(transport_->Send(peer, tag, v),
                                    absl::StrCat("rank ", rank_, " sending ", tag.ToString(), " to rank ", peer));
    }
  }
  st.to_send.erase(it);
  return absl::OkStatus();
}

absl::Status RankRuntime::RecvForward(StepState& st, int s, int mb, const std::string& where) {
  const StagePlan& sp = plan_.stages(s);
  std::vector<std::pair<int, std::shared_ptr<transport::Work>>> works;
  for (int k = 0; k < sp.inputs_size(); ++k) {
    const StageInput& si = sp.inputs(k);
    if (si.source_case() != StageInput::kSourceStage) continue;
    int peer = schedule_.stage_to_rank[si.source_stage()];
    if (peer == rank_) continue;
    Tag tag = MakeTag(st.activation, st.step, mb, si.source_stage(), s, si.source_output());
    works.emplace_back(k, transport_->Recv(peer, tag));
  }
  auto& inbox = st.fwd_inbox[{s, mb}];
  inbox.resize(sp.inputs_size());
  for (auto& [k, work] : works) {
    PIPPY_RETURN_IF_ERROR(WaitFor(work, where));
    inbox[k] = work->Value();
    if (!st.training) {
      if (std::optional<std::string> why = AbortReason(inbox[k])) {
        if (st.abort.empty()) st.abort = *why;
        inbox[k] = c10::IValue();
        continue;
      }
    }
    st.bytes += TensorBytes(inbox[k]);
  }
  return absl::OkStatus();
}

absl::Status RankRuntime::Backward(StepState& st, int s, int mb, bool inputs, bool weights) {
  auto it = st.saved.find({s, mb});
  if (it == st.saved.end()) {
    return absl::FailedPreconditionError(absl::StrCat("no forward state for stage ", s, " micro-batch ", mb,
                                                      ": backward before forward, or twice"));
  }
  StepState::Saved& saved = it->second;
  const StagePlan& sp = plan_.stages(s);
  if (!saved.roots_ready) {
    if (sp.is_last()) {
      saved.roots = {saved.loss / static_cast<double>(st.m)};
      saved.root_grads = {at::ones_like(saved.roots[0])};
    } else {
      auto grads_it = st.bwd_inbox.find({s, mb});
      for (size_t j = 0; j < saved.outputs.size(); ++j) {
        if (!saved.outputs[j].isTensor() || !saved.outputs[j].toTensor().requires_grad()) continue;
        if (grads_it == st.bwd_inbox.end() || j >= grads_it->second.size() || !grads_it->second[j].defined()) continue;
        saved.roots.push_back(saved.outputs[j].toTensor());
        saved.root_grads.push_back(grads_it->second[j]);
      }
      if (grads_it != st.bwd_inbox.end()) st.bwd_inbox.erase(grads_it);
    }
    saved.roots_ready = true;
  }
  std::vector<at::Tensor> leaves;
  std::vector<int> leaf_index;
  for (size_t k = 0; k < saved.inputs.size(); ++k) {
    if (saved.inputs[k].isTensor() && saved.inputs[k].toTensor().requires_grad() &&
        sp.inputs(static_cast<int>(k)).source_case() == StageInput::kSourceStage) {
      leaves.push_back(saved.inputs[k].toTensor());
      leaf_index.push_back(static_cast<int>(k));
    }
  }
  std::vector<at::Tensor> input_grads(saved.inputs.size());
  // Tied parameters: take this micro-batch's contribution apart from .grad.
  std::vector<at::Tensor> kept;
  auto tied_it = tied_params_.find(s);
  if (weights && tied_it != tied_params_.end()) {
    for (auto& [p, g] : tied_it->second) {
      kept.push_back(p.grad());
      p.mutable_grad() = at::Tensor();
    }
  }
  absl::Status s_status = TorchCall(absl::StrCat("stage ", s, " backward of micro-batch ", mb), [&] {
    if (saved.roots.empty()) return;
    if (inputs && weights) {
      torch::autograd::backward(saved.roots, saved.root_grads);
      for (size_t i = 0; i < leaves.size(); ++i) input_grads[leaf_index[i]] = leaves[i].grad();
    } else if (inputs) {
      if (leaves.empty()) return;
      auto gs = torch::autograd::grad(saved.roots, leaves, saved.root_grads, /*retain_graph=*/true,
                                      /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t i = 0; i < leaves.size(); ++i) input_grads[leaf_index[i]] = gs[i];
    } else {
      std::vector<at::Tensor> params = LocalParameters(s);
      if (params.empty()) return;
      torch::autograd::backward(saved.roots, saved.root_grads, /*retain_graph=*/false, /*create_graph=*/false,
                                params);
    }
  }, absl::StatusCode::kInternal);
  if (weights && tied_it != tied_params_.end()) {
    for (size_t i = 0; i < tied_it->second.size(); ++i) {
      auto& [p, g] = tied_it->second[i];
      st.tied_contrib[{g, s, mb}] = p.grad();
      p.mutable_grad() = kept[i];
    }
  }
  PIPPY_RETURN_IF_ERROR(s_status);
  if (inputs) {
    for (int k = 0; k < sp.inputs_size(); ++k) {
      const StageInput& si = sp.inputs(k);
      if (si.source_case() != StageInput::kSourceStage) continue;
      int p = si.source_stage();
      if (schedule_.stage_to_rank[p] == rank_) {
        if (!input_grads[k].defined()) continue;
        auto& inbox = st.bwd_inbox[{p, mb}];
        inbox.resize(plan_.stages(p).outputs_size());
        at::Tensor& slot = inbox[si.source_output()];
        slot = slot.defined() ? slot + input_grads[k] : input_grads[k];
      } else {
        auto& out = st.grads_to_send[{s, mb}];
        out.resize(sp.inputs_size());
        out[k] = input_grads[k];
      }
    }
  }
  if (weights) {
    st.saved.erase(it);
    --st.live;
  }
  return absl::OkStatus();
}

absl::Status RankRuntime::SendBackward(StepState& st, int s, int mb) {
  const StagePlan& sp = plan_.stages(s);
  auto it = st.grads_to_send.find({s, mb});
  for (int k = 0; k < sp.inputs_size(); ++k) {
    const StageInput& si = sp.inputs(k);
    if (si.source_case() != StageInput::kSourceStage) continue;
    int peer = schedule_.stage_to_rank[si.source_stage()];
    if (peer == rank_) continue;
    at::Tensor g;
    if (it != st.grads_to_send.end() && k < static_cast<int>(it->second.size())) g = it->second[k];
    Tag tag = MakeTag(Tag::Kind::kGradient, st.step, mb, s, si.source_stage(), si.source_output());
    if (g.defined()) st.bytes += static_cast<int64_t>(g.numel() * g.element_size());
    st.pending_sends.emplace_back(transport_->Send(peer, tag, g.defined() ? c10::IValue(g) : c10::IValue()),
                                  absl::StrCat("rank ", rank_, " sending ", tag.ToString(), " to rank ", peer));
  }
  if (it != st.grads_to_send.end()) st.grads_to_send.erase(it);
  return absl::OkStatus();
}

absl::Status RankRuntime::RecvBackward(StepState& st, int s, int mb, const std::string& where) {
  struct Pending {
    int output;
    int peer;
    std::shared_ptr<transport::Work> work;
  };
  std::vector<Pending> works;
  for (size_t j = 0; j < consumers_[s].size(); ++j) {
    for (const auto& [c, k] : consumers_[s][j]) {
      int peer = schedule_.stage_to_rank[c];
      if (peer == rank_) continue;
      Tag tag = MakeTag(Tag::Kind::kGradient, st.step, mb, c, s, static_cast<int>(j));
      works.push_back({static_cast<int>(j), peer, transport_->Recv(peer, tag)});
    }
  }
  auto& inbox = st.bwd_inbox[{s, mb}];
  inbox.resize(consumers_[s].size());
  auto saved = st.saved.find({s, mb});
  for (auto& [j, peer, work] : works) {
    PIPPY_RETURN_IF_ERROR(WaitFor(work, where));
    const c10::IValue v = work->Value();
    if (v.isNone()) continue;  // that consumer needed no gradient
    // A gradient must be a tensor shaped like the output it is for: anything else
    // from a peer is a malformed message, reported, never thrown.
    if (!v.isTensor()) {
      return absl::DataLossError(absl::StrCat(where, ": rank ", peer, " sent a ", v.tagKind(),
                                              " where a gradient tensor was expected"));
    }
    const at::Tensor& g = v.toTensor();
    st.bytes += static_cast<int64_t>(g.numel() * g.element_size());
    if (saved != st.saved.end() && static_cast<size_t>(j) < saved->second.outputs.size() &&
        saved->second.outputs[j].isTensor() && saved->second.outputs[j].toTensor().sizes() != g.sizes()) {
      return absl::DataLossError(absl::StrCat(where, ": rank ", peer, " sent a gradient of shape ",
                                              c10::str(g.sizes()), " for an output of shape ",
                                              c10::str(saved->second.outputs[j].toTensor().sizes())));
    }
    at::Tensor& slot = inbox[j];
    PIPPY_RETURN_IF_ERROR(TorchCall(where, [&] { slot = slot.defined() ? slot + g : g; }));
  }
  return absl::OkStatus();
}

CollectiveContext RankRuntime::Collectives(int step) {
  CollectiveContext ctx;
  ctx.rank = rank_;
  ctx.num_ranks = schedule_.num_ranks;
  ctx.step = step;
  ctx.transport = transport_;
  ctx.wait = [this](const std::shared_ptr<transport::Work>& w, const std::string& where) { return WaitFor(w, where); };
  return ctx;
}

absl::Status RankRuntime::SyncTiedGradients(StepState& st) {
  const CollectiveContext ctx = Collectives(st.step);
  for (int g = 0; g < plan_.tied_size(); ++g) {
    const TiedParameter& tp = plan_.tied(g);
    TiedGroup group;
    group.group = g;
    group.name = tp.canonical();
    group.holders.assign(tp.stages().begin(), tp.stages().end());
    std::sort(group.holders.begin(), group.holders.end());
    for (int s : group.holders) group.stages_of_rank[schedule_.stage_to_rank[s]].push_back(s);
    auto mine = group.stages_of_rank.find(rank_);
    if (mine == group.stages_of_rank.end()) continue;
    // This rank's contributions, per holder stage and micro-batch; the shape from any
    // local copy of the tensor.
    std::vector<std::vector<at::Tensor>> local;
    for (int s : mine->second) {
      std::vector<at::Tensor> per_mb;
      for (int mb = 0; mb < st.m; ++mb) {
        auto it = st.tied_contrib.find({g, s, mb});
        per_mb.push_back(it != st.tied_contrib.end() ? it->second : at::Tensor());
      }
      local.push_back(std::move(per_mb));
      for (const auto& [p, pg] : tied_params_[s]) {
        if (pg == g) group.shape = p.sizes().vec();
      }
    }
    PIPPY_ASSIGN_OR_RETURN(at::Tensor total, SumTiedGradient(ctx, group, local, st.m));
    for (int s : mine->second) {
      for (auto& [p, pg] : tied_params_[s]) {
        if (pg == g) p.mutable_grad() = total.defined() ? total.clone() : at::Tensor();
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<double> RankRuntime::ClipGradients(int step) {
  // Squared norm of this rank's gradients; a tied tensor counts once (its first holder),
  // and so does a tensor every rank of the tensor-parallel group holds whole (its first rank).
  double local = 0;
  std::vector<at::Tensor> grads;
  transport::ReplicaGroup* tp_group = options_.tensor_parallel;
  const bool tp = tp_group != nullptr && tp_group->size() > 1;
  for (const auto& [s, module] : stages_) {
    std::set<std::string> skip;
    for (const ParameterInfo& pi : plan_.stages(s).parameters()) {
      if (pi.tie_group() >= 0 && plan_.tied(pi.tie_group()).stages(0) != s) skip.insert(pi.name());
      if (tp && !pi.has_tp_dim() && tp_group->index() != 0) skip.insert(pi.name());
    }
    for (const auto& p : module.named_parameters(true)) {
      if (!p.value.grad().defined()) continue;
      grads.push_back(p.value.grad());
      if (!skip.count(p.name)) local += p.value.grad().to(at::kDouble).pow(2).sum().item<double>();
    }
  }
  PIPPY_ASSIGN_OR_RETURN(double total, AllReduceSum(Collectives(step), local, "gradient-norm exchange"));
  if (tp) {
    // Across the group in float32 as two parts (high and low), so that the sum keeps
    // about double precision.
    at::Tensor parts = torch::empty({2}, at::kFloat);
    const float high = static_cast<float>(total);
    parts[0] = high;
    parts[1] = static_cast<float>(total - static_cast<double>(high));
    PIPPY_RETURN_IF_ERROR(tp_group->AllReduceSum(parts));
    total = static_cast<double>(parts[0].item<float>()) + static_cast<double>(parts[1].item<float>());
  }
  const double norm = std::sqrt(total);
  const double coef = options_.clip_grad_norm / (norm + 1e-6);
  if (coef < 1.0) {
    torch::NoGradGuard no_grad;
    for (at::Tensor& g : grads) g.mul_(coef);
  }
  return norm;
}

}  // namespace pippy::stage
