#include "pipeline/partition/model_graph.h"

#include <algorithm>
#include <functional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "torch/csrc/jit/ir/alias_analysis.h"

namespace pippy::partition {
namespace {

using torch::jit::Node;
using torch::jit::Value;
namespace prim = c10::prim;

bool ContainsTensor(const c10::TypePtr& type) {
  if (type->kind() == c10::TypeKind::TensorType) return true;
  for (const c10::TypePtr& t : type->containedTypes()) {
    if (ContainsTensor(t)) return true;
  }
  return false;
}

bool IsTensorType(const c10::TypePtr& type) { return type->kind() == c10::TypeKind::TensorType; }

std::string DescribeValue(const Value* v) {
  std::string where = v->node()->kind() == prim::Param
                          ? "a model input"
                          : absl::StrCat(v->node()->kind().toQualString(), " in module '",
                                         ModulePath(v->node()), "'");
  return absl::StrCat("'", v->debugName(), "' (", v->type()->repr_str(), ", from ", where, ")");
}

}  // namespace

void ForEachNodeRecursive(Node* node, const std::function<void(Node*)>& fn) {
  fn(node);
  for (torch::jit::Block* b : node->blocks()) {
    for (Node* inner : b->nodes()) ForEachNodeRecursive(inner, fn);
  }
}

namespace {

// Whether an op writes `v` in place, or a view of it (select, slice, view, ...), as the
// ops' schemas say (`Tensor(a!) self`). AliasDb cannot tell: it treats every tensor
// read from a module's attributes as one wildcard set, so a write to one attribute (a
// KV cache) would count as a write to every parameter.
bool WritesThrough(Value* v, int depth = 0) {
  if (depth > 16) return false;
  for (const torch::jit::Use& use : v->uses()) {
    Node* n = use.user;
    const c10::FunctionSchema* schema = n->maybeSchema();
    if (schema == nullptr) {
      if (n->kind() == prim::SetAttr) return true;
      continue;
    }
    if (use.offset >= schema->arguments().size()) continue;
    const c10::AliasInfo* in = schema->arguments()[use.offset].alias_info();
    if (in == nullptr) continue;
    if (in->isWrite()) return true;
    // A view of it: an output in the same alias set.
    for (size_t o = 0; o < schema->returns().size() && o < n->outputs().size(); ++o) {
      const c10::AliasInfo* out = schema->returns()[o].alias_info();
      if (out == nullptr || out->isWrite()) continue;
      const bool same = std::any_of(out->beforeSets().begin(), out->beforeSets().end(),
                                    [&](const c10::Symbol& s) { return in->beforeSets().count(s) > 0; });
      if (same && WritesThrough(n->outputs()[o], depth + 1)) return true;
    }
  }
  return false;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelGraph>> ModelGraph::Build(const torch::jit::Module& model) {
  std::unique_ptr<ModelGraph> mg(new ModelGraph());
  mg->model_ = model;
  PIPPY_ASSIGN_OR_RETURN(InlinedForward inlined, InlineForward(model));
  mg->graph_ = inlined.graph;
  mg->markers_ = std::move(inlined.markers);
  PIPPY_RETURN_IF_ERROR(TorchCall("analysing forward()", [&] { return mg->Analyze(); }));
  return mg;
}

int ModelGraph::OpIndexOf(const Node* node) const {
  while (node->owningBlock() != graph_->block()) node = node->owningBlock()->owningNode();
  if (node == graph_->return_node()) return num_ops();
  auto it = op_index_.find(node);
  return it == op_index_.end() ? -1 : it->second;
}

int ModelGraph::TensorIndexOf(const std::string& path) const {
  auto it = tensor_index_.find(path);
  return it == tensor_index_.end() ? -1 : it->second;
}

absl::Status ModelGraph::Analyze() {
  // Tensor attributes, grouped by the tensor they hold (tied weights).
  std::unordered_map<const c10::TensorImpl*, int> by_impl;
  std::function<void(const torch::jit::Module&, const std::string&)> walk =
      [&](const torch::jit::Module& m, const std::string& prefix) {
        const auto& type = m.type();
        const auto& obj = m._ivalue();
        for (size_t i = 0; i < type->numAttributes(); ++i) {
          const std::string& name = type->getAttributeName(i);
          std::string path = prefix.empty() ? name : absl::StrCat(prefix, ".", name);
          const c10::IValue& slot = obj->getSlot(i);
          if (slot.isTensor()) {
            const at::Tensor& t = slot.toTensor();
            auto [it, inserted] = by_impl.emplace(t.unsafeGetTensorImpl(), tensors_.size());
            if (inserted) tensors_.push_back(ModelTensor{{}, t, false, false});
            ModelTensor& mt = tensors_[it->second];
            mt.names.push_back(path);
            mt.is_parameter |= type->is_parameter(i);
            mt.is_buffer |= type->is_buffer(i);
            tensor_index_[path] = it->second;
          } else if (slot.isModule()) {
            module_paths_.push_back(path);
            walk(slot.toModule(), path);
          }
        }
      };
  walk(model_, "");

  // Free nodes and ops.
  torch::jit::AliasDb alias_db(graph_);
  for (Node* n : graph_->nodes()) {
    bool is_free = n->kind() == prim::Constant || n->kind() == prim::GetAttr;
    if (!is_free && (n->kind() == prim::ListConstruct || n->kind() == prim::TupleConstruct)) {
      is_free = std::all_of(n->inputs().begin(), n->inputs().end(),
                            [&](Value* v) { return free_.count(v->node()) > 0; }) &&
                !alias_db.hasWriters(n->output());
    }
    // Pure computations on attributes and constants that give no tensors (e.g.
    // Conv2d's `padding_mode != "zeros"`) are recomputed wherever they are needed.
    if (!is_free && n->blocks().empty() && !n->inputs().empty() && !n->hasSideEffects() &&
        std::all_of(n->inputs().begin(), n->inputs().end(),
                    [&](Value* v) { return free_.count(v->node()) > 0; }) &&
        std::none_of(n->outputs().begin(), n->outputs().end(), [&](Value* v) {
          return ContainsTensor(v->type()) || alias_db.hasWriters(v);
        })) {
      is_free = true;
    }
    if (n->kind() == prim::GetAttr && !AttributePath(n->output(), self())) is_free = false;
    if (is_free) {
      free_.insert(n);
    } else {
      op_index_[n] = static_cast<int>(ops_.size());
      ops_.push_back(n);
      op_paths_.push_back(ModulePath(n));
    }
  }
  const int n_ops = num_ops();
  for (int i = 0; i < n_ops; ++i) {
    for (std::string path = op_paths_[i]; !path.empty();) {
      auto [it, inserted] = module_spans_.emplace(path, std::make_pair(i, i));
      if (!inserted) it->second.second = i;
      auto dot = path.rfind('.');
      path = dot == std::string::npos ? "" : path.substr(0, dot);
    }
  }

  // Tensor attributes read by each op.
  tensor_reads_.resize(n_ops);
  for (int i = 0; i < n_ops; ++i) {
    std::unordered_set<std::string> seen;
    ForEachNodeRecursive(ops_[i], [&](Node* n) {
      for (Value* in : n->inputs()) {
        if (in->node()->kind() != prim::GetAttr) continue;
        auto path = AttributePath(in, self());
        if (!path) continue;
        std::string p = absl::StrJoin(*path, ".");
        auto t = tensor_index_.find(p);
        if (t == tensor_index_.end()) continue;
        if (seen.insert(p).second) tensor_reads_[i].push_back(p);
        if (WritesThrough(in)) tensors_[static_cast<size_t>(t->second)].written = true;
      }
    });
  }

  // Liveness of every top-level value produced by an op or given as a model input.
  auto add_value = [&](Value* v, int def) {
    int last_use = def;
    for (const torch::jit::Use& use : v->uses()) last_use = std::max(last_use, OpIndexOf(use.user));
    int last_write = -1;
    if (alias_db.hasWriters(v)) {
      for (int i = def + 1; i < n_ops; ++i) {
        if (alias_db.writesToAlias(ops_[i], {v})) last_write = i;
      }
    }
    values_.push_back({v, def, last_use, last_write});
  };
  for (size_t i = 1; i < graph_->inputs().size(); ++i) add_value(graph_->inputs()[i], -1);
  for (int i = 0; i < n_ops; ++i) {
    for (Value* out : ops_[i]->outputs()) add_value(out, i);
  }

  // A cut c is blocked by a value live across it (def < c <= last_use) that is not a
  // tensor, or that an op at or after c modifies in place. Model inputs are given to
  // every stage that needs them, so they never block.
  blocked_.assign(n_ops + 1, 0);
  std::vector<int> diff(n_ops + 2, 0);
  for (const ValueInfo& vi : values_) {
    if (vi.def < 0) continue;
    int end = -1;
    if (!IsTensorType(vi.value->type())) end = vi.last_use;
    else if (vi.last_write >= 0) end = std::min(vi.last_use, vi.last_write);
    if (end > vi.def) {
      diff[vi.def + 1] += 1;
      diff[std::min(end, n_ops) + 1] -= 1;
    }
  }
  int running = 0;
  for (int c = 0; c <= n_ops; ++c) {
    running += diff[c];
    blocked_[c] = running;
  }
  for (int c = 1; c < n_ops; ++c) {
    if (blocked_[c] == 0) legal_cuts_.push_back(c);
  }

  for (const SplitMarker& m : markers_) {
    int c = OpIndexOf(m.next);
    if (c < 0) {
      // The node after the marker is free (e.g. a constant): the cut goes before the next op.
      Node* n = m.next;
      while (n != graph_->return_node() && free_.count(n)) n = n->next();
      c = OpIndexOf(n);
    }
    marker_cuts_.push_back(c);
    marker_paths_.push_back(m.module_path);
  }
  return absl::OkStatus();
}

absl::Status ModelGraph::ExplainCut(int c) const {
  if (c <= 0 || c >= num_ops()) {
    return absl::InvalidArgumentError("a cut must leave at least one operation on each side");
  }
  if (blocked_[c] == 0) return absl::OkStatus();
  for (const ValueInfo& vi : values_) {
    if (vi.def < 0 || !(vi.def < c && c <= vi.last_use)) continue;
    if (!IsTensorType(vi.value->type())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the value ", DescribeValue(vi.value), " would cross the cut, and only tensors can be "
          "sent between stages"));
    }
    if (vi.last_write >= c) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the tensor ", DescribeValue(vi.value), " would cross the cut and is modified in place "
          "after it (in module '", op_paths_[vi.last_write], "')"));
    }
  }
  return absl::InternalError("cut blocked for an unknown reason");
}

int ModelGraph::BoundaryDepth(int c) const {
  if (c <= 0 || c >= num_ops()) return 0;
  std::vector<absl::string_view> a = absl::StrSplit(op_paths_[c - 1], '.', absl::SkipEmpty());
  std::vector<absl::string_view> b = absl::StrSplit(op_paths_[c], '.', absl::SkipEmpty());
  int d = 0;
  while (d < static_cast<int>(a.size()) && d < static_cast<int>(b.size()) && a[d] == b[d]) ++d;
  return d;
}

}  // namespace pippy::partition
