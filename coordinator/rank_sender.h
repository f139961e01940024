// Streaming a placed rank what it needs and nothing else: its assignment, then its
// stages' TorchScript, its share of the data, on a restart its training state, and
// the shards of an uploaded dataset it reads (--dataset-upload),
// each in chunks of at most `chunk_bytes` (the last one says so). A stage comes from
// memory (serialised as it is sent, right after the split) or from its file; no file
// is ever held whole.
//
// Thread safety: SendRank may run on several threads at once, one per rank; each call
// writes only to its own RankSend's channel.
#ifndef PIPPY_COORDINATOR_RANK_SENDER_H_
#define PIPPY_COORDINATOR_RANK_SENDER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "coordinator/worker_channel.h"
#include "proto/coordinator.pb.h"

namespace pippy::coordinator {

// Writes stage `stage`'s TorchScript through `sink`, piece by piece.
using StageWriter =
    std::function<absl::Status(int stage, const std::function<absl::Status(absl::string_view)>& sink)>;

// What placing sends one rank.
struct RankSend {
  std::shared_ptr<WorkerChannel> channel;
  CoordinatorMessage assignment;           // its Assignment
  std::vector<int> stages;                 // in the order the assignment lists them
  std::vector<int> stage_files;            // each one's file key (JobRun::FileKey), what the writer reads
  std::string share_file;                  // its data share (missing: it reads none)
  std::string state_file;                  // a restart's training state (empty: none)
  std::vector<std::string> dataset_files;  // an uploaded dataset's shards, for a rank reading it
  std::shared_ptr<std::atomic<bool>> stop;  // set when the attempt ends: sending stops
};

// Sends `send`, stages through `writer`; counts each stage's bytes into `stage_bytes`.
// Errors: CANCELLED once `stop` is set (the attempt ended); UNAVAILABLE when the
// worker's stream closed (the worker is lost; its removal recovers the job); any other
// error says what could not be sent ("stage 2 to rank 1: ...") and fails the attempt.
absl::Status SendRank(const RankSend& send, const StageWriter& writer, size_t chunk_bytes,
                      std::map<int, int64_t>* stage_bytes);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_RANK_SENDER_H_
