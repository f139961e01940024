// Analysis of an inlined forward() for cutting it into pipeline stages.
//
// The top-level nodes of the inlined graph are split into "free" nodes — constants,
// attribute reads (prim::GetAttr chains from self) and lists/tuples built only from
// those — which every stage that needs them rebuilds, and "ops", which belong to
// exactly one stage. A cut at position c (1 <= c < num_ops()) puts ops [0, c) in
// earlier stages and ops [c, ...) in later ones. A cut is legal when every value
// live across it is a tensor that no later op modifies in place.
//
// Thread safety: immutable after Build(); const methods may be called concurrently.
#ifndef PIPPY_PIPELINE_PARTITION_MODEL_GRAPH_H_
#define PIPPY_PIPELINE_PARTITION_MODEL_GRAPH_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "absl/status/statusor.h"
#include "pipeline/partition/inliner.h"
#include "torch/script.h"

namespace pippy::partition {

// A tensor attribute of the model (parameter, buffer or plain tensor attribute).
// Tied weights — one tensor under several names — are ONE entry.
struct ModelTensor {
  std::vector<std::string> names;  // in module order; names[0] is the canonical name
  at::Tensor tensor;
  bool is_parameter = false;
  bool is_buffer = false;
  bool written = false;  // forward modifies it in place (a KV cache, BatchNorm's running stats)
};

class ModelGraph {
 public:
  static absl::StatusOr<std::unique_ptr<ModelGraph>> Build(const torch::jit::Module& model);

  const torch::jit::Module& model() const { return model_; }
  torch::jit::Graph& graph() const { return *graph_; }
  torch::jit::Value* self() const { return graph_->inputs()[0]; }

  // Ops: top-level nodes that are not free, in graph order.
  int num_ops() const { return static_cast<int>(ops_.size()); }
  torch::jit::Node* op(int i) const { return ops_[i]; }
  const std::string& op_path(int i) const { return op_paths_[i]; }
  // Position of the op that is, or contains, `node`; num_ops() for the return node.
  int OpIndexOf(const torch::jit::Node* node) const;
  bool IsFree(const torch::jit::Node* node) const { return free_.count(node) > 0; }

  // Cut legality.
  bool IsLegalCut(int c) const { return c >= 1 && c < num_ops() && blocked_[c] == 0; }
  const std::vector<int>& legal_cuts() const { return legal_cuts_; }
  // OK for a legal cut; otherwise INVALID_ARGUMENT naming a value that blocks it.
  absl::Status ExplainCut(int c) const;
  // Number of leading module-path components shared by the ops either side of cut c:
  // 0 between top-level modules, 1 between blocks.3 and blocks.4, ... (lower is a
  // cleaner module boundary).
  int BoundaryDepth(int c) const;

  // Cut positions given by PipeSplit markers, and their module paths.
  const std::vector<int>& marker_cuts() const { return marker_cuts_; }
  const std::vector<std::string>& marker_paths() const { return marker_paths_; }

  // First and last op of every module path that runs ops (ancestors included).
  const std::map<std::string, std::pair<int, int>>& module_spans() const { return module_spans_; }

  // Every submodule path of the model ("" excluded), in module order.
  const std::vector<std::string>& module_paths() const { return module_paths_; }

  // Tensor attributes.
  const std::vector<ModelTensor>& tensors() const { return tensors_; }
  // Index into tensors() of an attribute path ("blocks.0.ln1.weight"), or -1.
  int TensorIndexOf(const std::string& path) const;
  // Tensor attribute paths read by op i (including nested blocks), as read.
  const std::vector<std::string>& tensor_reads(int i) const { return tensor_reads_[i]; }

  // Values (top-level) by position: definition op (-1 for model inputs) and the last
  // op that uses them (num_ops() when returned).
  struct ValueInfo {
    torch::jit::Value* value;
    int def;
    int last_use;
    int last_write;  // last op writing to it in place, -1 if none
  };
  const std::vector<ValueInfo>& values() const { return values_; }

 private:
  ModelGraph() = default;
  absl::Status Analyze();

  torch::jit::Module model_;
  std::shared_ptr<torch::jit::Graph> graph_;
  std::vector<SplitMarker> markers_;
  std::vector<torch::jit::Node*> ops_;
  std::vector<std::string> op_paths_;
  std::unordered_map<const torch::jit::Node*, int> op_index_;
  std::unordered_set<const torch::jit::Node*> free_;
  std::vector<int> blocked_;  // per cut position: number of values blocking it
  std::vector<int> legal_cuts_;
  std::vector<int> marker_cuts_;
  std::vector<std::string> marker_paths_;
  std::vector<std::string> module_paths_;
  std::map<std::string, std::pair<int, int>> module_spans_;
  std::vector<ModelTensor> tensors_;
  std::unordered_map<std::string, int> tensor_index_;
  std::vector<std::vector<std::string>> tensor_reads_;
  std::vector<ValueInfo> values_;
};

// Calls fn on `node` and every node nested in its blocks.
void ForEachNodeRecursive(torch::jit::Node* node, const std::function<void(torch::jit::Node*)>& fn);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_MODEL_GRAPH_H_
