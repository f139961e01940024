// Splitting every zoo model into K stages and running the stages in sequence
// (forward and backward, as pipeline ranks would) must reproduce the unsplit model:
// outputs, every parameter gradient, and buffers updated in training mode.
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/partition/partition.h"
#include "pipeline/partition/sequential_runner.h"
#include "torch/csrc/autograd/autograd.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::partition {
namespace {

std::string ZooPath(const std::string& name) { return "examples/models/zoo/" + name; }

// max |a - b| / max |b|: the relative difference of a whole tensor.
double RelDiff(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor da = a.detach().to(at::kDouble), db = b.detach().to(at::kDouble);
  double denom = db.abs().max().item<double>();
  double num = (da - db).abs().max().item<double>();
  if (num == 0) return 0;
  return num / std::max(denom, 1e-30);
}

// A loss every test applies to the model output: sum of output * fixed weights.
at::Tensor Loss(const c10::IValue& output) {
  at::Tensor loss = at::zeros({}, at::kDouble);
  int64_t seed = 7;
  for (const at::Tensor& t : FlattenTensors(output)) {
    if (!at::isFloatingType(t.scalar_type())) continue;
    auto gen = at::detail::createCPUGenerator(seed++);
    at::Tensor w = at::randn(t.sizes(), gen, t.options().requires_grad(false));
    loss = loss + (t * w).sum().to(at::kDouble);
  }
  return loss;
}

struct Case {
  std::string model;
  int stages;
};

std::string CaseName(const testing::TestParamInfo<Case>& info) {
  return absl::StrCat(info.param.model, "_K", info.param.stages);
}

class SplitEquivalenceTest : public testing::TestWithParam<Case> {
 protected:
  static void SetUpTestSuite() { torch::jit::setGraphExecutorOptimize(false); }
};

// The largest relative difference seen, reported at the end of the run.
double g_worst = 0;

TEST_P(SplitEquivalenceTest, StagesInSequence_MatchUnsplitModel) {
  const Case& c = GetParam();
  auto model = torchio::LoadModel(ZooPath(c.model + ".pt"));
  ASSERT_TRUE(model.ok()) << model.status();
  auto reference = torchio::LoadModel(ZooPath(c.model + ".pt"));
  ASSERT_TRUE(reference.ok()) << reference.status();
  auto inputs = torchio::LoadExampleInputs(ZooPath(c.model + ".input.pt"), *model);
  ASSERT_TRUE(inputs.ok()) << inputs.status();

  SplitOptions opts;
  opts.num_stages = c.stages;
  opts.example_inputs = *inputs;
  auto pipe = SplitModel(*model, opts);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  ASSERT_EQ(pipe->stages.size(), static_cast<size_t>(c.stages));

  SequentialRunner runner(&*pipe);
  auto out = runner.Forward(*inputs);
  ASSERT_TRUE(out.ok()) << out.status();
  c10::IValue ref_out = reference->forward(*inputs);

  std::vector<at::Tensor> got = FlattenTensors(*out), want = FlattenTensors(ref_out);
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, RelDiff(got[i], want[i]));

  ASSERT_TRUE(runner.Backward(Loss(*out)).ok());
  torch::autograd::backward({Loss(ref_out)});

  std::map<std::string, at::Tensor> grads = runner.Gradients();
  int checked = 0;
  for (const auto& p : reference->named_parameters(true)) {
    if (!p.value.grad().defined()) continue;
    auto it = grads.find(p.name);
    ASSERT_NE(it, grads.end()) << "no gradient for " << p.name;
    double d = RelDiff(it->second, p.value.grad());
    EXPECT_LE(d, 1e-6) << p.name;
    worst = std::max(worst, d);
    ++checked;
  }
  EXPECT_GT(checked, 0);
  // Buffers (BatchNorm running statistics) advance the same way.
  std::map<std::string, at::Tensor> tensors = runner.NamedTensors();
  for (const auto& b : reference->named_buffers(true)) {
    auto it = tensors.find(b.name);
    if (it == tensors.end()) continue;  // a buffer forward() never reads
    double d = RelDiff(it->second, b.value);
    EXPECT_LE(d, 1e-6) << b.name;
    worst = std::max(worst, d);
  }
  EXPECT_LE(worst, 1e-6);
  g_worst = std::max(g_worst, worst);
  std::cout << "[ figure   ] " << c.model << " K=" << c.stages << " max relative difference "
            << worst << " (" << checked << " parameters)\n";
}

INSTANTIATE_TEST_SUITE_P(
    Zoo, SplitEquivalenceTest,
    testing::Values(Case{"mlp", 2}, Case{"mlp", 3}, Case{"mlp", 4}, Case{"mlp", 8},
                    Case{"gpt", 2}, Case{"gpt", 3}, Case{"gpt", 4}, Case{"gpt", 8},
                    Case{"unet", 2}, Case{"unet", 3}, Case{"unet", 4}, Case{"unet", 8},
                    Case{"cnn_bn", 2}, Case{"cnn_bn", 3}, Case{"cnn_bn", 4}, Case{"cnn_bn", 8},
                    Case{"multi", 2}, Case{"multi", 3}, Case{"multi", 4}, Case{"multi", 8},
                    Case{"mlp_marked", 3}),
    CaseName);

class Reporter : public testing::Environment {
 public:
  void TearDown() override {
    std::cout << "[ figure   ] worst max relative difference over the zoo: " << g_worst << "\n";
  }
};
testing::Environment* const kReporter = testing::AddGlobalTestEnvironment(new Reporter);

}  // namespace
}  // namespace pippy::partition
