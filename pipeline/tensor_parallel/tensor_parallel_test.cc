// Tensor parallelism's pieces without daemons: the plan's syntax; the ops' collectives
// over an in-process group; the sharding pass on the zoo's Llama (the shards, run on T
// threads, give the unsplit stages' outputs AND gradients: sharded gradients are the
// slices of the unsplit ones, replicated ones equal them on every rank); and every
// refusal, each naming the module and the fix.
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "pipeline/partition/partition.h"
#include "pipeline/tensor_parallel/sharding.h"
#include "pipeline/tensor_parallel/tp_ops.h"
#include "pipeline/tensor_parallel/tp_plan.h"
#include "pipeline/torchio/model_io.h"
#include "torch/csrc/jit/runtime/graph_executor.h"

namespace pippy::tp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

std::string Zoo(const std::string& f) { return "examples/models/zoo/" + f; }

constexpr char kLlamaPlan[] =
    "layers.*.attn.q=colwise,layers.*.attn.k=colwise,layers.*.attn.v=colwise,layers.*.attn.o=rowwise,"
    "layers.*.mlp.gate=colwise,layers.*.mlp.up=colwise,layers.*.mlp.down=rowwise,tok_emb=vocab";

// Max relative difference; `floor`: the least denominator.
double RelDiff(const at::Tensor& a, const at::Tensor& b, double floor = 1e-30) {
  at::Tensor da = a.detach().to(at::kDouble), db = b.detach().to(at::kDouble);
  double num = (da - db).abs().max().item<double>();
  return num == 0 ? 0 : num / std::max(db.abs().max().item<double>(), floor);
}

TEST(TpPlan, Parses_RoundTrips_AndMatchesAtomByAtom) {
  auto spec = ParsePlan(kLlamaPlan, 2);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->rules_size(), 8);
  EXPECT_EQ(spec->rules(3).style(), TP_ROWWISE);
  EXPECT_EQ(PlanText(*spec), kLlamaPlan);
  EXPECT_TRUE(Matches("layers.*.attn.q", "layers.12.attn.q"));
  EXPECT_FALSE(Matches("layers.*.attn.q", "layers.1.attn.qkv"));
  EXPECT_FALSE(Matches("layers.*", "layers.1.attn"));
  EXPECT_TRUE(Matches("layers.[01].mlp.*", "layers.1.mlp.up"));
}

TEST(TpPlan, BadText_NamesTheEntry) {
  EXPECT_THAT(ParsePlan("layers.*.q", 2).status().message(), HasSubstr("'layers.*.q' is not PATTERN=STYLE"));
  EXPECT_THAT(ParsePlan("q=columnwise", 2).status().message(), HasSubstr("unknown style 'columnwise'"));
  EXPECT_THAT(ParsePlan("q=colwise,q=rowwise", 2).status().message(), HasSubstr("'q' is given twice"));
  EXPECT_THAT(ParsePlan("", 2).status().message(), HasSubstr("needs --tp-plan"));
  EXPECT_THAT(ParsePlan("q=colwise", 1).status().message(), HasSubstr("needs --tensor-parallel T"));
}

TEST(LocalGroup, SumsInMemberOrder_TimesOutAlone_AbortEndsWaits) {
  LocalGroup g(3, absl::Seconds(10));
  std::vector<at::Tensor> t = {torch::full({4}, 1.0), torch::full({4}, 2.0), torch::full({4}, 4.0)};
  std::vector<std::thread> th;
  std::vector<absl::Status> st(3);
  for (int i = 0; i < 3; ++i) th.emplace_back([&, i] { st[i] = g.member(i)->AllReduceSum(t[i]); });
  for (auto& x : th) x.join();
  for (int i = 0; i < 3; ++i) {
    EXPECT_TRUE(st[i].ok()) << st[i];
    EXPECT_TRUE(at::equal(t[i], torch::full({4}, 7.0)));
  }
  LocalGroup lonely(2, absl::Milliseconds(50));
  at::Tensor x = torch::ones({2});
  EXPECT_EQ(lonely.member(0)->AllReduceSum(x).code(), absl::StatusCode::kDeadlineExceeded);
  LocalGroup aborted(2, absl::Seconds(30));
  std::thread waiter([&] { EXPECT_EQ(aborted.member(0)->AllReduceSum(x).code(), absl::StatusCode::kAborted); });
  aborted.Abort();
  waiter.join();
}

TEST(TpOps, OutsideAGroup_SaysSo) {
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("pippy::tp_reduce", "");
  try {
    op.typed<at::Tensor(const at::Tensor&)>().call(torch::ones({2}));
    ADD_FAILURE() << "tp_reduce ran without a group";
  } catch (const c10::Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("outside a tensor-parallel group"));
  }
}

class ShardingTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { torch::jit::setGraphExecutorOptimize(false); }

  absl::StatusOr<std::vector<std::vector<torch::jit::Module>>> Shard(const std::string& model, int stages,
                                                                     const std::string& plan, int T) {
    auto m = torchio::LoadModel(Zoo(model + ".pt"));
    if (!m.ok()) return m.status();
    model_ = *m;
    auto in = torchio::LoadExampleInputs(Zoo(model + ".input.pt"), model_);
    if (!in.ok()) return in.status();
    inputs_ = *in;
    target_ = torchio::LoadTorchSaved(Zoo(model + ".target.pt")).value();
    partition::SplitOptions so;
    so.num_stages = stages;
    auto pipe = partition::SplitModel(model_, so);
    if (!pipe.ok()) return pipe.status();
    pipe_ = std::move(*pipe);
    auto spec = ParsePlan(plan, T);
    if (!spec.ok()) return spec.status();
    ShardOptions o;
    o.spec = *spec;
    o.example_inputs = inputs_;
    return ShardPipe(&pipe_, o);
  }

  // Forward through every stage (in process, autograd across them), the model's loss,
  // backward. `run` is each stage's module.
  static void TrainOnce(const std::vector<torch::jit::Module>& run, const std::vector<c10::IValue>& inputs,
                        const c10::IValue& target, const PipelinePlan& plan) {
    std::vector<std::vector<c10::IValue>> outs(run.size());
    c10::IValue last;
    for (size_t s = 0; s < run.size(); ++s) {
      std::vector<c10::IValue> in;
      for (const StageInput& si : plan.stages(s).inputs()) {
        in.push_back(si.source_case() == StageInput::kSourceStage ? outs[si.source_stage()][si.source_output()]
                                                                  : inputs[si.model_input()]);
      }
      c10::IValue out = const_cast<torch::jit::Module&>(run[s]).forward(in);
      if (plan.stages(s).is_last()) {
        last = out;
      } else {
        outs[s] = out.toTupleRef().elements().vec();
      }
    }
    at::Tensor loss = const_cast<torch::jit::Module&>(run.back()).run_method("loss", last, target).toTensor();
    loss.backward();
  }

  torch::jit::Module model_;
  std::vector<c10::IValue> inputs_;
  c10::IValue target_;
  partition::Pipe pipe_;
};

TEST_F(ShardingTest, Llama_TwoStagesTwoRanks_ShardsGiveTheUnsplitValuesAndGradients) {
  for (int T : {2, 4}) {
    auto shards = Shard("llama", 2, kLlamaPlan, T);
    ASSERT_TRUE(shards.ok()) << shards.status();
    ASSERT_EQ(shards->size(), 2u);
    // Each shard holds 1/T of the sharded parameters.
    int sharded = 0;
    for (const ParameterInfo& pi : pipe_.plan.stages(0).parameters()) {
      if (!pi.has_tp_dim()) continue;
      ++sharded;
      for (int r = 0; r < T; ++r) {
        at::Tensor p = (*shards)[0][r].attr("tok_emb").toModule().attr("weight").toTensor();
        if (pi.name() == "tok_emb.weight") EXPECT_EQ(p.size(0), pi.shape(0) / T);
      }
    }
    EXPECT_GT(sharded, 10);
    EXPECT_EQ(pipe_.plan.tensor_parallel().size(), T);

    // Gradients: the unsplit stages, then T ranks of shards on threads.
    TrainOnce(pipe_.stages, inputs_, target_, pipe_.plan);
    LocalGroup group(T, absl::Seconds(60));
    std::vector<std::thread> threads;
    std::vector<std::string> errors(T);
    for (int r = 0; r < T; ++r) {
      threads.emplace_back([&, r] {
        ScopedGroup scope(group.member(r));
        try {
          TrainOnce({(*shards)[0][r], (*shards)[1][r]}, inputs_, target_, pipe_.plan);
        } catch (const c10::Error& e) {
          errors[r] = e.what();
          group.Abort();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < T; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
    // The scale of the model's gradients: a gradient that is zero in exact arithmetic
    // (k's bias: softmax ignores a shift shared by all keys) is rounding noise in both
    // runs, compared against this scale rather than against itself.
    double scale = 0;
    for (const auto& st : pipe_.stages) {
      for (const at::Tensor& p : st.parameters()) scale = std::max(scale, p.grad().abs().max().item<double>());
    }
    double worst = 0;
    int compared = 0;
    for (int s = 0; s < 2; ++s) {
      std::map<std::string, const ParameterInfo*> info;
      for (const ParameterInfo& pi : pipe_.plan.stages(s).parameters()) info[pi.name()] = &pi;
      std::map<std::string, at::Tensor> full;
      for (const auto& p : pipe_.stages[s].named_parameters(true)) full[p.name] = p.value.grad();
      for (int r = 0; r < T; ++r) {
        for (const auto& p : (*shards)[s][r].named_parameters(true)) {
          ASSERT_TRUE(p.value.grad().defined()) << p.name;
          const ParameterInfo& pi = *info.at(p.name);
          at::Tensor want = pi.has_tp_dim() ? ShardOf(full.at(p.name), pi.tp_dim(), r, T) : full.at(p.name);
          ASSERT_TRUE(p.value.sizes().equals(want.sizes())) << p.name;
          const double d = RelDiff(p.value.grad(), want, 1e-6 * scale);
          EXPECT_LE(d, 1e-5) << "stage " << s << " rank " << r << " " << p.name << (pi.has_tp_dim() ? " sharded" : " replicated");
          worst = std::max(worst, d);
          ++compared;
        }
      }
    }
    std::cout << "[ figure   ] llama P=2 x T=" << T << ": " << compared
              << " shard gradients vs the unsplit model's, worst max relative difference " << worst << "\n";
    // Gathered back, the untrained shards are the unsplit stages' tensors bitwise.
    for (int s = 0; s < 2; ++s) {
      auto whole = GatherShards(pipe_.plan.stages(s), (*shards)[s]);
      ASSERT_TRUE(whole.ok()) << whole.status();
      for (const auto& p : pipe_.stages[s].named_parameters(true)) EXPECT_TRUE(at::equal(whole->at(p.name), p.value)) << p.name;
    }
    {
      torch::NoGradGuard no_grad;
      (*shards)[1][T - 1].attr("norm").toModule().attr("weight").toTensor().add_(1e-3);
    }
    auto broken = GatherShards(pipe_.plan.stages(1), (*shards)[1]);
    EXPECT_EQ(broken.status().code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(broken.status().message(), HasSubstr("replicated norm.weight differs between tensor-parallel ranks 0"));
    for (auto& s : pipe_.stages) {
      for (at::Tensor p : s.parameters()) p.mutable_grad() = at::Tensor();
    }
  }
}

TEST_F(ShardingTest, PatternMatchingNothing_ListsModules) {
  auto s = Shard("llama", 2, "layers.*.attn.query=colwise,layers.*.attn.o=rowwise", 2).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("'layers.*.attn.query' matches no module"), HasSubstr("layers.0.attn.q")));
}

TEST_F(ShardingTest, NonLinear_NamesTheOpThatReadsIt) {
  auto s = Shard("llama", 2, "layers.*.attn_norm=colwise", 2).status();
  EXPECT_THAT(s.message(), AllOf(HasSubstr("layers.0.attn_norm"), HasSubstr("not a Linear or an Embedding")));
  s = Shard("llama", 2, "layers.*.attn=colwise", 2).status();
  EXPECT_THAT(s.message(), AllOf(HasSubstr("layers.0.attn (colwise) is not a Linear")));
}

TEST_F(ShardingTest, SizeNotDivisible_SaysWhichAndWhat) {
  auto s = Shard("llama", 2, kLlamaPlan, 3).status();
  EXPECT_THAT(s.message(), AllOf(HasSubstr("3 does not divide"), HasSubstr("choose a --tensor-parallel that divides it")));
}

TEST_F(ShardingTest, HardCodedHeadCount_NamesTheViewAndTheFix) {
  auto s = Shard("llama_fixed_heads", 2, kLlamaPlan, 2).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("aten::view in layers.0.attn"), HasSubstr("colwise layers.0.attn.q"),
                                 HasSubstr("Write -1")));
}

TEST_F(ShardingTest, FusedQkv_NamesTheSplitAndTheFix) {
  auto s = Shard("gpt", 2, "blocks.*.attn.qkv=colwise,blocks.*.attn.proj=rowwise", 2).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("colwise blocks.0.attn.qkv"), HasSubstr("fused projection"),
                                 HasSubstr("own Linear")));
}

TEST_F(ShardingTest, TiedWeights_Refused) {
  auto s = Shard("gpt", 2, "tok_emb=vocab", 2).status();
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tok_emb.weight is tied to head.weight"), HasSubstr("untie")));
}

TEST_F(ShardingTest, ShardedModelOutput_Refused) {
  auto s = Shard("llama", 2, "head=colwise", 2).status();
  EXPECT_THAT(s.message(), AllOf(HasSubstr("the model's output is sharded"), HasSubstr("colwise head")));
}

TEST_F(ShardingTest, RowwiseWithoutColwise_Refused) {
  auto s = Shard("llama", 2, "layers.*.attn.o=rowwise", 2).status();
  EXPECT_THAT(s.message(), HasSubstr("rowwise layers.0.attn.o reads a value no colwise Linear sharded"));
}

// A model the static rules pass but sharding changes: the hidden features are centred
// (a mean over the sharded dimension) between a colwise and a rowwise Linear. The check
// on the example batch catches it and names the first module that differs.
TEST_F(ShardingTest, ReductionOverShardedFeatures_TheCheckNamesTheModule) {
  auto linear = [](const std::string& name, int in, int out) {
    torch::jit::Module m(name);
    m.register_parameter("weight", torch::randn({out, in}), false);
    m.register_parameter("bias", torch::randn({out}), false);
    m.define("def forward(self, x):\n  return torch.linear(x, self.weight, self.bias)\n");
    return m;
  };
  torch::jit::Module top("Centred");
  top.register_module("a", linear("A", 8, 16));
  top.register_module("b", linear("B", 16, 8));
  top.define("def forward(self, x):\n  h = self.a.forward(x)\n  h = h - h.mean(-1, keepdim=True)\n  return self.b.forward(h)\n");
  partition::SplitOptions so;
  auto pipe = partition::SplitModel(top, so);
  ASSERT_TRUE(pipe.ok()) << pipe.status();
  ShardOptions o;
  o.spec = *ParsePlan("a=colwise,b=rowwise", 2);
  o.example_inputs = {torch::randn({4, 8})};
  auto s = ShardPipe(&*pipe, o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), AllOf(HasSubstr("tensor-parallel check"), HasSubstr("the output of rowwise b"),
                                 HasSubstr("differs from the unsplit stage")));
  // Without the centring, the same plan passes.
  torch::jit::Module plain("Plain");
  plain.register_module("a", linear("A", 8, 16));
  plain.register_module("b", linear("B", 16, 8));
  plain.define("def forward(self, x):\n  return self.b.forward(torch.relu(self.a.forward(x)))\n");
  auto pipe2 = partition::SplitModel(plain, so);
  ASSERT_TRUE(pipe2.ok()) << pipe2.status();
  EXPECT_TRUE(ShardPipe(&*pipe2, o).ok());
}

}  // namespace
}  // namespace pippy::tp
