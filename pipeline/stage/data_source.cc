#include "pipeline/stage/data_source.h"

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "common/torch_status.h"
#include "pipeline/partition/model_io.h"
#include "torch/csrc/jit/serialization/pickle.h"

namespace pippy::stage {
namespace {

c10::IValue Take(const c10::IValue& v, const at::Tensor& idx) {
  if (v.isTensor()) return v.toTensor().index_select(0, idx);
  return v;  // non-tensor arguments are the same for every batch
}

at::Tensor Rows(int64_t step, int64_t batch, int64_t n) {
  return at::remainder(at::arange(step * batch, (step + 1) * batch, at::kLong), n);
}

}  // namespace

absl::StatusOr<DataSource> DataSource::FromBytes(const std::string& bytes, const torch::jit::Module& model) {
  if (bytes.size() < 4 || bytes.compare(0, 4, "PK\x03\x04") != 0) {
    return absl::InvalidArgumentError(
        "data: not a file written by torch.save (expected torch.save({\"inputs\": ..., \"targets\": ...}, path))");
  }
  std::vector<char> data(bytes.begin(), bytes.end());
  auto loaded = TorchCall("data", [&] { return torch::jit::pickle_load(data); });
  if (!loaded.ok()) return loaded.status();
  if (!loaded->isGenericDict()) {
    return absl::InvalidArgumentError("data: expected a dict {\"inputs\": ..., \"targets\": ...}");
  }
  auto dict = loaded->toGenericDict();
  auto inputs = dict.find(std::string("inputs"));
  if (inputs == dict.end()) return absl::InvalidArgumentError("data: the dict has no \"inputs\" entry");
  DataSource ds;
  auto args = partition::ToForwardArguments(inputs->value(), model, "data \"inputs\"");
  if (!args.ok()) return args.status();
  ds.inputs_ = *args;
  auto targets = dict.find(std::string("targets"));
  if (targets != dict.end()) ds.target_ = targets->value();
  ds.num_samples_ = -1;
  auto count = [&](const c10::IValue& v, const std::string& what) -> absl::Status {
    if (!v.isTensor()) return absl::OkStatus();
    const at::Tensor& t = v.toTensor();
    if (t.dim() == 0) return absl::InvalidArgumentError(absl::StrCat("data: ", what, " is a scalar; samples go along dim 0"));
    if (ds.num_samples_ >= 0 && t.size(0) != ds.num_samples_) {
      return absl::InvalidArgumentError(absl::StrCat("data: ", what, " has ", t.size(0), " samples but others have ",
                                                     ds.num_samples_));
    }
    ds.num_samples_ = t.size(0);
    return absl::OkStatus();
  };
  auto names = partition::ForwardArgumentNames(model);
  for (size_t i = 0; i < ds.inputs_.size(); ++i) {
    absl::Status s = count(ds.inputs_[i], absl::StrCat("input '", names[i], "'"));
    if (!s.ok()) return s;
  }
  absl::Status s = count(ds.target_, "\"targets\"");
  if (!s.ok()) return s;
  if (ds.num_samples_ <= 0) return absl::InvalidArgumentError("data: no tensor with samples in \"inputs\"");
  return ds;
}

std::vector<c10::IValue> DataSource::Inputs(int64_t step, int64_t batch) const {
  at::Tensor idx = Rows(step, batch, num_samples_);
  std::vector<c10::IValue> out;
  for (const auto& v : inputs_) out.push_back(Take(v, idx));
  return out;
}

c10::IValue DataSource::Target(int64_t step, int64_t batch) const {
  if (target_.isNone()) return target_;
  return Take(target_, Rows(step, batch, num_samples_));
}

}  // namespace pippy::stage
