// Stage-runtime overhead and memory, side by side with references in the same run.
//
// 1. Per-action overhead: the zoo MLP (8 Linear layers on 16 x 32 tensors — tiny, so
//    bookkeeping dominates) trained by 2 ranks (threads, loopback transport), 1F1B,
//    m = 8. Reference: the unsplit model doing the same micro-batches' forward and
//    backward in one thread. Reported: microseconds per action and the overhead
//    per compute action over the reference's time per (stage, micro-batch) pass.
// 2. Peak live activations per rank, GPipe vs 1F1B, m = 8, p = 4, as counted by the
//    runtime (micro-batches holding autograd state), beside the simulator's figure.
//
// Run: bazel run -c opt //bench:runtime_bench
#include <chrono>
#include <cstdio>
#include <thread>

#include "proto/names.h"
#include "pipeline/job/job_spec.h"
#include "pipeline/job/layout.h"
#include "pipeline/job/rank_job.h"
#include "pipeline/stage/data_source.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/schedule/schedule.h"
#include "pipeline/schedule/simulator.h"
#include "pipeline/stage/microbatch.h"
#include "pipeline/stage/rank_runtime.h"
#include "pipeline/stage/training.h"
#include "pipeline/transport/loopback/loopback_transport.h"
#include "ATen/Parallel.h"
#include "torch/csrc/autograd/autograd.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace {

using namespace pippy;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct PipelineFigures {
  double seconds_per_step = 0;
  int actions_rank0 = 0;
  int compute_actions_rank0 = 0;
  std::vector<int> peak;
  stage::StepBreakdown breakdown_rank0;  // of the last step
};

PipelineFigures RunPipeline(const torch::jit::Module& model, const std::vector<c10::IValue>& inputs,
                            const c10::IValue& target, ScheduleKind kind, int p, int m, int steps) {
  partition::SplitOptions so;
  so.num_stages = p;
  auto pipe = partition::SplitModel(model, so);
  // The job as a worker would run it: the spec, job::RankJob, a DataSource whose
  // batch is the whole example.
  JobSpec spec;
  spec.mutable_schedule()->set_kind(kind);
  spec.mutable_schedule()->set_microbatches(m);
  spec.mutable_split()->set_stages(p);
  spec.set_steps(steps + 3);
  spec.set_batch_size(static_cast<int>(inputs[0].toTensor().size(0)));
  spec.set_loss(LOSS_MSE);
  spec.mutable_optimizer()->set_kind(OPTIMIZER_SGD);
  spec.mutable_optimizer()->set_lr(1e-4);
  if (!job::CheckSpec(&spec).ok()) std::abort();
  std::vector<std::string> names;
  for (const ModelValue& v : pipe->plan.inputs()) names.push_back(v.name());
  auto data = *stage::DataSource::FromValues(inputs, target, names);
  auto transports = transport::loopback::Create(p);
  std::vector<std::unique_ptr<job::RankJob>> rts;
  const JobLayout layout = *job::MakeLayout(spec, pipe->plan);
  for (int r = 0; r < p; ++r) {
    rts.push_back(std::move(*job::RankJob::Create(spec, pipe->plan, layout.ranks(r), r, {{r, pipe->stages[r]}},
                                                   transports[r].get(), absl::Seconds(60))));
  }
  const schedule::Schedule* sched = &rts[0]->schedule();
  PipelineFigures f;
  f.peak.assign(p, 0);
  double start = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < p; ++r) {
    threads.emplace_back([&, r] {
      for (int s = 0; s < steps + 3; ++s) {
        if (r == 0 && s == 3) start = Now();  // after warm-up steps
        auto res = rts[r]->RunStep(s, data);
        if (res.ok()) f.peak[r] = std::max(f.peak[r], res->peak_live_activations);
        if (res.ok() && r == 0) f.breakdown_rank0 = res->breakdown;
      }
    });
  }
  for (auto& t : threads) t.join();
  f.seconds_per_step = (Now() - start) / steps;
  f.actions_rank0 = static_cast<int>(sched->ranks[0].size());
  for (const auto& a : sched->ranks[0]) f.compute_actions_rank0 += a.IsCompute() ? 1 : 0;
  return f;
}

// The unsplit model doing what one pipeline step does: m micro-batches' forward and
// backward (loss scaled by 1/m), then an SGD step. Seconds per step.
double ReferenceStep(torch::jit::Module& model, const std::vector<c10::IValue>& inputs, const c10::IValue& target,
                     int m, int steps) {
  auto mbs = *stage::SplitIntoMicrobatches(inputs, m);
  auto tgs = *stage::SplitIntoMicrobatches({target}, m);
  std::vector<at::Tensor> params;
  for (const auto& p : model.parameters()) params.push_back(p);
  stage::OptimizerOptions oo;
  oo.lr = 1e-4;
  auto opt = std::move(*stage::MakeOptimizer(oo, params));
  auto run = [&] {
    for (int i = 0; i < m; ++i) {
      at::Tensor out = model.forward(mbs[i]).toTensor();
      auto loss = *stage::ComputeLoss(LOSS_MSE, model, out, tgs[i][0]);
      torch::autograd::backward({loss / static_cast<double>(m)});
    }
    opt->step();
    opt->zero_grad();
  };
  for (int s = 0; s < 3; ++s) run();
  double start = Now();
  for (int s = 0; s < steps; ++s) run();
  return (Now() - start) / steps;
}

}  // namespace

int main() {
  torch::jit::setGraphExecutorOptimize(false);
  at::set_num_threads(1);
  const char* zoo = "examples/models/zoo/";
  auto model = *torchio::LoadModel(std::string(zoo) + "mlp.pt");
  auto inputs = *torchio::LoadExampleInputs(std::string(zoo) + "mlp.input.pt", model);
  auto target = *torchio::LoadTorchSaved(std::string(zoo) + "mlp.target.pt");
  const int steps = 200;

  const int m = 8;
  auto ref_model = *torchio::LoadModel(std::string(zoo) + "mlp.pt");
  const double ref_step = ReferenceStep(ref_model, inputs, target, m, steps);
  // One rank holding the whole model: the runtime's bookkeeping alone (no peer, no wait).
  PipelineFigures one = RunPipeline(model, inputs, target, SCHEDULE_1F1B, 1, m, steps);
  const double one_overhead_us = (one.seconds_per_step - ref_step) / one.compute_actions_rank0 * 1e6;
  // Two ranks (threads, loopback): where rank 0's step went.
  PipelineFigures f = RunPipeline(model, inputs, target, SCHEDULE_1F1B, 2, m, steps);
  const auto& b = f.breakdown_rank0;
  const double step_total = b.compute_seconds + b.wait_seconds + b.transport_seconds + b.optimizer_seconds +
                            b.other_seconds;
  std::printf("Stage-runtime overhead (zoo MLP: 8 Linear layers, 16x32 activations, 1F1B, m=%d, %d steps)\n", m,
              steps);
  std::printf("%-66s %12s\n", "what", "value");
  std::printf("%-66s %10.1f us\n", "reference: unsplit model, m micro-batches fwd+bwd + SGD step", ref_step * 1e6);
  std::printf("%-66s %10.1f us\n", "pippy, 1 rank holding the whole model (no peer): step", one.seconds_per_step * 1e6);
  std::printf("%-66s %10.1f us\n", "  runtime overhead per compute action ((pippy - reference) / actions)",
              one_overhead_us);
  std::printf("%-66s %10.1f us\n", "pippy, 2 ranks (threads, loopback): step", f.seconds_per_step * 1e6);
  std::printf("%-66s %10d\n", "  actions on rank 0 (compute + send/recv)", f.actions_rank0);
  std::printf("%-66s %10.1f us\n", "  rank 0: compute (its half of the model)", b.compute_seconds * 1e6);
  std::printf("%-66s %10.1f us\n", "  rank 0: waiting for rank 1 (bubble and peer compute)", b.wait_seconds * 1e6);
  std::printf("%-66s %10.1f us\n", "  rank 0: transport, optimizer and the rest, per action",
              (step_total - b.compute_seconds - b.wait_seconds) / f.actions_rank0 * 1e6);
  std::printf("\nPeak live activations per rank (micro-batches holding autograd state), m=8, p=4\n");
  std::printf("%-10s %-22s %-22s\n", "schedule", "runtime (measured)", "simulator");
  for (auto kind : {SCHEDULE_GPIPE, SCHEDULE_1F1B}) {
    PipelineFigures g = RunPipeline(model, inputs, target, kind, 4, 8, 2);
    schedule::ScheduleOptions so;
    so.num_ranks = 4;
    so.num_microbatches = 8;
    auto sim = schedule::Simulate(*schedule::MakeSchedule(kind, so));
    std::string measured, simulated;
    for (int x : g.peak) measured += std::to_string(x) + " ";
    for (int x : sim->peak_live_per_rank) simulated += std::to_string(x) + " ";
    std::printf("%-10s %-22s %-22s\n", names::Name(kind).c_str(), measured.c_str(),
                simulated.c_str());
  }
  return 0;
}
