#include "pipeline/autoplan/profile.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "ATen/Parallel.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/autoplan/chooser.h"
#include "pipeline/partition/forward_probe.h"
#include "pipeline/partition/model_graph.h"
#include "pipeline/partition/plan_builder.h"
#include "pipeline/stage/microbatch.h"
#include "pipeline/stage/training.h"
#include "torch/csrc/autograd/autograd.h"

extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace pippy::autoplan {
namespace {

using Clock = std::chrono::steady_clock;

double Micros(Clock::time_point since) {
  return std::chrono::duration<double, std::micro>(Clock::now() - since).count();
}

// Bytes malloc has handed out and not had back (the heap's and mmap'ed chunks): what a
// forward holds until its backward, whatever the allocator gives back to the system.
int64_t HeapInUse() {
  const struct mallinfo2 mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

void CollectTensors(const c10::IValue& v, std::vector<at::Tensor>* out) {
  if (v.isTensor()) {
    out->push_back(v.toTensor());
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) CollectTensors(e, out);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) CollectTensors(e, out);
  }
}

int64_t BytesOf(const c10::IValue& v) {
  std::vector<at::Tensor> ts;
  CollectTensors(v, &ts);
  int64_t n = 0;
  for (const at::Tensor& t : ts) n += static_cast<int64_t>(t.numel() * t.element_size());
  return n;
}

// An earlier span's output as a span's input: floating tensors as fresh leaves that
// record gradients (the span's I is the gradient of them), the rest as it is.
c10::IValue AsLeaf(const c10::IValue& v, bool train, std::vector<at::Tensor>* leaves) {
  if (!v.isTensor()) return v;
  at::Tensor t = v.toTensor().detach();
  if (train && t.is_floating_point()) {
    t.requires_grad_(true);
    leaves->push_back(t);
  }
  return t;
}

struct SpanRun {
  std::vector<double> forward_us, input_us, weight_us;
  int64_t activation_bytes = 0;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// A measurement's error in one line: its context and, of a TorchScript traceback, the
// last line (the raised error itself: "builtins.ValueError: Expected more than 1 value
// per channel when training, ...").
std::string Briefly(absl::string_view message) {
  std::vector<absl::string_view> lines = absl::StrSplit(message, '\n', absl::SkipWhitespace());
  if (lines.empty()) return "";
  std::string out(lines.front().substr(0, 200));
  if (lines.size() > 1) absl::StrAppend(&out, " ... ", lines.back().substr(0, 300));
  return out;
}

}  // namespace

std::vector<int> CandidateSizes(int64_t batch, int also) {
  std::vector<int> sizes;
  for (int m = 1; m <= 32 && m <= batch; m *= 2) {
    if (batch % m == 0) sizes.push_back(static_cast<int>(batch / m));
  }
  if (also > 0 && batch % also == 0) sizes.push_back(static_cast<int>(batch / also));
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  return sizes;
}

absl::StatusOr<ModelProfile> ProfileModel(const torch::jit::Module& model, const std::vector<c10::IValue>& batch,
                                          const ProfileOptions& options) {
  const Clock::time_point began = Clock::now();
  PIPPY_ASSIGN_OR_RETURN(std::unique_ptr<partition::ModelGraph> mg, partition::ModelGraph::Build(model));
  if (batch.size() + 1 != mg->graph().inputs().size()) {
    return absl::InvalidArgumentError(absl::StrCat("the batch has ", batch.size(), " value(s) but forward() takes ",
                                                   mg->graph().inputs().size() - 1));
  }
  if (mg->num_ops() == 0) return absl::InvalidArgumentError("forward() computes nothing: there is nothing to measure");
  int64_t samples = 0;
  for (const c10::IValue& v : batch) {
    if (v.isTensor() && v.toTensor().dim() > 0) {
      samples = v.toTensor().size(0);
      break;
    }
  }
  if (samples < 1) return absl::InvalidArgumentError("the batch has no tensor with a batch dimension");
  std::vector<int> sizes = options.microbatch_sizes;
  if (sizes.empty()) sizes.push_back(static_cast<int>(samples));
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  for (int b : sizes) {
    if (b < 1 || samples % b != 0) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batches of ", b, " samples do not divide the batch of ",
                                                     samples));
    }
  }
  // Spans between evenly spread legal cuts, built as the stages of a probe pipe.
  const std::vector<int>& legal = mg->legal_cuts();
  const size_t want = std::min<size_t>(legal.size(), static_cast<size_t>(std::max(1, options.max_spans - 1)));
  std::vector<int> cuts;
  for (size_t i = 0; i < want; ++i) cuts.push_back(legal[(i * legal.size()) / want]);
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  partition::Pipe probe;
  for (size_t i = 1; i < mg->graph().inputs().size(); ++i) {
    ModelValue* mv = probe.plan.add_inputs();
    mv->set_name(mg->graph().inputs()[i]->debugName());
    mv->set_type(mg->graph().inputs()[i]->type()->repr_str());
  }
  PIPPY_RETURN_IF_ERROR(partition::BuildPipe(*mg, cuts, /*share_tensors=*/true, &probe));
  const int S = static_cast<int>(probe.stages.size());

  ModelProfile profile;
  profile.set_repeats(std::max(1, options.repeats));
  profile.set_threads(at::get_num_threads());
  char host[256] = {0};
  if (gethostname(host, sizeof(host) - 1) == 0) profile.set_host(host);
  for (int s = 0; s < S; ++s) {
    const StagePlan& sp = probe.plan.stages(s);
    SpanCost* span = profile.add_spans();
    span->set_first_node(sp.first_node());
    span->set_num_nodes(sp.num_nodes());
    span->set_first_module(sp.first_module());
    span->set_last_module(sp.last_module());
    for (const ParameterInfo& p : sp.parameters()) {
      if (p.requires_grad()) {
        span->set_param_bytes(span->param_bytes() + p.bytes());
      } else {
        span->set_buffer_bytes(span->buffer_bytes() + p.bytes());
      }
    }
  }
  // The stage's parameters that take gradients.
  std::vector<std::vector<at::Tensor>> params(S);
  for (int s = 0; s < S; ++s) {
    for (const at::Tensor& p : probe.stages[s].parameters(/*recurse=*/true)) {
      if (p.requires_grad()) params[s].push_back(p);
    }
  }

  const bool train = options.train;
  // Each size on its own: a size the model cannot run (BatchNorm in training with one
  // sample, a reshape that needs a whole batch) is left out, saying why, and the plan is
  // chosen among the others.
  for (int b : sizes) {
    absl::Status measured = TorchCall(absl::StrCat("measuring the model at ", b, " sample(s) per micro-batch"),
                                      [&]() -> absl::Status {
      PIPPY_ASSIGN_OR_RETURN(auto split, stage::SplitIntoMicrobatches(batch, static_cast<int>(samples / b)));
      const std::vector<c10::IValue>& inputs = split[0];
      std::vector<SpanRun> runs(S);
      std::vector<std::vector<c10::IValue>> outs(S);
      const int warmups = std::max(0, options.warmups);
      const int most = warmups + std::max(1, options.repeats);
      const Clock::time_point size_began = Clock::now();
      for (int rep = 0; rep < most; ++rep) {
        const bool timed = rep >= warmups;
        if (rep >= warmups + 3 && Micros(size_began) > 1e6 * options.seconds_per_size) break;
        for (int s = 0; s < S; ++s) {
          const StagePlan& sp = probe.plan.stages(s);
          std::vector<at::Tensor> leaves;
          std::vector<c10::IValue> args;
          for (const StageInput& si : sp.inputs()) {
            // Model inputs come from the data (no gradients, as on the ranks); another
            // span's outputs as activations received from an earlier stage.
            if (si.source_case() == StageInput::kModelInput) {
              args.push_back(inputs[static_cast<size_t>(si.model_input())]);
              continue;
            }
            const c10::IValue& v = outs[static_cast<size_t>(si.source_stage())][static_cast<size_t>(si.source_output())];
            args.push_back(AsLeaf(v, train, &leaves));
          }
          partition::BufferSnapshot restore(probe.stages[s]);
          std::optional<torch::NoGradGuard> no_grad;
          if (!train) no_grad.emplace();
          const int64_t heap_before = HeapInUse();
          Clock::time_point t0 = Clock::now();
          c10::IValue result = probe.stages[s].forward(args);
          const double f = Micros(t0);
          const int64_t held = HeapInUse() - heap_before;
          SpanRun& run = runs[static_cast<size_t>(s)];
          if (timed) {
            run.forward_us.push_back(f);
            run.activation_bytes = rep == warmups ? held : std::min(run.activation_bytes, held);
          }
          std::vector<at::Tensor> out_tensors, differentiable, grads;
          CollectTensors(result, &out_tensors);
          for (const at::Tensor& t : out_tensors) {
            if (t.requires_grad()) {
              differentiable.push_back(t);
              grads.push_back(at::ones_like(t));
            }
          }
          double in_us = 0, w_us = 0;
          if (train && !differentiable.empty()) {
            if (!leaves.empty()) {
              t0 = Clock::now();
              torch::autograd::grad(differentiable, leaves, grads, /*retain_graph=*/true, /*create_graph=*/false,
                                    /*allow_unused=*/true);
              in_us = Micros(t0);
            }
            if (!params[static_cast<size_t>(s)].empty()) {
              t0 = Clock::now();
              torch::autograd::grad(differentiable, params[static_cast<size_t>(s)], grads, /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
              w_us = Micros(t0);
            }
          }
          if (timed) {
            run.input_us.push_back(in_us);
            run.weight_us.push_back(w_us);
          }
          std::vector<c10::IValue> next;
          if (sp.is_last()) {
            next.push_back(result);
          } else {
            next = result.toTupleRef().elements().vec();
          }
          for (c10::IValue& v : next) {
            if (v.isTensor()) v = v.toTensor().detach();
          }
          outs[static_cast<size_t>(s)] = std::move(next);
        }
      }
      // A cut after span j sends every earlier span's output that a later span reads,
      // once (its readers past the cut are most often all in the next stage).
      std::vector<int64_t> cut_bytes(S, 0);
      for (int s = 0; s < S; ++s) {
        const StagePlan& sp = probe.plan.stages(s);
        for (int o = 0; o < sp.outputs_size() && !sp.is_last(); ++o) {
          const int64_t bytes = BytesOf(outs[static_cast<size_t>(s)][static_cast<size_t>(o)]);
          int last = s;
          for (int c : sp.outputs(o).consumers()) last = std::max(last, c);
          for (int j = s; j < last && j < S - 1; ++j) cut_bytes[static_cast<size_t>(j)] += bytes;
        }
      }
      for (int s = 0; s < S; ++s) {
        const SpanRun& run = runs[static_cast<size_t>(s)];
        SpanSize* z = profile.mutable_spans(s)->add_sizes();
        z->set_forward_us(Median(run.forward_us));
        z->set_backward_input_us(Median(run.input_us));
        z->set_backward_weight_us(Median(run.weight_us));
        z->set_activation_bytes(std::max<int64_t>(0, run.activation_bytes));
        z->set_cut_bytes(cut_bytes[static_cast<size_t>(s)]);
      }
      return absl::OkStatus();
    });
    if (measured.ok()) {
      profile.add_microbatch_sizes(b);
    } else {
      profile.add_unmeasured(Briefly(measured.message()));
    }
  }
  if (profile.microbatch_sizes_size() == 0) {
    return absl::InvalidArgumentError(absl::StrJoin(profile.unmeasured(), "; "));
  }

  // The optimizer's step over (up to 32 MiB of) parameters like the model's.
  if (train) {
    absl::Status opt = TorchCall("measuring the optimizer", [&]() -> absl::Status {
      int64_t total = 0;
      for (const SpanCost& sc : profile.spans()) total += sc.param_bytes();
      const int64_t elems = std::max<int64_t>(1 << 16, std::min<int64_t>(total, int64_t{32} << 20) / 4);
      at::Tensor p = at::zeros({elems});
      p.mutable_grad() = at::ones({elems});
      stage::OptimizerOptions oo;
      oo.kind = options.optimizer == OPTIMIZER_UNSPECIFIED ? OPTIMIZER_SGD : options.optimizer;
      oo.momentum = 0.9;
      PIPPY_ASSIGN_OR_RETURN(std::unique_ptr<torch::optim::Optimizer> optimizer, stage::MakeOptimizer(oo, {p}));
      std::vector<double> runs;
      for (int rep = 0; rep < 1 + std::max(1, options.repeats); ++rep) {
        const Clock::time_point t0 = Clock::now();
        optimizer->step();
        if (rep > 0) runs.push_back(Micros(t0));
      }
      profile.set_optimizer_us_per_mib(Median(runs) / (static_cast<double>(elems * 4) / (1 << 20)));
      return absl::OkStatus();
    });
    PIPPY_RETURN_IF_ERROR(opt);
  }
  profile.set_seconds(Micros(began) / 1e6);
  return profile;
}

std::vector<double> MeasureColocation(int max_k) {
  std::vector<double> out = {1.0};
  max_k = std::min(max_k, 16);
  if (max_k < 2) return out;
  at::Tensor w = at::randn({256, 256});
  auto work = [&w]() -> double {
    c10::InferenceMode guard;
    at::Tensor x = at::randn({64, 256});
    const Clock::time_point t0 = Clock::now();
    for (int i = 0; i < 60; ++i) x = at::tanh(at::mm(x, w) + x) * 0.5;
    return Micros(t0);
  };
  // k threads at once, each its time; the median of 3 rounds of their mean.
  auto round = [&](int k) {
    std::vector<double> times(static_cast<size_t>(k));
    std::vector<std::thread> threads;
    for (int t = 0; t < k; ++t) threads.emplace_back([&, t] { times[static_cast<size_t>(t)] = work(); });
    for (std::thread& th : threads) th.join();
    double sum = 0;
    for (double v : times) sum += v;
    return sum / k;
  };
  work();  // warm-up
  std::vector<double> alone;
  for (int r = 0; r < 5; ++r) alone.push_back(round(1));
  const double base = Median(alone);
  for (int k = 2; k <= max_k; ++k) {
    std::vector<double> together;
    for (int r = 0; r < 3; ++r) together.push_back(round(k));
    out.push_back(base > 0 ? std::max(1.0, Median(together) / base) : 1.0);
  }
  return out;
}

absl::StatusOr<PlanChoice> MeasureAndChoose(const JobSpec& spec, const torch::jit::Module& model,
                                            const std::vector<c10::IValue>& batch) {
  const int replicas = std::max(1, spec.replicas());
  std::vector<c10::IValue> per_replica = batch;
  if (replicas > 1) {
    PIPPY_ASSIGN_OR_RETURN(auto split, stage::SplitIntoMicrobatches(batch, replicas));
    per_replica = split[0];
  }
  ProfileOptions po;
  po.microbatch_sizes =
      CandidateSizes(spec.batch_size() / replicas, spec.auto_plan().microbatches() ? 0 : spec.schedule().microbatches());
  po.train = spec.mode() == MODE_TRAIN;
  po.optimizer = spec.optimizer().kind();
  int threads = 0;
  for (const WorkerCapacity& w : spec.auto_plan().workers()) {
    if (w.threads() > 0) threads = threads == 0 ? w.threads() : std::min(threads, w.threads());
  }
  threads = std::max(1, threads);
  const int had = at::get_num_threads();
  at::set_num_threads(threads);
  if (openblas_set_num_threads) openblas_set_num_threads(threads);
  absl::StatusOr<ModelProfile> profile = ProfileModel(model, per_replica, po);
  if (profile.ok()) {
    // The most ranks any candidate could put on one host, up to its cores.
    std::map<std::string, int> on_host;
    int most = 1;
    for (const WorkerCapacity& w : spec.auto_plan().workers()) {
      const int n = ++on_host[w.host()];
      most = std::max(most, w.host_cpus() > 0 ? std::min(n, w.host_cpus()) : n);
    }
    for (double v : MeasureColocation(most)) profile->add_colocated_slowdown(v);
  }
  at::set_num_threads(had);
  if (openblas_set_num_threads) openblas_set_num_threads(had);
  if (!profile.ok()) return Fallback(spec, std::string(profile.status().message()));
  return ChoosePlan(spec, *profile);
}

}  // namespace pippy::autoplan
