// What the coordinator does with a submission before accepting it, once: check the
// spec, load the model, check the data against it (one micro-batch through the model
// and the loss), split the model, make the job's layout (its schedule validated, each
// rank's action list, data needs and memory: pipeline/job/layout.h), and write each
// stage's archive and each rank's share of the data into the submission's folder.
//
// All of it but the spec check runs in a child process (child_process.h): the
// coordinator's own process never loads a submitted model, never holds its tensors and
// never runs its code. The child reads the folder, writes the stage files, the shares,
// the plan and the layout (plan.pb, layout.pb) beside them, and exits; the coordinator
// reads those small files. The child's heap is capped (2 GiB + 4 x the model and data
// files, or less if the coordinator itself runs under a lower cap), the model's forward
// (each stage's on the example micro-batch, the loss check, --balance time) is bounded
// by `probe_timeout`, the whole child by `timeout`; a crash, a hang, an allocation past
// the cap fail that submission only.
//
// The child splits record by record (torchio/model_records.h): a skeleton of the model
// (code and tensor metadata, no tensor data) is split, then one stage at a time reads
// its storage records, runs the example micro-batch and is written out. Memory: the
// code, the largest stage, one micro-batch's activations and the data. The whole model
// is loaded instead for --balance flops or time and --loss model (they run the whole
// model) and for archives whose storage records are not numbered as torch.jit.save
// numbers them; the log says so.
#ifndef PIPPY_COORDINATOR_JOB_PREPARATION_H_
#define PIPPY_COORDINATOR_JOB_PREPARATION_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

namespace pippy::coordinator {

struct PreparedJob {
  JobSpec spec;                 // checked, defaults filled in
  PipelinePlan plan;
  JobLayout layout;             // made once here; stored with the job, pieces sent to the ranks
  std::vector<int64_t> share_bytes;  // by rank; the shares are written in the folder
  std::vector<int64_t> stage_bytes;  // by stage; the stage files are written in the folder
};

struct PrepareOptions {
  // A pippy-coordinator binary to prepare in (`BINARY --prepare DIR`); empty: in this
  // process (the coordinator's unit tests only: pippy-coordinator always uses a child).
  std::string preparer;
  absl::Duration timeout = absl::Minutes(5);        // the whole child
  absl::Duration probe_timeout = absl::Minutes(2);  // the model's forward passes
  // Polled while the child runs: true stops it (the coordinator is stopping).
  std::function<bool()> cancelled;
  // Load the model whole even where the record-by-record path would do (tests that
  // compare the two).
  bool whole = false;
  // Folders a job's dataset may be read from (--dataset-root; stage/dataset.h).
  std::vector<std::string> dataset_roots;
};

// `dir` holds model.pt and (unless the spec asks for synthetic data or a dataset)
// data.pt; the stage files and data shares are written beside them (see
// artifact_store.h for names). A dataset (DataSpec.dataset) is indexed, not copied:
// its layout goes into the job's (JobLayout.dataset and each reading rank's piece),
// its first batch is the example, the shares are empty, and a job given in epochs
// gets its steps (PreparedJob.spec.steps).
// Errors: INVALID_ARGUMENT whose message starts with the field (spec fields, "model:",
// "data:", "split:", "schedule:"), naming a crash, a deadline or the memory cap where
// the child met one; UNAVAILABLE when the folder cannot be written, the child cannot be
// started, or `cancelled` stopped it.
absl::StatusOr<PreparedJob> PrepareJob(const JobSpec& spec, const std::string& dir,
                                       const PrepareOptions& options = {});

// The child's side: `BINARY --prepare DIR [--whole] [--dataset-root R]...`. Exit 0
// with the files written; else the error reported (child_process.h) and exit 3.
inline constexpr char kPrepareFlag[] = "--prepare";
inline constexpr char kWholeFlag[] = "--whole";
inline constexpr char kDatasetRootFlag[] = "--dataset-root";
int RunPreparationChild(const std::string& dir, bool whole, const std::vector<std::string>& dataset_roots);

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_JOB_PREPARATION_H_
