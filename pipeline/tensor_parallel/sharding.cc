#include "pipeline/tensor_parallel/sharding.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/partition/inliner.h"
#include "pipeline/tensor_parallel/tp_ops.h"
#include "pipeline/tensor_parallel/tp_plan.h"
#include "torch/csrc/jit/api/function_impl.h"
#include "torch/csrc/jit/ir/constants.h"
#include "torch/csrc/jit/ir/ir.h"

namespace pippy::tp {
namespace {

using torch::jit::Graph;
using torch::jit::Module;
using torch::jit::Node;
using torch::jit::Value;

constexpr char kObserved[] = "tp_observed_";

std::string Where(const Node* n) {
  const std::string p = partition::ModulePath(n);
  return p.empty() ? "the model's forward()" : p;
}

struct Target {
  Node* node = nullptr;
  std::string module;
  TpStyle style = TP_STYLE_UNSPECIFIED;
};

void ForEachNode(torch::jit::Block* block, const std::function<void(Node*)>& fn) {
  for (Node* n : block->nodes()) {
    fn(n);
    for (torch::jit::Block* b : n->blocks()) ForEachNode(b, fn);
  }
}

// The ops that read the weights of the plan's modules in `g`, in graph order.
absl::StatusOr<std::vector<Target>> FindTargets(Graph& g, const std::map<std::string, TpStyle>& styles) {
  std::vector<Target> out;
  std::map<Node*, Target> by_node;
  absl::Status error;
  Value* self = g.inputs()[0];
  ForEachNode(g.block(), [&](Node* n) {
    if (!error.ok() || n->kind() != c10::prim::GetAttr) return;
    auto path = partition::AttributePath(n->output(), self);
    if (!path || path->size() < 2 || path->back() != "weight") return;
    const std::string module = absl::StrJoin(path->begin(), path->end() - 1, ".");
    auto it = styles.find(module);
    if (it == styles.end()) return;
    const TpStyle style = it->second;
    for (const torch::jit::Use& use : n->output()->uses()) {
      Node* user = use.user;
      const bool linear = user->kind() == c10::aten::linear && use.offset == 1;
      const bool embedding = user->kind() == c10::aten::embedding && use.offset == 0;
      if ((style == TP_VOCAB && !embedding) || (style != TP_VOCAB && !linear)) {
        error = absl::InvalidArgumentError(absl::StrCat(
            "--tp-plan: ", module, " (", StyleName(style), ") has its weight read by ", user->kind().toQualString(),
            " in ", Where(user), ", not by ", style == TP_VOCAB ? "an Embedding (aten::embedding)" : "a Linear (aten::linear)",
            ": colwise and rowwise shard nn.Linear, vocab shards nn.Embedding; take ", module, " out of the plan"));
        return;
      }
      if (user->owningBlock() != g.block()) {
        error = absl::InvalidArgumentError(absl::StrCat(
            "--tp-plan: ", module, " is called inside control flow (prim::If / prim::Loop) in ", Where(user),
            "; pippy shards only calls outside of it: take ", module, " out of the plan"));
        return;
      }
      by_node[user] = Target{user, module, style};
    }
  });
  PIPPY_RETURN_IF_ERROR(error);
  for (Node* n : g.nodes()) {
    auto it = by_node.find(n);
    if (it != by_node.end()) out.push_back(it->second);
  }
  return out;
}

bool IsConstantInt(Value* v, int64_t want) {
  auto c = torch::jit::toIValue(v);
  return c && c->isInt() && c->toInt() == want;
}

// The first tainted value used inside `block` (recursively): its source, or "".
std::string TaintInside(torch::jit::Block* block, const std::unordered_map<Value*, std::string>& taint) {
  std::string found;
  ForEachNode(block, [&](Node* n) {
    for (Value* in : n->inputs()) {
      auto it = taint.find(in);
      if (found.empty() && it != taint.end()) found = it->second;
    }
  });
  return found;
}

// Follows the sharded values (outputs of colwise Linears, until a rowwise one sums them)
// through stage `s`'s graph; refuses what sharding would change. `input_taint`: the
// colwise module each graph input (after self) is sharded by, or "". Returns the same
// for each stage output (the tuple's elements; the last stage: its one output).
absl::StatusOr<std::vector<std::string>> FollowShardedValues(Graph& g, const std::vector<Target>& targets,
                                                             const std::vector<std::string>& input_taint,
                                                             bool is_last) {
  std::unordered_map<Value*, std::string> taint;
  for (size_t i = 0; i < input_taint.size(); ++i) {
    if (!input_taint[i].empty()) taint[g.inputs()[i + 1]] = input_taint[i];
  }
  std::map<Node*, const Target*> target_of;
  for (const Target& t : targets) target_of[t.node] = &t;
  auto source = [&](Value* v) -> std::string {
    auto it = taint.find(v);
    return it == taint.end() ? "" : it->second;
  };
  for (Node* n : g.nodes()) {
    auto ti = target_of.find(n);
    if (ti != target_of.end()) {
      const Target& t = *ti->second;
      const std::string in = source(n->input(0));
      if (t.style == TP_COLWISE) {
        if (!in.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "--tp-plan: colwise ", t.module, " reads a value already sharded by colwise ", in,
              "; a colwise Linear takes a replicated input: put a rowwise Linear between them (or make ", t.module,
              " rowwise)"));
        }
        taint[n->output()] = t.module;
      } else if (t.style == TP_ROWWISE && in.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--tp-plan: rowwise ", t.module, " reads a value no colwise Linear sharded; a rowwise Linear takes the "
            "sharded output of colwise ones (o after q/k/v, down after up): make the Linears before it colwise, or "
            "take ", t.module, " out of the plan"));
      }
      continue;
    }
    std::string in;
    for (Value* v : n->inputs()) {
      if (in.empty()) in = source(v);
    }
    for (torch::jit::Block* b : n->blocks()) {
      if (in.empty()) in = TaintInside(b, taint);
    }
    if (in.empty()) continue;
    const c10::Symbol k = n->kind();
    const bool sharded_self = !source(n->input(0)).empty();
    if (sharded_self && (k == c10::aten::view || k == c10::aten::reshape)) {
      Value* size = n->input(1);
      bool follows = !source(size).empty();
      if (size->node()->kind() == c10::prim::ListConstruct) {
        for (Value* e : size->node()->inputs()) follows = follows || !source(e).empty() || IsConstantInt(e, -1);
      }
      if (!follows) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--tp-plan: ", k.toQualString(), " in ", Where(n), " gives the sharded output of colwise ", in,
            " a fixed shape; with its features split across ranks that shape is wrong. Write -1 for the dimension "
            "sharding divides (the head count: view(B, T, -1, head_dim), as torchtitan's Llama does), or take ",
            in, " out of the plan"));
      }
    }
    if (sharded_self && (k == c10::aten::split || k == c10::aten::split_with_sizes || k == c10::aten::chunk ||
                         k == c10::aten::unsafe_chunk || k == c10::aten::unsafe_split ||
                         k == c10::aten::tensor_split)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tp-plan: the sharded output of colwise ", in, " is cut into parts by ", k.toQualString(), " in ",
          Where(n), ": ", in, " looks like a fused projection (e.g. qkv), and sharding its columns would mix "
          "its parts across ranks. Give each part its own Linear (q, k, v), or take ", in, " out of the plan"));
    }
    for (Value* o : n->outputs()) taint[o] = in;
  }
  std::vector<std::string> out;
  Value* ret = g.outputs()[0];
  if (!is_last && ret->node()->kind() == c10::prim::TupleConstruct) {
    for (Value* v : ret->node()->inputs()) out.push_back(source(v));
  } else {
    out.push_back(source(ret));
  }
  if (is_last && !out[0].empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tp-plan: the model's output is sharded (it comes from colwise ", out[0],
        " with no rowwise Linear after it); end every sharded region with a rowwise Linear, or take ", out[0],
        " out of the plan"));
  }
  return out;
}

// Writes the collectives into `g` where `targets` are (graph order); names each
// sharded module's output tp_observed_<k> for the check.
void Rewrite(Graph& g, const std::vector<Target>& targets) {
  std::unordered_map<Value*, Value*> copied;  // replicated input -> its tp_copy
  const c10::Symbol copy_op = c10::Symbol::fromQualString(kCopyOp);
  const c10::Symbol reduce_op = c10::Symbol::fromQualString(kReduceOp);
  const c10::Symbol vocab_op = c10::Symbol::fromQualString(kVocabEmbeddingOp);
  int k = 0;
  for (const Target& t : targets) {
    Node* n = t.node;
    Value* observed = nullptr;
    if (t.style == TP_COLWISE) {
      Value* x = n->input(0);
      auto it = copied.find(x);
      if (it == copied.end()) {
        torch::jit::WithInsertPoint at(n);
        Value* c = g.insert(copy_op, {x});
        c->node()->setScope(n->scope());
        it = copied.emplace(x, c).first;
      }
      n->replaceInput(0, it->second);
      observed = n->output();
    } else if (t.style == TP_ROWWISE) {
      Value* bias = n->input(2);
      {
        torch::jit::WithInsertPoint at(n);
        n->replaceInput(2, g.insertConstant(c10::IValue()));
      }
      torch::jit::WithInsertPoint after(n->next());
      Value* partial = n->output();
      Value* sum = g.insert(reduce_op, {partial});
      sum->node()->setScope(n->scope());
      Value* result = sum;
      if (bias->type()->kind() != c10::TypeKind::NoneType) {
        result = g.insert(c10::aten::add, {sum, bias});
        result->node()->setScope(n->scope());
      }
      partial->replaceAllUsesWith(result);
      sum->node()->replaceInput(0, partial);
      observed = result;
    } else {
      torch::jit::WithInsertPoint at(n);
      Value* e = g.insert(vocab_op, {n->input(0), n->input(1)});
      e->node()->setScope(n->scope());
      n->output()->replaceAllUsesWith(e);
      n->destroy();
      observed = e;
    }
    observed->setDebugName(absl::StrCat(kObserved, k++));
  }
}

Module ModuleAt(const Module& root, const std::string& path) {
  Module m = root;
  for (absl::string_view atom : absl::StrSplit(path, '.')) m = m.attr(std::string(atom)).toModule();
  return m;
}

// A copy of `m`'s forward graph that also returns `pick`'s values: (output, v0, v1, ...).
std::shared_ptr<Graph> ObservingGraph(const Module& m, const std::function<std::vector<Value*>(Graph&)>& pick) {
  std::shared_ptr<Graph> g = m.get_method("forward").graph()->copy();
  std::vector<Value*> all{g->outputs()[0]};
  for (Value* v : pick(*g)) all.push_back(v);
  Node* t = g->appendNode(g->createTuple(all));
  g->eraseOutput(0);
  g->registerOutput(t->output());
  return g;
}

struct Observed {
  c10::IValue output;
  std::vector<at::Tensor> values;
};

Observed RunObserving(const Module& m, const std::shared_ptr<Graph>& g, const std::vector<c10::IValue>& inputs) {
  torch::jit::GraphFunction fn("tp_check", g, nullptr);
  torch::jit::Stack stack{m._ivalue()};
  for (const c10::IValue& v : inputs) stack.push_back(v);
  fn.run(stack);
  const auto elements = stack.back().toTupleRef().elements();
  Observed out;
  out.output = elements[0];
  for (size_t i = 1; i < elements.size(); ++i) out.values.push_back(elements[i].toTensor());
  return out;
}

double RelDiff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor da = a.detach().to(at::kDouble), db = b.detach().to(at::kDouble);
  const double num = (da - db).abs().max().item<double>();
  if (num == 0) return 0;
  return num / std::max(db.abs().max().item<double>(), 1e-30);
}

std::vector<c10::IValue> Elements(const c10::IValue& v, bool is_last) {
  if (!is_last && v.isTuple()) return v.toTupleRef().elements().vec();
  return {v};
}

// The tensors of a (possibly nested) output, in order.
void Tensors(const c10::IValue& v, std::vector<at::Tensor>* out) {
  if (v.isTensor()) {
    out->push_back(v.toTensor());
  } else if (v.isTuple()) {
    for (const c10::IValue& e : v.toTupleRef().elements()) Tensors(e, out);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) Tensors(e, out);
  }
}

class TrainingOff {
 public:
  explicit TrainingOff(std::vector<Module> modules) : modules_(std::move(modules)) {
    for (Module& m : modules_) {
      was_.push_back(m.is_training());
      m.eval();
    }
  }
  ~TrainingOff() {
    for (size_t i = 0; i < modules_.size(); ++i) modules_[i].train(was_[i]);
  }

 private:
  std::vector<Module> modules_;
  std::vector<bool> was_;
};

}  // namespace

at::Tensor ShardOf(const at::Tensor& full, int dim, int rank, int size) {
  torch::NoGradGuard no_grad;
  return full.detach().chunk(size, dim)[rank].contiguous().clone();
}

absl::StatusOr<std::map<std::string, at::Tensor>> GatherShards(const StagePlan& sp, const std::vector<Module>& shards) {
  const int T = static_cast<int>(shards.size());
  std::vector<std::map<std::string, at::Tensor>> held(T);
  for (int r = 0; r < T; ++r) {
    for (const auto& p : shards[r].named_parameters(true)) held[r][p.name] = p.value;
    for (const auto& b : shards[r].named_buffers(true)) held[r][b.name] = b.value;
  }
  std::map<std::string, at::Tensor> out;
  torch::NoGradGuard no_grad;
  for (const ParameterInfo& pi : sp.parameters()) {
    std::vector<at::Tensor> parts;
    for (int r = 0; r < T; ++r) {
      auto it = held[r].find(pi.name());
      if (it == held[r].end() || !it->second.defined()) {
        return absl::DataLossError(absl::StrCat("stage ", sp.index(), " shard ", r, " has no tensor ", pi.name()));
      }
      std::vector<int64_t> want(pi.shape().begin(), pi.shape().end());
      if (pi.has_tp_dim()) want[static_cast<size_t>(pi.tp_dim())] /= T;
      if (it->second.sizes().vec() != want) {
        return absl::DataLossError(absl::StrCat("stage ", sp.index(), " shard ", r, "'s ", pi.name(), " has shape ",
                                                c10::str(it->second.sizes()), ", not ", c10::str(want)));
      }
      parts.push_back(it->second.detach());
    }
    if (pi.has_tp_dim()) {
      out[pi.name()] = at::cat(parts, pi.tp_dim());
      continue;
    }
    for (int r = 1; r < T; ++r) {
      if (!at::equal(parts[r], parts[0])) {
        return absl::DataLossError(absl::StrCat("stage ", sp.index(), ": replicated ", pi.name(),
                                                " differs between tensor-parallel ranks 0 and ", r));
      }
    }
    out[pi.name()] = parts[0];
  }
  return out;
}

absl::StatusOr<std::vector<std::vector<Module>>> ShardPipe(partition::Pipe* pipe, const ShardOptions& options) {
  PIPPY_RETURN_IF_ERROR(CheckSpec(options.spec));
  const int T = options.spec.size();
  PipelinePlan& plan = pipe->plan;
  const int S = plan.stages_size();
  if (options.example_inputs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tensor-parallel checks each stage's ", T, " shards against the unsplit stage on an example batch: give "
        "--example-input FILE (or the job's data)"));
  }
  // The model's modules (every prefix of a parameter or buffer name) and its parameters.
  std::map<std::string, const ParameterInfo*> params;
  std::set<std::string> modules;
  for (const StagePlan& sp : plan.stages()) {
    for (const ParameterInfo& pi : sp.parameters()) {
      params.emplace(pi.name(), &pi);
      std::vector<std::string> atoms = absl::StrSplit(pi.name(), '.');
      for (size_t n = 1; n < atoms.size(); ++n) modules.insert(absl::StrJoin(atoms.begin(), atoms.begin() + n, "."));
    }
  }
  std::map<std::string, TpStyle> styles;
  for (const TpRule& rule : options.spec.rules()) {
    int matched = 0;
    for (const std::string& m : modules) {
      if (!Matches(rule.pattern(), m)) continue;
      auto [it, fresh] = styles.emplace(m, rule.style());
      if (!fresh && it->second != rule.style()) {
        return absl::InvalidArgumentError(absl::StrCat("--tp-plan: ", m, " matches both ", StyleName(it->second),
                                                       " and ", StyleName(rule.style()), " (", rule.pattern(),
                                                       "); give each module one style"));
      }
      ++matched;
    }
    if (matched == 0) {
      std::vector<std::string> some;
      for (const auto& [name, pi] : params) {
        if (!pi->is_buffer() && absl::EndsWith(name, ".weight") && some.size() < 6) {
          some.push_back(name.substr(0, name.size() - 7));
        }
      }
      return absl::InvalidArgumentError(absl::StrCat(
          "--tp-plan: '", rule.pattern(), "' matches no module of the model (modules with weights: ",
          absl::StrJoin(some, ", "), ", ...); patterns match module paths atom by atom, '*' within one atom "
          "(layers.*.attn.q)"));
    }
  }
  // Each planned module: a weight of its own, untied, whose sharded size T divides.
  std::map<std::string, int> tp_dim;  // parameter name -> sharded dimension
  for (const auto& [m, style] : styles) {
    auto w = params.find(m + ".weight");
    if (w == params.end() || w->second->is_buffer() || w->second->shape_size() != 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tp-plan: ", m, " (", StyleName(style), ") is not a Linear or an Embedding (it has no 2-d weight of "
          "its own); colwise and rowwise shard nn.Linear, vocab nn.Embedding: name those modules"));
    }
    const ParameterInfo& pi = *w->second;
    if (pi.tie_group() >= 0 || pi.aliases_size() > 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tp-plan: ", m, ".weight is tied to ", pi.aliases_size() > 0 ? pi.aliases(0) : "another module's weight",
          "; pippy does not shard tied weights: take ", m, " out of the plan (or untie the weights)"));
    }
    const int dim = style == TP_ROWWISE ? 1 : 0;
    const int64_t n = pi.shape(dim);
    if (n % T != 0) {
      const char* what = style == TP_COLWISE ? "output features" : style == TP_ROWWISE ? "input features" : "rows";
      return absl::InvalidArgumentError(absl::StrCat("--tp-plan: ", StyleName(style), " ", m, " splits its ", n, " ",
                                                     what, " across ", T, " ranks, but ", T, " does not divide ", n,
                                                     ": choose a --tensor-parallel that divides it, or take ", m,
                                                     " out of the plan"));
    }
    tp_dim[pi.name()] = dim;
    if (style == TP_COLWISE && params.count(m + ".bias")) tp_dim[m + ".bias"] = 0;
  }

  // Each stage: follow the sharded values, write the collectives, slice the parameters.
  std::vector<std::vector<Module>> shards(S);
  std::vector<std::vector<std::string>> out_taint(S);
  for (int s = 0; s < S; ++s) {
    const StagePlan& sp = plan.stages(s);
    PIPPY_ASSIGN_OR_RETURN(Module base, TorchCall(absl::StrCat("stage ", s, ": copying the stage"), [&] {
      torch::NoGradGuard no_grad;
      return pipe->stages[s].clone();
    }, absl::StatusCode::kInternal));
    std::shared_ptr<Graph> g = base.get_method("forward").graph();
    PIPPY_ASSIGN_OR_RETURN(std::vector<Target> targets, FindTargets(*g, styles));
    std::vector<std::string> in_taint;
    for (const StageInput& in : sp.inputs()) {
      in_taint.push_back(in.source_case() == StageInput::kSourceStage
                             ? out_taint[in.source_stage()][in.source_output()]
                             : "");
    }
    PIPPY_ASSIGN_OR_RETURN(out_taint[s], FollowShardedValues(*g, targets, in_taint, sp.is_last()));
    PIPPY_RETURN_IF_ERROR(TorchCall(absl::StrCat("stage ", s, ": writing the tensor-parallel collectives"),
                                    [&] { Rewrite(*g, targets); }, absl::StatusCode::kInternal));
    for (int r = 0; r < T; ++r) {
      PIPPY_ASSIGN_OR_RETURN(Module shard, TorchCall(absl::StrCat("stage ", s, ": making shard ", r), [&] {
        torch::NoGradGuard no_grad;
        Module m = base.clone();
        for (const auto& p : pipe->stages[s].named_parameters(true)) {
          auto dot = p.name.rfind('.');
          Module owner = dot == std::string::npos ? m : ModuleAt(m, p.name.substr(0, dot));
          const std::string leaf = dot == std::string::npos ? p.name : p.name.substr(dot + 1);
          auto d = tp_dim.find(p.name);
          at::Tensor t = d == tp_dim.end() ? owner.attr(leaf).toTensor() : ShardOf(p.value, d->second, r, T);
          t.requires_grad_(p.value.requires_grad());
          owner.register_parameter(leaf, t, /*is_buffer=*/false);
        }
        return m;
      }, absl::StatusCode::kInternal));
      shards[s].push_back(shard);
    }
  }

  // The check: the example batch through the unsplit stages and through the shards.
  std::vector<std::vector<c10::IValue>> full_out(S);
  std::vector<std::vector<std::vector<c10::IValue>>> shard_out(S, std::vector<std::vector<c10::IValue>>(T));
  for (int s = 0; s < S; ++s) {
    const StagePlan& sp = plan.stages(s);
    std::vector<c10::IValue> full_in;
    std::vector<std::vector<c10::IValue>> shard_in(T);
    for (const StageInput& in : sp.inputs()) {
      const bool from_stage = in.source_case() == StageInput::kSourceStage;
      full_in.push_back(from_stage ? full_out[in.source_stage()][in.source_output()]
                                   : options.example_inputs[in.model_input()]);
      for (int r = 0; r < T; ++r) {
        shard_in[r].push_back(from_stage ? shard_out[in.source_stage()][r][in.source_output()]
                                         : options.example_inputs[in.model_input()]);
      }
    }
    std::vector<Module> all{pipe->stages[s]};
    for (const Module& m : shards[s]) all.push_back(m);
    TrainingOff eval(all);
    std::vector<Target> full_targets;
    PIPPY_ASSIGN_OR_RETURN(Observed full, TorchCall(absl::StrCat("tensor-parallel check: the unsplit stage ", s), [&] {
      torch::NoGradGuard no_grad;
      std::shared_ptr<Graph> g = ObservingGraph(pipe->stages[s], [&](Graph& graph) {
        auto found = FindTargets(graph, styles);
        TORCH_CHECK(found.ok(), std::string(found.status().message()));
        full_targets = *found;
        std::vector<Value*> v;
        for (const Target& t : full_targets) v.push_back(t.node->output());
        return v;
      });
      return RunObserving(pipe->stages[s], g, full_in);
    }));
    std::vector<Observed> part(T);
    std::vector<absl::Status> errors(T);
    LocalGroup group(T, absl::Seconds(60));
    std::vector<std::thread> threads;
    for (int r = 0; r < T; ++r) {
      threads.emplace_back([&, r] {
        ScopedGroup scope(group.member(r));
        auto done = TorchCall(absl::StrCat("tensor-parallel check: stage ", s, " shard ", r), [&] {
          torch::NoGradGuard no_grad;
          std::shared_ptr<Graph> g = ObservingGraph(shards[s][r], [](Graph& graph) {
            std::map<int, Value*> by_index;
            for (Node* n : graph.nodes()) {
              for (Value* o : n->outputs()) {
                if (!o->hasDebugName() || !absl::StartsWith(o->debugName(), kObserved)) continue;
                std::string rest = o->debugName().substr(sizeof(kObserved) - 1);
                rest = rest.substr(0, rest.find('.'));
                int k = 0;
                if (absl::SimpleAtoi(rest, &k)) by_index[k] = o;
              }
            }
            std::vector<Value*> v;
            for (const auto& [k, val] : by_index) v.push_back(val);
            return v;
          });
          return RunObserving(shards[s][r], g, shard_in[r]);
        });
        if (done.ok()) {
          part[r] = std::move(*done);
        } else {
          errors[r] = done.status();
          group.Abort();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < T; ++r) {
      if (!errors[r].ok() && !absl::StrContains(errors[r].message(), "was aborted")) {
        return absl::InvalidArgumentError(absl::StrCat(errors[r].message(),
                                                       " (the plan changes a shape the model relies on: change the "
                                                       "plan, or the model's code there)"));
      }
    }
    for (int r = 0; r < T; ++r) PIPPY_RETURN_IF_ERROR(errors[r]);
    auto refuse = [&](const std::string& what, double diff, int r) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tp-plan: tensor-parallel check on the example batch: ", what, " on rank ", r, " of stage ", s,
          "'s group differs from the unsplit stage by ", diff, " (max relative; at most ", options.tolerance,
          "): the values between its colwise and rowwise Linears are not combined the way sharding assumes "
          "(a reduction over the sharded features, a fused projection, a size fixed in the code); change the plan "
          "or the model there"));
    };
    for (size_t k = 0; k < full_targets.size(); ++k) {
      const Target& t = full_targets[k];
      const at::Tensor& want = full.values[k];
      for (int r = 0; r < T; ++r) {
        if (part[r].values.size() != full_targets.size()) {
          return absl::InternalError(absl::StrCat("tensor-parallel check: stage ", s, " shard ", r, " observed ",
                                                  part[r].values.size(), " modules, the unsplit stage ",
                                                  full_targets.size(), " (sharding bug)"));
        }
      }
      if (t.style == TP_COLWISE) {
        std::vector<at::Tensor> pieces;
        for (int r = 0; r < T; ++r) pieces.push_back(part[r].values[k]);
        const at::Tensor got = at::cat(pieces, -1);
        if (!got.sizes().equals(want.sizes())) {
          return refuse(absl::StrCat("the output of colwise ", t.module, " (shape ", c10::str(got.sizes()), " vs ",
                                     c10::str(want.sizes()), ")"), 1, 0);
        }
        const double d = RelDiff(got, want);
        if (d > options.tolerance) return refuse(absl::StrCat("the output of colwise ", t.module), d, 0);
      } else {
        for (int r = 0; r < T; ++r) {
          const at::Tensor& got = part[r].values[k];
          const double d = got.sizes().equals(want.sizes()) ? RelDiff(got, want) : 1.0;
          if (d > options.tolerance) {
            return refuse(absl::StrCat("the output of ", StyleName(t.style), " ", t.module), d, r);
          }
        }
      }
    }
    full_out[s] = Elements(full.output, sp.is_last());
    for (int r = 0; r < T; ++r) {
      shard_out[s][r] = Elements(part[r].output, sp.is_last());
      for (size_t j = 0; j < full_out[s].size() && j < out_taint[s].size(); ++j) {
        if (!out_taint[s][j].empty()) continue;  // sharded: checked where it is used
        std::vector<at::Tensor> want, got;
        Tensors(full_out[s][j], &want);
        Tensors(shard_out[s][r][j], &got);
        for (size_t i = 0; i < want.size(); ++i) {
          const double d = i < got.size() && got[i].sizes().equals(want[i].sizes()) && at::isFloatingType(want[i].scalar_type())
                               ? RelDiff(got[i], want[i])
                               : (i < got.size() && at::equal(got[i], want[i]) ? 0.0 : 1.0);
          if (d > options.tolerance) {
            return refuse(sp.is_last() ? std::string("the model's output")
                                       : absl::StrCat("output ", j, " (", sp.outputs(j).name(), ")"),
                          d, r);
          }
        }
      }
    }
  }
  // The plan says what is sharded.
  *plan.mutable_tensor_parallel() = options.spec;
  for (StagePlan& sp : *plan.mutable_stages()) {
    for (ParameterInfo& pi : *sp.mutable_parameters()) {
      auto d = tp_dim.find(pi.name());
      if (d != tp_dim.end()) pi.set_tp_dim(d->second);
    }
  }
  return shards;
}

}  // namespace pippy::tp
