#include "pipeline/stage/data_source.h"

#include "ATen/ATen.h"
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/torchio/model_io.h"
#include "torch/csrc/jit/serialization/pickle.h"

namespace pippy::stage {
namespace {

c10::IValue Take(const c10::IValue& v, const at::Tensor& idx) {
  if (v.isTensor()) return v.toTensor().index_select(0, idx);
  return v;  // non-tensor arguments are the same for every batch
}

// Replica `part` of `parts` takes the part-th of `parts` contiguous equal slices of
// the step's batch.
at::Tensor Rows(int64_t step, int64_t batch, int64_t n, int part, int parts) {
  const int64_t slice = batch / parts;
  const int64_t begin = step * batch + part * slice;
  return at::remainder(at::arange(begin, begin + slice, at::kLong), n);
}

absl::StatusOr<c10::impl::GenericDict> LoadDict(absl::string_view bytes, const std::string& what) {
  if (bytes.size() < 4 || bytes.substr(0, 4) != absl::string_view("PK\x03\x04", 4)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": not a file written by torch.save (expected torch.save({\"inputs\": ..., \"targets\": ...}, path))"));
  }
  PIPPY_ASSIGN_OR_RETURN(c10::IValue loaded, torchio::PickleLoad(bytes, what));
  if (!loaded.isGenericDict()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": expected a dict {\"inputs\": ..., \"targets\": ...}"));
  }
  return loaded.toGenericDict();
}

}  // namespace

absl::StatusOr<DataSource> DataSource::FromBytes(absl::string_view bytes, const std::vector<std::string>& names) {
  PIPPY_ASSIGN_OR_RETURN(c10::impl::GenericDict dict, LoadDict(bytes, "data"));
  auto inputs = dict.find(std::string("inputs"));
  if (inputs == dict.end()) return absl::InvalidArgumentError("data: the dict has no \"inputs\" entry");
  PIPPY_ASSIGN_OR_RETURN(std::vector<c10::IValue> args,
                         torchio::ToForwardArguments(inputs->value(), names, "data \"inputs\""));
  auto targets = dict.find(std::string("targets"));
  return FromValues(std::move(args), targets != dict.end() ? targets->value() : c10::IValue(), names);
}

absl::StatusOr<DataSource> DataSource::FromExampleBytes(absl::string_view bytes, const std::vector<std::string>& names) {
  absl::StatusOr<DataSource> file = FromBytes(bytes, names);
  if (file.ok()) return file;
  absl::StatusOr<c10::IValue> v = torchio::PickleLoad(bytes, "data");
  if (!v.ok() || (v->isGenericDict() && v->toGenericDict().contains(std::string("inputs")))) return file;
  absl::StatusOr<std::vector<c10::IValue>> args = torchio::ToForwardArguments(*v, names, "data");
  if (!args.ok()) return file;
  return FromValues(std::move(*args), c10::IValue(), names);
}

absl::StatusOr<DataSource> DataSource::FromValues(std::vector<c10::IValue> inputs, c10::IValue targets,
                                                  const std::vector<std::string>& names) {
  if (inputs.size() != names.size()) {
    return absl::InvalidArgumentError(absl::StrCat("data: ", inputs.size(), " input(s) but forward() takes ",
                                                   names.size()));
  }
  DataSource ds;
  ds.names_ = names;
  ds.inputs_ = std::move(inputs);
  ds.target_ = std::move(targets);
  ds.num_samples_ = -1;
  auto count = [&](const c10::IValue& v, const std::string& what) -> absl::Status {
    if (!v.isTensor()) return absl::OkStatus();
    const at::Tensor& t = v.toTensor();
    // Expanded or overlapping views: found by fuzz/data_fuzz, as a share that did not
    // read back; quantized tensors: std::terminate from index_select.
    PIPPY_RETURN_IF_ERROR(torchio::CheckRowTensor(t, absl::StrCat("data: ", what)));
    if (ds.num_samples_ >= 0 && t.size(0) != ds.num_samples_) {
      return absl::InvalidArgumentError(absl::StrCat("data: ", what, " has ", t.size(0), " samples but others have ",
                                                     ds.num_samples_));
    }
    ds.num_samples_ = t.size(0);
    return absl::OkStatus();
  };
  for (size_t i = 0; i < ds.inputs_.size(); ++i) {
    PIPPY_RETURN_IF_ERROR(count(ds.inputs_[i], absl::StrCat("input '", names[i], "'")));
  }
  PIPPY_RETURN_IF_ERROR(count(ds.target_, "\"targets\""));
  if (ds.num_samples_ <= 0) return absl::InvalidArgumentError("data: no tensor with samples in \"inputs\"");
  return ds;
}

absl::StatusOr<std::string> DataSource::ShareBytes(const std::vector<int>& input_indices, bool with_targets) const {
  if (input_indices.empty() && !with_targets) return std::string();
  return TorchCall("writing a rank's share of the data", [&]() -> absl::StatusOr<std::string> {
    // Keyed by argument position: the rank knows the plan's inputs, not the model.
    c10::impl::GenericDict inputs(c10::IntType::get(), c10::AnyType::get());
    for (int i : input_indices) {
      if (i < 0 || i >= static_cast<int>(inputs_.size())) {
        return absl::InternalError(absl::StrCat("the plan reads model input ", i, " but forward() takes ",
                                                inputs_.size()));
      }
      inputs.insert(static_cast<int64_t>(i), inputs_[i]);
    }
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    dict.insert("inputs", inputs);
    if (with_targets && !target_.isNone()) dict.insert("targets", target_);
    dict.insert("num_samples", num_samples_);
    std::vector<char> bytes = torch::jit::pickle_save(dict);
    return std::string(bytes.begin(), bytes.end());
  });
}

absl::StatusOr<DataSource> DataSource::FromShareBytes(absl::string_view bytes, const std::vector<std::string>& names) {
  DataSource ds;
  ds.names_ = names;
  ds.inputs_.assign(names.size(), c10::IValue());
  if (bytes.empty()) {
    ds.num_samples_ = 1;
    return ds;
  }
  PIPPY_ASSIGN_OR_RETURN(c10::impl::GenericDict dict, LoadDict(bytes, "this rank's share of the data"));
  auto inputs = dict.find(std::string("inputs"));
  auto samples = dict.find(std::string("num_samples"));
  if (inputs == dict.end() || !inputs->value().isGenericDict() || samples == dict.end() ||
      !samples->value().isInt()) {
    return absl::InvalidArgumentError("this rank's share of the data lacks \"inputs\" or \"num_samples\"");
  }
  for (const auto& entry : inputs->value().toGenericDict()) {
    if (!entry.key().isInt() || entry.key().toInt() < 0 || entry.key().toInt() >= static_cast<int64_t>(names.size())) {
      return absl::InvalidArgumentError(absl::StrCat("data share: input keys must be positions below ", names.size()));
    }
    ds.inputs_[entry.key().toInt()] = entry.value();
  }
  auto targets = dict.find(std::string("targets"));
  if (targets != dict.end()) ds.target_ = targets->value();
  ds.num_samples_ = samples->value().toInt();
  if (ds.num_samples_ <= 0) return absl::InvalidArgumentError("data share: no samples");
  return ds;
}

std::vector<c10::IValue> DataSource::Inputs(int64_t step, int64_t batch, int replica, int replicas) const {
  at::Tensor idx = Rows(step, batch, num_samples_, replica, replicas);
  std::vector<c10::IValue> out;
  for (const auto& v : inputs_) out.push_back(Take(v, idx));
  return out;
}

c10::IValue DataSource::Target(int64_t step, int64_t batch, int replica, int replicas) const {
  if (target_.isNone()) return target_;
  return Take(target_, Rows(step, batch, num_samples_, replica, replicas));
}

}  // namespace pippy::stage
