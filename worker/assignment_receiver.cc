#include "worker/assignment_receiver.h"

#include <unistd.h>

#include <filesystem>
#include <utility>

#include "absl/strings/str_cat.h"

namespace pippy::worker {

namespace {

void RemoveDir(const std::string& dir) {
  if (dir.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace

void AssignmentReceiver::Start(const Assignment& assignment) {
  shard_.Close(/*sync=*/false).IgnoreError();
  RemoveDir(in_.dataset_dir);  // an assignment that never completed
  in_ = ReceivedAssignment();
  in_.assignment = assignment;
  shards_done_ = 0;
  if (assignment.dataset_file_bytes_size() > 0) {
    const std::string base = scratch_dir_.empty() ? std::filesystem::temp_directory_path().string() : scratch_dir_;
    in_.dataset_dir = absl::StrCat(base, "/pippy-dataset-", getpid(), "-", assignment.job_id(), "-r",
                                   assignment.rank(), "-p", assignment.replica(), "-a", assignment.attempt());
    for (int i = 0; i < assignment.dataset_file_bytes_size(); ++i) {
      in_.dataset_files.push_back(absl::StrCat(in_.dataset_dir, "/shard_", i));
    }
  }
  stage_done_.clear();
  for (const auto& f : assignment.stages()) {
    in_.stages[f.stage()].reserve(static_cast<size_t>(std::max<int64_t>(0, f.bytes())));
    stage_done_[f.stage()] = false;
  }
  in_.data.reserve(static_cast<size_t>(std::max<int64_t>(0, assignment.data_bytes())));
  in_.state.reserve(static_cast<size_t>(std::max<int64_t>(0, assignment.state_bytes())));
  data_done_ = false;
  state_done_ = false;
  receiving_ = true;
}

bool AssignmentReceiver::Complete() const {
  if (!data_done_) return false;
  if (shards_done_ < static_cast<int>(in_.dataset_files.size())) return false;
  if (in_.assignment.state_bytes() > 0 && !state_done_) return false;
  for (const auto& [s, done] : stage_done_) {
    if (!done) return false;
  }
  return true;
}

template <typename Chunk>
std::optional<ReceivedAssignment> AssignmentReceiver::Append(const Chunk& c, std::string* into, bool* done) {
  *into += c.chunk();
  in_.bytes_received += static_cast<int64_t>(c.chunk().size());
  if (c.last_chunk()) *done = true;
  if (!Complete()) return std::nullopt;
  receiving_ = false;
  return std::exchange(in_, ReceivedAssignment());
}

absl::StatusOr<std::optional<ReceivedAssignment>> AssignmentReceiver::Add(const StageChunk& c) {
  if (!Belongs(c)) return std::nullopt;
  auto it = in_.stages.find(c.stage());
  if (it == in_.stages.end()) {
    receiving_ = false;
    return absl::InternalError(absl::StrCat("the coordinator sent stage ", c.stage(), ", which is not this rank's"));
  }
  return Append(c, &it->second, &stage_done_[c.stage()]);
}

std::optional<ReceivedAssignment> AssignmentReceiver::Add(const DataChunk& c) {
  if (!Belongs(c)) return std::nullopt;
  return Append(c, &in_.data, &data_done_);
}

std::optional<ReceivedAssignment> AssignmentReceiver::Add(const StateChunk& c) {
  if (!Belongs(c)) return std::nullopt;
  return Append(c, &in_.state, &state_done_);
}

absl::StatusOr<std::optional<ReceivedAssignment>> AssignmentReceiver::Add(const DatasetChunk& c) {
  if (!Belongs(c)) return std::nullopt;
  if (c.shard() != shards_done_ || c.shard() >= static_cast<int>(in_.dataset_files.size())) {
    receiving_ = false;
    shard_.Close(/*sync=*/false).IgnoreError();
    RemoveDir(in_.dataset_dir);
    return absl::InternalError(absl::StrCat("the coordinator sent the dataset's shard ", c.shard(), " while shard ",
                                            shards_done_, " of ", in_.dataset_files.size(), " was due"));
  }
  auto fail = [&](const absl::Status& s) -> absl::Status {
    receiving_ = false;
    shard_.Close(/*sync=*/false).IgnoreError();
    RemoveDir(in_.dataset_dir);
    return absl::UnavailableError(absl::StrCat("writing the uploaded dataset's shard ", c.shard(), " to ",
                                               in_.dataset_dir, ": ", s.message()));
  };
  if (!shard_.is_open()) {
    std::error_code ec;
    std::filesystem::create_directories(in_.dataset_dir, ec);
    if (ec) return fail(absl::UnavailableError(ec.message()));
    absl::Status opened = shard_.Open(in_.dataset_files[static_cast<size_t>(c.shard())]);
    if (!opened.ok()) return fail(opened);
  }
  absl::Status s = shard_.Append(c.chunk());
  if (s.ok() && c.last_chunk()) s = shard_.Close(/*sync=*/false);
  if (!s.ok()) return fail(s);
  in_.bytes_received += static_cast<int64_t>(c.chunk().size());
  if (c.last_chunk()) ++shards_done_;
  if (!Complete()) return std::optional<ReceivedAssignment>();
  receiving_ = false;
  return std::optional<ReceivedAssignment>(std::exchange(in_, ReceivedAssignment()));
}

Assignment AssignmentReceiver::Drop() {
  receiving_ = false;
  shard_.Close(/*sync=*/false).IgnoreError();
  RemoveDir(in_.dataset_dir);
  Assignment a = in_.assignment;
  in_ = ReceivedAssignment();
  return a;
}

}  // namespace pippy::worker
