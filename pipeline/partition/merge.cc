#include "pipeline/partition/merge.h"

#include <cstdio>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "caffe2/serialize/inline_container.h"
#include "absl/strings/str_split.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/torchio/model_records.h"

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

std::vector<int> Indices(const std::map<int, std::string>& stage_paths) {
  std::vector<int> out;
  for (const auto& entry : stage_paths) out.push_back(entry.first);
  return out;
}

}  // namespace

StageSource StageFiles(const std::map<int, std::string>& stage_paths) {
  return [stage_paths](int index) -> absl::StatusOr<StageTensors> {
    auto path = stage_paths.find(index);
    if (path == stage_paths.end()) return absl::InternalError(absl::StrCat("no file for stage ", index));
    PIPPY_ASSIGN_OR_RETURN(torch::jit::Module stage, torchio::LoadModel(path->second));
    StageTensors tensors;
    for (const auto& p : stage.named_parameters(true)) tensors.emplace_back(p.name, p.value);
    for (const auto& b : stage.named_buffers(true)) tensors.emplace_back(b.name, b.value);
    return tensors;
  };
}

absl::Status MergeStagesByRecords(const std::string& model_path, const std::map<int, std::string>& stage_paths,
                                  const std::string& out_path) {
  return MergeStagesByRecords(model_path, Indices(stage_paths), StageFiles(stage_paths), out_path);
}

absl::Status MergeStagesIntoModel(const std::string& model_path, const std::map<int, std::string>& stage_paths,
                                  const std::string& out_path) {
  return MergeStagesIntoModel(model_path, Indices(stage_paths), StageFiles(stage_paths), out_path);
}

absl::Status MergeStagesByRecords(const std::string& model_path, const std::vector<int>& stages,
                                  const StageSource& source, const std::string& out_path) {
  absl::StatusOr<std::unique_ptr<torchio::ModelRecords>> opened = torchio::ModelRecords::Open(model_path, "model");
  if (!opened.ok()) return absl::UnimplementedError(opened.status().message());
  torchio::ModelRecords& records = **opened;
  // Each model tensor by name; each storage key with the one tensor that owns it whole.
  std::map<std::string, at::Tensor> by_name;
  std::map<int64_t, const c10::TensorImpl*> owner;
  for (const auto& a : records.skeleton().named_attributes(/*recurse=*/true)) {
    if (!a.value.isTensor()) continue;
    const at::Tensor t = a.value.toTensor();
    by_name[a.name] = t;
    const int64_t key = records.KeyOf(t);
    if (key < 0) continue;
    const bool whole = t.storage_offset() == 0 && t.is_contiguous() &&
                       static_cast<size_t>(t.numel()) * t.element_size() == t.storage().nbytes();
    auto [it, fresh] = owner.emplace(key, t.unsafeGetTensorImpl());
    if (!whole || (!fresh && it->second != t.unsafeGetTensorImpl())) {
      return absl::UnimplementedError(absl::StrCat("'", a.name, "' does not own a whole storage of its own"));
    }
  }
  const std::string tmp = out_path + ".tmp";
  absl::Status s = TorchCall("writing the merged model", [&]() -> absl::Status {
    caffe2::serialize::PyTorchStreamReader& in = records.reader();
    caffe2::serialize::PyTorchStreamWriter out(tmp);
    out.setMinVersion(in.version());
    std::set<int64_t> written;
    for (int index : stages) {
      // One trained stage at a time.
      PIPPY_ASSIGN_OR_RETURN(StageTensors tensors, source(index));
      for (const auto& [name, value] : tensors) {
        auto target = by_name.find(name);
        if (target == by_name.end()) {
          return absl::InvalidArgumentError(absl::StrCat("the model has no tensor '", name, "' (stage ", index, ")"));
        }
        if (target->second.sizes() != value.sizes() || target->second.dtype() != value.dtype()) {
          return absl::InvalidArgumentError(absl::StrCat("'", name, "' has shape ", c10::str(target->second.sizes()),
                                                         " in the model but ", c10::str(value.sizes()), " in stage ",
                                                         index));
        }
        const int64_t key = records.KeyOf(target->second);
        if (key < 0 || !written.insert(key).second) continue;  // empty, or tied: written once
        const at::Tensor bytes = value.contiguous();
        out.writeRecord(absl::StrCat("data/", key), bytes.data_ptr(), bytes.nbytes());
      }
    }
    // Everything else as it was: code, pickles, constants, and untrained storages.
    for (const std::string& record : in.getAllRecords()) {
      if (record == "version" || record == ".data/version") continue;
      int64_t key = 0;
      if (absl::StartsWith(record, "data/") && absl::SimpleAtoi(record.substr(5), &key) && written.count(key) > 0) {
        continue;
      }
      auto [data, n] = in.getRecord(record);
      out.writeRecord(record, data.get(), n);
    }
    out.writeEndOfFile();
    return absl::OkStatus();
  });
  if (s.ok() && std::rename(tmp.c_str(), out_path.c_str()) != 0) {
    s = absl::UnavailableError(absl::StrCat("cannot rename '", tmp, "' to '", out_path, "'"));
  }
  if (!s.ok()) std::remove(tmp.c_str());
  return s;
}

absl::Status MergeStagesIntoModel(const std::string& model_path, const std::vector<int>& stages,
                                  const StageSource& source, const std::string& out_path) {
  PIPPY_ASSIGN_OR_RETURN(torch::jit::Module model, torchio::LoadModel(model_path));
  for (int index : stages) {
    // One stage at a time: it is released before the next is read.
    PIPPY_ASSIGN_OR_RETURN(StageTensors tensors, source(index));
    PIPPY_RETURN_IF_ERROR(TorchCall(absl::StrCat("merging trained stage ", index), [&]() -> absl::Status {
      torch::NoGradGuard no_grad;
      for (const auto& [name, value] : tensors) PIPPY_RETURN_IF_ERROR(CopyInto(model, name, value, index));
      return absl::OkStatus();
    }));
  }
  return torchio::SaveModule(model, out_path);
}

}  // namespace pippy::partition
