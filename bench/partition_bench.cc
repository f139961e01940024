// Partitioner speed on a 100-block GPT-like model (~4,000 graph nodes).
//
// Side by side in the same run: LibTorch loading the model (torch::jit::load) and
// LibTorch's own torch::jit::Inline pass on forward() — the references — and pippy's
// labelled inliner, its full analysis, and SplitModel for K = 2, 4, 8 (params) and
// K = 4 (flops, with the example input). Ratios to the references are printed as
// counters. Run: bazel run -c opt //bench:partition_bench
#include <benchmark/benchmark.h>

#include <chrono>
#include <string>

#include "pipeline/partition/inliner.h"
#include "pipeline/partition/model_graph.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"
#include "torch/csrc/jit/passes/inliner.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace {

using namespace pippy::partition;

const char* kModel = "examples/models/deep/gpt_deep.pt";
const char* kInput = "examples/models/deep/gpt_deep.input.pt";

torch::jit::Module& Model() {
  static torch::jit::Module m = *pippy::torchio::LoadModel(kModel);
  return m;
}

double Seconds(const std::function<void()>& fn, int reps = 5) {
  double best = 1e30;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

double ReferenceInlineSeconds() {
  static double s = Seconds([] {
    auto g = Model().get_method("forward").graph()->copy();
    torch::jit::Inline(*g);
  });
  return s;
}

double ReferenceLoadSeconds() {
  static double s = Seconds([] { benchmark::DoNotOptimize(pippy::torchio::LoadModel(kModel)); }, 3);
  return s;
}

void BM_Reference_TorchJitLoad(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(pippy::torchio::LoadModel(kModel));
}
BENCHMARK(BM_Reference_TorchJitLoad)->Unit(benchmark::kMillisecond);

void BM_Reference_TorchJitInline(benchmark::State& state) {
  size_t nodes = 0;
  for (auto _ : state) {
    auto g = Model().get_method("forward").graph()->copy();
    torch::jit::Inline(*g);
    nodes = std::distance(g->nodes().begin(), g->nodes().end());
  }
  state.counters["nodes"] = static_cast<double>(nodes);
}
BENCHMARK(BM_Reference_TorchJitInline)->Unit(benchmark::kMillisecond);

void BM_PippyInlineForward(benchmark::State& state) {
  for (auto _ : state) benchmark::DoNotOptimize(InlineForward(Model()));
}
BENCHMARK(BM_PippyInlineForward)->Unit(benchmark::kMillisecond);

void BM_PippyModelGraph(benchmark::State& state) {
  int ops = 0, cuts = 0;
  for (auto _ : state) {
    auto mg = ModelGraph::Build(Model());
    ops = (*mg)->num_ops();
    cuts = static_cast<int>((*mg)->legal_cuts().size());
  }
  state.counters["ops"] = ops;
  state.counters["legal_cuts"] = cuts;
}
BENCHMARK(BM_PippyModelGraph)->Unit(benchmark::kMillisecond);

void BM_PippySplitParams(benchmark::State& state) {
  SplitOptions opts;
  opts.num_stages = static_cast<int>(state.range(0));
  for (auto _ : state) {
    auto pipe = SplitModel(Model(), opts);
    if (!pipe.ok()) state.SkipWithError(std::string(pipe.status().message()).c_str());
  }
}
BENCHMARK(BM_PippySplitParams)->Arg(2)->Arg(4)->Arg(8)->Unit(benchmark::kMillisecond);

void BM_PippySplitFlopsWithExample(benchmark::State& state) {
  SplitOptions opts;
  opts.num_stages = 4;
  opts.balance = pippy::BALANCE_FLOPS;
  opts.example_inputs = *pippy::torchio::LoadExampleInputs(kInput, Model());
  for (auto _ : state) {
    auto pipe = SplitModel(Model(), opts);
    if (!pipe.ok()) state.SkipWithError(std::string(pipe.status().message()).c_str());
  }
}
BENCHMARK(BM_PippySplitFlopsWithExample)->Unit(benchmark::kMillisecond);

// Load + split K=4 + write nothing: what `pippyctl split MODEL --stages 4` does.
void BM_PippyLoadAndSplit(benchmark::State& state) {
  SplitOptions opts;
  opts.num_stages = 4;
  for (auto _ : state) {
    auto m = pippy::torchio::LoadModel(kModel);
    auto pipe = SplitModel(*m, opts);
    benchmark::DoNotOptimize(pipe);
  }
}
BENCHMARK(BM_PippyLoadAndSplit)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  torch::jit::setGraphExecutorOptimize(false);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  // Ratios to the references, measured again here (best of 5) so they are in one table.
  SplitOptions k4;
  k4.num_stages = 4;
  const double load = ReferenceLoadSeconds(), torch_inline = ReferenceInlineSeconds();
  const double pippy_inline = Seconds([] { benchmark::DoNotOptimize(InlineForward(Model())); });
  const double split = Seconds([&] { benchmark::DoNotOptimize(SplitModel(Model(), k4)); });
  std::printf("\n%-44s %10s %10s\n", "what (gpt_deep, 100 blocks)", "ms", "ratio");
  std::printf("%-44s %10.1f %10s\n", "torch::jit::load (reference)", load * 1e3, "1.00");
  std::printf("%-44s %10.1f %10s\n", "torch::jit::Inline (reference)", torch_inline * 1e3, "-");
  std::printf("%-44s %10.1f %9.1fx  (vs torch::jit::Inline)\n", "pippy labelled inliner", pippy_inline * 1e3,
              pippy_inline / torch_inline);
  std::printf("%-44s %10.1f %9.2fx  (vs load)\n", "pippy SplitModel K=4 (params)", split * 1e3, split / load);
  std::printf("%-44s %10.1f %10s  (target < 1000 ms)\n", "load + split (what pippyctl split does)",
              (load + split) * 1e3, "");
  return 0;
}
