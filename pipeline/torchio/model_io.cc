#include "pipeline/torchio/model_io.h"

#include <malloc.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "c10/core/CPUAllocator.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "caffe2/serialize/file_adapter.h"
#include "caffe2/serialize/inline_container.h"
#include "caffe2/serialize/read_adapter_interface.h"
#include "torch/csrc/jit/frontend/error_report.h"
#include "torch/csrc/jit/serialization/export.h"
#include "torch/csrc/jit/serialization/import.h"
#include "torch/csrc/jit/serialization/import_read.h"
#include "torch/csrc/jit/serialization/pickle.h"
#include "torch/csrc/jit/serialization/storage_context.h"
#include "torch/csrc/jit/serialization/unpickler.h"

namespace pippy::torchio {
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

namespace {

// Reads a TorchScript archive in place from memory that outlives the load.
class ViewReadAdapter : public caffe2::serialize::ReadAdapterInterface {
 public:
  explicit ViewReadAdapter(absl::string_view bytes) : bytes_(bytes) {}
  size_t size() const override { return bytes_.size(); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= bytes_.size() || n == 0) return 0;  // an empty record's buffer may be null (request_fuzz, UBSan)
    n = std::min<size_t>(n, bytes_.size() - pos);
    std::memcpy(buf, bytes_.data() + pos, n);
    return n;
  }

 private:
  absl::string_view bytes_;
};

// The archive read by `reader` without its debug info (code/**.debug_pkl, the source
// ranges that map the code to the Python it came from), written to memory.
std::string WithoutDebugInfo(caffe2::serialize::PyTorchStreamReader& reader) {
  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) -> size_t {
    out.append(static_cast<const char*>(data), n);
    return n;
  });
  writer.setMinVersion(reader.version());
  for (const std::string& name : reader.getAllRecords()) {
    if (absl::EndsWith(name, ".debug_pkl") || name == "version" || name == ".data/version") continue;
    auto [data, size] = reader.getRecord(name);
    writer.writeRecord(name, data.get(), size);
  }
  writer.writeEndOfFile();
  return out;
}

// torch::jit::load, where a TorchScript compile error (torch::jit::ErrorReport) is loaded
// again without the archive's debug info before it is reported. The error's what()
// reads the debug info lazily to point at the original Python; with corrupt debug info
// that read throws inside what(), which is noexcept: the process would terminate. (A
// mutated archive did this under fuzz/model_fuzz.) Without debug info, what() reports
// the TorchScript code's own lines.
torch::jit::Module LoadReportingSafely(const std::function<std::shared_ptr<caffe2::serialize::ReadAdapterInterface>()>& open) {
  try {
    return torch::jit::load(open(), c10::Device(c10::kCPU));
  } catch (const torch::jit::ErrorReport&) {  // not e.what(): see above
  }
  caffe2::serialize::PyTorchStreamReader reader(open());
  const std::string stripped = WithoutDebugInfo(reader);
  return torch::jit::load(std::make_shared<ViewReadAdapter>(stripped), c10::Device(c10::kCPU));
}

// torch::jit::load, like pickle_load, sizes each storage by the element count the
// archive's pickle claims and fills it from the record, however short; there is no
// storage-context hook to give it the records' sizes as PickleLoad does. A storage the
// default CPU allocator made is a malloc'd block of the record's size, so glibc's
// malloc_usable_size tells whether the claim fits in it (storages from elsewhere are
// not checked).
absl::Status CheckStorageAllocation(const at::Tensor& t, const std::string& where) {
  if (!t.defined() || !t.has_storage()) return absl::OkStatus();
  const c10::Storage& s = t.storage();
  void* data = s.data_ptr().get();
  if (data == nullptr || s.nbytes() == 0 || s.data_ptr().get_context() != data ||
      s.data_ptr().get_deleter() != c10::GetCPUAllocator()->raw_deleter()) {
    return absl::OkStatus();
  }
  const size_t have = malloc_usable_size(data);
  if (have < s.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the archive claims ", s.nbytes(),
                                                   " bytes for this tensor's storage but holds only ", have,
                                                   " (corrupt archive, or not written by torch.jit.save)"));
  }
  return absl::OkStatus();
}

// Loads through `load` (from a file or from memory) and turns LibTorch's errors into
// messages that say what the file is and what to do.
absl::StatusOr<torch::jit::Module> LoadArchive(const std::string& name, absl::string_view head, uint64_t size,
                                               const std::function<torch::jit::Module()>& load,
                                               bool check_allocations = true) {
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' is empty, not a TorchScript archive: ", kHowToSave));
  }
  if (!IsZip(std::string(head.substr(0, 4)))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", name, "' is not a TorchScript archive (it is not a zip file): ", kHowToSave));
  }
  absl::StatusOr<torch::jit::Module> loaded = TorchCall(absl::StrCat("loading '", name, "'"), load);
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
  for (const auto& a : loaded->named_attributes(/*recurse=*/true)) {
    if (!a.value.isTensor()) continue;
    const std::string where = absl::StrCat("'", name, "': ", a.name);
    if (check_allocations) PIPPY_RETURN_IF_ERROR(CheckStorageAllocation(a.value.toTensor(), where));
    PIPPY_RETURN_IF_ERROR(CheckTensorsInStorage(a.value, where));
  }
  return loaded;
}

}  // namespace

absl::StatusOr<torch::jit::Module> LoadModel(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "': no such file or not readable"));
  char head[4] = {0, 0, 0, 0};
  in.read(head, 4);
  const std::streamsize got = in.gcount();
  in.close();
  std::error_code ec;
  const uint64_t size = std::filesystem::file_size(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("cannot read '", path, "': ", ec.message()));
  return LoadArchive(path, absl::string_view(head, static_cast<size_t>(got)), size,
                     [&] {
                       return LoadReportingSafely(
                           [&] { return std::make_shared<caffe2::serialize::FileAdapter>(path); });
                     });
}

absl::StatusOr<torch::jit::Module> LoadModelFromBytes(absl::string_view bytes, const std::string& name) {
  return LoadArchive(name, bytes, bytes.size(),
                     [&] { return LoadReportingSafely([&] { return std::make_shared<ViewReadAdapter>(bytes); }); });
}

absl::StatusOr<torch::jit::Module> LoadSkeletonFromBytes(absl::string_view bytes, const std::string& name) {
  return LoadArchive(
      name, bytes, bytes.size(),
      [&] { return LoadReportingSafely([&] { return std::make_shared<ViewReadAdapter>(bytes); }); },
      /*check_allocations=*/false);
}

absl::Status WriteModule(const torch::jit::Module& module,
                         const std::function<absl::Status(absl::string_view)>& sink) {
  absl::Status sink_error;
  absl::Status s = TorchCall("writing a TorchScript archive", [&] {
    // Once the sink fails (a cancelled job's sender stops), the rest is discarded but
    // reported as written: a short write makes PyTorchStreamWriter throw, and its
    // destructor then throws again while unwinding (std::terminate: it took the
    // coordinator down when a job was cancelled while its stages were streamed).
    torch::jit::ExportModule(module, [&](const void* data, size_t n) -> size_t {
      if (sink_error.ok()) sink_error = sink(absl::string_view(static_cast<const char*>(data), n));
      return n;
    });
  }, absl::StatusCode::kInternal);
  if (!sink_error.ok()) return sink_error;
  return s;
}

absl::Status SaveModule(const torch::jit::Module& module, const std::string& path) {
  const std::string tmp = absl::StrCat(path, ".tmp");
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", tmp, "'"));
    PIPPY_RETURN_IF_ERROR(WriteModule(module, [&](absl::string_view piece) -> absl::Status {
      out.write(piece.data(), static_cast<std::streamsize>(piece.size()));
      if (!out) return absl::UnavailableError(absl::StrCat("writing '", tmp, "' failed (disk full?)"));
      return absl::OkStatus();
    }));
    out.flush();
    if (!out) return absl::UnavailableError(absl::StrCat("writing '", tmp, "' failed (disk full?)"));
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot rename '", tmp, "' to '", path, "': ", ec.message()));
  return absl::OkStatus();
}

std::vector<std::string> ForwardArgumentNames(const torch::jit::Module& model) {
  std::vector<std::string> names;
  const auto& args = model.get_method("forward").function().getSchema().arguments();
  for (size_t i = 1; i < args.size(); ++i) names.push_back(args[i].name());
  return names;
}

namespace {

absl::Status CheckTensor(const at::Tensor& t, const std::string& where) {
  if (!t.defined() || t.numel() == 0) return absl::OkStatus();
  if (!t.has_storage()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a tensor without storage (corrupt file)"));
  }
  if (t.storage_offset() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a negative storage offset (corrupt file)"));
  }
  // The farthest element, in elements from the storage's start, with overflow checks.
  uint64_t last = static_cast<uint64_t>(t.storage_offset());
  for (int64_t d = 0; d < t.dim(); ++d) {
    const int64_t size = t.size(d), stride = t.stride(d);
    if (stride < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": a negative stride (corrupt file)"));
    const uint64_t reach = static_cast<uint64_t>(size - 1);
    if (stride > 0 && reach > (UINT64_MAX - last) / static_cast<uint64_t>(stride)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": sizes and strides overflow (corrupt file)"));
    }
    last += reach * static_cast<uint64_t>(stride);
  }
  const uint64_t item = static_cast<uint64_t>(t.element_size());
  const uint64_t have = static_cast<uint64_t>(t.storage().nbytes());
  if (last >= have / item) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a tensor of shape [", absl::StrJoin(t.sizes(), ", "),
                                                   "] reaches past its storage of ", have,
                                                   " bytes (corrupt file, or not written by PyTorch)"));
  }
  return absl::OkStatus();
}

absl::Status CheckValue(const c10::IValue& v, const std::string& where, int depth) {
  if (depth > 64) return absl::InvalidArgumentError(absl::StrCat(where, ": nested more than 64 levels deep"));
  if (v.isTensor()) return CheckTensor(v.toTensor(), where);
  if (v.isTuple()) {
    const auto& elems = v.toTupleRef().elements();
    for (size_t i = 0; i < elems.size(); ++i) {
      PIPPY_RETURN_IF_ERROR(CheckValue(elems[i], absl::StrCat(where, "[", i, "]"), depth + 1));
    }
  } else if (v.isList()) {
    const auto list = v.toListRef();
    for (size_t i = 0; i < list.size(); ++i) {
      PIPPY_RETURN_IF_ERROR(CheckValue(list[i], absl::StrCat(where, "[", i, "]"), depth + 1));
    }
  } else if (v.isGenericDict()) {
    for (const auto& e : v.toGenericDict()) {
      const std::string key = e.key().isString() ? e.key().toStringRef() : "?";
      PIPPY_RETURN_IF_ERROR(CheckValue(e.value(), absl::StrCat(where, "[\"", key, "\"]"), depth + 1));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckTensorsInStorage(const c10::IValue& value, const std::string& what) {
  return CheckValue(value, what, 0);
}

namespace {

uint64_t LE(absl::string_view b, size_t at, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[at + i])) << (8 * i);
  return v;
}

// Walks the zip's central directory: every entry's sizes within the archive.
absl::Status CheckZipClaims(absl::string_view b, const std::string& what) {
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a torch.save file: ", why));
  };
  // The end-of-central-directory record: in the last 64 KiB + 22 bytes.
  if (b.size() < 22) return bad("too short for a zip file");
  size_t eocd = absl::string_view::npos;
  for (size_t i = b.size() - 22 + 1; i-- > 0 && b.size() - i <= 65557;) {
    if (LE(b, i, 4) == 0x06054b50) {
      eocd = i;
      break;
    }
  }
  if (eocd == absl::string_view::npos) return bad("no zip directory (truncated?)");
  const uint64_t entries = LE(b, eocd + 10, 2), cd_size = LE(b, eocd + 12, 4), cd_at = LE(b, eocd + 16, 4);
  if (cd_at > b.size() || cd_size > b.size() - cd_at) return bad("its zip directory lies outside the file");
  size_t at = cd_at;
  for (uint64_t e = 0; e < entries; ++e) {
    if (at + 46 > cd_at + cd_size || LE(b, at, 4) != 0x02014b50) return bad("a corrupt zip directory");
    const uint64_t compressed = LE(b, at + 20, 4), size = LE(b, at + 24, 4);
    const uint64_t name = LE(b, at + 28, 2), extra = LE(b, at + 30, 2), comment = LE(b, at + 32, 2);
    if (compressed > b.size() || size > b.size()) {
      return bad(absl::StrCat("record '", b.substr(at + 46, std::min<uint64_t>(name, b.size() - at - 46)),
                              "' claims ", size, " bytes in a ", b.size(), "-byte file"));
    }
    at += 46 + name + extra + comment;
  }
  return absl::OkStatus();
}

// PickleLoad's body; `limits` set: PickleLoadUntrusted's checks first.
absl::StatusOr<c10::IValue> LoadPickled(absl::string_view bytes, const std::string& what,
                                        const PickleLimits* limits) {
  if (limits != nullptr && !IsZip(std::string(bytes.substr(0, 4)))) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a torch.save file (it is not a zip file; in Python: "
                                                   "torch.save(value, f) with PyTorch >= 1.6)"));
  }
  // A record claims its size in the zip's central directory, and reading it allocates
  // that much: none may claim more than the archive holds (torch.save stores records
  // uncompressed).
  if (limits != nullptr) PIPPY_RETURN_IF_ERROR(CheckZipClaims(bytes, what));
  absl::Status scanned = absl::OkStatus();
  PIPPY_ASSIGN_OR_RETURN(c10::IValue value, TorchCall(what, [&]() -> c10::IValue {
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<ViewReadAdapter>(bytes));
    if (!reader.hasRecord("data.pkl")) {
      scanned = absl::InvalidArgumentError(absl::StrCat(what, ": not a torch.save file (no data.pkl record)"));
      return c10::IValue();
    }
    auto [pkl, pkl_size] = reader.getRecord("data.pkl");
    absl::StatusOr<std::string> pickle =
        PickleForLibTorch(absl::string_view(static_cast<const char*>(pkl.get()), pkl_size), what, limits);
    if (!pickle.ok()) {
      scanned = pickle.status();
      return c10::IValue();
    }
    auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
    for (const std::string& name : reader.getAllRecords()) {
      if (!absl::StartsWith(name, "data/")) continue;  // data/<key>: a storage's bytes
      auto [data, size] = reader.getRecord(name);
      storages->addStorage(name.substr(5), c10::Storage(c10::Storage::use_byte_size_t(), size, std::move(data),
                                                        /*allocator=*/nullptr, /*resizable=*/false));
    }
    return UnpickleWithStorages(*pickle, reader.version(), storages, /*untrusted=*/limits != nullptr);
  }));
  PIPPY_RETURN_IF_ERROR(scanned);
  PIPPY_RETURN_IF_ERROR(CheckTensorsInStorage(value, what));
  return value;
}

}  // namespace

c10::IValue UnpickleWithStorages(const std::string& pickle, uint64_t version,
                                 std::shared_ptr<torch::jit::DeserializationStorageContext> storages,
                                 bool untrusted) {
  // Untrusted: no type tag reaches LibTorch's type parser (the scan allows none).
  auto no_types = [](const std::string& type) -> c10::TypePtr {
    throw std::runtime_error("type tags are not accepted in a request: " + type.substr(0, 64));
  };
  c10::TypePtr (*parser)(const std::string&) = untrusted ? +no_types : torch::jit::Unpickler::defaultTypeParser;
  // As torch::jit::readArchiveAndTensors, from the (rewritten) pickle.
  size_t read = 0;
  auto next = [&](char* buffer, size_t len) -> size_t {
    const size_t n = std::min(len, pickle.size() - read);
    if (n == 0) return 0;
    std::memcpy(buffer, pickle.data() + read, n);
    read += n;
    return n;
  };
  auto missing = [](const std::string& key) -> at::DataPtr {
    throw std::runtime_error("the pickle refers to storage '" + key.substr(0, 64) + "', which the file lacks");
  };
  torch::jit::Unpickler unpickler(next, nullptr, nullptr, missing, c10::nullopt, false, parser, std::move(storages));
  unpickler.set_version(version);
  return unpickler.parse_ivalue();
}

absl::Status CheckRowTensor(const at::Tensor& t, const std::string& what) {
  if (t.dim() == 0) return absl::InvalidArgumentError(absl::StrCat(what, " is a scalar; rows go along dim 0"));
  if (t.layout() != at::kStrided || !t.device().is_cpu() || c10::isQIntType(t.scalar_type()) ||
      t.scalar_type() == at::kComplexHalf) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " is a ", t.toString(), " tensor; only dense CPU tensors of a plain dtype are accepted"));
  }
  if (t.numel() > 0 && t.has_storage() &&
      static_cast<uint64_t>(t.numel()) * t.element_size() > static_cast<uint64_t>(t.storage().nbytes())) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is an expanded or overlapping view (", t.numel(),
                                                   " elements over ", t.storage().nbytes(),
                                                   " bytes); save it with .contiguous()"));
  }
  return absl::OkStatus();
}

absl::StatusOr<c10::IValue> PickleLoad(absl::string_view bytes, const std::string& what) {
  return LoadPickled(bytes, what, nullptr);
}

absl::StatusOr<c10::IValue> PickleLoadUntrusted(absl::string_view bytes, const std::string& what,
                                                const PickleLimits& limits) {
  return LoadPickled(bytes, what, &limits);
}

absl::StatusOr<c10::IValue> LoadTorchSaved(const std::string& path) {
  PIPPY_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  if (!IsZip(bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' is not a file written by torch.save (expected its zip format; "
        "in Python: torch.save(value, path) with PyTorch >= 1.6)"));
  }
  return PickleLoad(bytes, absl::StrCat("reading '", path, "'"));
}

absl::StatusOr<std::vector<c10::IValue>> ToForwardArguments(const c10::IValue& value,
                                                            const torch::jit::Module& model,
                                                            const std::string& what) {
  return ToForwardArguments(value, ForwardArgumentNames(model), what);
}

absl::StatusOr<std::vector<c10::IValue>> ToForwardArguments(const c10::IValue& value,
                                                            const std::vector<std::string>& names,
                                                            const std::string& what) {
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

std::string DtypeName(c10::ScalarType type) {
  switch (type) {
    case c10::kFloat: return "float32";
    case c10::kDouble: return "float64";
    case c10::kHalf: return "float16";
    case c10::kBFloat16: return "bfloat16";
    case c10::kLong: return "int64";
    case c10::kInt: return "int32";
    case c10::kShort: return "int16";
    case c10::kChar: return "int8";
    case c10::kByte: return "uint8";
    case c10::kBool: return "bool";
    default: return c10::toString(type);
  }
}

}  // namespace pippy::torchio
