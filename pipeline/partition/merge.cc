#include "pipeline/partition/merge.h"

#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/partition/model_io.h"

namespace pippy::partition {

absl::StatusOr<std::string> MergeStagesIntoModel(const std::string& model_bytes,
                                                 const std::map<int, std::string>& stages) {
  PIPPY_ASSIGN_OR_RETURN(torch::jit::Module model, LoadModelFromBytes(model_bytes, "model"));
  return TorchCall("merging trained stages", [&]() -> absl::StatusOr<std::string> {
    torch::NoGradGuard no_grad;
    for (const auto& [index, bytes] : stages) {
      PIPPY_ASSIGN_OR_RETURN(torch::jit::Module stage, LoadModelFromBytes(bytes, absl::StrCat("stage ", index)));
      auto copy = [&](const std::string& name, const at::Tensor& value) -> absl::Status {
        std::vector<std::string> path = absl::StrSplit(name, '.');
        torch::jit::Module owner = model;
        for (size_t i = 0; i + 1 < path.size(); ++i) {
          if (!owner.hasattr(path[i])) return absl::InvalidArgumentError(absl::StrCat("the model has no '", name, "'"));
          owner = owner.attr(path[i]).toModule();
        }
        if (!owner.hasattr(path.back()) || !owner.attr(path.back()).isTensor()) {
          return absl::InvalidArgumentError(absl::StrCat("the model has no tensor '", name, "'"));
        }
        at::Tensor target = owner.attr(path.back()).toTensor();
        if (target.sizes() != value.sizes()) {
          return absl::InvalidArgumentError(absl::StrCat("'", name, "' has shape ", c10::str(target.sizes()),
                                                         " in the model but ", c10::str(value.sizes()), " in stage ", index));
        }
        target.copy_(value);
        return absl::OkStatus();
      };
      for (const auto& p : stage.named_parameters(true)) PIPPY_RETURN_IF_ERROR(copy(p.name, p.value));
      for (const auto& b : stage.named_buffers(true)) PIPPY_RETURN_IF_ERROR(copy(b.name, b.value));
    }
    std::ostringstream out;
    model.save(out);
    return out.str();
  });
}

}  // namespace pippy::partition
