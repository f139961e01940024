// An assignment and its files as their chunks arrive on the worker's stream: the
// rank's stages' TorchScript (StageChunk), its share of the data (DataChunk), on a
// restart its training state (StateChunk), and the shards of an uploaded dataset it
// reads (DatasetChunk), written to a folder of their own under the scratch folder as
// they come (a dataset is never held in memory). Chunks of another job or attempt (a
// cancelled transfer, an earlier attempt) are not the assignment's and are dropped.
//
// Thread safety: none (the session's reader thread owns it).
#ifndef PIPPY_WORKER_ASSIGNMENT_RECEIVER_H_
#define PIPPY_WORKER_ASSIGNMENT_RECEIVER_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include <vector>

#include "absl/status/statusor.h"
#include "common/file_writer.h"
#include "proto/coordinator.pb.h"

namespace pippy::worker {

// Everything an assignment brought, once it has all arrived.
struct ReceivedAssignment {
  Assignment assignment;
  std::map<int, std::string> stages;  // stage -> TorchScript archive bytes
  std::string data;                   // the rank's data share (DataSource::ShareBytes)
  std::string state;                  // a restart's training state ("" without)
  // An uploaded dataset: its folder on this worker and each shard's file in it, in the
  // order of layout.dataset.shards (the folder is the caller's to remove).
  std::string dataset_dir;
  std::vector<std::string> dataset_files;
  int64_t bytes_received = 0;
};

class AssignmentReceiver {
 public:
  // Where uploaded datasets' shards are written (a folder per assignment in it).
  void set_scratch_dir(std::string dir) { scratch_dir_ = std::move(dir); }

  // A new assignment: what was arriving before is dropped. Memory for the files is
  // reserved from the sizes the assignment announces.
  void Start(const Assignment& assignment);

  // Whether an assignment is being received.
  bool receiving() const { return receiving_; }
  const Assignment& assignment() const { return in_.assignment; }

  // A chunk of the assignment being received. Returns the whole assignment once its
  // last piece arrived (receiving stops), nullopt while more is to come or when the
  // chunk is not this assignment's (dropped).
  // Errors: INTERNAL for a stage the assignment does not list (receiving stops).
  absl::StatusOr<std::optional<ReceivedAssignment>> Add(const StageChunk& chunk);
  std::optional<ReceivedAssignment> Add(const DataChunk& chunk);
  std::optional<ReceivedAssignment> Add(const StateChunk& chunk);
  // Errors: INTERNAL for a shard the assignment does not announce or out of order;
  // UNAVAILABLE when writing it fails (receiving stops, the folder is removed).
  absl::StatusOr<std::optional<ReceivedAssignment>> Add(const DatasetChunk& chunk);

  // Stops receiving (a dataset folder being written is removed); returns the
  // assignment that was arriving (to report it).
  Assignment Drop();

 private:
  template <typename Chunk>
  bool Belongs(const Chunk& c) const {
    return receiving_ && c.job_id() == in_.assignment.job_id() && c.attempt() == in_.assignment.attempt();
  }
  template <typename Chunk>
  std::optional<ReceivedAssignment> Append(const Chunk& c, std::string* into, bool* done);
  bool Complete() const;

  bool receiving_ = false;
  ReceivedAssignment in_;
  std::map<int, bool> stage_done_;
  bool data_done_ = false;
  bool state_done_ = false;
  std::string scratch_dir_;
  FileWriter shard_;      // the dataset shard being written
  int shards_done_ = 0;   // of in_.dataset_files
};

}  // namespace pippy::worker

#endif  // PIPPY_WORKER_ASSIGNMENT_RECEIVER_H_
