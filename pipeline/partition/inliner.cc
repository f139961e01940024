#include "pipeline/partition/inliner.h"

#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "torch/csrc/jit/api/function_impl.h"
#include "torch/csrc/jit/ir/scope.h"
#include "torch/csrc/jit/ir/constants.h"
#include "torch/csrc/jit/passes/constant_propagation.h"

namespace pippy::partition {
namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;
namespace prim = c10::prim;

constexpr char kMarkerClass[] = "PipeSplit";

// Builds the flat graph by copying: forward()'s nodes are appended to a new graph one
// by one, and a call is replaced by its callee's body, copied the same way (its own
// calls in turn). Appending is what LibTorch's node numbering is made for; inserting a
// callee's nodes before the call (torch::jit::insertGraph) halves the gap before the
// call at every node in LibTorch 1.13 and renumbers the whole block every ~40 nodes
// (100 renumberings, half of the 45 ms a 100-block GPT took).
class Inliner {
 public:
  explicit Inliner(const torch::jit::Module& model)
      : model_(model), graph_(std::make_shared<Graph>()), root_(c10::make_intrusive<torch::jit::Scope>()) {}

  absl::Status Run() {
    const std::shared_ptr<Graph> forward = model_.get_method("forward").graph();
    Env env;
    for (Value* in : forward->inputs()) env[in] = graph_->addInput()->copyMetadata(in);
    PIPPY_RETURN_IF_ERROR(EmitBlock(forward->block(), graph_->block(), env, ""));
    for (Value* out : forward->outputs()) graph_->registerOutput(Lookup(env, out));
    return absl::OkStatus();
  }

  std::shared_ptr<Graph> graph() const { return graph_; }
  std::vector<Node*>& markers() { return markers_; }

 private:
  // A function's values (forward()'s or one call's callee) to their copies.
  using Env = std::unordered_map<Value*, Value*>;

  static Value* Lookup(const Env& env, Value* v) {
    auto it = env.find(v);
    TORCH_CHECK(it != env.end(), "inliner: value %", v->debugName(), " used before it is defined");
    return it->second;
  }

  torch::jit::ScopePtr ScopeFor(const std::string& path) {
    if (path.empty()) return root_;
    auto it = scopes_.find(path);
    if (it != scopes_.end()) return it->second;
    auto scope = root_->push(c10::Symbol::scope(path));
    scopes_.emplace(path, scope);
    return scope;
  }

  // Appends a copy of `n` (its inputs mapped through `env`, no blocks) to `dst`.
  Node* Copy(Node* n, Block* dst, Env& env, const std::string& path) {
    Node* c = graph_->createClone(n, [&env](Value* v) { return Lookup(env, v); }, /*copy_blocks=*/false);
    c->setScope(ScopeFor(path));
    dst->appendNode(c);
    for (size_t i = 0; i < n->outputs().size(); ++i) env[n->output(i)] = c->output(i);
    return c;
  }

  // Copies `src`'s nodes (code of the module at `path`) to the end of `dst`.
  absl::Status EmitBlock(Block* src, Block* dst, Env& env, const std::string& path) {
    for (Node* n : src->nodes()) {
      if (n->kind() == prim::CallMethod || n->kind() == prim::CallFunction) {
        PIPPY_RETURN_IF_ERROR(EmitCall(n, dst, env, path));
        continue;
      }
      if (n->kind() == prim::PythonOp) {
        return absl::InvalidArgumentError(absl::StrCat(
            "forward() in module '", path,
            "' calls a Python function (torch.jit.ignore / unused): pippy runs the model "
            "without Python; make that code scriptable"));
      }
      Node* c = Copy(n, dst, env, path);
      for (Block* b : n->blocks()) {
        Block* cb = c->addBlock();
        for (Value* in : b->inputs()) env[in] = cb->addInput()->copyMetadata(in);
        PIPPY_RETURN_IF_ERROR(EmitBlock(b, cb, env, path));
        for (Value* out : b->outputs()) cb->registerOutput(Lookup(env, out));
      }
    }
    return absl::OkStatus();
  }

  // Emits the body of the function `call` runs in place of the call; a PipeSplit
  // marker's call is copied as it is.
  absl::Status EmitCall(Node* call, Block* dst, Env& env, const std::string& path) {
    std::shared_ptr<Graph> callee;
    std::vector<Value*> args;  // in the new graph
    std::string callee_path;   // the module whose code the call runs
    if (call->kind() == prim::CallMethod) {
      const std::string method = call->s(c10::attr::name);
      Value* obj = Lookup(env, call->input(0));
      if (obj->type()->cast<c10::InterfaceType>()) {
        std::string where = obj->node()->kind() == prim::GetAttr ? obj->node()->s(c10::attr::name) : obj->debugName();
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot inline the call to '", where, ".", method, "' in module '", path,
            "': '", where, "' is declared with the module interface ",
            obj->type()->repr_str(),
            ", so the module it runs is only known at run time; declare the attribute "
            "with the submodule's own class to let pippy split it"));
      }
      auto attr_path = AttributePath(obj, graph_->inputs()[0]);
      if (!attr_path) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot inline the call to method '", method, "' in module '", path,
            "': the module is not reached from self by attribute access (it comes from ",
            obj->node()->kind().toQualString(),
            "); index ModuleList/ModuleDict with constants or iterate over them"));
      }
      torch::jit::Module sub = model_;
      for (const std::string& name : *attr_path) sub = sub.attr(name).toModule();
      std::string sub_path = absl::StrJoin(*attr_path, ".");
      if (sub.type()->name()->name() == kMarkerClass && method == "forward") {
        markers_.push_back(Copy(call, dst, env, sub_path));
        return absl::OkStatus();
      }
      auto found = sub.find_method(method);
      if (!found) {
        return absl::InvalidArgumentError(absl::StrCat("cannot inline '", sub_path, ".", method,
                                                       "': no such method"));
      }
      callee = torch::jit::toGraphFunction(found->function()).graph();
      for (Value* in : call->inputs()) args.push_back(Lookup(env, in));
      callee_path = sub_path;
    } else {
      auto fn_type = call->input(0)->type()->cast<c10::FunctionType>();
      torch::jit::GraphFunction* fn = fn_type ? torch::jit::tryToGraphFunction(*fn_type->function()) : nullptr;
      if (fn == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot inline a function call in module '", path,
            "': the callee is not a TorchScript function; make it scriptable"));
      }
      callee = fn->graph();
      for (size_t i = 1; i < call->inputs().size(); ++i) args.push_back(Lookup(env, call->input(i)));
      callee_path = path;
    }
    TORCH_CHECK(callee->inputs().size() == args.size(), "inlined call input count mismatch");
    TORCH_CHECK(callee->outputs().size() == call->outputs().size(), "inlined call output count mismatch");
    Env callee_env;
    for (size_t i = 0; i < args.size(); ++i) callee_env[callee->inputs()[i]] = args[i];
    PIPPY_RETURN_IF_ERROR(EmitBlock(callee->block(), dst, callee_env, callee_path));
    for (size_t i = 0; i < call->outputs().size(); ++i) env[call->output(i)] = Lookup(callee_env, callee->outputs()[i]);
    return absl::OkStatus();
  }

  const torch::jit::Module& model_;
  std::shared_ptr<Graph> graph_;
  torch::jit::ScopePtr root_;
  std::unordered_map<std::string, torch::jit::ScopePtr> scopes_;
  std::vector<Node*> markers_;
};

// Forwards tuples that are built and taken apart in the same graph (a module returning
// several values to its caller): TupleUnpack and TupleIndex of a TupleConstruct use its
// inputs directly. One linear pass (LibTorch's LowerSimpleTuples does more, slowly).
void ForwardTuples(Block* b) {
  for (Node* n : b->nodes()) {
    for (Block* inner : n->blocks()) ForwardTuples(inner);
    if (n->kind() == prim::TupleUnpack && n->input()->node()->kind() == prim::TupleConstruct) {
      Node* built = n->input()->node();
      if (built->inputs().size() != n->outputs().size()) continue;
      for (size_t i = 0; i < n->outputs().size(); ++i) n->output(i)->replaceAllUsesWith(built->input(i));
    } else if (n->kind() == prim::TupleIndex && n->input(0)->node()->kind() == prim::TupleConstruct) {
      Node* built = n->input(0)->node();
      auto index = torch::jit::constant_as<int64_t>(n->input(1));
      if (!index) continue;
      const int64_t size = static_cast<int64_t>(built->inputs().size());
      const int64_t i = *index < 0 ? *index + size : *index;
      if (i < 0 || i >= size) continue;
      n->output()->replaceAllUsesWith(built->input(static_cast<size_t>(i)));
    }
  }
}

// Dead-code elimination without alias analysis: removes nodes whose outputs nobody
// uses and that cannot change anything — no side effects, no argument they write,
// no blocks. (LibTorch's pass builds an AliasDb of the whole graph to also remove
// writes to dead values; keeping every possible write is what a split needs.)
void RemoveUnusedNodes(Block* b) {
  for (auto it = b->nodes().reverse().begin(); it != b->nodes().reverse().end();) {
    Node* n = *it;
    ++it;
    for (Block* inner : n->blocks()) RemoveUnusedNodes(inner);
    if (!n->blocks().empty() || n->hasSideEffects()) continue;
    bool used = false;
    for (Value* v : n->outputs()) used |= v->hasUses();
    if (used) continue;
    if (const c10::FunctionSchema* schema = n->maybeSchema(); schema != nullptr && schema->is_mutable()) continue;
    if (n->kind().is_aten() && n->maybeSchema() == nullptr) continue;  // unknown op: keep
    n->destroy();
  }
}

// What constants decide, folded from the constants onwards: an op whose inputs are all
// constants is run once and its outputs become constants; an `if` on a constant
// condition is replaced by its taken branch (`if inplace:` in F.relu with ReLU's
// constant `inplace`). LibTorch's ConstantPropagation tries every node of the graph;
// this visits only what constants reach.
void FoldFrom(Graph& graph, const std::vector<Value*>& constants) {
  std::vector<Node*> work;
  auto push_users = [&](Value* v) {
    for (const torch::jit::Use& u : v->uses()) {
      if (u.user->kind() != prim::Return) work.push_back(u.user);
    }
  };
  for (Value* c : constants) push_users(c);
  std::unordered_set<Node*> done;
  while (!work.empty()) {
    Node* n = work.back();
    work.pop_back();
    if (done.count(n)) continue;
    if (n->kind() == prim::If) {
      auto cond = torch::jit::constant_as<bool>(n->input(0));
      if (!cond) continue;
      done.insert(n);
      Block* taken = n->blocks()[*cond ? 0 : 1];
      for (Node* inner = taken->nodes().front(); inner != taken->return_node();) {
        Node* next = inner->next();
        inner->moveBefore(n);
        inner = next;
      }
      for (size_t i = 0; i < n->outputs().size(); ++i) {
        n->output(i)->replaceAllUsesWith(taken->outputs()[i]);
        push_users(taken->outputs()[i]);
      }
      // The branch not taken goes with the `if`: its nodes may wait in `work`.
      std::function<void(Block*)> forget = [&](Block* b) {
        done.insert(b->return_node());
        for (Node* inner : b->nodes()) {
          done.insert(inner);
          for (Block* deeper : inner->blocks()) forget(deeper);
        }
      };
      for (Block* b : n->blocks()) forget(b);
      n->destroy();
      continue;
    }
    if (n->kind() == prim::Constant || !n->blocks().empty() || n->hasSideEffects() || n->isNondeterministic()) {
      continue;
    }
    bool all_constant = true;
    for (Value* in : n->inputs()) all_constant &= in->node()->kind() == prim::Constant;
    if (!all_constant) continue;
    done.insert(n);
    auto outputs = torch::jit::runNodeIfInputsAreConstant(n);
    if (!outputs || outputs->size() != n->outputs().size()) continue;
    torch::jit::WithInsertPoint guard(n);
    std::vector<Value*> folded;
    for (const c10::IValue& v : *outputs) {
      auto constant = torch::jit::tryInsertConstant(graph, v);
      if (!constant) break;
      folded.push_back(*constant);
    }
    if (folded.size() != n->outputs().size()) continue;  // not representable: leave it (and the new constants die)
    for (size_t i = 0; i < folded.size(); ++i) {
      n->output(i)->replaceAllUsesWith(folded[i]);
      push_users(folded[i]);
    }
  }
}

bool HasSetAttr(const std::shared_ptr<Graph>& graph) {
  bool found = false;
  std::function<void(Block*)> walk = [&](Block* b) {
    for (Node* n : b->nodes()) {
      if (n->kind() == prim::SetAttr) found = true;
      for (Block* inner : n->blocks()) walk(inner);
    }
  };
  walk(graph->block());
  return found;
}

// Moves every prim::GetAttr chain from self to the top of the graph, so that stage
// graphs can rebuild them against the stage module's own types. Reads of attributes
// that forward() also writes (prim::SetAttr) stay where they are.
void HoistAttributeReads(const std::shared_ptr<Graph>& graph) {
  Value* self = graph->inputs()[0];
  std::unordered_set<std::string> written;
  std::vector<Node*> reads;
  std::function<void(Block*)> collect = [&](Block* b) {
    for (Node* n : b->nodes()) {
      if (n->kind() == prim::SetAttr) {
        auto path = AttributePath(n->input(0), self);
        if (path) {
          path->push_back(n->s(c10::attr::name));
          written.insert(absl::StrJoin(*path, "."));
        }
      }
      if (n->kind() == prim::GetAttr) reads.push_back(n);
      for (Block* inner : n->blocks()) collect(inner);
    }
  };
  collect(graph->block());
  // `reads` is in graph order, so each chain's links stay after the link they read.
  // A chain is hoisted when it starts at self (and, if forward() writes attributes,
  // does not read one it writes); the path is only spelled out in that case.
  auto rooted_at_self = [self](const Value* v) {
    while (v != self) {
      if (v->node()->kind() != prim::GetAttr) return false;
      v = v->node()->input(0);
    }
    return true;
  };
  std::vector<Node*> hoisted;
  std::unordered_set<Node*> hoisted_set;
  for (Node* n : reads) {
    if (!rooted_at_self(n->output())) continue;
    if (!written.empty() && written.count(absl::StrJoin(*AttributePath(n->output(), self), "."))) continue;
    hoisted.push_back(n);
    hoisted_set.insert(n);
  }
  // The reads already at the top (the first `leading` of `hoisted`, which is in graph
  // order) stay. From the first node that is not hoisted on, the other hoisted reads and
  // then the remaining nodes are moved to the end, each in its order: appending is
  // cheap in LibTorch's node numbering, moving many nodes into one gap is not (LibTorch
  // 1.13 halves the gap at each and renumbers the block every ~40).
  Block* top = graph->block();
  Node* first_kept = top->nodes().front();
  size_t leading = 0;
  for (; first_kept != top->return_node() && hoisted_set.count(first_kept); first_kept = first_kept->next()) ++leading;
  if (leading == hoisted.size()) return;
  std::vector<Node*> rest;
  for (Node* n = first_kept; n != top->return_node(); n = n->next()) {
    if (!hoisted_set.count(n)) rest.push_back(n);
  }
  for (size_t i = leading; i < hoisted.size(); ++i) hoisted[i]->moveBefore(top->return_node());
  for (Node* n : rest) n->moveBefore(top->return_node());
}

// Replaces reads of scalar configuration attributes (ints, floats, bools, strings,
// lists of them — e.g. ReLU's `inplace`, Conv2d's `padding_mode`) by constants and
// folds what they decide (`if self.inplace:`), so that alias analysis sees what the
// model really does. `training` stays a real attribute; so do attributes that
// forward() writes.
// Every constant of the graph, in blocks too.
void CollectConstants(Block* b, std::vector<Value*>* out) {
  for (Node* n : b->nodes()) {
    if (n->kind() == prim::Constant) out->push_back(n->output());
    for (Block* inner : n->blocks()) CollectConstants(inner, out);
  }
}

void FoldConfigurationAttributes(std::shared_ptr<Graph>& graph, const torch::jit::Module& model) {
  Value* self = graph->inputs()[0];
  std::vector<Node*> reads;
  for (Node* n : graph->nodes()) {
    if (n->kind() == prim::GetAttr) reads.push_back(n);
  }
  for (Node* n : reads) {
    const std::string name = n->s(c10::attr::name);
    if (name == "training") continue;
    auto path = AttributePath(n->input(0), self);
    if (!path) continue;
    torch::jit::Module owner = model;
    for (const std::string& p : *path) owner = owner.attr(p).toModule();
    c10::IValue value = owner.attr(name);
    if (value.isTensor() || value.isModule() || value.isObject() || value.isNone()) continue;
    if (n->output()->type()->kind() == c10::TypeKind::OptionalType) continue;
    torch::jit::WithInsertPoint guard(n);
    auto constant = torch::jit::tryInsertConstant(*graph, value);
    if (!constant) continue;
    n->output()->replaceAllUsesWith(*constant);
    n->destroy();
  }
}

}  // namespace

std::string ModulePath(const Node* node) {
  const torch::jit::ScopePtr& scope = const_cast<Node*>(node)->scope();
  if (!scope || scope->isBlank()) return "";
  return scope->name().toUnqualString();
}

std::optional<std::vector<std::string>> AttributePath(const Value* value, const Value* self) {
  std::vector<std::string> names;
  while (value != self) {
    const Node* n = value->node();
    if (n->kind() != prim::GetAttr) return std::nullopt;
    names.push_back(n->s(c10::attr::name));
    value = n->input(0);
  }
  return std::vector<std::string>(names.rbegin(), names.rend());
}

absl::StatusOr<InlinedForward> InlineForward(const torch::jit::Module& model) {
  return TorchCall("inlining forward()", [&]() -> absl::StatusOr<InlinedForward> {
    InlinedForward out;
    Inliner inliner(model);
    PIPPY_RETURN_IF_ERROR(inliner.Run());
    out.graph = inliner.graph();
    ForwardTuples(out.graph->block());
    RemoveUnusedNodes(out.graph->block());
    HoistAttributeReads(out.graph);
    if (!HasSetAttr(out.graph)) FoldConfigurationAttributes(out.graph, model);
    std::vector<Value*> constants;
    CollectConstants(out.graph->block(), &constants);
    FoldFrom(*out.graph, constants);
    RemoveUnusedNodes(out.graph->block());
    // Markers become cut positions; the identity call itself disappears.
    std::unordered_set<Node*> marker_set(inliner.markers().begin(), inliner.markers().end());
    for (Node* marker : inliner.markers()) {
      if (marker->owningBlock() != out.graph->block()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "PipeSplit marker '", ModulePath(marker),
            "' runs inside control flow (an if or a loop); put markers at the top level of "
            "forward() or in nn.Sequential"));
      }
      Node* next = marker->next();
      while (marker_set.count(next)) next = next->next();
      if (next == out.graph->return_node()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "PipeSplit marker '", ModulePath(marker),
            "' is the last thing forward() does, so it marks no cut; remove it"));
      }
      marker->output()->replaceAllUsesWith(marker->input(1));
      out.markers.push_back({ModulePath(marker), next});
      marker->destroy();
    }
    return out;
  });
}

}  // namespace pippy::partition
