#include "coordinator/result_assembly.h"

#include <map>

#include "pipeline/partition/merge.h"

namespace pippy::coordinator {

absl::StatusOr<std::string> AssembleResult(ArtifactStore& files, const std::string& job_id, bool inference,
                                           int stages) {
  if (!files.ResultsComplete(job_id, inference ? -1 : stages)) {
    return absl::DataLossError(inference ? "the last rank finished without sending all of its outputs; submit the "
                                           "job again"
                                         : "a rank finished without sending all of its trained stages; submit the "
                                           "job again");
  }
  if (inference) return files.OutputsPath(job_id);
  std::map<int, std::string> results;
  for (int st = 0; st < stages; ++st) results[st] = files.ResultPath(job_id, st);
  const std::string assembled = files.JobDir(job_id) + "/assembled.pt";
  absl::Status merged = partition::MergeStagesIntoModel(files.ModelPath(job_id), results, assembled);
  if (!merged.ok()) return merged;
  return assembled;
}

}  // namespace pippy::coordinator
