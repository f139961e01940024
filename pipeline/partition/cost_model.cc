#include "pipeline/partition/cost_model.h"

#include <unordered_map>

#include "absl/strings/str_join.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/partition/forward_probe.h"
#include "torch/csrc/jit/api/function_impl.h"

namespace pippy::partition {
namespace {

using torch::jit::Node;
using torch::jit::Value;

// Runs the inlined forward once on a copy of the model and returns every top-level
// op output (by op index, output index).
absl::StatusOr<std::vector<std::vector<c10::IValue>>> CaptureOpOutputs(
    const ModelGraph& mg, const std::vector<c10::IValue>& inputs) {
  return TorchCall("running the example input through the model", [&]()
                       -> absl::StatusOr<std::vector<std::vector<c10::IValue>>> {
    auto graph = mg.graph().copy();
    // Graph::copy keeps node order: pair the ops of the copy with the original's.
    std::vector<Node*> copy_ops;
    {
      auto orig = mg.graph().nodes().begin();
      for (Node* n : graph->nodes()) {
        if (!mg.IsFree(*orig)) copy_ops.push_back(n);
        ++orig;
      }
    }
    std::vector<Value*> captured;
    for (Node* n : copy_ops) {
      for (Value* v : n->outputs()) captured.push_back(v);
    }
    torch::jit::WithInsertPoint guard(graph->return_node());
    Value* orig_out = graph->outputs()[0];
    graph->eraseOutput(0);
    std::vector<Value*> all = {orig_out};
    all.insert(all.end(), captured.begin(), captured.end());
    graph->registerOutput(graph->insertNode(graph->createTuple(all))->output());
    torch::jit::GraphFunction fn("pippy_capture", graph, nullptr);
    BufferSnapshot restore(mg.model());  // the model runs itself; its buffers are put back
    torch::jit::Stack stack;
    stack.push_back(mg.model()._ivalue());
    for (const auto& in : inputs) stack.push_back(in);
    torch::NoGradGuard no_grad;
    fn.run(stack);
    auto tuple = stack.back().toTuple();
    std::vector<std::vector<c10::IValue>> out(copy_ops.size());
    size_t k = 1;
    for (size_t i = 0; i < copy_ops.size(); ++i) {
      for (size_t j = 0; j < copy_ops[i]->outputs().size(); ++j) out[i].push_back(tuple->elements()[k++]);
    }
    return out;
  });
}

int64_t Numel(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().numel();
  int64_t n = 0;
  if (v.isTuple()) for (const auto& e : v.toTupleRef().elements()) n += Numel(e);
  if (v.isTensorList()) for (const at::Tensor& t : v.toTensorVector()) n += t.numel();
  return n;
}

}  // namespace

// Parameter bytes first read by each op (each tensor counted once).
std::vector<double> ParamCosts(const ModelGraph& mg) {
  std::vector<double> cost(mg.num_ops(), 0.0);
  std::vector<bool> seen(mg.tensors().size(), false);
  for (int i = 0; i < mg.num_ops(); ++i) {
    for (const std::string& p : mg.tensor_reads(i)) {
      int t = mg.TensorIndexOf(p);
      if (seen[t] || !mg.tensors()[t].is_parameter) continue;
      seen[t] = true;
      const at::Tensor& tensor = mg.tensors()[t].tensor;
      cost[i] += static_cast<double>(tensor.numel() * tensor.element_size());
    }
  }
  return cost;
}

// Estimated FLOPs of every op with the shapes of the example input: 2·MACs for matrix
// products and convolutions, a few per element for normalisations and softmax, one
// per output element otherwise.
absl::StatusOr<std::vector<double>> FlopCosts(const ModelGraph& mg,
                                              const std::vector<c10::IValue>& inputs) {
  PIPPY_ASSIGN_OR_RETURN(auto outputs, CaptureOpOutputs(mg, inputs));
  std::unordered_map<const Value*, at::Tensor> known;
  for (int i = 0; i < mg.num_ops(); ++i) {
    for (size_t j = 0; j < outputs[i].size(); ++j) {
      if (outputs[i][j].isTensor()) known[mg.op(i)->output(j)] = outputs[i][j].toTensor();
    }
  }
  for (size_t i = 1; i < mg.graph().inputs().size(); ++i) {
    if (inputs[i - 1].isTensor()) known[mg.graph().inputs()[i]] = inputs[i - 1].toTensor();
  }
  auto tensor_of = [&](const Value* v) -> const at::Tensor* {
    auto it = known.find(v);
    if (it != known.end()) return &it->second;
    if (v->node()->kind() == c10::prim::GetAttr) {
      auto path = AttributePath(v, mg.self());
      if (path) {
        int t = mg.TensorIndexOf(absl::StrJoin(*path, "."));
        if (t >= 0) return &mg.tensors()[t].tensor;
      }
    }
    return nullptr;
  };
  std::vector<double> cost(mg.num_ops(), 0.0);
  for (int i = 0; i < mg.num_ops(); ++i) {
    Node* n = mg.op(i);
    double out_numel = 0;
    for (const auto& o : outputs[i]) out_numel += static_cast<double>(Numel(o));
    const std::string kind = n->kind().toQualString();
    double flops = out_numel;
    const at::Tensor* a = n->inputs().size() > 0 ? tensor_of(n->input(0)) : nullptr;
    const at::Tensor* b = n->inputs().size() > 1 ? tensor_of(n->input(1)) : nullptr;
    if ((kind == "aten::linear") && b != nullptr && b->dim() == 2) {
      flops = 2.0 * out_numel * static_cast<double>(b->size(1));
    } else if ((kind == "aten::matmul" || kind == "aten::mm" || kind == "aten::bmm") && a && a->dim() >= 1) {
      flops = 2.0 * out_numel * static_cast<double>(a->size(-1));
    } else if (kind == "aten::addmm" && b && b->dim() == 2) {
      flops = 2.0 * out_numel * static_cast<double>(b->size(1));
    } else if ((kind == "aten::conv1d" || kind == "aten::conv2d" || kind == "aten::conv3d" ||
                kind == "aten::_convolution" || kind == "aten::convolution") && b && b->dim() >= 3) {
      flops = 2.0 * out_numel * static_cast<double>(b->numel() / b->size(0));
    } else if ((kind == "aten::conv_transpose1d" || kind == "aten::conv_transpose2d" ||
                kind == "aten::conv_transpose3d") && a && b && b->dim() >= 3) {
      flops = 2.0 * static_cast<double>(a->numel()) * static_cast<double>(b->numel() / b->size(0));
    } else if (kind == "aten::layer_norm" || kind == "aten::batch_norm" || kind == "aten::group_norm" ||
               kind == "aten::softmax" || kind == "aten::log_softmax" || kind == "aten::gelu") {
      flops = 5.0 * out_numel;
    } else if (!n->blocks().empty()) {
      // Control flow: count what its body computes once per output element.
      flops = std::max(out_numel, 1.0) * 2.0;
    }
    cost[i] = flops;
  }
  return cost;
}

}  // namespace pippy::partition
