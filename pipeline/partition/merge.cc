#include "pipeline/partition/merge.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/torchio/model_io.h"

namespace pippy::partition {
namespace {

// Copies `value` into the model's tensor `name` (a dotted path).
absl::Status CopyInto(torch::jit::Module& model, const std::string& name, const at::Tensor& value, int stage) {
  std::vector<std::string> path = absl::StrSplit(name, '.');
  torch::jit::Module owner = model;
  for (size_t i = 0; i + 1 < path.size(); ++i) {
    if (!owner.hasattr(path[i]) || !owner.attr(path[i]).isModule()) {
      return absl::InvalidArgumentError(absl::StrCat("the model has no '", name, "' (stage ", stage, ")"));
    }
    owner = owner.attr(path[i]).toModule();
  }
  if (!owner.hasattr(path.back()) || !owner.attr(path.back()).isTensor()) {
    return absl::InvalidArgumentError(absl::StrCat("the model has no tensor '", name, "' (stage ", stage, ")"));
  }
  at::Tensor target = owner.attr(path.back()).toTensor();
  if (target.sizes() != value.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' has shape ", c10::str(target.sizes()),
                                                   " in the model but ", c10::str(value.sizes()), " in stage ", stage));
  }
  target.copy_(value);
  return absl::OkStatus();
}

}  // namespace

absl::Status MergeStagesIntoModel(const std::string& model_path, const std::map<int, std::string>& stage_paths,
                                  const std::string& out_path) {
  PIPPY_ASSIGN_OR_RETURN(torch::jit::Module model, torchio::LoadModel(model_path));
  for (const auto& entry : stage_paths) {
    const int index = entry.first;
    const std::string& path = entry.second;
    // One stage at a time: it is released before the next is loaded.
    PIPPY_ASSIGN_OR_RETURN(torch::jit::Module stage, torchio::LoadModel(path));
    PIPPY_RETURN_IF_ERROR(TorchCall(absl::StrCat("merging trained stage ", index), [&]() -> absl::Status {
      torch::NoGradGuard no_grad;
      for (const auto& p : stage.named_parameters(true)) PIPPY_RETURN_IF_ERROR(CopyInto(model, p.name, p.value, index));
      for (const auto& b : stage.named_buffers(true)) PIPPY_RETURN_IF_ERROR(CopyInto(model, b.name, b.value, index));
      return absl::OkStatus();
    }));
  }
  return torchio::SaveModule(model, out_path);
}

}  // namespace pippy::partition
