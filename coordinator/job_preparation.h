// What the coordinator does with a submission before accepting it, once: check the
// spec, load the model, check the data against it (one micro-batch through the model
// and the loss), split the model, make the job's layout (its schedule validated, each
// rank's action list, data needs and memory: pipeline/job/layout.h), and write each
// rank's share of the data into the submission's folder. The split stages stay in
// memory (PreparedStages) until they are streamed to their workers or written to
// stage files; nothing later loads the whole model again until the trained stages are
// put back into it (partition::MergeStagesIntoModel).
//
// Memory: one copy of the model (the stages share its tensors), plus one micro-batch
// of activations for the example forward pass, plus the data.
#ifndef PIPPY_COORDINATOR_JOB_PREPARATION_H_
#define PIPPY_COORDINATOR_JOB_PREPARATION_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "proto/job.pb.h"
#include "proto/plan.pb.h"

namespace pippy::coordinator {

// The stages of a prepared job, in memory. Holding it holds the model's tensors.
// Thread safety: Write and WriteFiles may run on several threads at once.
class PreparedStages {
 public:
  virtual ~PreparedStages() = default;
  virtual int size() const = 0;
  // Writes stage `stage` as a TorchScript archive (a standalone module, what `pippyctl
  // split --out` writes) through `sink`, piece by piece. A sink error is returned.
  virtual absl::Status Write(int stage, const std::function<absl::Status(absl::string_view)>& sink) const = 0;
  // Writes every stage to `dir`/stage_<s>.pt, several at a time; returns their sizes.
  // Errors: UNAVAILABLE naming a file that cannot be written.
  virtual absl::StatusOr<std::vector<int64_t>> WriteFiles(const std::string& dir) const = 0;
};

struct PreparedJob {
  JobSpec spec;                 // checked, defaults filled in
  PipelinePlan plan;
  JobLayout layout;             // made once here; stored with the job, pieces sent to the ranks
  std::vector<int64_t> share_bytes;  // by rank; the shares are written in the folder
  std::shared_ptr<const PreparedStages> stages;
};

// `dir` holds model.pt and (unless the spec asks for synthetic data) data.pt; the data
// shares are written beside them (see artifact_store.h for names).
// Errors: INVALID_ARGUMENT whose message starts with the field (spec fields, "model:",
// "data:", "split:", "schedule:"); UNAVAILABLE when the folder cannot be written.
struct PrepareOptions {
  // A pippy-coordinator binary to load the model in first (model_check.h); empty: the
  // model is loaded only in this process (tests of the coordinator's logic).
  std::string model_checker;
  absl::Duration model_check_timeout = absl::Minutes(5);
};
absl::StatusOr<PreparedJob> PrepareJob(const JobSpec& spec, const std::string& dir,
                                       const PrepareOptions& options = {});

}  // namespace pippy::coordinator

#endif  // PIPPY_COORDINATOR_JOB_PREPARATION_H_
