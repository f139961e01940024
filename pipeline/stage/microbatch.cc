#include "pipeline/stage/microbatch.h"

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"

namespace pippy::stage {

absl::StatusOr<std::vector<std::vector<c10::IValue>>> SplitIntoMicrobatches(
    const std::vector<c10::IValue>& args, int n, const std::vector<ChunkSpec>& specs,
    const std::vector<std::string>& names) {
  if (n < 1) return absl::InvalidArgumentError("micro-batches must be at least 1");
  std::vector<std::vector<c10::IValue>> out(n);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string name = i < names.size() ? absl::StrCat("'", names[i], "'") : absl::StrCat("#", i);
    ChunkSpec spec = i < specs.size() ? specs[i] : ChunkSpec{};
    if (!args[i].isTensor() || spec.replicate) {
      for (int mb = 0; mb < n; ++mb) out[mb].push_back(args[i]);
      continue;
    }
    const at::Tensor& t = args[i].toTensor();
    if (t.dim() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("input ", name, " is a scalar tensor: nothing to split"));
    }
    int dim = spec.dim < 0 ? spec.dim + static_cast<int>(t.dim()) : spec.dim;
    if (dim < 0 || dim >= t.dim()) {
      return absl::InvalidArgumentError(absl::StrCat("input ", name, " has ", t.dim(), " dims; cannot split along dim ", spec.dim));
    }
    const int64_t size = t.size(dim);
    if (size < n) {
      return absl::InvalidArgumentError(absl::StrCat("the batch of input ", name, " has ", size,
                                                     " samples (dim ", dim, "), fewer than ", n,
                                                     " micro-batches: use a larger batch or fewer micro-batches"));
    }
    if (size % n != 0) {
      return absl::InvalidArgumentError(absl::StrCat("the batch of input ", name, " (", size, " samples, dim ", dim,
                                                     ") does not split into ", n,
                                                     " equal micro-batches: use a batch size divisible by ", n));
    }
    std::vector<at::Tensor> chunks = t.chunk(n, dim);
    for (int mb = 0; mb < n; ++mb) out[mb].push_back(chunks[mb]);
  }
  return out;
}

absl::StatusOr<c10::IValue> MergeMicrobatches(const std::vector<c10::IValue>& outputs) {
  if (outputs.empty()) return c10::IValue();
  const c10::IValue& first = outputs[0];
  if (first.isTensor()) {
    std::vector<at::Tensor> ts;
    for (const auto& o : outputs) {
      if (!o.isTensor()) return absl::InternalError("micro-batch outputs differ in structure");
      ts.push_back(o.toTensor());
    }
    if (ts[0].dim() == 0) return at::stack(ts).mean();
    return at::cat(ts, 0);
  }
  if (first.isTuple()) {
    const size_t k = first.toTupleRef().elements().size();
    std::vector<c10::IValue> merged;
    for (size_t j = 0; j < k; ++j) {
      std::vector<c10::IValue> col;
      for (const auto& o : outputs) col.push_back(o.toTupleRef().elements()[j]);
      auto m = MergeMicrobatches(col);
      if (!m.ok()) return m.status();
      merged.push_back(*m);
    }
    return c10::ivalue::Tuple::create(std::move(merged));
  }
  return first;
}

}  // namespace pippy::stage
