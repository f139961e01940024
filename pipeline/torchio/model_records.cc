#include "pipeline/torchio/model_records.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "caffe2/serialize/file_adapter.h"
#include "caffe2/serialize/inline_container.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/torchio/model_io.h"

namespace pippy::torchio {
namespace {

constexpr char kDataDir[] = "data/";

uint64_t Le(const unsigned char* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Each record's size by name (without the archive's top folder), from the zip's
// central directory (zip64 too), read without reading the records. Errors: UNKNOWN for
// a directory that does not parse; INVALID_ARGUMENT for a record named twice.
// `compressed` (if set) gets the records stored compressed (torch.save never does).
absl::StatusOr<std::map<std::string, uint64_t>> RecordSizes(const std::string& path, const std::string& name,
                                                            std::set<std::string>* compressed = nullptr) {
  // A directory that does not parse (not a zip, truncated): UNKNOWN, for the whole
  // loader to say what the file is; a record listed twice: refused here.
  auto bad = [&](const std::string& why) {
    return absl::UnknownError(absl::StrCat("'", name, "': ", why));
  };
  std::ifstream f(path, std::ios::binary);
  f.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(f.tellg());
  const uint64_t tail_len = std::min<uint64_t>(size, 65536 + 22);
  std::string tail(tail_len, '\0');
  f.seekg(static_cast<std::streamoff>(size - tail_len));
  f.read(tail.data(), static_cast<std::streamsize>(tail_len));
  const auto* t = reinterpret_cast<const unsigned char*>(tail.data());
  int64_t eocd = -1;
  for (int64_t i = static_cast<int64_t>(tail_len) - 22; i >= 0; --i) {
    if (Le(t + i, 4) == 0x06054b50) {
      eocd = i;
      break;
    }
  }
  if (eocd < 0) return bad("no end of central directory");
  uint64_t entries = Le(t + eocd + 10, 2), dir_size = Le(t + eocd + 12, 4), dir_offset = Le(t + eocd + 16, 4);
  if (eocd >= 20 && Le(t + eocd - 20, 4) == 0x07064b50) {  // zip64: its end record holds the real figures
    const uint64_t z64 = Le(t + eocd - 20 + 8, 8);
    unsigned char rec[56];
    f.seekg(static_cast<std::streamoff>(z64));
    f.read(reinterpret_cast<char*>(rec), sizeof rec);
    if (!f || Le(rec, 4) != 0x06064b50) return bad("a zip64 end record that does not parse");
    entries = Le(rec + 32, 8);
    dir_size = Le(rec + 40, 8);
    dir_offset = Le(rec + 48, 8);
  }
  if (dir_offset + dir_size > size || dir_size > (uint64_t{1} << 30)) return bad("a central directory out of the file");
  std::string dir(dir_size, '\0');
  f.seekg(static_cast<std::streamoff>(dir_offset));
  f.read(dir.data(), static_cast<std::streamsize>(dir_size));
  if (!f) return bad("a central directory that cannot be read");
  std::map<std::string, uint64_t> out;
  const auto* d = reinterpret_cast<const unsigned char*>(dir.data());
  size_t at = 0;
  for (uint64_t e = 0; e < entries; ++e) {
    if (at + 46 > dir.size() || Le(d + at, 4) != 0x02014b50) return bad("a central directory entry that does not parse");
    uint64_t record_size = Le(d + at + 24, 4);
    const uint64_t method = Le(d + at + 10, 2);
    const size_t name_len = Le(d + at + 28, 2), extra_len = Le(d + at + 30, 2), comment_len = Le(d + at + 32, 2);
    if (at + 46 + name_len + extra_len + comment_len > dir.size()) return bad("a central directory entry past its end");
    std::string record(dir.data() + at + 46, name_len);
    if (record_size == 0xFFFFFFFFu) {  // the size is in the zip64 extra field
      for (size_t x = at + 46 + name_len; x + 4 <= at + 46 + name_len + extra_len;) {
        const uint64_t id = Le(d + x, 2), len = Le(d + x + 2, 2);
        if (id == 1 && len >= 8) record_size = Le(d + x + 4, 8);
        x += 4 + len;
      }
    }
    const size_t slash = record.find('/');
    if (slash != std::string::npos) record = record.substr(slash + 1);
    if (method != 0 && compressed != nullptr) compressed->insert(record);
    if (!out.emplace(record, record_size).second) {
      return absl::InvalidArgumentError(absl::StrCat("'", name, "' is corrupt (the record ", record,
                                                     " is listed twice): copy the file again, or save the model "
                                                     "with torch.jit.script(model).save(path)"));
    }
    at += 46 + name_len + extra_len + comment_len;
  }
  return out;
}

// Every tensor a module holds (parameters, buffers, tensor attributes), by name.
std::vector<std::pair<std::string, at::Tensor>> TensorsOf(const torch::jit::Module& module) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& a : module.named_attributes(/*recurse=*/true)) {
    if (a.value.isTensor() && a.value.toTensor().defined() && a.value.toTensor().has_storage()) {
      out.emplace_back(a.name, a.value.toTensor());
    }
  }
  return out;
}

}  // namespace

ModelRecords::~ModelRecords() = default;

absl::StatusOr<std::unique_ptr<ModelRecords>> ModelRecords::Open(const std::string& path, const std::string& name) {
  std::unique_ptr<ModelRecords> r(new ModelRecords());
  r->name_ = name;
  // The zip's directory first: a record listed twice is refused before anything reads it.
  absl::StatusOr<std::map<std::string, uint64_t>> listed = RecordSizes(path, name);
  if (!listed.ok()) return listed.status();
  const std::map<std::string, uint64_t>& sizes = *listed;
  std::string skeleton;
  bool numbered = true;
  // The archive with each storage record replaced by the 8 bytes of its key.
  absl::Status built = TorchCall(absl::StrCat("reading '", name, "'"), [&] {
    r->reader_ = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
        std::make_shared<caffe2::serialize::FileAdapter>(path));
    caffe2::serialize::PyTorchStreamWriter writer([&skeleton](const void* data, size_t n) {
      skeleton.append(static_cast<const char*>(data), n);
      return n;
    });
    writer.setMinVersion(r->reader_->version());
    for (const std::string& record : r->reader_->getAllRecords()) {
      if (record == "version" || record == ".data/version") continue;  // the writer writes its own
      int64_t key = 0;
      if (absl::StartsWith(record, kDataDir)) {
        if (!absl::SimpleAtoi(record.substr(sizeof(kDataDir) - 1), &key)) {
          numbered = false;
          return;
        }
        writer.writeRecord(record, &key, sizeof key);
        continue;
      }
      auto [bytes, n] = r->reader_->getRecord(record);
      writer.writeRecord(record, bytes.get(), n);
    }
    writer.writeEndOfFile();
  });
  if (!built.ok()) return absl::UnknownError(built.message());
  if (!numbered) {
    return absl::UnimplementedError(absl::StrCat("'", name, "' has storage records that are not numbered as "
                                                 "torch.jit.save numbers them"));
  }
  PIPPY_ASSIGN_OR_RETURN(r->skeleton_, LoadSkeletonFromBytes(skeleton, name));
  for (const auto& [tensor_name, t] : TensorsOf(r->skeleton_)) {
    const c10::Storage& s = t.storage();
    if (s.nbytes() == 0 || s.data() == nullptr) continue;  // an empty tensor: no record
    if (r->key_of_.count(s.unsafeGetStorageImpl()) > 0) continue;  // shared storage
    int64_t key = 0;
    std::memcpy(&key, s.data(), sizeof key);
    r->skeleton_storage_[key] = s;
    r->key_of_[s.unsafeGetStorageImpl()] = key;
    r->name_of_.emplace(key, tensor_name);
    // Each storage against its record, before any is read.
    const std::string record = absl::StrCat(kDataDir, key);
    auto found = sizes.find(record);
    if (found == sizes.end()) {
      return absl::InvalidArgumentError(absl::StrCat("'", name, "': ", tensor_name, ": its storage record ", record,
                                                     " is missing (corrupt archive)"));
    }
    if (found->second < s.nbytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "'", name, "': ", tensor_name, ": the archive claims ", s.nbytes(), " bytes for this tensor's storage but "
          "holds only ", found->second, " in its record ", record, " (corrupt archive, or not written by "
          "torch.jit.save)"));
    }
  }
  return r;
}

int64_t ModelRecords::KeyOf(const at::Tensor& t) const {
  if (!t.defined() || !t.has_storage()) return -1;
  auto it = key_of_.find(t.storage().unsafeGetStorageImpl());
  return it == key_of_.end() ? -1 : it->second;
}

absl::Status ModelRecords::Materialize(const torch::jit::Module& module) {
  return TorchCall(absl::StrCat("reading the tensors of '", name_, "'"), [&]() -> absl::Status {
    for (auto& [tensor_name, t] : TensorsOf(module)) {
      auto known = key_of_.find(t.storage().unsafeGetStorageImpl());
      if (known == key_of_.end()) continue;  // not from the archive's records
      const int64_t key = known->second;
      auto lent = lent_.find(key);
      if (lent == lent_.end()) {
        const c10::Storage& skeleton = skeleton_storage_.at(key);
        const std::string record = absl::StrCat(kDataDir, key);
        if (!reader_->hasRecord(record)) {
          return absl::InvalidArgumentError(absl::StrCat("'", name_, "': ", name_of_.at(key), ": its storage record ",
                                                         record, " is missing (corrupt archive)"));
        }
        auto [bytes, n] = reader_->getRecord(record);
        if (n < skeleton.nbytes()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "'", name_, "': ", name_of_.at(key), ": the archive claims ", skeleton.nbytes(),
              " bytes for this tensor's storage but holds only ", n, " in its record ", record,
              " (corrupt archive, or not written by torch.jit.save)"));
        }
        c10::Storage real(c10::Storage::use_byte_size_t(), skeleton.nbytes(), std::move(bytes), nullptr, false);
        lent = lent_.emplace(key, real).first;
        key_of_[real.unsafeGetStorageImpl()] = key;
      }
      t.unsafeGetTensorImpl()->set_storage_keep_dtype(lent->second);
    }
    return absl::OkStatus();
  });
}

void ModelRecords::Dematerialize(const torch::jit::Module& module) {
  for (auto& [tensor_name, t] : TensorsOf(module)) {
    auto known = key_of_.find(t.storage().unsafeGetStorageImpl());
    if (known == key_of_.end()) continue;
    auto lent = lent_.find(known->second);
    if (lent == lent_.end() || lent->second.unsafeGetStorageImpl() != t.storage().unsafeGetStorageImpl()) continue;
    t.unsafeGetTensorImpl()->set_storage_keep_dtype(skeleton_storage_.at(known->second));
  }
  for (const auto& [key, storage] : lent_) key_of_.erase(storage.unsafeGetStorageImpl());
  lent_.clear();
}

absl::StatusOr<SavedSkeleton> LoadSavedSkeleton(const std::string& path, const std::string& what) {
  auto bad = [&](const std::string& why) { return absl::InvalidArgumentError(absl::StrCat(what, ": ", why)); };
  {
    std::ifstream f(path, std::ios::binary);
    char magic[4] = {};
    if (!f.read(magic, 4) || std::memcmp(magic, "PK\x03\x04", 4) != 0) {
      return bad("not a file written by torch.save (expected its zip format; in Python: torch.save(value, path))");
    }
  }
  std::set<std::string> compressed;
  absl::StatusOr<std::map<std::string, uint64_t>> sizes = RecordSizes(path, what, &compressed);
  if (!sizes.ok()) return bad(std::string(sizes.status().message()));
  SavedSkeleton out;
  absl::Status scanned = absl::OkStatus();
  PIPPY_ASSIGN_OR_RETURN(out.value, TorchCall(what, [&]() -> c10::IValue {
    caffe2::serialize::PyTorchStreamReader reader(std::make_shared<caffe2::serialize::FileAdapter>(path));
    if (!reader.hasRecord("data.pkl")) {
      scanned = bad("not a torch.save file (no data.pkl record)");
      return c10::IValue();
    }
    auto [pkl, pkl_size] = reader.getRecord("data.pkl");
    PickleLimits limits;
    limits.max_bytes = 1 << 20;
    absl::StatusOr<std::string> pickle =
        PickleForLibTorch(absl::string_view(static_cast<const char*>(pkl.get()), pkl_size), what, &limits);
    if (!pickle.ok()) {
      scanned = pickle.status();
      return c10::IValue();
    }
    // Every storage claims its record's size and points at no data: 8 bytes shared by
    // all, which nothing reads (the dataset preads rows from the records' offsets).
    static char kNoData[8];
    auto storages = std::make_shared<torch::jit::DeserializationStorageContext>();
    for (const auto& [record, size] : *sizes) {
      if (!absl::StartsWith(record, kDataDir)) continue;
      if (compressed.count(record) > 0) {
        scanned = bad(absl::StrCat("its record ", record, " is compressed; write the file with torch.save"));
        return c10::IValue();
      }
      c10::Storage storage(c10::Storage::use_byte_size_t(), size, c10::DataPtr(kNoData, c10::Device(c10::kCPU)),
                           /*allocator=*/nullptr, /*resizable=*/false);
      out.records[storage.unsafeGetStorageImpl()] = SavedSkeleton::Record{
          static_cast<int64_t>(reader.getRecordOffset(record)), static_cast<int64_t>(size)};
      storages->addStorage(record.substr(sizeof(kDataDir) - 1), storage);
    }
    return UnpickleWithStorages(*pickle, reader.version(), storages, /*untrusted=*/true);
  }));
  PIPPY_RETURN_IF_ERROR(scanned);
  PIPPY_RETURN_IF_ERROR(CheckTensorsInStorage(out.value, what));
  return out;
}

}  // namespace pippy::torchio
