// The coordinator's files under its state directory: what a job is made of on disk,
// so that no model is held in memory longer than one step of work needs it.
//
//   uploads/<n>/            a submission while it arrives (model.pt, data.pt); removed
//                           unless the job is accepted, then renamed to jobs/<job>/
//   datasets/<n>/           a dataset uploaded with submission n (--dataset-upload): its
//                           shards; it stays where it is (the job's spec names it) until
//                           the job ends; at start-up those no job names are removed
//   jobs/<job>/model.pt     the submitted model (read again to assemble the result)
//   jobs/<job>/stage_<s>.pt each stage's TorchScript, as shipped to its worker
//   jobs/<job>/share_<r>.pt rank r's share of the data (see DataSource::ShareBytes)
//   jobs/<job>/result_<s>.pt  a trained stage as its worker sends it back
//   jobs/<job>/outputs.pt   an inference job's outputs as the last rank sends them
//   jobs/<job>/checkpoint-<k>/stage_<s>.pt, rank_<r>.state
//                           a checkpoint after k steps: each stage's TorchScript with its
//                           trained parameters, each rank's training state. Every file is
//                           written to a .tmp name, fsynced and renamed; the job record
//                           (JobStore) naming step k commits it; older ones are removed.
//                           A training job's last one (and model.pt) stays once the job
//                           ended, until it is deleted; a succeeded job's is the state
//                           after its last step (result_<s>.pt linked in as its stages)
//   jobs/<job>/fetch-<k>/   a checkpoint being merged into one model (links)
//   models/<job>.pt         what FetchModel serves: the trained model or the outputs
//   models/<job>.checkpoint-<k>.pt  the checkpoint after k steps as one model
//
// Thread safety: every method may be called from any thread. Appending results uses
// an internal mutex that guards the open result files only.
#ifndef PIPPY_COORDINATOR_ARTIFACT_STORE_H_
#define PIPPY_COORDINATOR_ARTIFACT_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/file_writer.h"

namespace pippy::coordinator {

// A submission's model and data files while their chunks arrive. Destroying an
// Upload that was not accepted removes its folder.
class Upload {
 public:
  ~Upload();
  Upload(const Upload&) = delete;
  Upload& operator=(const Upload&) = delete;

  // Errors: UNAVAILABLE when the disk write fails (the message names the file).
  absl::Status AppendModel(absl::string_view chunk);
  absl::Status AppendData(absl::string_view chunk);
  // A chunk of shard `name` of an uploaded dataset (DatasetFileChunk); `last` closes it.
  // Errors: INVALID_ARGUMENT for a name that is not a plain shard name (letters, digits,
  // '.', '_', '-'; .bin or .pt), a shard sent twice or interleaved with another;
  // UNAVAILABLE when the disk write fails.
  absl::Status AppendDatasetFile(const std::string& name, absl::string_view chunk, bool last);
  // Closes and fsyncs both files. Errors: UNAVAILABLE.
  absl::Status Close();

  const std::string& dir() const { return dir_; }
  std::string model_path() const { return dir_ + "/model.pt"; }
  std::string data_path() const { return dir_ + "/data.pt"; }  // exists only if data came
  int64_t model_bytes() const { return model_.bytes(); }
  int64_t data_bytes() const { return data_.bytes(); }
  // The uploaded dataset's folder (datasets/<n>), its shards and bytes so far.
  const std::string& dataset_dir() const { return dataset_dir_; }
  int dataset_files() const { return static_cast<int>(dataset_names_.size()); }
  int64_t dataset_bytes() const { return dataset_bytes_; }

 private:
  friend class ArtifactStore;
  Upload(std::string dir, std::string dataset_dir) : dir_(std::move(dir)), dataset_dir_(std::move(dataset_dir)) {}
  absl::Status Append(FileWriter& out, const std::string& path, absl::string_view chunk);

  std::string dir_;
  bool accepted_ = false;
  FileWriter model_, data_;  // written back to disk while the upload arrives
  std::string dataset_dir_;
  FileWriter shard_;                  // the shard arriving
  std::set<std::string> dataset_names_;
  int64_t dataset_bytes_ = 0;
};

class ArtifactStore {
 public:
  // Creates `state_dir`/{uploads,jobs,models}; clears leftovers of uploads that were
  // interrupted. Errors: UNAVAILABLE naming the folder.
  static absl::StatusOr<std::unique_ptr<ArtifactStore>> Open(const std::string& state_dir);

  // A new, empty upload folder. Errors: UNAVAILABLE.
  absl::StatusOr<std::unique_ptr<Upload>> NewUpload();
  // Moves an accepted upload (and what was prepared in it) to jobs/<job_id>/.
  absl::Status Accept(Upload& upload, const std::string& job_id);

  std::string JobDir(const std::string& job_id) const { return state_dir_ + "/jobs/" + job_id; }
  std::string ModelPath(const std::string& job_id) const { return JobDir(job_id) + "/model.pt"; }
  static std::string StageFileName(int stage);
  static std::string ShareFileName(int rank);
  std::string StagePath(const std::string& job_id, int stage) const { return JobDir(job_id) + "/" + StageFileName(stage); }
  std::string SharePath(const std::string& job_id, int rank) const { return JobDir(job_id) + "/" + ShareFileName(rank); }
  std::string ResultPath(const std::string& job_id, int stage) const;
  std::string OutputsPath(const std::string& job_id) const { return JobDir(job_id) + "/outputs.pt"; }
  // What FetchModel serves.
  std::string FetchPath(const std::string& job_id) const { return state_dir_ + "/models/" + job_id + ".pt"; }

  // Appends a chunk a worker sent back: a trained stage (stage >= 0) or inference
  // outputs (stage < 0); `last` closes the file. A job folder that is gone (the job
  // ended) swallows the chunk. Errors: UNAVAILABLE when the write fails.
  absl::Status AppendResult(const std::string& job_id, int stage, absl::string_view chunk, bool last);
  // Whether every stage in [0, stages) (or the outputs, for stages < 0) came back whole.
  bool ResultsComplete(const std::string& job_id, int stages);

  // Forgets results that arrived (or were arriving) for the job: a restarted job sends
  // them again.
  void ResetResults(const std::string& job_id);

  // ---- checkpoints ----
  std::string CheckpointDir(const std::string& job_id, int step) const {
    return absl::StrCat(JobDir(job_id), "/checkpoint-", step);
  }
  std::string CheckpointStagePath(const std::string& job_id, int step, int stage) const {
    return CheckpointDir(job_id, step) + "/" + StageFileName(stage);
  }
  std::string CheckpointStatePath(const std::string& job_id, int step, int rank) const {
    return absl::StrCat(CheckpointDir(job_id, step), "/rank_", rank, ".state");
  }
  // Appends a chunk of a checkpoint piece: a stage (stage >= 0) or a rank's state
  // (stage < 0). `last` fsyncs the file and renames it into place; returns whether the
  // piece is now complete. A job folder that is gone swallows the chunk.
  // Errors: UNAVAILABLE naming the file.
  absl::StatusOr<bool> AppendCheckpoint(const std::string& job_id, int step, int rank, int stage,
                                        absl::string_view chunk, bool last);
  // Makes the checkpoint's files durable (fsyncs its folder and the job's) before the
  // job record names it. Errors: UNAVAILABLE.
  absl::Status SyncCheckpoint(const std::string& job_id, int step);
  // Removes the job's checkpoints (and pieces being written) whose step `remove` picks.
  void RemoveCheckpoints(const std::string& job_id, const std::function<bool(int step)>& remove);
  // The job's trained stages (result_<s>.pt, s < stages) become the stages of its
  // checkpoint after `step`, whose rank states arrived already (hard links; synced).
  // Errors: UNAVAILABLE naming the file.
  absl::Status CheckpointFromResults(const std::string& job_id, int step, int stages);
  // Job `to` starts from job `from`'s checkpoint after `step`: its `stages` stage files
  // and `ranks` rank states are linked (copied across file systems) into `to`'s folder
  // as its own checkpoint after `step`, synced. Errors: NOT_FOUND naming a missing
  // piece; UNAVAILABLE.
  absl::Status LinkCheckpoint(const std::string& from, int step, const std::string& to, int stages, int ranks);
  // A folder holding the job's model.pt and its checkpoint's stages as result_<s>.pt
  // (links: they outlive the checkpoint being replaced), for result_assembly.h to
  // merge. Errors: NOT_FOUND naming a missing piece; UNAVAILABLE.
  absl::StatusOr<std::string> StageCheckpointForMerge(const std::string& job_id, int step, int stages);
  // Where the merged checkpoint after `step` is served from.
  std::string CheckpointFetchPath(const std::string& job_id, int step) const {
    return absl::StrCat(state_dir_, "/models/", job_id, ".checkpoint-", step, ".pt");
  }
  // Moves the merged checkpoint `path` to CheckpointFetchPath (dropping the job's earlier
  // merged checkpoints) and removes `merge_dir`. Errors: UNAVAILABLE.
  absl::Status PublishCheckpoint(const std::string& job_id, int step, const std::string& path,
                                 const std::string& merge_dir);
  // Removes a folder StageCheckpointForMerge made.
  static void RemoveMergeDir(const std::string& merge_dir);

  // Makes `path` (a finished file) what FetchModel serves for the job.
  absl::Status Publish(const std::string& job_id, const std::string& path);

  // Removes the job's folder (its inputs and results); what FetchModel serves stays.
  // `keep_checkpoint` > 0: that checkpoint and model.pt stay (a training job ended).
  void RemoveJobFiles(const std::string& job_id, int keep_checkpoint = 0);
  // Removes the job's folder and what FetchModel serves for it (the job is deleted).
  void RemoveAllOf(const std::string& job_id);
  // Removes an uploaded dataset's folder (`dir` must be one of datasets/; else nothing).
  void RemoveUploadedDataset(const std::string& dir);
  // Removes every folder of datasets/ that is not in `keep` (absolute paths): at
  // start-up, those of submissions cut off by a restart and of jobs that ended as the
  // coordinator stopped. Returns how many it removed.
  int RemoveUploadedDatasetsExcept(const std::set<std::string>& keep);
  std::string DatasetsDir() const;  // absolute

  // Reads `path` in pieces of at most `chunk_bytes` and hands each to `sink`; the
  // sink's first error stops the reading and is returned.
  // Errors: NOT_FOUND naming the file; UNAVAILABLE when reading fails.
  static absl::Status StreamFile(const std::string& path, size_t chunk_bytes,
                                 const std::function<absl::Status(absl::string_view)>& sink);
  // Size of a file, or -1.
  static int64_t FileSize(const std::string& path);

 private:
  explicit ArtifactStore(std::string state_dir) : state_dir_(std::move(state_dir)) {}
  // Removes the job's merged checkpoints (models/<job>.checkpoint-<k>.pt).
  void RemoveMergedCheckpoints(const std::string& job_id);

  const std::string state_dir_;
  absl::Mutex mu_;
  int64_t next_upload_ ABSL_GUARDED_BY(mu_) = 0;
  // (job, stage) -> the result file being written.
  std::map<std::pair<std::string, int>, std::unique_ptr<FileWriter>> open_ ABSL_GUARDED_BY(mu_);
  // (job, stage) of results that arrived whole.
  std::map<std::string, std::map<int, bool>> complete_ ABSL_GUARDED_BY(mu_);
  // Checkpoint pieces being written: final path -> (job, its .tmp file).
  std::map<std::string, std::pair<std::string, std::unique_ptr<FileWriter>>> open_checkpoints_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_ARTIFACT_STORE_H_
