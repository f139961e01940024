#include "coordinator/result_assembly.h"

#include <csignal>
#include <cstring>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "coordinator/child_process.h"
#include "common/status.h"
#include "pipeline/partition/merge.h"
#include "pipeline/tensor_parallel/sharding.h"
#include "pipeline/torchio/model_io.h"

namespace pippy::coordinator {
namespace {

// Paths as the files are named in a job's folder (artifact_store.h).
std::string ModelIn(const std::string& dir) { return dir + "/model.pt"; }
std::string ResultIn(const std::string& dir, int stage) { return absl::StrCat(dir, "/result_", stage, ".pt"); }
std::string AssembledIn(const std::string& dir) { return dir + "/assembled.pt"; }
std::string PlanIn(const std::string& dir) { return dir + "/tp_plan.pb"; }

// Tensor parallelism: stage s's tensors gathered from its shards, DIR/result_<s * T + t>.pt
// (one stage's shards in memory at a time).
partition::StageSource GatheredShards(const std::string& dir, const PipelinePlan& plan) {
  return [dir, plan](int s) -> absl::StatusOr<partition::StageTensors> {
    const int T = plan.tensor_parallel().size();
    std::vector<torch::jit::Module> shards;
    for (int t = 0; t < T; ++t) {
      PIPPY_ASSIGN_OR_RETURN(torch::jit::Module m, torchio::LoadModel(ResultIn(dir, s * T + t)));
      shards.push_back(m);
    }
    PIPPY_ASSIGN_OR_RETURN(auto whole, tp::GatherShards(plan.stages(s), shards));
    return partition::StageTensors(whole.begin(), whole.end());
  };
}

absl::Status MergeHere(const std::string& dir, int stages) {
  PipelinePlan plan;
  if (ArtifactStore::FileSize(PlanIn(dir)) > 0) {
    std::ifstream in(PlanIn(dir), std::ios::binary);
    if (!plan.ParseFromIstream(&in)) return absl::DataLossError(absl::StrCat("cannot read ", PlanIn(dir)));
  }
  std::vector<int> indices;
  partition::StageSource source;
  if (plan.tensor_parallel().size() > 1) {
    for (int st = 0; st < plan.stages_size(); ++st) indices.push_back(st);
    source = GatheredShards(dir, plan);
  } else {
    std::map<int, std::string> results;
    for (int st = 0; st < stages; ++st) {
      indices.push_back(st);
      results[st] = ResultIn(dir, st);
    }
    source = partition::StageFiles(results);
  }
  // Record by record where the model's tensors each own their storage; else whole.
  absl::Status merged = partition::MergeStagesByRecords(ModelIn(dir), indices, source, AssembledIn(dir));
  if (!absl::IsUnimplemented(merged)) return merged;
  return partition::MergeStagesIntoModel(ModelIn(dir), indices, source, AssembledIn(dir));
}

absl::Status MergeInChild(const std::string& dir, int stages, const AssembleOptions& options) {
  using Ending = ChildResult::Ending;
  ChildSpec spec;
  spec.argv = {options.merger, kMergeFlag, dir, absl::StrCat(stages)};
  spec.timeout = options.timeout;
  spec.cancelled = options.cancelled;
  const ChildResult r = RunChild(spec);
  if (r.ending == Ending::kExited && r.exit_code == 0) {
    log::Info("merged the trained stages in a child process (its peak resident memory {} MiB)", r.peak_rss_bytes >> 20);
  }
  if (std::optional<absl::Status> plain = PlainEnding(r, "merging the trained stages")) return *plain;
  switch (r.ending) {
    case Ending::kTimedOut:
    case Ending::kPhaseTimedOut:
      return absl::InvalidArgumentError(absl::StrCat("merging the trained stages did not finish within ",
                                                     absl::FormatDuration(r.limit), " (--prepare-timeout-s)"));
    case Ending::kSignalled:
      return absl::InvalidArgumentError(absl::StrCat("LibTorch crashed (signal ", r.signal, ", ", strsignal(r.signal),
                                                     ") merging the trained stages: a stage file a worker sent is "
                                                     "corrupt"));
    default:
      return absl::InternalError("unreachable: PlainEnding words the other endings");
  }
}

}  // namespace

absl::StatusOr<std::string> AssembleResult(ArtifactStore& files, const std::string& job_id, bool inference,
                                           int stages, const AssembleOptions& options) {
  if (!files.ResultsComplete(job_id, inference ? -1 : stages)) {
    return absl::DataLossError(inference ? "the last rank finished without sending all of its outputs; submit the "
                                           "job again"
                                         : "a rank finished without sending all of its trained stages; submit the "
                                           "job again");
  }
  if (inference) return files.OutputsPath(job_id);
  return MergeStagesIn(files.JobDir(job_id), stages, options);
}

absl::StatusOr<std::string> MergeStagesIn(const std::string& dir, int stages, const AssembleOptions& options) {
  if (options.plan.tensor_parallel().size() > 1) {
    std::ofstream out(PlanIn(dir), std::ios::binary | std::ios::trunc);
    if (!options.plan.SerializeToOstream(&out) || !out.flush()) {
      return absl::UnavailableError(absl::StrCat("cannot write ", PlanIn(dir)));
    }
  }
  absl::Status merged = options.merger.empty() ? MergeHere(dir, stages) : MergeInChild(dir, stages, options);
  if (!merged.ok()) return merged;
  return AssembledIn(dir);
}

int RunMergeChild(const std::string& dir, int stages) {
  log::Init("merge", log::Level::kOff);
  uint64_t bytes = static_cast<uint64_t>(std::max<int64_t>(0, ArtifactStore::FileSize(ModelIn(dir))));
  for (int st = 0; st < stages; ++st) {
    bytes += static_cast<uint64_t>(std::max<int64_t>(0, ArtifactStore::FileSize(ResultIn(dir, st))));
  }
  EnterChild(ChildHeapCap(bytes));
  AnnouncePhase("merge");
  absl::Status s = stages > 0 ? MergeHere(dir, stages) : absl::InvalidArgumentError("merge: no stages");
  if (!s.ok()) {
    ReportError(s);
    return 3;
  }
  ReportPeak();
  return 0;
}

}  // namespace pippy::coordinator
