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
#include "torch/csrc/jit/passes/dead_code_elimination.h"
#include "torch/csrc/jit/passes/lower_tuples.h"

namespace pippy::partition {
namespace {

using torch::jit::Block;
using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;
namespace prim = c10::prim;

constexpr char kMarkerClass[] = "PipeSplit";

void SetScopeRecursive(Node* n, const torch::jit::ScopePtr& scope) {
  n->setScope(scope);
  for (Block* b : n->blocks()) {
    for (Node* inner : b->nodes()) SetScopeRecursive(inner, scope);
  }
}

class Inliner {
 public:
  Inliner(const torch::jit::Module& model, std::shared_ptr<Graph> graph)
      : model_(model), graph_(std::move(graph)), root_(c10::make_intrusive<torch::jit::Scope>()) {}

  absl::Status Run() {
    for (Node* n : graph_->nodes()) SetScopeRecursive(n, root_);
    return InlineBlock(graph_->block());
  }

  std::vector<Node*>& markers() { return markers_; }

 private:
  torch::jit::ScopePtr ScopeFor(const std::string& path) {
    if (path.empty()) return root_;
    auto it = scopes_.find(path);
    if (it != scopes_.end()) return it->second;
    auto scope = root_->push(c10::Symbol::scope(path));
    scopes_.emplace(path, scope);
    return scope;
  }

  absl::Status InlineBlock(Block* block) {
    for (Node* n = block->nodes().front(); n != block->return_node();) {
      if (n->kind() == prim::CallMethod || n->kind() == prim::CallFunction) {
        Node* first_inserted = nullptr;
        Node* after = n->next();
        PIPPY_RETURN_IF_ERROR(InlineCall(n, &first_inserted));
        // Continue with the inlined body (its own calls are inlined in turn), or after
        // a marker, which stays in place.
        n = first_inserted != nullptr ? first_inserted : after;
        continue;
      }
      if (n->kind() == prim::PythonOp) {
        return absl::InvalidArgumentError(absl::StrCat(
            "forward() in module '", ModulePath(n),
            "' calls a Python function (torch.jit.ignore / unused): pippy runs the model "
            "without Python; make that code scriptable"));
      }
      for (Block* b : n->blocks()) PIPPY_RETURN_IF_ERROR(InlineBlock(b));
      n = n->next();
    }
    return absl::OkStatus();
  }

  // Replaces `call` by the callee's graph. Sets *first_inserted to the first inlined
  // node, or leaves it null when `call` is kept (a PipeSplit marker).
  absl::Status InlineCall(Node* call, Node** first_inserted) {
    std::shared_ptr<Graph> callee;
    std::vector<Value*> inputs;
    std::string path = ModulePath(call);
    if (call->kind() == prim::CallMethod) {
      const std::string method = call->s(c10::attr::name);
      Value* obj = call->input(0);
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
        call->setScope(ScopeFor(sub_path));
        markers_.push_back(call);
        return absl::OkStatus();
      }
      auto found = sub.find_method(method);
      if (!found) {
        return absl::InvalidArgumentError(absl::StrCat("cannot inline '", sub_path, ".", method,
                                                       "': no such method"));
      }
      callee = torch::jit::toGraphFunction(found->function()).graph();
      inputs.assign(call->inputs().begin(), call->inputs().end());
      path = sub_path;
    } else {
      auto fn_type = call->input(0)->type()->cast<c10::FunctionType>();
      torch::jit::GraphFunction* fn = fn_type ? torch::jit::tryToGraphFunction(*fn_type->function()) : nullptr;
      if (fn == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot inline a function call in module '", path,
            "': the callee is not a TorchScript function; make it scriptable"));
      }
      callee = fn->graph();
      inputs.assign(call->inputs().begin() + 1, call->inputs().end());
    }
    torch::jit::WithInsertPoint guard(call);
    Node* before = call->prev();
    std::vector<Value*> outputs = torch::jit::insertGraph(*graph_, *callee, inputs);
    torch::jit::ScopePtr scope = ScopeFor(path);
    for (Node* n = before->next(); n != call; n = n->next()) SetScopeRecursive(n, scope);
    TORCH_CHECK(outputs.size() == call->outputs().size(), "inlined call output count mismatch");
    for (size_t i = 0; i < outputs.size(); ++i) call->output(i)->replaceAllUsesWith(outputs[i]);
    *first_inserted = before->next() == call ? call->next() : before->next();
    call->destroy();
    return absl::OkStatus();
  }

  const torch::jit::Module& model_;
  std::shared_ptr<Graph> graph_;
  torch::jit::ScopePtr root_;
  std::unordered_map<std::string, torch::jit::ScopePtr> scopes_;
  std::vector<Node*> markers_;
};

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
  Node* last = graph->block()->param_node();
  for (Node* n : reads) {
    auto path = AttributePath(n->output(), self);
    if (!path || written.count(absl::StrJoin(*path, "."))) continue;
    if (n != last) n->moveAfter(last);
    last = n;
  }
}

// Replaces reads of scalar configuration attributes (ints, floats, bools, strings,
// lists of them — e.g. ReLU's `inplace`, Conv2d's `padding_mode`) by constants and
// folds what they decide (`if self.inplace:`), so that alias analysis sees what the
// model really does. `training` stays a real attribute; so do attributes that
// forward() writes.
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
  torch::jit::ConstantPropagationImmutableTypes(graph);
  torch::jit::EliminateDeadCode(graph);
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
    out.graph = model.get_method("forward").graph()->copy();
    Inliner inliner(model, out.graph);
    PIPPY_RETURN_IF_ERROR(inliner.Run());
    torch::jit::LowerSimpleTuples(out.graph);
    torch::jit::EliminateDeadCode(out.graph);
    HoistAttributeReads(out.graph);
    if (!HasSetAttr(out.graph)) FoldConfigurationAttributes(out.graph, model);
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
