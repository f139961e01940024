#include "worker/assignment_receiver.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace pippy::worker {

void AssignmentReceiver::Start(const Assignment& assignment) {
  in_ = ReceivedAssignment();
  in_.assignment = assignment;
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

Assignment AssignmentReceiver::Drop() {
  receiving_ = false;
  Assignment a = in_.assignment;
  in_ = ReceivedAssignment();
  return a;
}

}  // namespace pippy::worker
