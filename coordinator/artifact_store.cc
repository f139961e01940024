#include "coordinator/artifact_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <filesystem>
#include <fstream>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status.h"

namespace pippy::coordinator {
namespace fs = std::filesystem;

Upload::~Upload() {
  model_.Close(/*sync=*/false).IgnoreError();
  data_.Close(/*sync=*/false).IgnoreError();
  shard_.Close(/*sync=*/false).IgnoreError();
  if (!accepted_) {
    std::error_code ec;
    fs::remove_all(dir_, ec);
    fs::remove_all(dataset_dir_, ec);
  }
}

absl::Status Upload::AppendDatasetFile(const std::string& name, absl::string_view chunk, bool last) {
  const bool plain = !name.empty() && name.size() <= 200 && name[0] != '.' &&
                     name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") ==
                         std::string::npos &&
                     (absl::EndsWith(name, ".bin") || absl::EndsWith(name, ".pt"));
  if (!plain) {
    return absl::InvalidArgumentError(absl::StrCat("data.dataset: the uploaded shard name '", name.substr(0, 200),
                                                   "' is not a plain file name ending .bin or .pt"));
  }
  const std::string path = dataset_dir_ + "/" + name;
  if (!shard_.is_open()) {
    if (dataset_names_.count(name) > 0) {
      return absl::InvalidArgumentError(absl::StrCat("data.dataset: the shard '", name, "' was uploaded twice"));
    }
    std::error_code ec;
    fs::create_directories(dataset_dir_, ec);
    if (ec) return absl::UnavailableError(absl::StrCat("cannot create '", dataset_dir_, "': ", ec.message()));
    PIPPY_RETURN_IF_ERROR(shard_.Open(path));
    dataset_names_.insert(name);
  } else if (dataset_names_.count(name) == 0 || shard_.path() != path) {
    return absl::InvalidArgumentError(absl::StrCat("data.dataset: the shard '", name, "' began before the shard '",
                                                   fs::path(shard_.path()).filename().string(), "' ended"));
  }
  PIPPY_RETURN_IF_ERROR(shard_.Append(chunk));
  dataset_bytes_ += static_cast<int64_t>(chunk.size());
  if (last) PIPPY_RETURN_IF_ERROR(shard_.Close());
  return absl::OkStatus();
}

absl::Status Upload::Append(FileWriter& out, const std::string& path, absl::string_view chunk) {
  if (!out.is_open()) {
    absl::Status s = out.Open(path);
    if (!s.ok()) return absl::UnavailableError(absl::StrCat(s.message(), " (is the state directory writable?)"));
  }
  return out.Append(chunk);
}

absl::Status Upload::AppendModel(absl::string_view chunk) { return Append(model_, model_path(), chunk); }
absl::Status Upload::AppendData(absl::string_view chunk) { return Append(data_, data_path(), chunk); }

absl::Status Upload::Close() {
  // On disk before the job is accepted: a job whose record survives a crash has its
  // model too (a restart prepares a detached submission again from it).
  absl::Status s = model_.Close();
  absl::Status d = data_.Close();
  return s.ok() ? d : s;
}

absl::StatusOr<std::unique_ptr<ArtifactStore>> ArtifactStore::Open(const std::string& state_dir) {
  std::error_code ec;
  fs::remove_all(state_dir + "/uploads", ec);  // submissions cut off by a restart
  for (const char* sub : {"/uploads", "/jobs", "/models"}) {
    fs::create_directories(state_dir + sub, ec);
    if (ec) {
      return absl::UnavailableError(absl::StrCat("cannot create '", state_dir, sub, "': ", ec.message(),
                                                 "; give a writable --state-dir"));
    }
  }
  return std::unique_ptr<ArtifactStore>(new ArtifactStore(state_dir));
}

absl::StatusOr<std::unique_ptr<Upload>> ArtifactStore::NewUpload() {
  int64_t n;
  {
    absl::MutexLock lock(&mu_);
    n = next_upload_++;
  }
  const std::string dir = absl::StrCat(state_dir_, "/uploads/", getpid(), "-", n);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create '", dir, "': ", ec.message()));
  return std::unique_ptr<Upload>(new Upload(dir, absl::StrCat(DatasetsDir(), "/", getpid(), "-", n)));
}

absl::Status ArtifactStore::Accept(Upload& upload, const std::string& job_id) {
  absl::Status closed = upload.Close();
  if (!closed.ok()) return closed;
  std::error_code ec;
  fs::remove_all(JobDir(job_id), ec);  // leftovers of an earlier coordinator's job of that id
  fs::rename(upload.dir(), JobDir(job_id), ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot move '", upload.dir(), "' to '", JobDir(job_id), "': ", ec.message()));
  upload.accepted_ = true;
  upload.dir_ = JobDir(job_id);
  return absl::OkStatus();
}

std::string ArtifactStore::StageFileName(int stage) { return absl::StrCat("stage_", stage, ".pt"); }
std::string ArtifactStore::ShareFileName(int rank) { return absl::StrCat("share_", rank, ".pt"); }

std::string ArtifactStore::ResultPath(const std::string& job_id, int stage) const {
  return stage < 0 ? OutputsPath(job_id) : absl::StrCat(JobDir(job_id), "/result_", stage, ".pt");
}

absl::Status ArtifactStore::AppendResult(const std::string& job_id, int stage, absl::string_view chunk, bool last) {
  absl::MutexLock lock(&mu_);
  auto key = std::make_pair(job_id, stage);
  auto it = open_.find(key);
  if (it == open_.end()) {
    if (!fs::exists(JobDir(job_id))) return absl::OkStatus();  // the job ended meanwhile
    auto out = std::make_unique<FileWriter>();
    PIPPY_RETURN_IF_ERROR(out->Open(ResultPath(job_id, stage)));
    it = open_.emplace(key, std::move(out)).first;
    complete_[job_id][stage] = false;
  }
  absl::Status s = it->second->Append(chunk);
  // Not synced: an intermediate that the merge reads next (into the file fetch serves).
  if (s.ok() && last) s = it->second->Close(/*sync=*/false);
  if (last || !s.ok()) {
    open_.erase(it);
    PIPPY_RETURN_IF_ERROR(s);
    complete_[job_id][stage] = true;
  }
  return absl::OkStatus();
}

bool ArtifactStore::ResultsComplete(const std::string& job_id, int stages) {
  absl::MutexLock lock(&mu_);
  auto it = complete_.find(job_id);
  if (it == complete_.end()) return false;
  if (stages < 0) return it->second.count(-1) && it->second.at(-1);
  for (int s = 0; s < stages; ++s) {
    auto st = it->second.find(s);
    if (st == it->second.end() || !st->second) return false;
  }
  return true;
}

absl::Status ArtifactStore::Publish(const std::string& job_id, const std::string& path) {
  std::error_code ec;
  fs::rename(path, FetchPath(job_id), ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot move '", path, "' to '", FetchPath(job_id), "': ", ec.message()));
  return absl::OkStatus();
}

void ArtifactStore::ResetResults(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  for (auto it = open_.begin(); it != open_.end();) {
    it = it->first.first == job_id ? open_.erase(it) : std::next(it);
  }
  complete_.erase(job_id);
}

namespace {

absl::Status SyncPath(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::UnavailableError(absl::StrCat("cannot open '", path, "': ", strerror(errno)));
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  if (rc != 0) return absl::UnavailableError(absl::StrCat("fsync '", path, "': ", strerror(err)));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<bool> ArtifactStore::AppendCheckpoint(const std::string& job_id, int step, int rank, int stage,
                                                     absl::string_view chunk, bool last) {
  const std::string path =
      stage >= 0 ? CheckpointStagePath(job_id, step, stage) : CheckpointStatePath(job_id, step, rank);
  const std::string tmp = path + ".tmp";
  absl::MutexLock lock(&mu_);
  auto it = open_checkpoints_.find(path);
  if (it == open_checkpoints_.end()) {
    if (!fs::exists(JobDir(job_id))) return false;  // the job ended meanwhile
    std::error_code ec;
    fs::create_directories(CheckpointDir(job_id, step), ec);
    auto file = std::make_unique<FileWriter>();
    PIPPY_RETURN_IF_ERROR(file->Open(tmp));
    it = open_checkpoints_.emplace(path, std::make_pair(job_id, std::move(file))).first;
  }
  FileWriter& file = *it->second.second;
  absl::Status s = file.Append(chunk);
  if (s.ok() && last) s = file.Close();
  if (!s.ok() || last) open_checkpoints_.erase(it);  // closes it
  if (!s.ok()) return s;
  if (!last) return false;
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot rename '", tmp, "': ", ec.message()));
  return true;
}

absl::Status ArtifactStore::SyncCheckpoint(const std::string& job_id, int step) {
  absl::Status s = SyncPath(CheckpointDir(job_id, step));
  if (s.ok()) s = SyncPath(JobDir(job_id));
  return s;
}

void ArtifactStore::RemoveCheckpoints(const std::string& job_id, const std::function<bool(int step)>& remove) {
  const std::string prefix = JobDir(job_id) + "/checkpoint-";
  auto step_of = [&](const std::string& path) {
    return std::atoi(path.c_str() + prefix.size());  // "checkpoint-<k>[/...]"
  };
  {
    absl::MutexLock lock(&mu_);
    for (auto it = open_checkpoints_.begin(); it != open_checkpoints_.end();) {
      if (it->second.first == job_id && remove(step_of(it->first))) {
        it = open_checkpoints_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::error_code ec;
  for (fs::directory_iterator d(JobDir(job_id), ec), end; !ec && d != end; d.increment(ec)) {
    const std::string path = d->path().string();
    if (path.rfind(prefix, 0) == 0 && remove(step_of(path))) {
      std::error_code rm;
      fs::remove_all(d->path(), rm);
      if (rm) log::Warn("job={} could not remove '{}': {}", job_id, path, rm.message());
    }
  }
}

void ArtifactStore::RemoveAllOf(const std::string& job_id) {
  RemoveJobFiles(job_id);
  std::error_code ec;
  fs::remove(FetchPath(job_id), ec);
  RemoveMergedCheckpoints(job_id);
}

void ArtifactStore::RemoveMergedCheckpoints(const std::string& job_id) {
  const std::string merged = job_id + ".checkpoint-";
  std::error_code ec;
  for (fs::directory_iterator d(state_dir_ + "/models", ec), end; !ec && d != end; d.increment(ec)) {
    if (d->path().filename().string().rfind(merged, 0) == 0) {
      std::error_code rm;
      fs::remove(d->path(), rm);
    }
  }
}

std::string ArtifactStore::DatasetsDir() const {
  std::error_code ec;
  return fs::absolute(state_dir_ + "/datasets", ec).lexically_normal().string();
}

void ArtifactStore::RemoveUploadedDataset(const std::string& dir) {
  const std::string prefix = DatasetsDir() + "/";
  if (dir.rfind(prefix, 0) != 0 || dir.size() == prefix.size() || dir.find("..") != std::string::npos) return;
  std::error_code ec;
  fs::remove_all(dir, ec);
  if (ec) log::Warn("could not remove the uploaded dataset '{}': {}", dir, ec.message());
}

int ArtifactStore::RemoveUploadedDatasetsExcept(const std::set<std::string>& keep) {
  std::vector<std::string> gone;
  std::error_code ec;
  for (fs::directory_iterator d(DatasetsDir(), ec), end; !ec && d != end; d.increment(ec)) {
    const std::string dir = d->path().lexically_normal().string();
    if (keep.count(dir) == 0) gone.push_back(dir);
  }
  for (const std::string& dir : gone) {
    log::Info("removing the uploaded dataset '{}': no job names it", dir);
    RemoveUploadedDataset(dir);
  }
  return static_cast<int>(gone.size());
}

void ArtifactStore::RemoveJobFiles(const std::string& job_id, int keep_checkpoint) {
  {
    absl::MutexLock lock(&mu_);
    for (auto it = open_.begin(); it != open_.end();) {
      it = it->first.first == job_id ? open_.erase(it) : std::next(it);
    }
    complete_.erase(job_id);
    for (auto it = open_checkpoints_.begin(); it != open_checkpoints_.end();) {
      if (it->second.first == job_id) {
        it = open_checkpoints_.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::error_code ec;
  if (keep_checkpoint <= 0) {
    fs::remove_all(JobDir(job_id), ec);
    if (ec) log::Warn("job={} could not remove '{}': {}", job_id, JobDir(job_id), ec.message());
    return;
  }
  const std::string keep[] = {ModelPath(job_id), CheckpointDir(job_id, keep_checkpoint)};
  for (fs::directory_iterator d(JobDir(job_id), ec), end; !ec && d != end; d.increment(ec)) {
    const std::string path = d->path().string();
    if (path == keep[0] || path == keep[1]) continue;
    std::error_code rm;
    fs::remove_all(d->path(), rm);
    if (rm) log::Warn("job={} could not remove '{}': {}", job_id, path, rm.message());
  }
}

namespace {

// `to` becomes another name of `from` (a copy where links cannot cross file systems).
absl::Status LinkOrCopy(const std::string& from, const std::string& to) {
  std::error_code ec;
  if (!fs::exists(from, ec)) return absl::NotFoundError(absl::StrCat("'", from, "' is missing"));
  fs::remove(to, ec);
  fs::create_hard_link(from, to, ec);
  if (!ec) return absl::OkStatus();
  ec.clear();
  fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot copy '", from, "' to '", to, "': ", ec.message()));
  return SyncPath(to);
}

absl::Status MakeDir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::UnavailableError(absl::StrCat("cannot create '", dir, "': ", ec.message()));
  return absl::OkStatus();
}

}  // namespace

absl::Status ArtifactStore::CheckpointFromResults(const std::string& job_id, int step, int stages) {
  PIPPY_RETURN_IF_ERROR(MakeDir(CheckpointDir(job_id, step)));
  for (int st = 0; st < stages; ++st) {
    PIPPY_RETURN_IF_ERROR(LinkOrCopy(ResultPath(job_id, st), CheckpointStagePath(job_id, step, st)));
  }
  return SyncCheckpoint(job_id, step);
}

absl::Status ArtifactStore::LinkCheckpoint(const std::string& from, int step, const std::string& to, int stages,
                                           int ranks) {
  PIPPY_RETURN_IF_ERROR(MakeDir(CheckpointDir(to, step)));
  for (int st = 0; st < stages; ++st) {
    PIPPY_RETURN_IF_ERROR(LinkOrCopy(CheckpointStagePath(from, step, st), CheckpointStagePath(to, step, st)));
  }
  for (int r = 0; r < ranks; ++r) {
    PIPPY_RETURN_IF_ERROR(LinkOrCopy(CheckpointStatePath(from, step, r), CheckpointStatePath(to, step, r)));
  }
  return SyncCheckpoint(to, step);
}

absl::StatusOr<std::string> ArtifactStore::StageCheckpointForMerge(const std::string& job_id, int step, int stages) {
  const std::string dir = absl::StrCat(JobDir(job_id), "/fetch-", step);
  std::error_code ec;
  fs::remove_all(dir, ec);
  PIPPY_RETURN_IF_ERROR(MakeDir(dir));
  absl::Status s = LinkOrCopy(ModelPath(job_id), dir + "/model.pt");
  for (int st = 0; s.ok() && st < stages; ++st) {
    s = LinkOrCopy(CheckpointStagePath(job_id, step, st), absl::StrCat(dir, "/result_", st, ".pt"));
  }
  if (!s.ok()) {
    fs::remove_all(dir, ec);
    return s;
  }
  return dir;
}

void ArtifactStore::RemoveMergeDir(const std::string& merge_dir) {
  std::error_code ec;
  fs::remove_all(merge_dir, ec);
}

absl::Status ArtifactStore::PublishCheckpoint(const std::string& job_id, int step, const std::string& path,
                                              const std::string& merge_dir) {
  RemoveMergedCheckpoints(job_id);
  std::error_code ec;
  fs::rename(path, CheckpointFetchPath(job_id, step), ec);
  std::error_code rm;
  fs::remove_all(merge_dir, rm);
  if (ec) {
    return absl::UnavailableError(
        absl::StrCat("cannot move '", path, "' to '", CheckpointFetchPath(job_id, step), "': ", ec.message()));
  }
  return absl::OkStatus();
}

absl::Status ArtifactStore::StreamFile(const std::string& path, size_t chunk_bytes,
                                       const std::function<absl::Status(absl::string_view)>& sink) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  std::vector<char> buf(chunk_bytes);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize n = in.gcount();
    if (n <= 0) break;
    absl::Status s = sink(absl::string_view(buf.data(), static_cast<size_t>(n)));
    if (!s.ok()) return s;
  }
  if (in.bad()) return absl::UnavailableError(absl::StrCat("reading '", path, "' failed"));
  return absl::OkStatus();
}

int64_t ArtifactStore::FileSize(const std::string& path) {
  std::error_code ec;
  auto n = fs::file_size(path, ec);
  return ec ? -1 : static_cast<int64_t>(n);
}

}  // namespace pippy::coordinator
