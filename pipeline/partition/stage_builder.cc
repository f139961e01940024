#include "pipeline/partition/stage_builder.h"

#include <map>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "torch/csrc/jit/passes/inliner.h"

namespace pippy::partition {
namespace {

using torch::jit::Graph;
using torch::jit::Node;
using torch::jit::Value;
namespace prim = c10::prim;

std::string Identifier(const std::string& text) {
  std::string out;
  for (char ch : text) out += (std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_');
  if (out.empty() || std::isdigit(static_cast<unsigned char>(out[0]))) out = "v_" + out;
  return out;
}

class StageBuilder {
 public:
  StageBuilder(const ModelGraph& mg, const StageDefinition& def)
      : mg_(mg), def_(def), cu_(std::make_shared<torch::jit::CompilationUnit>()) {}

  absl::StatusOr<BuiltStage> Build() {
    const std::string ns = absl::StrCat("__torch__.pippy.stage", def_.index);
    root_ = torch::jit::Module(c10::QualifiedName(ns + ".Stage"), cu_, /*shouldMangle=*/true);
    root_.register_attribute("training", c10::BoolType::get(), mg_.model().is_training());
    modules_[""] = root_;
    originals_[""] = mg_.model();
    ChooseTensorNames();

    graph_ = std::make_shared<Graph>();
    Value* self = graph_->addInput("self")->setType(root_.type());
    attr_values_[""] = self;
    env_[mg_.self()] = self;
    for (Value* in : def_.inputs) {
      Value* v = graph_->addInput()->setType(in->type());
      v->setDebugName(Identifier(in->debugName()));
      env_[in] = v;
    }
    for (int i = def_.begin; i < def_.end; ++i) {
      Node* op = mg_.op(i);
      Node* clone = graph_->createClone(op, [&](Value* v) { return Map(v); });
      graph_->insertNode(clone);
      for (size_t k = 0; k < op->outputs().size(); ++k) env_[op->output(k)] = clone->output(k);
    }
    if (def_.is_last) {
      for (Value* out : mg_.graph().outputs()) graph_->registerOutput(Map(out));
    } else {
      std::vector<Value*> outs;
      for (Value* out : def_.outputs) outs.push_back(Map(out));
      Node* tuple = graph_->insertNode(graph_->createTuple(outs));
      graph_->registerOutput(tuple->output());
    }
    auto* fn = cu_->create_function(c10::QualifiedName(*root_.type()->name(), "forward"), graph_);
    root_.type()->addMethod(fn);
    if (def_.is_last && mg_.model().find_method("loss")) {
      // The model's loss(self, output, target) travels with the last stage (--loss model).
      auto loss = mg_.model().get_method("loss").graph()->copy();
      torch::jit::Inline(*loss);
      if (loss->inputs()[0]->hasUses()) {
        return absl::InvalidArgumentError(
            "the model's loss() reads attributes of the model (self.…); pippy needs loss(self, output, target) "
            "to use only its arguments");
      }
      loss->inputs()[0]->setType(root_.type());
      root_.type()->addMethod(
          cu_->create_function(c10::QualifiedName(*root_.type()->name(), "loss"), loss));
    }
    BuiltStage built;
    built.module = root_;
    for (const auto& [name, index] : registered_tensors_) built.tensors.emplace_back(name, index);
    return built;
  }

 private:
  // For each tied tensor, the name this stage uses: the first (module order) it reads.
  void ChooseTensorNames() {
    std::map<int, std::vector<std::string>> read;
    for (int i = def_.begin; i < def_.end; ++i) {
      for (const std::string& p : mg_.tensor_reads(i)) read[mg_.TensorIndexOf(p)].push_back(p);
    }
    for (auto& [index, paths] : read) {
      const auto& names = mg_.tensors()[index].names;
      std::string best;
      for (const std::string& n : names) {
        if (std::find(paths.begin(), paths.end(), n) != paths.end()) {
          best = n;
          break;
        }
      }
      stage_name_[index] = best;
    }
  }

  // The stage module (created on demand) at `path` in the hierarchy.
  torch::jit::Module EnsureModule(const std::string& path) {
    auto it = modules_.find(path);
    if (it != modules_.end()) return it->second;
    auto dot = path.rfind('.');
    std::string parent_path = dot == std::string::npos ? "" : path.substr(0, dot);
    std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
    torch::jit::Module parent = EnsureModule(parent_path);
    torch::jit::Module original = originals_[parent_path].attr(name).toModule();
    originals_[path] = original;
    std::string cls = Identifier(absl::StrCat(original.type()->name()->name(), "_", path));
    torch::jit::Module m(c10::QualifiedName(absl::StrCat("__torch__.pippy.stage", def_.index, ".", cls)),
                         cu_, /*shouldMangle=*/true);
    m.register_attribute("training", c10::BoolType::get(), original.is_training());
    parent.register_module(name, m);
    modules_[path] = m;
    return m;
  }

  // Registers attribute `path` (a parameter, buffer or other attribute) in the stage.
  void EnsureAttribute(const std::string& path) {
    if (registered_attrs_.count(path)) return;
    registered_attrs_.insert(path);
    auto dot = path.rfind('.');
    std::string parent_path = dot == std::string::npos ? "" : path.substr(0, dot);
    std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
    torch::jit::Module parent = EnsureModule(parent_path);
    if (parent.type()->hasAttribute(name)) return;  // e.g. `training`
    const torch::jit::Module& original = originals_[parent_path];
    const auto& otype = original.type();
    size_t slot = otype->getAttributeSlot(name);
    c10::IValue value = original._ivalue()->getSlot(slot);
    if (value.isTensor()) {
      const at::Tensor& original = value.toTensor();
      // Shared only where the tensor is its whole storage: saving a view would write
      // the storage it views (all of it) into the stage's file.
      const bool whole = original.storage().nbytes() ==
                         static_cast<size_t>(original.numel()) * original.element_size();
      at::Tensor t = def_.share_tensors && whole && original.is_contiguous() ? original.detach()
                                                                              : original.detach().clone();
      if (otype->is_parameter(slot)) t.requires_grad_(value.toTensor().requires_grad());
      parent.register_parameter(name, t, /*is_buffer=*/!otype->is_parameter(slot));
      registered_tensors_[path] = mg_.TensorIndexOf(path);
    } else {
      parent.register_attribute(name, otype->getAttribute(slot), value);
    }
  }

  // The value of attribute `path` in the stage graph (a GetAttr chain from self).
  Value* AttributeValue(const std::string& path) {
    auto it = attr_values_.find(path);
    if (it != attr_values_.end()) return it->second;
    auto dot = path.rfind('.');
    std::string parent_path = dot == std::string::npos ? "" : path.substr(0, dot);
    std::string name = dot == std::string::npos ? path : path.substr(dot + 1);
    Value* parent = AttributeValue(parent_path);
    EnsureModule(parent_path);
    c10::IValue value = originals_[parent_path].attr(name);
    if (value.isModule()) {
      EnsureModule(path);
    } else {
      EnsureAttribute(path);
    }
    Value* v = graph_->insertGetAttr(parent, name);
    attr_values_[path] = v;
    return v;
  }

  Value* Map(Value* v) {
    auto it = env_.find(v);
    if (it != env_.end()) return it->second;
    Node* n = v->node();
    if (n->kind() == prim::GetAttr) {
      auto path = AttributePath(v, mg_.self());
      TORCH_CHECK(path.has_value(), "attribute read not rooted at self");
      std::string p = absl::StrJoin(*path, ".");
      int tensor = mg_.TensorIndexOf(p);
      if (tensor >= 0 && stage_name_.count(tensor)) p = stage_name_[tensor];
      Value* out = AttributeValue(p);
      env_[v] = out;
      return out;
    }
    TORCH_CHECK(mg_.IsFree(n), "value ", v->debugName(), " (", n->kind().toQualString(),
                ") is not available in stage ", def_.index, " (partitioner bug)");
    Node* clone = graph_->createClone(n, [&](Value* in) { return Map(in); });
    graph_->insertNode(clone);
    for (size_t k = 0; k < n->outputs().size(); ++k) env_[n->output(k)] = clone->output(k);
    return env_.at(v);
  }

  const ModelGraph& mg_;
  const StageDefinition& def_;
  std::shared_ptr<torch::jit::CompilationUnit> cu_;
  torch::jit::Module root_;
  std::shared_ptr<Graph> graph_;
  std::unordered_map<std::string, torch::jit::Module> modules_;
  std::unordered_map<std::string, torch::jit::Module> originals_;
  std::unordered_map<std::string, Value*> attr_values_;
  std::unordered_set<std::string> registered_attrs_;
  std::map<std::string, int> registered_tensors_;
  std::unordered_map<int, std::string> stage_name_;
  std::unordered_map<Value*, Value*> env_;
};

}  // namespace

absl::StatusOr<BuiltStage> BuildStage(const ModelGraph& model_graph, const StageDefinition& stage) {
  return TorchCall(absl::StrCat("building stage ", stage.index),
                   [&] { return StageBuilder(model_graph, stage).Build(); },
                   absl::StatusCode::kInternal);
}

}  // namespace pippy::partition
