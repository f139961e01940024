#include "pipeline/stage/dataset.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <new>

#include "ATen/ATen.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "common/status.h"
#include "common/torch_status.h"
#include "pipeline/torchio/model_io.h"
#include "pipeline/torchio/model_records.h"

namespace pippy::stage {
namespace fs = std::filesystem;
namespace {

constexpr size_t kMaxShards = 1 << 20;
constexpr int64_t kMaxManifestBytes = 256 << 20;
constexpr size_t kMaxOpenFiles = 64;

absl::Status Bad(const std::string& why) { return absl::InvalidArgumentError(absl::StrCat("dataset: ", why)); }

int TokenWidth(TokenDtype dtype) { return dtype == TOKEN_DTYPE_UINT32 ? 4 : 2; }
const char* TokenName(TokenDtype dtype) { return dtype == TOKEN_DTYPE_UINT32 ? "uint32" : "uint16"; }

// The shards' paths (resolved) in order, and whether they are token streams.
struct ShardList {
  std::vector<std::string> paths;
  bool tokens = false;
};

absl::StatusOr<bool> KindOf(const fs::path& p) {
  if (p.extension() == ".bin") return true;
  if (p.extension() == ".pt") return false;
  return Bad(absl::StrCat("'", p.string(), "' is neither a token stream (*.bin) nor a tensor shard (*.pt)"));
}

absl::StatusOr<ShardList> ListShards(const std::string& path, const std::vector<std::string>& roots) {
  PIPPY_RETURN_IF_ERROR(CheckUnderRoots(path, roots));
  std::error_code ec;
  ShardList out;
  std::vector<fs::path> listed;
  if (fs::is_directory(path, ec)) {
    for (const fs::directory_entry& e : fs::directory_iterator(path, ec)) {
      const fs::path& p = e.path();
      if ((p.extension() == ".bin" || p.extension() == ".pt") && e.is_regular_file(ec)) listed.push_back(p);
      if (listed.size() > kMaxShards) return Bad(absl::StrCat("'", path, "' holds more than ", kMaxShards, " shards"));
    }
    if (ec) return Bad(absl::StrCat("cannot list '", path, "': ", ec.message()));
    std::sort(listed.begin(), listed.end());
    if (listed.empty()) {
      return Bad(absl::StrCat("the folder '", path, "' holds no shards: token streams are *.bin files, tensor shards "
                              "*.pt files (torch.save({\"inputs\": ..., \"targets\": ...}))"));
    }
  } else {
    // A manifest: one shard per line.
    if (fs::file_size(path, ec) > static_cast<uintmax_t>(kMaxManifestBytes)) {
      return Bad(absl::StrCat("the manifest '", path, "' is larger than ", kMaxManifestBytes >> 20, " MiB"));
    }
    std::ifstream f(path);
    if (!f) return Bad(absl::StrCat("cannot read the manifest '", path, "'"));
    const fs::path base = fs::path(path).parent_path();
    std::string line;
    while (std::getline(f, line)) {
      const absl::string_view entry = absl::StripAsciiWhitespace(line);
      if (entry.empty() || entry[0] == '#') continue;
      fs::path p(std::string{entry});
      listed.push_back(p.is_absolute() ? p : base / p);
      if (listed.size() > kMaxShards) return Bad(absl::StrCat("'", path, "' lists more than ", kMaxShards, " shards"));
    }
    if (listed.empty()) return Bad(absl::StrCat("the manifest '", path, "' lists no shards (one path per line)"));
  }
  PIPPY_ASSIGN_OR_RETURN(out.tokens, KindOf(listed[0]));
  for (const fs::path& p : listed) {
    PIPPY_ASSIGN_OR_RETURN(bool tokens, KindOf(p));
    if (tokens != out.tokens) {
      return Bad(absl::StrCat("'", path, "' mixes token streams (*.bin) and tensor shards (*.pt), e.g. '",
                              listed[0].string(), "' and '", p.string(), "': use one kind"));
    }
    if (!fs::is_regular_file(p, ec)) return Bad(absl::StrCat("the shard '", p.string(), "' is not a readable file"));
    PIPPY_RETURN_IF_ERROR(CheckUnderRoots(p.string(), roots));
    out.paths.push_back(fs::canonical(p, ec).string());
  }
  return out;
}

// The shards' files, opened when first read; at most kMaxOpenFiles stay open.
class ShardFiles {
 public:
  explicit ShardFiles(const DatasetLayout& layout) : layout_(layout) {}
  ~ShardFiles() {
    for (const auto& [s, fd] : open_) close(fd);
  }
  ShardFiles(const ShardFiles&) = delete;
  ShardFiles& operator=(const ShardFiles&) = delete;

  const std::string& path(int s) const { return layout_.shards(s).path(); }

  // Checks every shard is there with the size it was indexed with.
  absl::Status CheckSizes(const std::vector<std::string>& roots) const {
    for (const DatasetShard& shard : layout_.shards()) {
      PIPPY_RETURN_IF_ERROR(CheckUnderRoots(shard.path(), roots));
      struct stat st;
      if (stat(shard.path().c_str(), &st) != 0) {
        return absl::FailedPreconditionError(absl::StrCat("dataset: the shard '", shard.path(), "' is gone since the "
                                                          "job was submitted (", std::strerror(errno), ")"));
      }
      if (st.st_size != shard.bytes()) {
        return absl::FailedPreconditionError(absl::StrCat("dataset: the shard '", shard.path(), "' is ", st.st_size,
                                                          " bytes, ", shard.bytes(), " when the job was submitted: "
                                                          "a dataset must not change under a job"));
      }
    }
    return absl::OkStatus();
  }

  // `n` bytes at `offset` of shard `s` into `to`. Errors: DATA_LOSS naming the shard.
  // Tries the page cache first (preadv2 RWF_NOWAIT) and counts in misses() the reads
  // that had to wait for the disk.
  absl::Status Read(int s, int64_t offset, int64_t n, void* to) {
    PIPPY_ASSIGN_OR_RETURN(int fd, Fd(s));
    auto* p = static_cast<char*>(to);
    if (nowait_ && n > 0) {
      struct iovec v = {p, static_cast<size_t>(n)};
      const ssize_t got = preadv2(fd, &v, 1, offset, RWF_NOWAIT);
      if (got > 0) {
        p += got;
        offset += got;
        n -= got;
        bytes_read_ += got;
      } else if (got < 0 && errno == EOPNOTSUPP) {
        nowait_ = false;  // this file system has no RWF_NOWAIT reads: every read counts as a miss
      }
      if (n > 0) ++misses_;
    } else if (n > 0) {
      ++misses_;
    }
    while (n > 0) {
      const ssize_t got = pread(fd, p, static_cast<size_t>(n), offset);
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        return absl::DataLossError(absl::StrCat("dataset: reading ", n, " bytes at byte ", offset, " of the shard '",
                                                path(s), "' failed: ",
                                                got < 0 ? std::strerror(errno) : "the file is shorter than indexed"));
      }
      p += got;
      offset += got;
      n -= got;
      bytes_read_ += got;
    }
    return absl::OkStatus();
  }

  // Reads that were not all in the page cache.
  int64_t misses() const { return misses_; }
  int64_t bytes_read() const { return bytes_read_; }

  // Asks the kernel to start reading `n` bytes at `offset` of shard `s` into the page
  // cache now (posix_fadvise WILLNEED: it returns without waiting). Only a hint: a
  // shard that cannot be opened is left to Read to report.
  void Prefetch(int s, int64_t offset, int64_t n) {
    absl::StatusOr<int> fd = Fd(s);
    if (fd.ok()) posix_fadvise(*fd, offset, n, POSIX_FADV_WILLNEED);
  }

 private:
  absl::StatusOr<int> Fd(int s) {
    if (auto it = open_.find(s); it != open_.end()) return it->second;
    if (open_.size() >= kMaxOpenFiles) {
      for (const auto& [k, fd] : open_) close(fd);
      open_.clear();
    }
    const int fd = open(path(s).c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      return absl::FailedPreconditionError(absl::StrCat("dataset: cannot open the shard '", path(s), "': ",
                                                        std::strerror(errno)));
    }
    open_[s] = fd;
    return fd;
  }

  const DatasetLayout& layout_;
  std::map<int, int> open_;  // shard -> fd
  int64_t bytes_read_ = 0;
  int64_t misses_ = 0;
  bool nowait_ = true;
};

// The shard holding item `item` (a token or a row) of the stream, and its place there.
std::pair<int, int64_t> Locate(const std::vector<int64_t>& starts, int64_t item) {
  const auto it = std::upper_bound(starts.begin(), starts.end(), item);
  const int s = static_cast<int>(it - starts.begin()) - 1;
  return {s, item - starts[static_cast<size_t>(s)]};
}

std::vector<int64_t> Starts(const DatasetLayout& layout) {
  std::vector<int64_t> starts;
  int64_t at = 0;
  for (const DatasetShard& shard : layout.shards()) {
    starts.push_back(at);
    at += shard.rows();
  }
  return starts;
}

// int64 buffers for a token reader's batches, recycled: a batch's tensors keep their
// buffer until the pipeline drops the last view of them (any thread), and the next
// batch reuses it. Fresh buffers of a batch's size come from mmap and are paid for
// again in page faults at every step (on VMs, more than the reading itself).
// At most kKeep buffers wait here; a batch of another size frees them.
class BufferPool : public std::enable_shared_from_this<BufferPool> {
 public:
  static constexpr size_t kKeep = 8;

  at::Tensor Empty(int64_t rows, int64_t cols) {
    const size_t bytes = static_cast<size_t>(rows * cols) * sizeof(int64_t);
    void* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes != bytes_) {
        for (void* f : free_) std::free(f);
        free_.clear();
        bytes_ = bytes;
      }
      if (!free_.empty()) {
        p = free_.back();
        free_.pop_back();
      }
    }
    if (p == nullptr) p = std::aligned_alloc(64, (std::max<size_t>(bytes, 64) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    std::shared_ptr<BufferPool> self = shared_from_this();
    return at::from_blob(p, {rows, cols}, [self, bytes](void* q) { self->Return(q, bytes); },
                         at::TensorOptions().dtype(at::kLong));
  }

  ~BufferPool() {
    for (void* f : free_) std::free(f);
  }

 private:
  void Return(void* p, size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (bytes == bytes_ && free_.size() < kKeep) {
        free_.push_back(p);
        return;
      }
    }
    std::free(p);
  }

  std::mutex mu_;
  size_t bytes_ = 0;
  std::vector<void*> free_;
};

// A tensor shard's columns: forward()'s arguments, then the targets (last; None when
// the shard has none). A tensor column is read row by row from its record.
struct Column {
  bool tensor = false;
  c10::IValue constant;        // a non-tensor argument: the same for every sample
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> row_shape;
  int64_t row_bytes = 0;
  int64_t offset = 0;          // of row 0 in the shard's file
  int64_t rows = 0;
};

std::string Signature(const Column& c) {
  if (!c.tensor) return c.constant.isNone() ? "none" : c.constant.tagKind();
  return absl::StrCat(torchio::DtypeName(c.dtype), "[rows, ", absl::StrJoin(c.row_shape, ", "), "]");
}

// A tensor shard's columns, from its skeleton (no rows read). Errors: INVALID_ARGUMENT
// naming the shard.
absl::StatusOr<std::vector<Column>> ReadColumns(const std::string& path,
                                                const std::vector<std::string>& argument_names) {
  const std::string what = absl::StrCat("dataset: the shard '", path, "'");
  PIPPY_ASSIGN_OR_RETURN(torchio::SavedSkeleton skeleton, torchio::LoadSavedSkeleton(path, what));
  if (!skeleton.value.isGenericDict()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " is not a dict {\"inputs\": ..., \"targets\": ...}"));
  }
  const c10::impl::GenericDict dict = skeleton.value.toGenericDict();
  auto inputs = dict.find(std::string("inputs"));
  if (inputs == dict.end()) return absl::InvalidArgumentError(absl::StrCat(what, " has no \"inputs\" entry"));
  PIPPY_ASSIGN_OR_RETURN(std::vector<c10::IValue> values,
                         torchio::ToForwardArguments(inputs->value(), argument_names, absl::StrCat(what, " \"inputs\"")));
  auto targets = dict.find(std::string("targets"));
  values.push_back(targets != dict.end() ? targets->value() : c10::IValue());
  std::vector<Column> columns;
  int64_t rows = -1;
  for (size_t i = 0; i < values.size(); ++i) {
    const std::string name =
        i < argument_names.size() ? absl::StrCat("input '", argument_names[i], "'") : std::string("\"targets\"");
    Column c;
    if (!values[i].isTensor()) {
      c.constant = values[i];
      columns.push_back(std::move(c));
      continue;
    }
    const at::Tensor t = values[i].toTensor();
    PIPPY_RETURN_IF_ERROR(torchio::CheckRowTensor(t, absl::StrCat(what, ": ", name)));
    if (!t.is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", name, " is not contiguous; save it with "
                                                     ".contiguous() so that its rows can be read one by one"));
    }
    auto record = skeleton.records.find(t.storage().unsafeGetStorageImpl());
    if (record == skeleton.records.end()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", name, " has no storage record"));
    }
    c.tensor = true;
    c.dtype = t.scalar_type();
    c.row_shape.assign(t.sizes().begin() + 1, t.sizes().end());
    c.rows = t.size(0);
    c.row_bytes = t.size(0) > 0 ? t.numel() / t.size(0) * static_cast<int64_t>(t.element_size()) : 0;
    c.offset = record->second.offset + t.storage_offset() * static_cast<int64_t>(t.element_size());
    if (rows >= 0 && c.rows != rows) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", name, " has ", c.rows, " rows but the shard's other "
                                                     "columns have ", rows));
    }
    rows = c.rows;
    columns.push_back(std::move(c));
  }
  if (rows < 0) return absl::InvalidArgumentError(absl::StrCat(what, " has no tensor with rows in \"inputs\""));
  return columns;
}

absl::Status SameColumns(const std::vector<Column>& first, const std::string& first_path,
                         const std::vector<Column>& other, const std::string& other_path,
                         const std::vector<std::string>& argument_names) {
  for (size_t i = 0; i < first.size(); ++i) {
    const std::string a = Signature(first[i]), b = Signature(other[i]);
    if (a == b) continue;
    const std::string name =
        i < argument_names.size() ? absl::StrCat("input '", argument_names[i], "'") : std::string("\"targets\"");
    return Bad(absl::StrCat("the shard '", other_path, "' has ", name, " as ", b, " but '", first_path, "' has ", a,
                            ": every shard's columns must be alike"));
  }
  return absl::OkStatus();
}

}  // namespace

// ---- the two formats ----------------------------------------------------------------

class Dataset::Format {
 public:
  virtual ~Format() = default;
  // The samples `indices`, as a Batch of `num_arguments` inputs.
  virtual absl::StatusOr<Batch> Read(const std::vector<int64_t>& indices) = 0;
  // Starts reading the samples `indices` into the page cache without waiting (a hint:
  // errors are left to Read). Returns the bytes asked for.
  virtual int64_t Prefetch(const std::vector<int64_t>& indices) = 0;
  virtual int64_t bytes_read() const = 0;
  // Reads so far that waited for the disk (ShardFiles::misses).
  virtual int64_t misses() const = 0;
};

namespace {

class TokenFormat : public Dataset::Format {
 public:
  TokenFormat(const DatasetSpec& spec, const DatasetLayout& layout, int num_arguments, bool with_input,
              bool with_targets)
      : layout_(layout),
        files_(layout_),
        starts_(Starts(layout_)),
        seq_len_(spec.seq_len()),
        dtype_(spec.token_dtype()),
        width_(TokenWidth(spec.token_dtype())),
        num_arguments_(num_arguments),
        with_input_(with_input),
        with_targets_(with_targets) {}

  ShardFiles& files() { return files_; }

  absl::StatusOr<Batch> Read(const std::vector<int64_t>& indices) override {
    const int64_t n = static_cast<int64_t>(indices.size()), L = seq_len_;
    at::Tensor inputs, targets;
    if (with_input_) inputs = pool_->Empty(n, L);
    if (with_targets_) targets = pool_->Empty(n, L);
    int64_t* in = with_input_ ? inputs.data_ptr<int64_t>() : nullptr;
    int64_t* tg = with_targets_ ? targets.data_ptr<int64_t>() : nullptr;
    // Runs of consecutive samples (all of a step's, in order) are one read: their
    // windows share tokens. A shuffled step reads window by window.
    int64_t j = 0;
    absl::Status status;
    ForEachRun(indices, [&](int64_t first, int64_t count) {
      if (!status.ok()) return;
      status = ReadTokens(first, count);
      for (int64_t w = 0; status.ok() && w + L < count; w += L, ++j) {
        if (width_ == 2) {
          Widen<uint16_t>(w, L, in, tg, j * L);
        } else {
          Widen<uint32_t>(w, L, in, tg, j * L);
        }
      }
    });
    PIPPY_RETURN_IF_ERROR(status);
    Batch batch;
    batch.inputs.assign(static_cast<size_t>(num_arguments_), c10::IValue());
    if (with_input_) batch.inputs[0] = std::move(inputs);
    if (with_targets_) batch.target = std::move(targets);
    return batch;
  }

  int64_t bytes_read() const override { return files_.bytes_read(); }
  int64_t misses() const override { return files_.misses(); }

  int64_t Prefetch(const std::vector<int64_t>& indices) override {
    int64_t bytes = 0;
    ForEachRun(indices, [&](int64_t first, int64_t count) {
      (void)ForEachPiece(first, count, [&](int s, int64_t at, int64_t take, int64_t) {
        files_.Prefetch(s, at * width_, take * width_);
        return absl::OkStatus();
      });
      bytes += count * width_;
    });
    return bytes;
  }

 private:
  // Calls f(first token, token count) for each run of consecutive samples of
  // `indices`: their windows share tokens, so a run is one read.
  template <typename F>
  void ForEachRun(const std::vector<int64_t>& indices, F f) const {
    const int64_t n = static_cast<int64_t>(indices.size()), L = seq_len_;
    for (int64_t j0 = 0; j0 < n;) {
      int64_t j1 = j0 + 1;
      while (j1 < n && indices[static_cast<size_t>(j1)] == indices[static_cast<size_t>(j1 - 1)] + 1) ++j1;
      f(indices[static_cast<size_t>(j0)] * L, (j1 - j0) * L + 1);
      j0 = j1;
    }
  }

  // Calls f(shard, its first token, tokens, tokens before) for each shard's piece of
  // the stream's tokens [first, first + count), in order; stops at f's first error.
  template <typename F>
  absl::Status ForEachPiece(int64_t first, int64_t count, F f) const {
    for (int64_t done = 0; done < count;) {
      const auto [s, at] = Locate(starts_, first + done);
      const int64_t take = std::min(count - done, layout_.shards(s).rows() - at);
      PIPPY_RETURN_IF_ERROR(f(s, at, take, done));
      done += take;
    }
    return absl::OkStatus();
  }

  // Tokens [first, first + count) of the stream, across shard boundaries, into
  // Raw<T>() (ids checked against the layout's token_limit). Errors: ShardFiles::Read's;
  // INVALID_ARGUMENT naming the shard and offset of an id past the limit.
  absl::Status ReadTokens(int64_t first, int64_t count) {
    return width_ == 2 ? ReadTokens<uint16_t>(first, count) : ReadTokens<uint32_t>(first, count);
  }
  template <typename T>
  absl::Status ReadTokens(int64_t first, int64_t count) {
    std::vector<T>& raw = Raw<T>();
    raw.resize(static_cast<size_t>(count));
    PIPPY_RETURN_IF_ERROR(ForEachPiece(first, count, [&](int s, int64_t at, int64_t take, int64_t done) {
      return files_.Read(s, at * width_, take * width_, raw.data() + done);
    }));
    FromLittleEndian(raw);
    const int64_t limit = layout_.token_limit();
    if (limit <= 0) return absl::OkStatus();
    const T* r = raw.data();
    T top = 0;
    for (int64_t t = 0; t < count; ++t) top = std::max(top, r[t]);  // vectorised: one pass, no branch
    if (static_cast<uint64_t>(top) < static_cast<uint64_t>(limit)) return absl::OkStatus();
    int64_t k = 0;
    while (static_cast<uint64_t>(r[k]) < static_cast<uint64_t>(limit)) ++k;
    const auto [s, at] = Locate(starts_, first + k);
    return absl::InvalidArgumentError(absl::StrCat(
        "dataset: the shard '", files_.path(s), "' holds token id ", static_cast<uint64_t>(r[k]), " at token ", at,
        " (byte ", at * width_, "), outside the model's embedding of ", limit,
        " rows: the dataset was made for another vocabulary (or --token-dtype is not ", TokenName(dtype_), ")"));
  }

  template <typename T>
  std::vector<T>& Raw() {
    if constexpr (sizeof(T) == 2) {
      return raw16_;
    } else {
      return raw32_;
    }
  }
  // The files hold little-endian ids.
  template <typename T>
  static void FromLittleEndian(std::vector<T>& raw) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (T& v : raw) {
      v = sizeof(T) == 2 ? static_cast<T>(__builtin_bswap16(static_cast<uint16_t>(v)))
                         : static_cast<T>(__builtin_bswap32(static_cast<uint32_t>(v)));
    }
#else
    (void)raw;
#endif
  }
  // The window of L + 1 ids at the last read's id `w`: its first L to in[at..], its
  // last L to tg[at..].
  template <typename T>
  void Widen(int64_t w, int64_t L, int64_t* in, int64_t* tg, int64_t at) {
    const T* r = Raw<T>().data() + w;
    if (in != nullptr) {
      int64_t* to = in + at;
      for (int64_t t = 0; t < L; ++t) to[t] = static_cast<int64_t>(r[t]);
    }
    if (tg != nullptr) {
      int64_t* to = tg + at;
      for (int64_t t = 0; t < L; ++t) to[t] = static_cast<int64_t>(r[t + 1]);
    }
  }

  const DatasetLayout layout_;
  ShardFiles files_;
  const std::vector<int64_t> starts_;
  std::vector<uint16_t> raw16_;  // the last read's ids (uint16 streams)
  std::vector<uint32_t> raw32_;  // (uint32 streams)
  const std::shared_ptr<BufferPool> pool_ = std::make_shared<BufferPool>();
  const int64_t seq_len_;
  const TokenDtype dtype_;
  const int width_;
  const int num_arguments_;
  const bool with_input_, with_targets_;
};

class TensorFormat : public Dataset::Format {
 public:
  TensorFormat(const DatasetLayout& layout, std::vector<std::string> argument_names, std::vector<bool> wanted)
      : layout_(layout),
        files_(layout_),
        starts_(Starts(layout_)),
        names_(std::move(argument_names)),
        wanted_(std::move(wanted)) {}

  ShardFiles& files() { return files_; }

  absl::StatusOr<Batch> Read(const std::vector<int64_t>& indices) override {
    const int64_t n = static_cast<int64_t>(indices.size());
    std::vector<at::Tensor> out(wanted_.size());
    for (int64_t j = 0; j < n; ++j) {
      const auto [s, row] = Locate(starts_, indices[static_cast<size_t>(j)]);
      PIPPY_ASSIGN_OR_RETURN(const std::vector<Column>* columns, ColumnsOf(s));
      for (size_t c = 0; c < wanted_.size(); ++c) {
        const Column& col = (*columns)[c];
        if (!wanted_[c] || !col.tensor) continue;
        if (!out[c].defined()) {
          std::vector<int64_t> shape = {n};
          shape.insert(shape.end(), col.row_shape.begin(), col.row_shape.end());
          out[c] = at::empty(shape, at::TensorOptions().dtype(col.dtype));
        }
        char* to = static_cast<char*>(out[c].data_ptr()) + j * col.row_bytes;
        PIPPY_RETURN_IF_ERROR(files_.Read(s, col.offset + row * col.row_bytes, col.row_bytes, to));
      }
    }
    PIPPY_ASSIGN_OR_RETURN(const std::vector<Column>* first, ColumnsOf(Locate(starts_, indices[0]).first));
    Batch batch;
    batch.inputs.assign(names_.size(), c10::IValue());
    for (size_t c = 0; c < wanted_.size(); ++c) {
      if (!wanted_[c]) continue;
      const c10::IValue v = (*first)[c].tensor ? c10::IValue(out[c]) : (*first)[c].constant;
      if (c < names_.size()) {
        batch.inputs[c] = v;
      } else {
        batch.target = v;
      }
    }
    return batch;
  }

  int64_t bytes_read() const override { return files_.bytes_read(); }
  int64_t misses() const override { return files_.misses(); }

 public:
  int64_t Prefetch(const std::vector<int64_t>& indices) override {
    int64_t bytes = 0;
    for (int64_t index : indices) {
      const auto [s, row] = Locate(starts_, index);
      absl::StatusOr<const std::vector<Column>*> columns = ColumnsOf(s);
      if (!columns.ok()) return bytes;
      for (size_t c = 0; c < wanted_.size(); ++c) {
        const Column& col = (**columns)[c];
        if (!wanted_[c] || !col.tensor) continue;
        files_.Prefetch(s, col.offset + row * col.row_bytes, col.row_bytes);
        bytes += col.row_bytes;
      }
    }
    return bytes;
  }

 private:
  // Shard `s`'s columns, read from its skeleton when first needed and checked against
  // the first shard read (the index checked them all, but the files may have changed).
  absl::StatusOr<const std::vector<Column>*> ColumnsOf(int s) {
    if (auto it = columns_.find(s); it != columns_.end()) return &it->second;
    PIPPY_ASSIGN_OR_RETURN(std::vector<Column> columns, ReadColumns(files_.path(s), names_));
    if (!columns_.empty()) {
      const auto& [s0, first] = *columns_.begin();
      PIPPY_RETURN_IF_ERROR(SameColumns(first, files_.path(s0), columns, files_.path(s), names_));
    }
    int64_t rows = 0;
    for (const Column& c : columns) rows = c.tensor ? c.rows : rows;
    if (rows != layout_.shards(s).rows()) {
      return absl::FailedPreconditionError(absl::StrCat("dataset: the shard '", files_.path(s), "' has ", rows,
                                                        " rows, ", layout_.shards(s).rows(),
                                                        " when the job was submitted"));
    }
    if (columns_.size() >= 256) columns_.erase(std::prev(columns_.end()));  // bounded; the first stays
    return &columns_.emplace(s, std::move(columns)).first->second;
  }

  const DatasetLayout layout_;
  ShardFiles files_;
  const std::vector<int64_t> starts_;
  const std::vector<std::string> names_;
  const std::vector<bool> wanted_;  // by column: arguments, then the targets
  std::map<int, std::vector<Column>> columns_;
};

}  // namespace

// ---- public -------------------------------------------------------------------------

absl::Status CheckUnderRoots(const std::string& path, const std::vector<std::string>& roots) {
  std::error_code ec;
  const fs::path real = fs::canonical(path, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("dataset: '", path, "' cannot be read: ", ec.message()));
  for (const std::string& root : roots) {
    const fs::path r = fs::canonical(root, ec);
    if (ec) continue;
    const auto [end, _] = std::mismatch(r.begin(), r.end(), real.begin(), real.end());
    if (end == r.end()) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "dataset: '", path, "' is not under a dataset root of this daemon (",
      roots.empty() ? std::string("none: datasets are off") : absl::StrJoin(roots, ", "),
      "); start pippy-coordinator and pippy-worker with --dataset-root DIR for the folders jobs may read"));
}

absl::StatusOr<DatasetLayout> IndexDataset(const DatasetSpec& spec, const std::vector<std::string>& argument_names,
                                           int64_t batch, const std::vector<std::string>& roots) {
  if (!fs::path(spec.path()).is_absolute()) {
    return Bad(absl::StrCat("'", spec.path(), "' is not an absolute path (every worker must find it)"));
  }
  PIPPY_ASSIGN_OR_RETURN(ShardList list, ListShards(spec.path(), roots));
  DatasetLayout layout;
  layout.set_tokens(list.tokens);
  int64_t items = 0;
  std::vector<Column> first;
  for (const std::string& path : list.paths) {
    DatasetShard* shard = layout.add_shards();
    shard->set_path(path);
    std::error_code ec;
    shard->set_bytes(static_cast<int64_t>(fs::file_size(path, ec)));
    if (ec) return Bad(absl::StrCat("cannot read the size of '", path, "': ", ec.message()));
    if (list.tokens) {
      const int width = TokenWidth(spec.token_dtype());
      if (shard->bytes() % width != 0) {
        return Bad(absl::StrCat("the shard '", path, "' is ", shard->bytes(), " bytes, not a multiple of the ",
                                width, "-byte token width (", TokenName(spec.token_dtype()),
                                "): it is cut short, or its tokens are another width (--token-dtype)"));
      }
      shard->set_rows(shard->bytes() / width);
    } else {
      PIPPY_ASSIGN_OR_RETURN(std::vector<Column> columns, ReadColumns(path, argument_names));
      if (first.empty()) {
        first = columns;
      } else {
        PIPPY_RETURN_IF_ERROR(SameColumns(first, list.paths[0], columns, path, argument_names));
      }
      for (const Column& c : columns) {
        if (c.tensor) shard->set_rows(c.rows);
      }
    }
    items += shard->rows();
  }
  if (list.tokens) {
    if (argument_names.size() != 1) {
      return Bad(absl::StrCat("a token stream feeds forward()'s one argument, but this model's takes ",
                              argument_names.size(), " (", absl::StrJoin(argument_names, ", "),
                              "): use tensor shards (*.pt)"));
    }
    if (spec.seq_len() <= 0) return Bad("a token stream needs --seq-len L (tokens per sample)");
    layout.set_samples(items > spec.seq_len() ? (items - 1) / spec.seq_len() : 0);
  } else {
    layout.set_samples(items);
  }
  if (layout.samples() < batch) {
    return Bad(absl::StrCat("'", spec.path(), "' holds ", layout.samples(), " samples",
                            list.tokens ? absl::StrCat(" (", items, " tokens at --seq-len ", spec.seq_len(), ")") : "",
                            ", fewer than one batch of ", batch));
  }
  layout.set_steps_per_epoch(layout.samples() / batch);
  return layout;
}

Dataset::Dataset(Sampler sampler, std::unique_ptr<Format> format)
    : sampler_(std::move(sampler)), format_(std::move(format)) {}
Dataset::~Dataset() = default;

absl::StatusOr<std::unique_ptr<Dataset>> Dataset::Open(const DatasetSpec& spec, const DatasetLayout& layout,
                                                       const std::vector<std::string>& argument_names,
                                                       const std::vector<int>& input_indices, bool with_targets,
                                                       int64_t batch, uint64_t seed,
                                                       const std::vector<std::string>& roots) {
  const int num_arguments = static_cast<int>(argument_names.size());
  if (layout.shards_size() == 0 || layout.samples() < batch || batch <= 0) {
    return absl::InvalidArgumentError("dataset: the job's index of its dataset is empty (not made by IndexDataset)");
  }
  std::unique_ptr<Format> format;
  if (layout.tokens()) {
    const bool with_input = std::find(input_indices.begin(), input_indices.end(), 0) != input_indices.end();
    auto tokens = std::make_unique<TokenFormat>(spec, layout, num_arguments, with_input, with_targets);
    PIPPY_RETURN_IF_ERROR(tokens->files().CheckSizes(roots));
    format = std::move(tokens);
  } else {
    std::vector<bool> wanted(static_cast<size_t>(num_arguments) + 1, false);
    for (int i : input_indices) {
      if (i >= 0 && i < num_arguments) wanted[static_cast<size_t>(i)] = true;
    }
    wanted.back() = with_targets;
    auto tensors = std::make_unique<TensorFormat>(layout, argument_names, std::move(wanted));
    PIPPY_RETURN_IF_ERROR(tensors->files().CheckSizes(roots));
    format = std::move(tensors);
  }
  return std::unique_ptr<Dataset>(new Dataset(Sampler(layout.samples(), batch, spec.shuffle(), seed),
                                              std::move(format)));
}

int64_t Dataset::bytes_read() const { return format_->bytes_read(); }

absl::StatusOr<Batch> Dataset::Read(int64_t step, int64_t batch, int replica, int replicas) {
  const std::vector<int64_t> indices = sampler_.Indices(step, replica, replicas);
  const int64_t misses = format_->misses();
  absl::StatusOr<Batch> out =
      TorchCall("reading a batch of the dataset", [&]() -> absl::StatusOr<Batch> { return format_->Read(indices); });
  reads_since_miss_ = format_->misses() > misses ? 0 : reads_since_miss_ + 1;
  if (out.ok()) Prefetch(step, replica, replicas);
  return out;
}

void Dataset::Prefetch(int64_t step, int replica, int replicas) {
  // Steps are read in order (a jump, as at a resume, starts over): the next steps' rows
  // are asked for up to kPrefetchBytes ahead, each step once, while reads still meet
  // the disk (a dataset in the page cache is not asked for: a shuffled step would
  // spend a system call per window on it).
  if (step < prefetched_from_ || step > prefetched_to_) prefetched_to_ = step;
  prefetched_from_ = step;
  if (reads_since_miss_ >= kWarmReads) {
    prefetched_to_ = step;
    return;
  }
  while (prefetched_to_ < step + 1 || (prefetched_to_ - step) * step_bytes_ < kPrefetchBytes) {
    ++prefetched_to_;
    const int64_t bytes = format_->Prefetch(sampler_.Indices(prefetched_to_, replica, replicas));
    if (bytes <= 0) break;
    step_bytes_ = bytes;
  }
}

}  // namespace pippy::stage
