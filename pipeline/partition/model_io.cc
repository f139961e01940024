#include "pipeline/partition/model_io.h"

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "torch/csrc/jit/serialization/import.h"
#include "torch/csrc/jit/serialization/pickle.h"

namespace pippy::partition {
namespace {

constexpr char kHowToSave[] = "save the model with torch.jit.script(model).save(path)";

bool IsZip(const std::string& bytes) {
  return bytes.size() >= 4 && bytes.compare(0, 4, "PK\x03\x04") == 0;
}

}  // namespace

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "': no such file or not readable"));
  std::ostringstream buf;
  buf << in.rdbuf();
  if (in.bad()) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  return buf.str();
}

absl::StatusOr<torch::jit::Module> LoadModel(const std::string& path) {
  PIPPY_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  return LoadModelFromBytes(bytes, path);
}

absl::StatusOr<torch::jit::Module> LoadModelFromBytes(const std::string& bytes,
                                                      const std::string& name) {
  if (bytes.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' is empty, not a TorchScript archive: ", kHowToSave));
  }
  if (!IsZip(bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", name, "' is not a TorchScript archive (it is not a zip file): ", kHowToSave));
  }
  std::istringstream in(bytes);
  absl::StatusOr<torch::jit::Module> loaded =
      TorchCall(absl::StrCat("loading '", name, "'"),
                [&] { return torch::jit::load(in, c10::Device(c10::kCPU)); });
  if (!loaded.ok()) {
    std::string msg(loaded.status().message());
    if (absl::StrContains(msg, "central directory") || absl::StrContains(msg, "failed reading zip") ||
        absl::StrContains(msg, "file_size") || absl::StrContains(msg, "truncated")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", name, "' is truncated or corrupt (", msg, "): copy the file again or ", kHowToSave));
    }
    if (absl::StrContains(msg, "constants.pkl") || absl::StrContains(msg, "code/")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", name, "' looks like a torch.save() checkpoint, not a TorchScript archive: ",
          kHowToSave));
    }
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' is not a loadable TorchScript archive (", msg, "): ", kHowToSave));
  }
  if (!loaded->find_method("forward").has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' has no forward() method: pippy splits forward()"));
  }
  return loaded;
}

std::vector<std::string> ForwardArgumentNames(const torch::jit::Module& model) {
  std::vector<std::string> names;
  const auto& args = model.get_method("forward").function().getSchema().arguments();
  for (size_t i = 1; i < args.size(); ++i) names.push_back(args[i].name());
  return names;
}

absl::StatusOr<c10::IValue> LoadTorchSaved(const std::string& path) {
  PIPPY_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  if (!IsZip(bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' is not a file written by torch.save (expected its zip format; "
        "in Python: torch.save(value, path) with PyTorch >= 1.6)"));
  }
  std::vector<char> data(bytes.begin(), bytes.end());
  return TorchCall(absl::StrCat("reading '", path, "'"), [&] { return torch::jit::pickle_load(data); });
}

absl::StatusOr<std::vector<c10::IValue>> ToForwardArguments(const c10::IValue& value,
                                                            const torch::jit::Module& model,
                                                            const std::string& what) {
  std::vector<std::string> names = ForwardArgumentNames(model);
  std::vector<c10::IValue> args;
  if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    std::vector<std::string> unknown;
    for (const auto& entry : dict) {
      if (!entry.key().isString()) {
        return absl::InvalidArgumentError(
            absl::StrCat(what, ": dict keys must be forward() argument names (strings)"));
      }
      std::string key = entry.key().toStringRef();
      if (std::find(names.begin(), names.end(), key) == names.end()) unknown.push_back(key);
    }
    if (!unknown.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": unknown argument(s) ", absl::StrJoin(unknown, ", "), "; forward() takes (",
          absl::StrJoin(names, ", "), ")"));
    }
    for (const std::string& name : names) {
      auto it = dict.find(name);
      if (it == dict.end()) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": missing argument '", name,
                                                       "'; forward() takes (",
                                                       absl::StrJoin(names, ", "), ")"));
      }
      args.push_back(it->value());
    }
    return args;
  }
  if (value.isTuple()) {
    for (const auto& e : value.toTupleRef().elements()) args.push_back(e);
  } else if (value.isList() && names.size() != 1) {
    for (const auto& e : value.toListRef()) args.push_back(e);
  } else {
    args.push_back(value);
  }
  if (args.size() != names.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": holds ", args.size(), " value(s) but forward() takes ", names.size(), " (",
        absl::StrJoin(names, ", "), "); save a tuple in argument order or a dict by name"));
  }
  return args;
}

absl::StatusOr<std::vector<c10::IValue>> LoadExampleInputs(const std::string& path,
                                                           const torch::jit::Module& model) {
  PIPPY_ASSIGN_OR_RETURN(c10::IValue value, LoadTorchSaved(path));
  return ToForwardArguments(value, model, absl::StrCat("example input '", path, "'"));
}

}  // namespace pippy::partition
