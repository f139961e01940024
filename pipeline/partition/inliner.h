// Inlines a scripted module's forward() into one flat graph.
//
// Every node of the result carries, in Node::scope(), the full path of the submodule
// whose code it came from ("blocks.3.attn.qkv"; "" for the root module). Submodule
// calls are resolved by following the prim::GetAttr chain of the callee back to
// `self` (torch::jit::Inline and Node::callstack() do not give ModuleList members
// their names). Parameters, buffers and other attributes stay prim::GetAttr chains
// from self, so `training` remains a real attribute.
//
// Calls to PipeSplit modules (class name "PipeSplit", an identity module users put
// into the model to mark a cut) are not inlined; they are reported as markers.
#ifndef PIPPY_PIPELINE_PARTITION_INLINER_H_
#define PIPPY_PIPELINE_PARTITION_INLINER_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "torch/script.h"

namespace pippy::partition {

// A PipeSplit marker: a cut goes right before `next` (a top-level node).
struct SplitMarker {
  std::string module_path;   // the PipeSplit module's path, e.g. "layers.3"
  torch::jit::Node* next;    // valid while the graph is not changed by passes
};

struct InlinedForward {
  // Input 0 is self (the model's class type), then forward()'s arguments.
  std::shared_ptr<torch::jit::Graph> graph;
  std::vector<SplitMarker> markers;
};

// Errors: INVALID_ARGUMENT naming the call that cannot be inlined (a module interface,
// a module not reached through attributes, a Python function) and what to change.
absl::StatusOr<InlinedForward> InlineForward(const torch::jit::Module& model);

// The submodule path a node was labelled with ("" for the root module).
std::string ModulePath(const torch::jit::Node* node);

// Attribute names from `self` to `value` if `value` is a prim::GetAttr chain from
// `self` (empty for self itself); nullopt otherwise.
std::optional<std::vector<std::string>> AttributePath(const torch::jit::Value* value,
                                                      const torch::jit::Value* self);

}  // namespace pippy::partition

#endif  // PIPPY_PIPELINE_PARTITION_INLINER_H_
